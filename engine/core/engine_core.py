"""EngineCore: the synchronous heart of the engine. ``step()`` = schedule → run → update, no I/O.

The gRPC server and the offline ``LLM`` wrap it; it can be driven from a unit
test with no server. With multi-step decode (``num_scheduler_steps`` > 1) a step's
decode rows run further passes after the first, each applied as it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.errors import FailedPreconditionError, InvalidRequestError
from engine.config import EngineConfig
from engine.core.async_steps import AsyncSteps
from engine.core.finish_reason import FinishReason
from engine.core.kv_events import EventPublisher, NullEventPublisher, event_batch, make_event_publisher
from engine.core.kv_offload import kv_block_bytes, num_tier_slots
from engine.core.kv_transfer_params import RemoteKV
from engine.core.lora_request import LoRARequest
from engine.core.multimodal import MultiModalItem, check_items
from engine.core.outputs import EngineCoreOutput
from engine.core.pooling_params import PoolingParams, PoolingTasks
from engine.core.request import Request, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.spec_stats import SpecDecodingStats
from engine.executor.base import Executor, make_executor
from engine.models.pooling_config import resolve_runner
from engine.worker.structured_output import GrammarVocabulary

if TYPE_CHECKING:
    from engine.models import ModelConfig
    from engine.worker.model_runner import RunnerOutput

logger = logging.getLogger(__name__)



@dataclass
class StepStats:
    """What the last step did, for metrics and tests."""

    num_scheduled_tokens: dict[SequenceId, int]
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
    def __init__(self, config: EngineConfig, *, show_progress: bool = True,
                 grammar_vocabulary: GrammarVocabulary | None = None) -> None:
        """``grammar_vocabulary``: the tokenizer's vocabulary for structured outputs, which only an entry point
        can load (the core never reads text); None refuses requests with a constraint."""
        # --runner: a pooling model runs the pooling executor (engine.worker.pooling_runner), no KV cache
        self.runner = resolve_runner(config.model_path, config.runner, config.convert)
        self.pooling: PoolingTasks | None = None
        self._type_vocab_size: int | None = None   # segment ids the pooling model reads (None: none)
        if self.runner == "pooling":
            from engine.worker.pooling_runner import PoolingExecutor, pooling_engine_config

            config = pooling_engine_config(config)
            pooling_executor = PoolingExecutor(config)
            self.pooling = PoolingTasks.of(pooling_executor.info, pooling_executor.model_config.hidden_size)
            self._type_vocab_size = pooling_executor.type_vocab_size
            self.executor: Executor = pooling_executor
        else:
            self.executor = make_executor(config)
        self.config = config
        mc = self.executor.model_config
        self.model_config = mc
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = set(mc.eos_token_ids)
        try:
            self.max_model_len = self._resolve_max_model_len(mc.max_position_embeddings, mc.sliding_window)
            num_blocks = self.executor.initialize_cache(self.eos_token_ids, grammar_vocabulary)
        except BaseException:
            self.executor.shutdown()   # the other ranks of a replica end with it
            raise
        self.num_blocks = num_blocks
        self.max_model_len = self._fit_max_model_len(num_blocks)
        if self.pooling is not None and config.max_num_batched_tokens < self.max_model_len:
            # each prompt runs whole in one step (no chunks), so the step's budget holds the longest one
            self.config = config = config.with_changes(max_num_batched_tokens=self.max_model_len)
        reclaim_window = self._reclaim_window(mc)
        if config.kv_transfer_config is not None and (self.pooling is not None or reclaim_window):
            self.executor.shutdown()
            raise InvalidRequestError("kv_transfer_config", "a pooling model has no KV cache to transfer"
                                      if self.pooling is not None else
                                      "a sliding-window model gives back blocks outside its window: their KV does "
                                      "not cross to a decode engine yet")
        self.scheduler = Scheduler(
            config, num_blocks, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
            reclaim_window=reclaim_window,
            kv_offload_slots=num_tier_slots(config, mc, self.executor.kv_cache_dtype_name) or 0,
            kv_block_bytes=0 if config.kv_transfer_config is None else kv_block_bytes(
                mc, config.block_size, self.executor.kv_cache_dtype_name),
            kv_source=self.executor.kv_source)
        self._pending: list[EngineCoreOutput] = []
        # Where a multi-step step streams the outputs of each pass but its last as the pass ends (the AsyncEngine
        # sets it); None: ``step`` returns them all.
        self.output_sink: Callable[[list[EngineCoreOutput]], None] | None = None
        # LoRA: the adapters the executor holds, by id; every path an id was ever given (an id stands for one
        # adapter's weights for the process's life: its prefix-cache blocks outlive the adapter's removal); the
        # live requests of each adapter; the adapters whose removal waits for their last request to end.
        self._loras: dict[int, LoRARequest] = {}
        self._lora_paths: dict[int, str] = {}
        self._lora_of_request: dict[str, int] = {}
        self._lora_users: dict[int, int] = {}
        self._lora_removals: set[int] = set()
        self.last_step: StepStats | None = None
        self.total_steps = 0
        spec = config.speculative_config
        self.spec_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else config.device != "cpu" and config.kv_offloading_config is None
                                 and config.kv_transfer_config is None)
        self._async = (AsyncSteps(self.scheduler, self.executor, config, self._apply) if self.async_scheduling
                       else None)
        # KV cache events (--kv-events-config): the prefix cache's changes of each step, published as one batch.
        self.kv_event_publisher: EventPublisher = NullEventPublisher()
        try:
            self.kv_event_publisher = make_event_publisher(config.kv_events_config, config.data_parallel_rank)
        except BaseException:   # an endpoint that cannot be bound: the replica's other ranks end with it
            self.close()
            raise
        logger.info("engine ready: %s, dtype %s, %d KV blocks of %d tokens (%s), max_model_len %d, async "
                    "scheduling %s", config.model_name, self.executor.dtype_name, num_blocks, config.block_size,
                    self.executor.kv_cache_dtype_name, self.max_model_len, "on" if self.async_scheduling else "off")

    def check_health(self) -> None:
        """Raises WorkerFailedError once a rank of the replica has died, between steps too (a step raises it
        itself). An idle producer lets go of KV holds past their timeout here (a busy one does each step)."""
        self.executor.check_health()
        if self.scheduler.kv_transfer is not None:
            self.scheduler.kv_transfer.expire()

    def close(self) -> None:
        """Stops the replica's other ranks (nothing to stop with the uniproc executor); idempotent."""
        if self._async is not None:
            self._async.close()
        self.kv_event_publisher.shutdown()
        self.executor.shutdown()

    def _reclaim_window(self, mc: ModelConfig) -> int | None:
        """The window past which a sequence's blocks are given back: when every layer of the model slides
        (Mistral, Phi-3; not models that interleave global layers), none reads before it. Not with a draft model,
        whose own cache under the same blocks attends over the whole context."""
        window: int | None = mc.sliding_window
        if (window is None or mc.sliding_layers is not None or self.config.disable_sliding_window
                or (self.config.speculative_config is not None
                    and self.config.speculative_config.method == "draft_model")):
            return None
        return window

    # -- sizing -------------------------------------------------------------------------------------------
    def _resolve_max_model_len(self, model_max: int, sliding_window: int | None) -> int:
        """--max-model-len, or the model's declared context; with --disable-sliding-window, at most the model's
        sliding window (as vLLM caps it: every layer then attends over all of it, which is what the window saw)."""
        wanted = self.config.max_model_len
        limit, what = model_max, f"the model's context length {model_max}"
        if self.config.disable_sliding_window and sliding_window is not None and sliding_window < model_max:
            limit, what = sliding_window, f"the model's sliding window {sliding_window} (--disable-sliding-window)"
        if wanted is None:
            return limit
        if wanted > limit:
            raise InvalidRequestError("max_model_len", f"{wanted} exceeds {what}")
        return wanted

    def _fit_max_model_len(self, num_blocks: int) -> int:
        """The context against the KV cache: when one sequence of ``max_model_len`` cannot fit, say so with the
        arithmetic — and, when the length was the model's default rather than asked for, lower it to what fits (an
        asked-for length stays: its requests end at the cache's capacity, finish reason "length")."""
        capacity = num_blocks * self.config.block_size
        if capacity >= self.max_model_len:
            return self.max_model_len
        asked = self.config.max_model_len is not None
        logger.warning("the KV cache holds %d blocks x %d tokens = %d tokens, fewer than max_model_len %d (%s): %s; "
                       "give more cache memory (--kv-cache-memory / --gpu-memory-utilization) or a smaller "
                       "--max-model-len", num_blocks, self.config.block_size, capacity, self.max_model_len,
                       "asked for" if asked else "the model's context",
                       "a sequence ends where the cache is full" if asked else f"max_model_len lowered to {capacity}")
        return self.max_model_len if asked else capacity

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams,
                    *, priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None,
                    resumed_output_tokens: int = 0, mm_items: Sequence[MultiModalItem] = (),
                    kv_transfer: RemoteKV | None = None) -> Request:
        """Validate and queue a request. Raises InvalidRequestError (naming the field) or QueueFullError.

        ``prompt_token_ids``: a list of ints or a 1-D integer array (what the gRPC servicer passes on,
        straight from shared memory or protobuf). Token ids and parameters are checked against the model
        here; the prompt's length (max_model_len, the KV cache) and the request id by the scheduler.
        ``lora_request``: the adapter to run it through (None: the base model), loaded and validated the first
        time its id is seen (its errors refuse the request). ``cache_salt``: vLLM's prefix-cache salt, a
        non-empty string (None: no salt); only requests with the same salt share cached blocks.
        ``resumed_output_tokens``: the prompt's last this-many ids are output already delivered by another engine
        (request migration, :meth:`check_resumed`). ``mm_items``: the prompt's images, their placeholders in it
        (``engine.core.multimodal.check_items`` refuses what the model or ``--limit-mm-per-prompt`` does not take).
        ``kv_transfer``: prefill/decode disaggregation (:meth:`check_kv_transfer`; None: an ordinary request)."""
        if self.pooling is not None:
            raise FailedPreconditionError(f"{self.config.model_name} is a pooling model ({self.pooling.kind}): it "
                                          f"serves the pooling tasks {', '.join(self.pooling.tasks)}, not generation")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt", "must be a non-empty string if provided")
        if isinstance(prompt_token_ids, np.ndarray):
            if prompt_token_ids.ndim != 1 or not np.issubdtype(prompt_token_ids.dtype, np.integer):
                raise InvalidRequestError("prompt_token_ids", "must be a one-dimensional array of integers")
        if len(prompt_token_ids):   # an empty prompt is refused by the scheduler
            if isinstance(prompt_token_ids, np.ndarray):
                lo, hi = int(prompt_token_ids.min()), int(prompt_token_ids.max())
            else:
                lo, hi = min(prompt_token_ids), max(prompt_token_ids)  # C loops; a generator costs ~4 ms at 128k
            bad = lo if lo < 0 else hi if hi >= self.vocab_size else None
            if bad is not None:
                raise InvalidRequestError("prompt_token_ids", f"token id {bad} is out of range [0, {self.vocab_size})")
        params.validate(self.vocab_size, self.config.max_logprobs)
        if mm_items:
            check_items(mm_items, np.asarray(prompt_token_ids), self.model_config.image_token_id,
                        self.config.limit_mm_per_prompt, self.config.model_name, self.executor.image_tokens)
        if resumed_output_tokens:
            self.check_resumed(resumed_output_tokens, len(prompt_token_ids), params)
        handoff = False
        if kv_transfer is not None:
            self.check_kv_transfer(kv_transfer, params)
            if kv_transfer.do_remote_decode:   # the first token here, the rest on a decode engine
                handoff = params.max_tokens is None or params.max_tokens > 1
                params = params.clone(max_tokens=1, min_tokens=min(params.min_tokens, 1))
        limit = self.config.max_num_seqs
        if params.beam_search is not None and params.beam_search.beam_width > limit:
            raise InvalidRequestError("beam_search.beam_width", f"must be <= max_num_seqs ({limit}), got "
                                                                f"{params.beam_search.beam_width}")
        if params.best_of is not None and params.best_of > limit:
            raise InvalidRequestError("best_of", f"must be <= max_num_seqs ({limit}), got {params.best_of}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            # vLLM refuses it too: under fcfs a priority would be silently ignored.
            raise InvalidRequestError("priority", f"must be 0 under the {self.config.scheduling_policy} scheduling "
                                                  f"policy (start the engine with --scheduling-policy priority), "
                                                  f"got {priority}")
        if params.structured_outputs is not None:  # compiled (or found cached) now: never refused in a step
            self.executor.compile_grammar(params.structured_outputs)
        if lora_request is not None:
            self.add_lora(lora_request)
        request = Request(request_id, prompt_token_ids, params, arrival_time=arrival_time, priority=priority,
                          lora_request=lora_request, cache_salt=cache_salt,
                          resumed_output_tokens=resumed_output_tokens)
        request.mm_items = tuple(sorted(mm_items, key=lambda item: item.offset))
        request.kv_transfer, request.kv_handoff = kv_transfer, handoff
        self.scheduler.add_request(request)
        if lora_request is not None:
            lora_id = lora_request.lora_int_id
            self._lora_of_request[request_id] = lora_id
            self._lora_users[lora_id] = self._lora_users.get(lora_id, 0) + 1
        return request

    def check_kv_transfer(self, kv: RemoteKV, params: SamplingParams) -> None:
        """A request's ``kv_transfer`` against this engine's role: a producer takes do_remote_decode (n = 1, no
        best_of, no beam search), a consumer takes a producer's blocks; anything else is refused naming it."""
        config = self.config.kv_transfer_config
        if config is None:
            raise InvalidRequestError("kv_transfer", "this engine runs without --kv-transfer-config")
        if kv.do_remote_decode:
            if not config.is_producer:
                raise InvalidRequestError("kv_transfer.do_remote_decode",
                                          f"this engine's kv_role is {config.kv_role}: it does not hold KV for a "
                                          "decode engine")
            if kv.has_source:
                raise InvalidRequestError("kv_transfer", "do_remote_decode and a producer's blocks are exclusive")
            if params.n != 1 or params.best_of is not None or params.beam_search is not None:
                raise InvalidRequestError("kv_transfer.do_remote_decode",
                                          "needs n = 1 and neither best_of nor beam search")
        elif kv.has_source:
            if not config.is_consumer:
                raise InvalidRequestError("kv_transfer.remote_block_ids",
                                          f"this engine's kv_role is {config.kv_role}: it does not pull KV from a "
                                          "prefill engine")
            if len(kv.remote_block_ids) != len(kv.block_hashes):
                raise InvalidRequestError("kv_transfer.block_hashes",
                                          f"must have one hash per block ({len(kv.remote_block_ids)}), got "
                                          f"{len(kv.block_hashes)}")
        else:
            raise InvalidRequestError("kv_transfer", "must set do_remote_decode or name a producer's blocks")

    @staticmethod
    def check_resumed(num_resumed: int, num_ids: int, params: SamplingParams) -> None:
        """A resumed request (``resumed_output_tokens``) continues one sequence whose outputs the client has seen:
        at most the ids sent, n = 1, no best_of or beam search (those report nothing before their end, so a moved one
        starts again instead), and fewer than max_tokens (one that reached it had ended)."""
        if num_resumed > num_ids:
            raise InvalidRequestError("resumed_output_tokens", f"must be at most the prompt's length ({num_ids}), "
                                                               f"got {num_resumed}")
        if params.n != 1 or params.holds_outputs:
            raise InvalidRequestError("resumed_output_tokens", "needs n = 1 and neither best_of nor beam search")
        if params.max_tokens is not None and num_resumed >= params.max_tokens:
            raise InvalidRequestError("resumed_output_tokens", f"must be less than max_tokens ({params.max_tokens}), "
                                                               f"got {num_resumed}")

    def add_pooling_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                            params: PoolingParams, *, token_type_ids: Sequence[int] | None = None, priority: int = 0,
                            arrival_time: float | None = None) -> Request:
        """Validate and queue a pooling request: one step over its whole prompt, then one output carrying
        ``EngineCoreOutput.pooled``. FailedPreconditionError on a generation model; InvalidRequestError naming the
        field (an unsupported task, ``dimensions``, segment ids, token ids); QueueFullError."""
        if self.pooling is None:
            raise FailedPreconditionError(f"{self.config.model_name} is a generation model: it does not serve "
                                          "pooling (embeddings, scores, classification); start a pooling model "
                                          "(--runner pooling)")
        ids = np.asarray(prompt_token_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise InvalidRequestError("prompt_token_ids", "must be a one-dimensional array of integers")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} is out of range [0, {self.vocab_size})")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError("priority", f"must be 0 under the {self.config.scheduling_policy} scheduling "
                                                  "policy")
        spec = self.pooling.spec(params, len(ids), list(token_type_ids or []),
                                 self._type_vocab_size)
        request = Request(request_id, ids, SamplingParams(max_tokens=1), arrival_time=arrival_time,
                          priority=priority)
        request.pooling = spec
        self.scheduler.add_request(request)
        return request

    # -- LoRA adapters ------------------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> bool:
        """Load and validate an adapter now (the executor reads its folder); True when it was not loaded yet.

        Raises InvalidRequestError: LoRA is off; the id was given to another adapter folder; the folder is
        missing or malformed, or does not fit the model (the executor's message names the file and field).
        An adapter whose removal was waiting for its requests is kept after all."""
        if self.config.lora_config is None:
            raise InvalidRequestError("lora_request", "LoRA is not enabled: start the engine with --enable-lora "
                                                      "(offline: LLM(..., enable_lora=True))")
        lora_id = lora.lora_int_id
        path = self._lora_paths.get(lora_id)
        if path is not None and path != lora.lora_path:
            raise InvalidRequestError(
                "lora_request", f"lora_int_id {lora_id} already names the adapter at {path!r}, not "
                                f"{lora.lora_path!r}: give each adapter its own lora_int_id")
        self._lora_removals.discard(lora_id)
        if lora_id in self._loras:
            return False
        t0 = time.perf_counter()
        self.executor.add_lora(lora)
        logger.info("LoRA adapter %r (id %d) loaded from %s in %.0f ms", lora.lora_name, lora_id, lora.lora_path,
                    1000 * (time.perf_counter() - t0))
        self._loras[lora_id] = lora
        self._lora_paths[lora_id] = lora.lora_path
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Free an adapter's weights: now when no live request uses it, else when the last one ends (finished,
        aborted or failed). False when no adapter has that id."""
        if lora_id not in self._loras:
            return False
        if self._lora_users.get(lora_id):
            self._lora_removals.add(lora_id)
        else:
            self._drop_lora(lora_id)
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (those waiting for their requests to end before removal included)."""
        return set(self._loras)

    def _drop_lora(self, lora_id: int) -> None:
        self.executor.remove_lora(lora_id)
        del self._loras[lora_id]
        self._lora_removals.discard(lora_id)

    def _end_lora_uses(self, request_ids: Iterable[str]) -> None:
        """Count out the requests among ``request_ids`` that have ended; free adapters left unused and waiting."""
        for request_id in request_ids:
            if request_id not in self._lora_of_request or self.scheduler.get_request(request_id) is not None:
                continue   # no adapter, or a sequence of it still runs
            lora_id = self._lora_of_request.pop(request_id)
            self._lora_users[lora_id] -= 1
            if self._lora_users[lora_id] == 0:
                del self._lora_users[lora_id]
                if lora_id in self._lora_removals:
                    self._drop_lora(lora_id)

    def abort_requests(self, targets: Iterable[str | SequenceId], *, reason: FinishReason = FinishReason.ABORT
                       ) -> None:
        """End whole requests (a request id) or single sequences (a SequenceId) now, their blocks freed at
        once; each sequence ended reports one output with ``reason`` next step. Unknown or ended ones are
        ignored. ``reason`` is ERROR when the engine fails requests rather than a caller aborting them."""
        for target in targets:
            request_id, index = (target, None) if isinstance(target, str) else (target.request_id, target.index)
            for req in self.scheduler.abort_request(request_id, index, reason=reason):
                self.executor.release([req.seq_id])
                if req.holds_outputs:   # best_of, beams: its n outputs, none of which was reported yet
                    if req.ends_request:
                        last = req.num_returned - 1
                        self._pending += [EngineCoreOutput(
                            req.request_id, [], finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens, index=i, request_finished=i == last,
                            times=req.times() if i == last else None) for i in range(req.num_returned)]
                    continue
                self._pending.append(EngineCoreOutput(
                    req.request_id, [], finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens, index=req.index, request_finished=req.ends_request,
                    times=req.times() if req.ends_request else None))
            if self._lora_of_request:
                self._end_lora_uses([request_id])

    def release_kv_holds(self, pulled: Mapping[str, int]) -> None:
        """A prefill engine's holds whose decode engine went on: ``{request id: blocks it pulled}``; the holds end
        and the pulled blocks count as sent. Unknown ids are ignored."""
        if self.scheduler.kv_transfer is not None:
            for request_id, num_blocks in pulled.items():
                self.scheduler.kv_transfer.release(request_id, num_blocks)

    def has_unfinished_requests(self) -> bool:
        return (bool(self._pending) or self.scheduler.has_unfinished_requests()
                or (self._async is not None and self._async.busy))

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs. Under async scheduling these are the outputs of the step that was running when it
        was called, and the next step is left running (``engine.core.async_steps``)."""
        outputs, self._pending = self._pending, []
        if outputs and self.output_sink is not None and self.config.num_scheduler_steps > 1:
            # Before any pass of this step streams: a sequence's outputs stay in order.
            self.output_sink(outputs)
            outputs = []
        t0 = time.perf_counter()
        try:
            step_outputs = self._step_sync() if self._async is None else self._async.step()
        except BaseException:
            self._pending = outputs + self._pending  # outputs taken above are not lost with the step
            raise
        if self._async is None:
            return outputs + step_outputs
        sched = self._async.last_sched
        if sched is not None:
            st = self._async.stats
            self.last_step = StepStats(sched.num_scheduled_tokens, sched.num_batched_tokens,
                                       time.perf_counter() - t0, schedule_s=st.schedule_s, prepare_s=st.prepare_s,
                                       update_s=st.update_s)
        return outputs + step_outputs

    def _step_sync(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        prepare_s = 0.0
        run = None
        if sched.scheduled or sched.block_copies or sched.kv_transfer is not None:
            run = self.executor.execute_model(sched)
            prepare_s = self.executor.last_prepare_s
        t2 = time.perf_counter()
        step_outputs = self._apply(sched, run)
        t3 = time.perf_counter()
        self.last_step = StepStats(sched.num_scheduled_tokens, sched.num_batched_tokens, time.perf_counter() - t0,
                                   schedule_s=t1 - t0, prepare_s=prepare_s, update_s=t3 - t2)
        return step_outputs

    def _apply(self, sched: SchedulerOutput, run: RunnerOutput | None) -> list[EngineCoreOutput]:
        """A step's result into the scheduler (None: nothing ran); its outputs. Ended sequences are released."""
        if run is not None:
            ended = {seq_id: FinishReason.EOS for seq_id in run.grammar_complete}
            ended.update({seq_id: FinishReason.ERROR for seq_id in run.grammar_failed})
            step_outputs = self.scheduler.update_from_output(sched, run.sampled, run.logprobs, run.beam_candidates,
                                                             run.prompt_logprobs, grammar_ended=ended,
                                                             pooled=run.pooled)
            if self.spec_stats is not None:
                for seq_id, num_drafts in run.num_draft_tokens.items():
                    self.spec_stats.observe(num_drafts, len(run.sampled[seq_id]) - 1)
        else:
            step_outputs = self.scheduler.update_from_output(sched, {}, {})
        if self.scheduler.kv_loader is not None and run is not None:
            self.scheduler.kv_loader.finish_loads(run.kv_loads)
        if run is not None and any(s.num_lookahead_steps for s in sched.scheduled):
            step_outputs = self._lookahead_passes(sched, step_outputs)
        self._release_ended()
        self._publish_kv_events()
        self.total_steps += 1
        return step_outputs

    def _publish_kv_events(self) -> None:
        events = self.scheduler.block_manager.take_events()
        if self.scheduler.kv_offload is not None:
            events += self.scheduler.kv_offload.take_events()
        if events:
            self.kv_event_publisher.publish(event_batch(events))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's ``reset_prefix_cache``): False, and nothing changes, while a request
        holds blocks. Publishes AllBlocksCleared."""
        done = self.scheduler.block_manager.reset_prefix_cache()
        if done and self.scheduler.kv_offload is not None:
            self.scheduler.kv_offload.reset()
        self._publish_kv_events()
        return done

    def _release_ended(self) -> None:
        """Forget the worker state of the sequences the last update ended, and their adapters' uses."""
        finished = self.scheduler.ended   # best_of reports n of its sequences, but every one ended
        if finished:
            self.executor.release(finished)
            if self._lora_of_request:
                self._end_lora_uses({seq_id.request_id for seq_id in finished})

    def _lookahead_passes(self, first: SchedulerOutput, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Multi-step decode: the further decode passes of a step whose first pass gave ``outputs``, each applied
        as it ends. Streaming (``multi_step_stream_outputs``): each pass's outputs but the last go to
        ``output_sink`` as the pass ends (without a sink they are all returned, in pass order); else each
        sequence's deltas of the step come merged into one. Returns what the step hands back."""
        stream = self.config.multi_step_stream_outputs
        passes = [outputs]
        j = 1
        try:
            while (sched := self.scheduler.lookahead_pass(first, j)) is not None:
                self._release_ended()   # the sequences the pass before ended
                if stream and self.output_sink is not None:
                    self.output_sink(passes.pop())
                run = self.executor.execute_model(sched)
                passes.append(self.scheduler.update_from_output(sched, run.sampled, run.logprobs))
                j += 1
        except BaseException:
            self._pending = [o for p in passes for o in p] + self._pending   # applied: reported next step
            raise
        flat = [o for p in passes for o in p]
        return flat if stream else merge_deltas(flat)

    def scheduler_stats(self) -> dict[str, int]:
        """Cumulative counters (for GetInfo and Prometheus)."""
        sched = self.scheduler
        return {
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            # vLLM's external (KV connector) prefix cache: here the offload tier (0 without one)
            "external_prefix_cache_queries": 0 if sched.kv_loader is None else sched.kv_loader.queries,
            "external_prefix_cache_hits": 0 if sched.kv_loader is None else sched.kv_loader.hits,
            "num_preemptions": sched.num_preemptions,
            "prompt_tokens": sched.num_prompt_tokens,
            **({} if sched.kv_transfer is None else {
                f"kv_transfer_{name}": getattr(sched.kv_transfer.counters, name)
                for name in ("blocks_sent", "bytes_sent", "blocks_received", "bytes_received", "fallbacks",
                             "holds_expired")}),
            "generation_tokens": sched.num_generation_tokens,
            "steps": self.total_steps,
            **({} if self.spec_stats is None else {
                "spec_decode_num_drafts": self.spec_stats.num_drafts,
                "spec_decode_num_draft_tokens": self.spec_stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_stats.num_accepted_tokens,
            }),
            **({} if self.model_config.image_token_id is None else dict(zip(
                ("encoder_cache_queries", "encoder_cache_hits"), self.executor.encoder_cache_stats()))),
        }

    def info(self) -> dict[str, object]:
        sched = self.scheduler
        return {
            "model": self.config.model_name,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "eos_token_ids": sorted(self.eos_token_ids),
            "bos_token_id": self.model_config.bos_token_id,
            "block_size": self.config.block_size,
            "total_kv_blocks": self.num_blocks,
            "free_kv_blocks": sched.block_manager.num_free_blocks,
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "dtype": self.executor.dtype_name,
            "device": self.executor.device_name,
            "kv_role": "" if self.config.kv_transfer_config is None else self.config.kv_transfer_config.kv_role,
            "kv_transport": "" if self.config.kv_transfer_config is None else self.config.kv_transfer_config.transport,
        }


def merge_deltas(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Each sequence's deltas as one output (its tokens and logprobs in order, the last one's end), placed where
    its last delta was: a request's output that ends it stays after its other sequences'."""
    merged: dict[SequenceId, EngineCoreOutput] = {}
    last: dict[SequenceId, int] = {}
    for i, out in enumerate(outputs):
        key = out.seq_id
        last[key] = i
        into = merged.get(key)
        if into is None:
            merged[key] = out
            continue
        into.new_token_ids = into.new_token_ids + out.new_token_ids
        if into.new_logprobs is not None and out.new_logprobs is not None:
            into.new_logprobs = into.new_logprobs + out.new_logprobs
        into.finish_reason, into.request_finished = out.finish_reason, out.request_finished
        into.cumulative_logprob, into.times = out.cumulative_logprob, out.times
    return sorted(merged.values(), key=lambda out: last[out.seq_id])
