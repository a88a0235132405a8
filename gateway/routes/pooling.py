"""Pooling models over REST: OpenAI's ``POST /v1/embeddings``; vLLM's ``/pooling``, ``/score`` (and ``/v1/score``),
``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``: Jina's and Cohere's shape) and ``/classify``.

One HTTP request is one unary call to the tokenizer service (``Embed``, ``Score`` or ``Classify``), which sends
its inputs to the engine at once. A generation model answers these routes with a 400 saying so (the service's
FAILED_PRECONDITION), as a pooling model answers the generation routes. A client that goes away cancels the call.
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import ApiError, BackendError
from gateway.pooling_schemas import (
    Embed,
    PoolingBackend,
    parse_classify,
    parse_embedding,
    parse_rerank,
    parse_score,
)
from gateway.routes.common import GatewayState, ModelChoice, gateway_state, read_json, request_id, resolve_model
from gateway.routes.generate import unless_disconnected

_T = TypeVar("_T")
_NUMPY_ORDER = {"little": "<", "big": ">", "native": "<" if sys.byteorder == "little" else ">"}


def pooling_routes() -> list[Route]:
    return [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/pooling", pooling, methods=["POST"]),
        Route("/score", score, methods=["POST"]),
        Route("/v1/score", score, methods=["POST"]),
        Route("/rerank", rerank, methods=["POST"]),
        Route("/v1/rerank", rerank, methods=["POST"]),
        Route("/v2/rerank", rerank, methods=["POST"]),
        Route("/classify", classify, methods=["POST"]),
    ]


class _Call:
    """One route's backend call: the backend, the model, the request id, the client's error for a failure."""

    def __init__(self, request: Request, state: GatewayState, model: ModelChoice, renames: dict[str, str]) -> None:
        backend = state.backend
        if not isinstance(backend, PoolingBackend):
            raise ApiError(501, "This backend does not serve pooling models.", type="server_error",
                           code="not_implemented")
        self.request = request
        self.state = state
        self.backend: PoolingBackend = backend
        self.model = model
        self.rid = request_id(request)
        self.timeout = state.settings.request_timeout
        self._renames = renames

    async def run(self, work: Awaitable[_T]) -> _T:
        """``work``'s result; a backend failure as the client's error, named by the request's own fields (the
        service says ``inputs[1]``, the route's field is ``input``)."""
        out: list[_T] = []

        async def collect() -> None:
            out.append(await work)

        try:
            if not await unless_disconnected(self.request, collect()):
                raise _Gone
        except BackendError as err:
            raise self._renamed(self.state.api_error(err, self.model)) from None
        return out[0]

    def _renamed(self, error: ApiError) -> ApiError:
        for ours, theirs in self._renames.items():
            if error.param is not None and error.param.split("[")[0] == ours:
                new = theirs + error.param[len(ours):]
                error.message = error.message.replace(error.param, new, 1)
                error.param = new
                break
        return error


class _Gone(Exception):
    """The client went away: nobody reads the answer."""


async def _start(request: Request) -> tuple[GatewayState, dict[str, object], int | None]:
    state = gateway_state(request)
    body = await read_json(request)
    return state, body, await state.models.max_model_len()


async def embeddings(request: Request) -> Response:
    return await _embed(request, pooling_route=False)


async def pooling(request: Request) -> Response:
    return await _embed(request, pooling_route=True)


async def _embed(request: Request, *, pooling_route: bool) -> Response:
    state, body, max_model_len = await _start(request)
    req = parse_embedding(body, max_model_len, pooling=pooling_route)
    call = _Call(request, state, await resolve_model(request, req.model), {"inputs": "input"})
    try:
        task = req.task
        if task is None:  # /pooling without a task: the model's own output
            tasks = await call.run(call.backend.pooling_tasks(timeout=state.settings.unary_timeout))
            task = "embed" if "embed" in tasks or "classify" not in tasks else "classify"
        if task == "classify":
            classes = await call.run(call.backend.classify(req.inputs, req.options, request_id=call.rid,
                                                           timeout=call.timeout, model=call.model.adapter))
            rows: Sequence[object] = [_encode(req, p, len(p), nested=False) for p in classes.probs]
            tokens = classes.prompt_tokens
        else:
            result = await call.run(call.backend.embed(req.inputs, req.options, dimensions=req.dimensions, task=task,
                                                       request_id=call.rid, timeout=call.timeout,
                                                       model=call.model.adapter))
            nested = task == "token_embed"
            rows = [_encode(req, v, n, nested=nested) for v, n in zip(result.vectors, result.row_size)]
            tokens = result.prompt_tokens
    except _Gone:
        return Response(status_code=499)
    if pooling_route:
        data = [{"index": i, "object": "pooling", "data": row} for i, row in enumerate(rows)]
        return _listing("pool", call.model, data, tokens)
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    return _listing("embd", call.model, data, tokens)


def _encode(req: Embed, values: Sequence[float], row_size: int, *, nested: bool) -> object:
    """A vector as JSON numbers (token_embed: one list per token), or base64 of its bytes in the asked type and
    byte order (OpenAI's base64 is little-endian float32: the default here on every common CPU)."""
    if not req.base64:
        if nested and row_size:
            return [list(values[i:i + row_size]) for i in range(0, len(values), row_size)]
        return list(values)
    order = _NUMPY_ORDER[req.endianness]
    array = np.asarray(values, dtype=np.float32)
    if req.embed_dtype == "float16":
        raw = array.astype(f"{order}f2").tobytes()
    elif req.embed_dtype == "bfloat16":  # float32's top half, rounded to nearest even (torch's conversion)
        bits = array.view(np.uint32).astype(np.uint64)
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(f"{order}u2").tobytes()
    else:
        raw = array.astype(f"{order}f4").tobytes()
    return base64.b64encode(raw).decode("ascii")


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _listing(prefix: str, model: ModelChoice, data: list[dict[str, object]], tokens: int) -> JSONResponse:
    return JSONResponse({"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model.name, "data": data, "usage": _usage(tokens)})


async def classify(request: Request) -> Response:
    state, body, max_model_len = await _start(request)
    req = parse_classify(body, max_model_len)
    call = _Call(request, state, await resolve_model(request, req.model), {"inputs": "input"})
    try:
        result = await call.run(call.backend.classify(req.inputs, req.options, request_id=call.rid,
                                                      timeout=call.timeout, model=call.model.adapter))
    except _Gone:
        return Response(status_code=499)
    data = [{"index": i, "label": label, "probs": list(probs), "num_classes": len(probs)}
            for i, (probs, label) in enumerate(zip(result.probs, result.labels))]
    return _listing("classify", call.model, data, result.prompt_tokens)


async def score(request: Request) -> Response:
    state, body, max_model_len = await _start(request)
    req = parse_score(body, max_model_len)
    first, second = _score_names(body)
    call = _Call(request, state, await resolve_model(request, req.model), {"queries": first, "documents": second})
    try:
        result = await call.run(call.backend.score(req.queries, req.documents, req.options, request_id=call.rid,
                                                   timeout=call.timeout, model=call.model.adapter))
    except _Gone:
        return Response(status_code=499)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)]
    return _listing("score", call.model, data, result.prompt_tokens)


def _score_names(body: dict[str, object]) -> tuple[str, str]:
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        if first in body and second in body:
            return first, second
    return "text_1", "text_2"


async def rerank(request: Request) -> Response:
    state, body, max_model_len = await _start(request)
    req = parse_rerank(body, max_model_len)
    call = _Call(request, state, await resolve_model(request, req.model), {"queries": "query"})
    try:
        result = await call.run(call.backend.score(req.queries, req.documents, req.options, request_id=call.rid,
                                                   timeout=call.timeout, model=call.model.adapter))
    except _Gone:
        return Response(status_code=499)
    order = sorted(range(len(result.scores)), key=lambda i: -result.scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results: list[dict[str, object]] = []
    for i in order:
        item: dict[str, object] = {"index": i, "relevance_score": result.scores[i]}
        if req.return_documents:
            item["document"] = {"text": req.documents[i]}
        results.append(item)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": call.model.name,
                         "usage": _usage(result.prompt_tokens), "results": results})
