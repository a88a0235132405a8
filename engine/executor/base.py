"""The executor protocol the core drives, and the choice of executor from the config.

``uni`` runs the one worker in the engine process. ``mp`` and ``ray`` run a replica of
``tensor_parallel_size × pipeline_parallel_size`` ranks: rank 0 (the driver: the requests' inputs, the
sampler) in the engine process, the others as processes it starts (``mp``) or Ray actors in a placement group
(``ray``); each step the driver broadcasts a typed message (``engine.executor.message``) and returns the sampled
tokens. A rank that dies raises :class:`WorkerFailedError` from the step in flight (never a hang on a
collective), and the engine process exits for its supervisor to restart it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import EngineConfig
from engine.executor.errors import WorkerFailedError

if TYPE_CHECKING:
    from engine.core.lora_request import LoRARequest
    from engine.core.request import SequenceId
    from engine.core.sampling_params import StructuredOutputsParams
    from engine.core.scheduler_output import SchedulerOutput
    from engine.models import ModelConfig
    from engine.worker.kv_transports import KVSource
    from engine.worker.model_runner import PreparedStep, RunnerOutput
    from engine.worker.structured_output import GrammarVocabulary


class Executor(Protocol):
    num_blocks: int

    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def device_name(self) -> str: ...
    @property
    def dtype_name(self) -> str: ...
    @property
    def kv_cache_dtype_name(self) -> str: ...
    @property
    def last_prepare_s(self) -> float: ...
    @property
    def kv_source(self) -> KVSource | None: ...
    def encoder_cache_stats(self) -> tuple[int, int]: ...
    def image_tokens(self, tensors: Mapping[str, Any]) -> int: ...

    def initialize_cache(self, eos_token_ids: set[int],
                         grammar_vocabulary: GrammarVocabulary | None = None) -> int: ...
    def compile_grammar(self, spec: StructuredOutputsParams) -> None: ...
    def fork(self, parent: SequenceId, child: SequenceId) -> None: ...
    def add_lora(self, lora: LoRARequest) -> None: ...
    def remove_lora(self, lora_id: int) -> None: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...
    def prepare_model(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The step's host side, on the caller's thread (``execute_model`` = both halves)."""
        ...
    def execute_prepared(self, prepared: PreparedStep) -> RunnerOutput:
        """The device side of a prepared step; steps run in the order they were prepared."""
        ...
    def release(self, seq_ids: list[SequenceId]) -> None: ...
    def check_health(self) -> None:
        """Raises WorkerFailedError once a rank of the replica has died (between steps too)."""
        ...
    def shutdown(self) -> None:
        """Stops the other ranks (a Shutdown message, then a bounded wait and kill); idempotent."""
        ...


def make_executor(config: EngineConfig) -> Executor:
    """The executor ``config.executor_backend`` names."""
    backend = config.executor_backend
    if backend == "uni":
        from engine.executor.uniproc import UniprocExecutor
        return UniprocExecutor(config)
    if backend == "mp":
        from engine.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(config)
    from engine.executor.ray_executor import RayExecutor
    return RayExecutor(config)


__all__ = ["Executor", "WorkerFailedError", "make_executor"]
