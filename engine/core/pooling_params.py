"""``PoolingParams``: what one pooling request asks (vLLM's names), checked against the model's tasks."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequestError

if TYPE_CHECKING:   # the engine's CLI parses its flags before torch (engine.models) is imported
    from engine.models.pooling_config import PoolingModelInfo

TASKS = ("embed", "classify", "score", "token_embed")


@dataclass
class PoolingParams:
    """vLLM's ``PoolingParams``: ``dimensions`` keeps an embedding's first N values (renormalised when normalising:
    Matryoshka); ``normalize`` None is the model's own setting; ``use_activation`` applies a classifier's softmax /
    a cross-encoder's sigmoid (None: on). ``task`` is set by the API that sends it (None: "embed")."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None
    truncate_prompt_tokens: int | None = None

    def clone(self, **changes: Any) -> PoolingParams:
        return replace(self, **changes)

    def validate(self, tasks: tuple[str, ...], embedding_size: int, matryoshka_dimensions: tuple[int, ...],
                 is_matryoshka: bool, runner_kind: str) -> str:
        """The task to run; InvalidRequestError naming the field otherwise."""
        task = self.task or ("embed" if "embed" in tasks else tasks[0])
        if task not in TASKS:
            raise InvalidRequestError("task", f"unknown pooling task {task!r}; expected one of {', '.join(TASKS)}")
        if task not in tasks:
            raise InvalidRequestError("task", f"this {runner_kind} model does not support the {task!r} task; it "
                                              f"supports {', '.join(tasks)}")
        if self.dimensions is not None:
            if task != "embed":
                raise InvalidRequestError("dimensions", f"applies to the embed task, not {task!r}")
            if not is_matryoshka:
                raise InvalidRequestError("dimensions", "this model does not support Matryoshka representations "
                                                        "(its config has no is_matryoshka / matryoshka_dimensions)")
            if not 1 <= self.dimensions <= embedding_size:
                raise InvalidRequestError("dimensions", f"must be between 1 and the embedding size {embedding_size}, "
                                                        f"got {self.dimensions}")
            if matryoshka_dimensions and self.dimensions not in matryoshka_dimensions:
                raise InvalidRequestError("dimensions", f"{self.dimensions} is not one of the model's Matryoshka "
                                                        f"dimensions {list(matryoshka_dimensions)}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise InvalidRequestError("truncate_prompt_tokens", "must be >= -1")
        return task


@dataclass
class PoolingSpec:
    """A pooling request's part of its core ``Request`` (``Request.pooling``): the task it runs, its parameters, and
    BERT segment ids, one per prompt token (None: all 0)."""

    task: str
    params: PoolingParams
    token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class PoolingTasks:
    """What the loaded pooling model serves (``engine.models.pooling_config.PoolingModelInfo``'s answers), as the
    core checks requests against it and GetInfo reports it."""

    tasks: tuple[str, ...]
    embedding_size: int
    is_matryoshka: bool
    matryoshka_dimensions: tuple[int, ...]
    labels: tuple[str, ...]
    kind: str   # "embedding" or "classification": how a refusal names the model

    @classmethod
    def of(cls, info: PoolingModelInfo, hidden_size: int) -> PoolingTasks:
        return cls(info.tasks, info.hidden_size or hidden_size, info.is_matryoshka, info.matryoshka_dimensions,
                   info.labels, "embedding" if info.kind == "embed" else "classification")

    def spec(self, params: PoolingParams, num_tokens: int, token_type_ids: list[int] | None,
             type_vocab_size: int | None) -> PoolingSpec:
        """The request's PoolingSpec; InvalidRequestError naming the field when the model cannot run it.
        ``type_vocab_size`` None: the model reads no segment ids (a decoder), so they are dropped."""
        task = params.validate(self.tasks, self.embedding_size, self.matryoshka_dimensions, self.is_matryoshka,
                               self.kind)
        if type_vocab_size is None or not token_type_ids:
            return PoolingSpec(task, params)
        if len(token_type_ids) != num_tokens:
            raise InvalidRequestError("token_type_ids", f"has {len(token_type_ids)} ids for {num_tokens} prompt tokens")
        bad = [t for t in token_type_ids if not 0 <= t < type_vocab_size]
        if bad:
            raise InvalidRequestError("token_type_ids", f"segment id {bad[0]} is out of range [0, {type_vocab_size})")
        return PoolingSpec(task, params, list(token_type_ids))
