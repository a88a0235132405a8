"""vLLM's ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import BackendError
from gateway.routes.common import gateway_state, read_json, request_id, resolve_model
from gateway.schemas import parse_detokenize, parse_tokenize


async def tokenize(request: Request) -> Response:
    state = gateway_state(request)
    req = parse_tokenize(await read_json(request))
    model = await resolve_model(request, req.model)
    try:
        result = await state.backend.tokenize(req.prompt, add_special_tokens=req.add_special_tokens,
                                              return_token_strs=req.return_token_strs,
                                              request_id=request_id(request), timeout=state.settings.unary_timeout,
                                              adapter=model.adapter)
    except BackendError as err:
        raise state.api_error(err, model) from None
    return JSONResponse({
        "count": len(result.token_ids),
        "max_model_len": result.max_model_len,
        "tokens": list(result.token_ids),
        "token_strs": list(result.token_strs) if result.token_strs is not None else None,
    })


async def detokenize(request: Request) -> Response:
    state = gateway_state(request)
    req = parse_detokenize(await read_json(request))
    model = await resolve_model(request, req.model)
    try:
        text = await state.backend.detokenize(req.token_ids, request_id=request_id(request),
                                              timeout=state.settings.unary_timeout, adapter=model.adapter)
    except BackendError as err:
        raise state.api_error(err, model) from None
    return JSONResponse({"prompt": text})
