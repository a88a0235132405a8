"""The offline API of pooling models in vLLM's shapes: ``LLM.embed`` -> ``EmbeddingRequestOutput``
(``.outputs.embedding``), ``LLM.classify`` -> ``ClassificationRequestOutput`` (``.outputs.probs``), ``LLM.score`` ->
``ScoringRequestOutput`` (``.outputs.score``: a cross-encoder's relevance, or the cosine similarity of two
embeddings on an embedding model, as vLLM computes it), ``LLM.encode`` -> ``PoolingRequestOutput``
(``.outputs.data``, a tensor)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
import torch.nn.functional as F

from common.errors import InvalidRequestError
from engine.core.pooling_params import PoolingParams

if TYPE_CHECKING:
    from engine.entrypoints.llm import LLM

T = TypeVar("T")
# A prompt: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dict.
PoolingPrompt = str | Sequence[int] | dict[str, object]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclass
class PoolingRequestOutput(Generic[T]):
    """One prompt's result: ``outputs`` is the task's output type."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    pass


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    pass


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass


@dataclass
class _Input:
    token_ids: list[int]
    token_type_ids: list[int] = field(default_factory=list)


class PoolingRunner:
    """Runs an ``LLM``'s pooling requests to completion on its engine core (batched by its scheduler)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._ids = itertools.count()

    def inputs(self, prompts: PoolingPrompt | Sequence[PoolingPrompt],
               truncate_prompt_tokens: int | None = None) -> list[_Input]:
        """Token ids of each prompt (text through the model's tokenizer), the last ``truncate_prompt_tokens`` kept
        (vLLM's truncation of token prompts; -1 or None: all)."""
        items = self.llm._normalize_prompts(prompts)  # type: ignore[arg-type]
        out = [_Input(list(ids)) for _, ids in items]
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > 0:
            for item in out:
                item.token_ids = item.token_ids[-truncate_prompt_tokens:]
        return out

    def pair_inputs(self, pairs: list[tuple[str, str]]) -> list[_Input]:
        """Each (query, document) joined as the model's tokenizer joins a pair, with its segment ids."""
        return [_Input(ids, types) for ids, types in self.llm.tokenizer.encode_pairs(pairs)]

    def run(self, inputs: list[_Input], params: list[PoolingParams]) -> list[torch.Tensor]:
        """Each input's output rows (float32 [rows, row_size]), in input order."""
        engine = self.llm.engine
        rids: list[str] = []
        try:
            for item, p in zip(inputs, params, strict=True):
                rid = f"pool-{next(self._ids)}"
                engine.add_pooling_request(rid, item.token_ids, p, token_type_ids=item.token_type_ids or None)
                rids.append(rid)
        except BaseException:
            engine.abort_requests(rids)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        slot = {rid: i for i, rid in enumerate(rids)}
        results: list[torch.Tensor | None] = [None] * len(rids)
        remaining = len(rids)
        while remaining:
            for out in engine.step():
                i = slot.get(out.request_id)
                if i is None or not out.request_finished:
                    continue
                if out.pooled is None:
                    raise RuntimeError(f"pooling request {out.request_id} ended without output "
                                       f"({out.finish_reason})")
                results[i] = out.pooled
                remaining -= 1
        return [r for r in results if r is not None]


def broadcast_params(params: PoolingParams | Sequence[PoolingParams] | None, n: int, task: str,
                     truncate: int | None = None) -> list[PoolingParams]:
    """One PoolingParams per prompt, each set to ``task``."""
    if params is None or isinstance(params, PoolingParams):
        base = params or PoolingParams()
        return [base.clone(task=task, truncate_prompt_tokens=truncate)] * n
    if len(params) != n:
        raise InvalidRequestError("pooling_params", f"{len(params)} params for {n} prompts")
    return [p.clone(task=task, truncate_prompt_tokens=truncate) for p in params]


def embed(runner: PoolingRunner, prompts: PoolingPrompt | Sequence[PoolingPrompt],
          pooling_params: PoolingParams | Sequence[PoolingParams] | None,
          truncate_prompt_tokens: int | None) -> list[EmbeddingRequestOutput]:
    inputs = runner.inputs(prompts, truncate_prompt_tokens)
    rows = runner.run(inputs, broadcast_params(pooling_params, len(inputs), "embed", truncate_prompt_tokens))
    return [EmbeddingRequestOutput(str(i), EmbeddingOutput(r[0].tolist()), item.token_ids)
            for i, (item, r) in enumerate(zip(inputs, rows))]


def classify(runner: PoolingRunner, prompts: PoolingPrompt | Sequence[PoolingPrompt],
             pooling_params: PoolingParams | Sequence[PoolingParams] | None,
             truncate_prompt_tokens: int | None) -> list[ClassificationRequestOutput]:
    inputs = runner.inputs(prompts, truncate_prompt_tokens)
    rows = runner.run(inputs, broadcast_params(pooling_params, len(inputs), "classify", truncate_prompt_tokens))
    return [ClassificationRequestOutput(str(i), ClassificationOutput(r[0].tolist()), item.token_ids)
            for i, (item, r) in enumerate(zip(inputs, rows))]


def encode(runner: PoolingRunner, prompts: PoolingPrompt | Sequence[PoolingPrompt],
           pooling_params: PoolingParams | Sequence[PoolingParams] | None, pooling_task: str | None,
           truncate_prompt_tokens: int | None) -> list[PoolingRequestOutput[PoolingOutput]]:
    pooling = runner.llm.engine.pooling
    task = pooling_task or (pooling.tasks[0] if pooling is not None else "embed")
    inputs = runner.inputs(prompts, truncate_prompt_tokens)
    rows = runner.run(inputs, broadcast_params(pooling_params, len(inputs), task, truncate_prompt_tokens))
    return [PoolingRequestOutput(str(i), PoolingOutput(r if task == "token_embed" else r[0]), item.token_ids)
            for i, (item, r) in enumerate(zip(inputs, rows))]


def score(runner: PoolingRunner, text_1: str | Sequence[str], text_2: str | Sequence[str],
          pooling_params: PoolingParams | None, truncate_prompt_tokens: int | None) -> list[ScoringRequestOutput]:
    """vLLM's pairing: one text against each of many, or the two lists pair by pair. A cross-encoder reads each
    pair joined; an embedding model embeds both sides and scores their cosine similarity."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right) or not left:
        raise InvalidRequestError("text_1", f"{len(left)} texts cannot pair with {len(right)}: give one text_1, or "
                                            "as many as text_2")
    pooling = runner.llm.engine.pooling
    if pooling is not None and "score" in pooling.tasks:
        inputs = runner.pair_inputs(list(zip(left, right)))
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > 0:
            for item in inputs:
                item.token_ids = item.token_ids[-truncate_prompt_tokens:]
                item.token_type_ids = item.token_type_ids[-truncate_prompt_tokens:]
        rows = runner.run(inputs, broadcast_params(pooling_params, len(inputs), "score"))
        return [ScoringRequestOutput(str(i), ScoringOutput(float(r.reshape(-1)[0])), item.token_ids)
                for i, (item, r) in enumerate(zip(inputs, rows))]
    if pooling is None or "embed" not in pooling.tasks:
        tasks = ", ".join(pooling.tasks) if pooling is not None else "generation"
        raise InvalidRequestError("task", f"score needs a cross-encoder or an embedding model; this one serves "
                                          f"{tasks}")
    a = embed(runner, left, pooling_params, truncate_prompt_tokens)
    b = embed(runner, right, pooling_params, truncate_prompt_tokens)
    return [ScoringRequestOutput(str(i), ScoringOutput(float(F.cosine_similarity(
        torch.tensor(x.outputs.embedding), torch.tensor(y.outputs.embedding), dim=0))),
        x.prompt_token_ids + y.prompt_token_ids) for i, (x, y) in enumerate(zip(a, b))]
