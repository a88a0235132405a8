"""EngineCore: the synchronous heart of the engine. ``step()`` = schedule → run → update, no I/O.

The gRPC server and the offline ``LLM`` wrap it; it can be driven from a unit
test with no server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig
from engine.device import get_device
from engine.errors import InvalidRequestError
from engine.models import load_model, resolve_dtype
from engine.core.outputs import EngineCoreOutput
from engine.core.request import FinishReason, Request
from engine.worker.model_runner import ModelRunner
from engine.worker.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 * 2**30
_MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class StepStats:
    """What the last step did, for metrics and tests."""

    num_scheduled_tokens: dict[str, int]
    num_batched_tokens: int
    duration_s: float
    # Host-side bookkeeping: the part of a step that an accelerator cannot hide.
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    update_s: float = 0.0

    @property
    def overhead_fraction(self) -> float:
        """Scheduler + input preparation + output processing, as a share of the step."""
        return (self.schedule_s + self.prepare_s + self.update_s) / self.duration_s if self.duration_s else 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, *, show_progress: bool = True) -> None:
        self.config = config
        self.device = get_device(config.device, num_threads=config.num_threads)
        self.device.set_seed(config.seed)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.kv_cache_dtype = (self.dtype if config.kv_cache_dtype == "auto"
                               else resolve_dtype(config.kv_cache_dtype, config.device))
        self.model = load_model(config.model_path, self.dtype, self.device.torch_device)
        self.device.prepare_model(self.model, self.dtype)
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = set(mc.eos_token_ids)
        self.max_model_len = self._resolve_max_model_len(mc.max_position_embeddings)
        self.sampler = Sampler(mc.vocab_size, self.eos_token_ids, seed=config.seed, argmax=self.device.row_argmax())
        num_blocks = self._num_kv_blocks()
        self.num_blocks = num_blocks
        self.runner = ModelRunner(self.model, self.device, self.sampler, num_blocks=num_blocks,
                                  block_size=config.block_size,
                                  max_num_batched_tokens=config.max_num_batched_tokens, dtype=self.kv_cache_dtype)
        self.scheduler = Scheduler(config, num_blocks, eos_token_ids=self.eos_token_ids,
                                   max_model_len=self.max_model_len)
        self._pending: list[EngineCoreOutput] = []
        self.last_step: StepStats | None = None
        self.total_steps = 0
        logger.info("engine ready: %s, dtype %s, %d KV blocks of %d tokens (%s), max_model_len %d",
                    config.model_name, self.dtype, num_blocks, config.block_size, self.kv_cache_dtype,
                    self.max_model_len)

    # -- sizing -------------------------------------------------------------------------------------------
    def _resolve_max_model_len(self, model_max: int) -> int:
        wanted = self.config.max_model_len
        if wanted is None:
            return min(model_max, _MAX_DEFAULT_MODEL_LEN)
        if wanted > model_max:
            raise InvalidRequestError(
                "max_model_len", f"{wanted} exceeds the model's context length {model_max}")
        return wanted

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        mc = self.model.config
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        per_block = 2 * mc.num_layers * cfg.block_size * mc.num_kv_heads * mc.head_dim * elem
        if self.device.name == "cpu":
            budget = cfg.kv_cache_memory or _DEFAULT_CPU_KV_BYTES
        else:
            # Accelerators: a share of device memory, less what the weights and activations already hold.
            free, total = self.device.memory_info()
            used = total - free
            budget = int(total * cfg.device_memory_utilization) - used - self._activation_reserve()
        num = budget // per_block
        if num < 1:
            raise InvalidRequestError("kv_cache_memory", f"{budget} bytes leave no room for one KV block")
        return int(num)

    def _activation_reserve(self) -> int:
        """Rough activation peak of a max-size step: hidden states and logits in fp32, with headroom."""
        mc = self.model.config
        tokens = self.config.max_num_batched_tokens
        return 4 * tokens * (4 * mc.hidden_size + 2 * mc.intermediate_size) + 4 * self.config.max_num_seqs * mc.vocab_size * 2

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams,
                    *, priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validate and queue a request. Raises InvalidRequestError (naming the field) or QueueFullError.

        ``prompt_token_ids``: a list of ints or a 1-D integer array (what the gRPC servicer passes on,
        straight from shared memory or protobuf)."""
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if isinstance(prompt_token_ids, np.ndarray):
            if prompt_token_ids.ndim != 1 or not np.issubdtype(prompt_token_ids.dtype, np.integer):
                raise InvalidRequestError("prompt_token_ids", "must be a one-dimensional array of integers")
            lo, hi = int(prompt_token_ids.min()), int(prompt_token_ids.max())
        else:
            lo, hi = min(prompt_token_ids), max(prompt_token_ids)  # C loops; a generator costs ~4 ms at 128k
        bad = lo if lo < 0 else hi if hi >= self.vocab_size else None
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} is out of range [0, {self.vocab_size})")
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(prompt_token_ids)} tokens, more than max_model_len "
                          f"{self.max_model_len}")
        params.validate(self.vocab_size)
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already running")
        request = Request(request_id, prompt_token_ids, params, arrival_time=arrival_time, priority=priority)
        self.scheduler.add_request(request)
        return request

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort now (blocks freed at once); each aborted request reports one ABORT output next step."""
        for rid in request_ids:
            for req in self.scheduler.abort_request(rid):
                self.runner.release([req.request_id])
                self._pending.append(EngineCoreOutput(
                    req.request_id, [], finish_reason=FinishReason.ABORT,
                    num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished_requests()

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_unfinished_requests():
            return outputs
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        prepare_s = 0.0
        if sched.scheduled or sched.block_copies:
            run = self.runner.execute(sched)
            prepare_s = self.runner.last_prepare_s
            t2 = time.perf_counter()
            step_outputs = self.scheduler.update_from_output(sched, run.sampled, run.logprobs)
        else:
            t2 = time.perf_counter()
            step_outputs = self.scheduler.update_from_output(sched, {}, {})
        t3 = time.perf_counter()
        finished = [o.request_id for o in step_outputs if o.finished]
        if finished:
            self.runner.release(finished)
        self.total_steps += 1
        self.last_step = StepStats({s.request.request_id: s.num_new_tokens for s in sched.scheduled},
                                   sched.num_batched_tokens, time.perf_counter() - t0,
                                   schedule_s=t1 - t0, prepare_s=prepare_s, update_s=t3 - t2)
        return outputs + step_outputs

    def scheduler_stats(self) -> dict[str, int]:
        """Cumulative counters (for GetInfo and Prometheus)."""
        sched = self.scheduler
        return {
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "prompt_tokens": sched.num_prompt_tokens,
            "generation_tokens": sched.num_generation_tokens,
            "steps": self.total_steps,
        }

    def info(self) -> dict[str, object]:
        sched = self.scheduler
        return {
            "model": self.config.model_name,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "eos_token_ids": sorted(self.eos_token_ids),
            "bos_token_id": self.model.config.bos_token_id,
            "block_size": self.config.block_size,
            "total_kv_blocks": self.num_blocks,
            "free_kv_blocks": sched.block_manager.num_free_blocks,
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": self.device.name,
        }
