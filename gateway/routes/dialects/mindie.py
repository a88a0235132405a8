"""MindIE Service's own routes: ``POST /generate``, where MindIE answers both its TGI-style and its vLLM-style
bodies, and its native ``POST /infer``.

``/generate`` picks the dialect by the body, as the two bodies differ: TGI's prompt is ``inputs``, vLLM's is
``prompt``. A body with ``inputs`` is TGI's (``stream`` true streams TGI's events, as MindIE does), one with
``prompt`` is vLLM's; one with both or neither is refused. Errors come back in the TGI shape on both (MindIE
has one error table for the route).

``/infer`` is TGI's request and answer with MindIE's stream events, which add ``prefill_time`` and
``decode_time`` to each token.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import bad_request
from gateway.routes.common import gateway_state, read_json
from gateway.routes.dialects import tgi, vllm_legacy
from gateway.routes.dialects.errors import answering, tgi_response


@answering(tgi_response)
async def generate(request: Request) -> Response:
    body = await read_json(request)
    has_inputs, has_prompt = "inputs" in body, "prompt" in body
    if has_inputs and has_prompt:
        raise bad_request("prompt", "A /generate body takes `inputs` (TGI) or `prompt` (vLLM), not both.")
    if has_prompt:
        return await vllm_legacy.respond(request, body)
    if not has_inputs:
        raise bad_request("inputs", "`inputs` is required (TGI's /generate; vLLM's takes `prompt`).")
    return await tgi.respond(request, tgi.parse_tgi(body, gateway_state(request).settings.max_n))


@answering(tgi_response)
async def infer(request: Request) -> Response:
    body = await read_json(request)
    return await tgi.respond(request, tgi.parse_tgi(body, gateway_state(request).settings.max_n), timing=True)
