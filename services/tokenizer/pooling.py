"""``Embed``, ``Score`` and ``Classify`` of the public API: pooling models behind the tokenizer service.

Each input is tokenized here (texts in one batch, off the event loop; a cross-encoder's pair as one input with its
segment ids), cut to its last ``truncate_prompt_tokens`` tokens when asked (vLLM's), refused when still longer than
the model's context, and sent to the engine as a ``Pool`` request of its own: the inputs of one call go out at once
and the engine's scheduler batches them with everything else it runs. Usage is the inputs' tokens summed.

Scoring follows vLLM's ``/score``: a cross-encoder (a model with the "score" task) reads each (query, document) pair
joined by its tokenizer; an embedding model embeds the texts and scores each pair by the cosine of their vectors.

The runner decides what a model serves: a generation model asked to pool, or a pooling model asked to generate, is
FAILED_PRECONDITION saying which it is, before any engine call.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
import numpy as np

from common.errors import FailedPreconditionError, InvalidRequestError
from common.logs import REQUEST_ID
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2
from services.tokenizer.limits import check_text
from services.tokenizer.prompt import PromptBuilder

if TYPE_CHECKING:
    from services.tokenizer.service import EngineInfo

POOLING = "pooling"
_T = TypeVar("_T")


class PoolingHost(Protocol):
    """What the pooling calls use of the tokenizer service (``GenerationServicer``)."""

    tokenizer: Tokenizer
    prompts: PromptBuilder
    served_model_name: str

    async def engine_info(self, refresh: bool = False, *, timeout: float | None = 10) -> EngineInfo: ...

    def engine_for(self, token_ids: list[int] | np.ndarray, *, lora_name: str = "", cache_salt: str = ""
                   ) -> AbstractAsyncContextManager[engine_pb2_grpc.EngineStub]: ...

    async def lora_adapter(self, model: str, *, engine_resolves: bool = False) -> str: ...


@dataclass(frozen=True)
class _Input:
    """One input as the engine gets it: token ids, and segment ids for a pair (empty: all 0)."""

    ids: list[int]
    type_ids: list[int] = field(default_factory=list)


def describe(info: EngineInfo) -> str:
    """What kind of model the engine runs, in words, for the errors that say why a call does not fit it."""
    if info.runner != POOLING:
        return "a generation model"
    if "score" in info.pooling_tasks:
        return "a cross-encoder (a scoring model)"
    if "embed" in info.pooling_tasks:
        return "an embedding model"
    if "classify" in info.pooling_tasks:
        return "a classification model"
    return "a pooling model"


def check_generate(info: EngineInfo, model: str) -> None:
    """``Generate`` on a pooling model is FAILED_PRECONDITION naming what the model is and what it serves."""
    if info.runner == POOLING:
        raise FailedPreconditionError(
            f"The model `{model}` is a pooling model ({describe(info)}), not a generation model: it cannot generate "
            "text. It serves embeddings, scores and classifications (REST: /v1/embeddings, /pooling, /score, "
            "/rerank, /classify; gRPC: Embed, Score, Classify).")


def _require(info: EngineInfo, model: str, task: str, doing: str) -> None:
    if info.runner != POOLING:
        raise FailedPreconditionError(
            f"The model `{model}` is a generation model, not a pooling model: it cannot {doing}. It serves "
            "completions (REST: /v1/completions, /v1/chat/completions; gRPC: Generate).")
    if task not in info.pooling_tasks:
        raise FailedPreconditionError(f"The model `{model}` is {describe(info)}: it cannot {doing} (its tasks: "
                                      f"{', '.join(info.pooling_tasks) or 'none'}).")


async def _start(host: PoolingHost, model: str, context: grpc.aio.ServicerContext, request_id: str, prefix: str
                 ) -> tuple[EngineInfo, str]:
    """The engine's info and the request's id (the caller's, its ``x-request-id``, or a new one); LoRA adapters
    serve generation only."""
    rid = request_id or _metadata(context, "x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
    REQUEST_ID.set(rid)
    await context.send_initial_metadata((("x-request-id", rid),))
    if await host.lora_adapter(model):
        raise InvalidRequestError("model", f"`{model}` is a LoRA adapter; adapters serve generation only")
    return await host.engine_info(), rid


def _keep(value: int | None, max_model_len: int) -> int | None:
    if value is not None and not 1 <= value <= max_model_len:
        raise InvalidRequestError("truncate_prompt_tokens", f"must be in [1, max_model_len ({max_model_len})], "
                                                            f"got {value}")
    return value


def _fit(field_name: str, item: _Input, keep: int | None, max_model_len: int) -> _Input:
    """``item`` cut to its last ``keep`` tokens (vLLM's truncate_prompt_tokens), and no longer than the context."""
    if not item.ids:
        raise InvalidRequestError(field_name, "is empty: it has no tokens")
    if keep is not None and len(item.ids) > keep:
        item = _Input(item.ids[-keep:], item.type_ids[-keep:])
    if len(item.ids) > max_model_len:
        raise InvalidRequestError(field_name, f"has {len(item.ids)} tokens, more than the model's context "
                                              f"(max_model_len {max_model_len}); shorten it or set "
                                              "truncate_prompt_tokens")
    return item


async def _inputs(host: PoolingHost, inputs: Sequence[generation_pb2.PoolingInput], info: EngineInfo, *,
                  add_special_tokens: bool, keep: int | None) -> list[_Input]:
    """Each input's token ids: texts encoded in one batch off the event loop, ids as they are."""
    if not inputs:
        raise InvalidRequestError("inputs", "at least one input is required")
    max_chars = host.prompts.max_chars(info.max_model_len)
    texts: dict[int, str] = {}
    out: list[list[int]] = []
    for i, item in enumerate(inputs):
        which = item.WhichOneof("input")
        if which == "text":
            check_text(f"inputs[{i}]", item.text, max_chars)
            texts[i] = item.text
            out.append([])
        elif which == "token_ids":
            ids = list(item.token_ids.ids)
            bad = next((t for t in ids if t >= info.vocab_size), None)
            if bad is not None and info.vocab_size:
                raise InvalidRequestError(f"inputs[{i}]", f"token id {bad} is out of range [0, {info.vocab_size})")
            out.append(ids)
        else:
            raise InvalidRequestError(f"inputs[{i}]", "one of text or token_ids is required")
    if texts:
        backend = host.tokenizer.backend
        encoded = await host.prompts.off_loop(backend.encode_batch, list(texts.values()),
                                              add_special_tokens=add_special_tokens)
        for i, enc in zip(texts, encoded):
            out[i] = list(enc.ids)
    return [_fit(f"inputs[{i}]", _Input(ids), keep, info.max_model_len) for i, ids in enumerate(out)]


async def _pool_all(host: PoolingHost, items: Sequence[_Input], template: engine_pb2.EnginePoolRequest,
                    request_id: str, timeout: float | None) -> list[engine_pb2.EnginePoolResponse]:
    """One ``Pool`` call per input, all at once; the first failure cancels the others (and so aborts them on the
    engine), as does the caller's cancellation."""
    key = f"pool-{uuid.uuid4().hex[:16]}"
    metadata = (("x-request-id", request_id),)

    async def one(i: int, item: _Input) -> engine_pb2.EnginePoolResponse:
        req = engine_pb2.EnginePoolRequest()
        req.CopyFrom(template)
        req.request_id = f"{key}-{i}"
        req.prompt_token_ids.ids.extend(item.ids)
        if any(item.type_ids):
            req.token_type_ids.extend(item.type_ids)
        async with host.engine_for(item.ids) as engine:
            resp: engine_pb2.EnginePoolResponse = await engine.Pool(req, timeout=timeout, metadata=metadata)
            return resp

    return await _all([one(i, item) for i, item in enumerate(items)])


async def _all(coros: Sequence[Awaitable[_T]]) -> list[_T]:
    """Every result in order; the first error is raised as it is (not in a group) once the rest are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [task.result() for task in tasks]


def _template(task: str, request_id: str, priority: int, trace_headers: dict[str, str]
              ) -> engine_pb2.EnginePoolRequest:
    req = engine_pb2.EnginePoolRequest(task=task, priority=priority, client_request_id=request_id)
    req.trace_headers.update(trace_headers)
    return req


async def embed(host: PoolingHost, request: generation_pb2.EmbedRequest, context: grpc.aio.ServicerContext
                ) -> generation_pb2.EmbedResponse:
    info, rid = await _start(host, request.model, context, request.request_id, "embd")
    task = request.task or "embed"
    if task not in ("embed", "token_embed"):
        raise InvalidRequestError("task", f'must be "embed" or "token_embed", got {task[:64]!r}')
    _require(info, host.served_model_name, task, "embed" if task == "embed" else "embed tokens")
    if request.HasField("dimensions"):
        _check_dimensions(info, host.served_model_name, request.dimensions)
    keep = _keep(request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
                 info.max_model_len)
    add = request.add_special_tokens if request.HasField("add_special_tokens") else True
    items = await _inputs(host, request.inputs, info, add_special_tokens=add, keep=keep)
    template = _template(task, rid, request.priority, dict(request.trace_headers))
    if request.HasField("normalize"):
        template.normalize = request.normalize
    if request.HasField("dimensions"):
        template.dimensions = request.dimensions
    results = await _pool_all(host, items, template, rid, context.time_remaining())
    embeddings = [generation_pb2.Embedding(values=r.data, row_size=r.row_size,
                                           prompt_tokens=r.prompt_tokens or len(item.ids))
                  for r, item in zip(results, items)]
    return generation_pb2.EmbedResponse(embeddings=embeddings, usage=_usage(e.prompt_tokens for e in embeddings))


def _check_dimensions(info: EngineInfo, model: str, dimensions: int) -> None:
    """vLLM's rule: only a Matryoshka model's vector may be cut short, to a size it was trained for."""
    if not info.is_matryoshka:
        raise InvalidRequestError("dimensions", f"the model `{model}` is not a Matryoshka model: its "
                                                f"{info.embedding_size}-dimension embeddings cannot be shortened")
    if not 1 <= dimensions <= info.embedding_size:
        raise InvalidRequestError("dimensions", f"must be in [1, {info.embedding_size}], got {dimensions}")
    if info.matryoshka_dimensions and dimensions not in info.matryoshka_dimensions:
        sizes = ", ".join(map(str, info.matryoshka_dimensions))
        raise InvalidRequestError("dimensions", f"the model `{model}` was trained for the sizes {sizes}, not "
                                                f"{dimensions}")


async def classify(host: PoolingHost, request: generation_pb2.ClassifyRequest, context: grpc.aio.ServicerContext
                   ) -> generation_pb2.ClassifyResponse:
    info, rid = await _start(host, request.model, context, request.request_id, "classify")
    _require(info, host.served_model_name, "classify", "classify")
    keep = _keep(request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
                 info.max_model_len)
    add = request.add_special_tokens if request.HasField("add_special_tokens") else True
    items = await _inputs(host, request.inputs, info, add_special_tokens=add, keep=keep)
    template = _template("classify", rid, request.priority, dict(request.trace_headers))
    if request.HasField("activation"):
        template.activation = request.activation
    results = await _pool_all(host, items, template, rid, context.time_remaining())
    out = []
    for r, item in zip(results, items):
        scores = list(r.data)
        best = int(np.argmax(scores)) if scores else 0
        label = info.labels[best] if best < len(info.labels) else f"LABEL_{best}"
        out.append(generation_pb2.Classification(scores=scores, label=label,
                                                 prompt_tokens=r.prompt_tokens or len(item.ids)))
    return generation_pb2.ClassifyResponse(results=out, usage=_usage(c.prompt_tokens for c in out))


async def score(host: PoolingHost, request: generation_pb2.ScoreRequest, context: grpc.aio.ServicerContext
                ) -> generation_pb2.ScoreResponse:
    info, rid = await _start(host, request.model, context, request.request_id, "score")
    cross = info.runner == POOLING and "score" in info.pooling_tasks
    _require(info, host.served_model_name, "score" if cross else "embed", "score")
    documents, queries = list(request.documents), list(request.queries)
    if not documents:
        raise InvalidRequestError("documents", "at least one document is required")
    if len(queries) not in (1, len(documents)):
        raise InvalidRequestError("queries", f"must be one query or as many as the documents ({len(documents)}), "
                                             f"got {len(queries)}")
    pairs = [(queries[0] if len(queries) == 1 else queries[i], doc) for i, doc in enumerate(documents)]
    max_chars = host.prompts.max_chars(info.max_model_len)
    for i, (q, d) in enumerate(pairs):
        check_text(f"queries[{0 if len(queries) == 1 else i}]", q, max_chars)
        check_text(f"documents[{i}]", d, max_chars)
    keep = _keep(request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
                 info.max_model_len)
    timeout = context.time_remaining()
    if cross:
        scores, tokens = await _cross_scores(host, info, pairs, keep, request, rid, timeout)
    else:
        scores, tokens = await _cosine_scores(host, info, pairs, keep, request, rid, timeout)
    return generation_pb2.ScoreResponse(scores=scores, prompt_tokens=tokens, usage=_usage(tokens))


async def _cross_scores(host: PoolingHost, info: EngineInfo, pairs: list[tuple[str, str]], keep: int | None,
                        request: generation_pb2.ScoreRequest, rid: str, timeout: float | None
                        ) -> tuple[list[float], list[int]]:
    """Each pair joined by the tokenizer (its separators and segment ids) and scored by the cross-encoder."""
    encoded = await host.prompts.off_loop(host.tokenizer.encode_pairs, pairs)
    items = [_fit(f"documents[{i}]", _Input(ids, type_ids), keep, info.max_model_len)
             for i, (ids, type_ids) in enumerate(encoded)]
    template = _template("score", rid, request.priority, dict(request.trace_headers))
    if request.HasField("activation"):
        template.activation = request.activation
    results = await _pool_all(host, items, template, rid, timeout)
    return [r.data[0] for r in results], [r.prompt_tokens or len(item.ids) for r, item in zip(results, items)]


async def _cosine_scores(host: PoolingHost, info: EngineInfo, pairs: list[tuple[str, str]], keep: int | None,
                         request: generation_pb2.ScoreRequest, rid: str, timeout: float | None
                         ) -> tuple[list[float], list[int]]:
    """Each distinct text embedded once; a pair's score is the cosine of its two vectors (vLLM's embedding score)."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    encoded = await host.prompts.off_loop(host.tokenizer.backend.encode_batch, texts, add_special_tokens=True)
    items = [_fit("documents", _Input(list(e.ids)), keep, info.max_model_len) for e in encoded]
    template = _template("embed", rid, request.priority, dict(request.trace_headers))
    results = await _pool_all(host, items, template, rid, timeout)
    vectors = {t: np.asarray(r.data, dtype=np.float64) for t, r in zip(texts, results)}
    tokens = {t: r.prompt_tokens or len(item.ids) for t, r, item in zip(texts, results, items)}
    scores = []
    for q, d in pairs:
        a, b = vectors[q], vectors[d]
        norm = float(np.linalg.norm(a) * np.linalg.norm(b))
        scores.append(float(a @ b) / norm if norm > 0 else 0.0)
    return scores, [tokens[q] + tokens[d] for q, d in pairs]


def _usage(tokens: Iterable[int]) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=sum(tokens))


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None
