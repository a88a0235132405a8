"""vLLM's legacy ``POST /generate`` (``vllm.entrypoints.api_server``), which MindIE serves as its vLLM-style
``/generate``: ``{"prompt", "stream", <SamplingParams fields>}`` → ``{"text": [prompt + output, …]}``, one
entry per sequence (``n``); streamed, the same object with each sequence's text so far, each followed by a
NUL byte, as vLLM frames it.

The sampling fields are vLLM's, so the body is read as a ``/v1/completions`` body as it is. What the answer
has no room for (``logprobs``, ``prompt_logprobs``, ``echo``: the prompt always leads) and the SamplingParams
fields Sluice does not honour are refused by name.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.backend import Delta
from gateway.errors import ApiError, bad_request
from gateway.routes.common import gateway_state, request_id, resolve_model
from gateway.routes.dialects import driver
from gateway.routes.dialects.errors import tgi_body
from gateway.routes.dialects.request import adapter, as_completion, refuse_set
from gateway.routes.generate import Run
from gateway.schemas import GenerationRequest
from gateway.sse import SSEResponse

REFUSED = {
    "logprobs": "the legacy /generate answer carries text only (use /v1/completions)",
    "prompt_logprobs": "the legacy /generate answer carries text only (use /v1/completions)",
    "echo": "the legacy /generate answer always starts with the prompt",
    "stream_options": "the legacy /generate stream carries text only",
    "logits_processors": "logits processors are not run from requests",
}


class NulFramed(SSEResponse):
    """vLLM's legacy stream: JSON objects each ended by a NUL byte, not server-sent events."""

    media_type = "text/plain"


def parse_vllm(body: dict[str, object], max_n: int) -> GenerationRequest:
    refuse_set(body, REFUSED)
    if body.get("spaces_between_special_tokens") is False or body.get("detokenize") is False:
        name = "detokenize" if body.get("detokenize") is False else "spaces_between_special_tokens"
        raise bad_request(name, f"`{name}`: only true is supported.")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt", "`prompt` must be a string: the answer starts with its text.")
    model = body.get("model")
    return as_completion({**body, "model": adapter(model) if isinstance(model, str) else model}, max_n, {})


class VllmFrames:
    """Each delta: every sequence's text so far, after the prompt."""

    def __init__(self, run: Run, prompt: str) -> None:
        self.run = run
        self.prompt = prompt

    def delta(self, index: int, delta: Delta) -> list[str]:
        if not delta.text and delta.finish_reason is None:
            return []
        return [json.dumps(texts(self.run, self.prompt), ensure_ascii=False) + "\0"]

    def end(self) -> list[str]:
        return []

    def error(self, err: ApiError) -> str:
        return json.dumps(tgi_body(err), ensure_ascii=False) + "\0"


def texts(run: Run, prompt: str) -> dict[str, object]:
    return {"text": [prompt + "".join(c.text) for c in run.builder.choices]}


async def respond(request: Request, body: dict[str, object]) -> Response:
    """``body``: already read (``/generate`` looked at it to pick the dialect); errors are raised for the
    route to render."""
    state = gateway_state(request)
    gen = parse_vllm(body, state.settings.max_n)
    prompt = gen.prompts[0].text or ""
    model = await resolve_model(request, gen.model)
    run = Run(state, gen, model, request_id(request))
    if gen.stream:
        return await driver.stream(run, VllmFrames(run, prompt), NulFramed)
    if not await driver.collect(request, run):
        return Response(status_code=499)
    return JSONResponse(texts(run, prompt))
