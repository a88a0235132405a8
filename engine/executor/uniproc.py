"""The ``uniproc`` executor: one worker in the engine process, called directly."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.models import ModelConfig
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration
from engine.worker.model_runner import PreparedStep, RunnerOutput
from engine.worker.worker import Worker

if TYPE_CHECKING:
    from engine.core.lora_request import LoRARequest
    from engine.core.request import SequenceId
    from engine.core.sampling_params import StructuredOutputsParams
    from engine.core.scheduler_output import SchedulerOutput
    from engine.worker.kv_transports import KVSource
    from engine.worker.structured_output import GrammarVocabulary


class UniprocExecutor:
    """Loads the model, sizes the KV cache and executes each step's ``SchedulerOutput`` on one worker."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.num_blocks = 0

    @property
    def model_config(self) -> ModelConfig:
        return self.worker.model_config

    @property
    def device_name(self) -> str:
        return self.worker.device.name

    @property
    def dtype_name(self) -> str:
        return str(self.worker.dtype).removeprefix("torch.")

    @property
    def kv_cache_dtype_name(self) -> str:
        return str(self.worker.kv_cache_dtype).removeprefix("torch.")

    def initialize_cache(self, eos_token_ids: set[int], grammar_vocabulary: GrammarVocabulary | None = None) -> int:
        """Allocates the KV cache and the runner; returns the number of blocks. ``grammar_vocabulary``: the
        tokenizer for structured outputs (None: requests with a constraint are refused)."""
        self.num_blocks = self.worker.num_kv_blocks()
        self.worker.init_runner(self.num_blocks, eos_token_ids, grammar_vocabulary)
        return self.num_blocks

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile (or find cached) a request's constraint before it is queued: InvalidRequestError naming the
        field when it does not compile, or when this engine has no vocabulary to constrain with."""
        runner = self.worker.runner
        assert runner is not None, "initialize_cache first"
        if runner.structured is None:
            raise InvalidRequestError("structured_outputs", "this engine was started without its tokenizer's "
                                                            "vocabulary, so it cannot constrain outputs")
        runner.structured.compile(spec)

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        """``child`` continues from ``parent``'s per-sequence worker state (its grammar matcher)."""
        if self.worker.runner is not None:
            self.worker.runner.fork(parent, child)

    def add_lora(self, lora: LoRARequest) -> None:
        """Reads and validates ``lora``'s folder against the loaded model into the worker's host cache (idempotent
        for an id already there); InvalidRequestError naming the file and field, or LoRA not enabled."""
        self.worker.add_lora(lora)

    def remove_lora(self, lora_id: int) -> None:
        """Forgets an adapter's weights (host cache and device slot); unknown ids are ignored."""
        self.worker.remove_lora(lora_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.execute_prepared(self.prepare_model(scheduler_output))

    def prepare_model(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """A step's host side (inputs, sampling rows), on the caller's thread."""
        assert self.worker.runner is not None, "initialize_cache first"
        return self.worker.runner.prepare(scheduler_output)

    def execute_prepared(self, prepared: PreparedStep) -> RunnerOutput:
        """A prepared step's device side; under async scheduling on the core's worker thread, in step order."""
        assert self.worker.runner is not None, "initialize_cache first"
        return self.worker.runner.run(prepared)

    def image_tokens(self, tensors: Mapping[str, Any]) -> int:
        """The placeholder embeddings the model makes of one image's processor tensors; ValueError for tensors its
        vision tower cannot take or a model without one."""
        model = self.worker.model
        if not isinstance(model, (LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration)):
            raise ValueError("the model takes no images")
        return model.image_tokens(tensors)

    @property
    def kv_source(self) -> KVSource | None:
        """Where decode engines reach this prefill engine's KV cache (None: not a producer)."""
        return self.worker.kv_source

    def encoder_cache_stats(self) -> tuple[int, int]:
        """(lookups, hits) of the driver's encoder cache (a vision-language model's; (0, 0) without one)."""
        stage = self.worker.stage
        cache = None if stage is None or stage.encoder is None else stage.encoder.cache
        return (0, 0) if cache is None else (cache.queries, cache.hits)

    @property
    def last_prepare_s(self) -> float:
        runner = self.worker.runner
        return 0.0 if runner is None else runner.last_prepare_s

    def check_health(self) -> None:
        """Nothing to check: the one worker is this process."""

    def shutdown(self) -> None:
        """Nothing to stop (the one worker is this process) but a KV transport's threads and mappings."""
        self.worker.close_kv_transport()

    def release(self, seq_ids: list[SequenceId]) -> None:
        """Forget the per-sequence state (seeded generators, grammar matchers) of sequences that ended."""
        if self.worker.runner is not None:
            self.worker.runner.release(seq_ids)
