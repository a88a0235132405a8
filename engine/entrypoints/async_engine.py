"""EngineCore on its own thread, fed and drained through queues, for asyncio servers.

The core's busy loop runs on a dedicated thread (torch releases the GIL in its
kernels); the event loop talks to it only through a command queue. Each request
is added with an :class:`OutputGroup`; a step's outputs are handed back grouped,
with one ``call_soon_threadsafe`` per event loop per step (not one per output:
each wakes the loop through a pipe, and at 32 running sequences that was 32 wake-ups
a step on the cores the model runs on). A request's outputs go to its group until
the core says the whole request has ended (``EngineCoreOutput.request_finished``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from common.errors import EngineDeadError
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.kv_transfer_params import RemoteKV
from engine.core.lora_request import LoRARequest
from engine.core.multimodal import MultiModalItem
from engine.core.outputs import EngineCoreOutput
from engine.core.pooling_params import PoolingParams
from engine.core.request import SequenceId
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.metrics import EngineMetrics
from engine.entrypoints.stats_logger import StatsLogger
from engine.executor.errors import WorkerFailedError

logger = logging.getLogger(__name__)

# How often an idle engine asks its executor whether every rank of the replica still lives (a step finds out
# by itself): an engine whose worker died must stop serving even with no request in flight.
HEALTH_CHECK_INTERVAL_S = 0.5


class OutputGroup(Protocol):
    """Where the outputs of a set of requests go: ``deliver`` runs on ``loop`` with all of one step's
    outputs of the group's requests, in step order."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, outputs: list[EngineCoreOutput]) -> None: ...


class _RequestQueue:
    """The group of one :meth:`AsyncEngine.generate` call: its outputs into an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            self.queue.put_nowait(out)


def _deliver_all(batches: list[tuple[OutputGroup, list[EngineCoreOutput]]]) -> None:
    for group, outputs in batches:
        try:
            group.deliver(outputs)
        except Exception:  # one broken consumer never keeps the step's other outputs from theirs
            logger.exception("delivering engine outputs failed")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int] | np.ndarray
    params: SamplingParams
    priority: int
    group: OutputGroup
    done: Future[None]
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    resumed_output_tokens: int = 0   # a request moved from another engine (EngineCore.add_request)
    mm_items: tuple[MultiModalItem, ...] = ()   # the prompt's images (EngineCore.add_request)
    kv_transfer: RemoteKV | None = None   # prefill/decode disaggregation (EngineCore.add_request)
    # When the request reached the engine (time.monotonic), not when its thread took it after the step running
    # then: the metrics' queue time and TTFT start here, as vLLM's start at its frontend.
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    targets: list[str | SequenceId]   # whole requests, or single sequences


@dataclass
class _Call:
    fn: Callable[[EngineCore], Any]
    done: Future[Any]


class _Stop:
    pass


class AsyncEngine:
    """Asyncio face of an :class:`EngineCore` running on a background thread."""

    core: EngineCore

    def __init__(self, core: EngineCore | Callable[[], EngineCore], *,
                 log_stats_interval: float | None = None, collect_metrics: bool = False) -> None:
        """``core``: an :class:`EngineCore`, or a function that builds one (loads the model, warms up).

        A function runs first thing on the engine thread, so that loading, warm-up and every step run on one
        thread: libgomp gives each thread that opens a parallel region its own worker pool, kept until that
        thread exits, and once it manages more threads than there are CPUs it cuts its spin-wait to ~100
        iterations, so the step's workers sleep and are woken at every region (≈ 30 000 times for 2 048
        decoded tokens, against ≈ 100 with one pool). ``started`` is done once the core exists (or holds
        the function's exception; the engine is then dead). Requests sent before that wait in the queue.
        ``log_stats_interval``: seconds between vLLM-style status lines (engine.entrypoints.stats_logger); None: none.
        ``collect_metrics``: keep the ``vllm:*`` Prometheus series in ``metrics`` (engine.entrypoints.metrics),
        made once the core exists.
        """
        self._build = None if isinstance(core, EngineCore) else core
        if isinstance(core, EngineCore):
            self.core = core
        self._log_stats_interval = log_stats_interval
        self._stats: StatsLogger | None = None
        self._collect_metrics = collect_metrics
        self.metrics: EngineMetrics | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._sinks: dict[str, OutputGroup] = {}   # engine thread only: where each live request's outputs go
        self._dead: BaseException | None = None
        self.started: Future[None] = Future()
        # Set when a rank of the replica died (WorkerFailedError): every request in flight has had its ERROR
        # output, and the engine process should exit for its supervisor to restart it.
        self.failed: Future[BaseException] = Future()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    @classmethod
    async def launch(cls, build: Callable[[], EngineCore], *,
                     log_stats_interval: float | None = None, collect_metrics: bool = False) -> AsyncEngine:
        """Start an engine whose core ``build()`` makes on the engine thread; returns once it is built, and
        raises what ``build`` raised."""
        engine = cls(build, log_stats_interval=log_stats_interval, collect_metrics=collect_metrics)
        await asyncio.wrap_future(engine.started)
        return engine

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    # -- event-loop side ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams,
                       *, priority: int = 0, lora_request: LoRARequest | None = None,
                       cache_salt: str | None = None, resumed_output_tokens: int = 0,
                       mm_items: tuple[MultiModalItem, ...] = (),
                       kv_transfer: RemoteKV | None = None) -> AsyncIterator[EngineCoreOutput]:
        """Add a request and yield its per-step outputs (of each of its sequences) until the core says it ended.

        Raises InvalidRequestError / QueueFullError before yielding anything if it is refused.
        Leaving the iteration early (cancellation, a client that went away) aborts the request.
        """
        group = _RequestQueue(asyncio.get_running_loop())
        outputs = group.queue
        done = self.submit(request_id, prompt_token_ids, params, group, priority=priority, lora_request=lora_request,
                           cache_salt=cache_salt, resumed_output_tokens=resumed_output_tokens, mm_items=mm_items,
                           kv_transfer=kv_transfer)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # Cancelled while queued: if the engine thread had already taken the request, abort it.
            self.abort([request_id])
            raise
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.request_finished
                yield out
        finally:
            if not finished:
                self.abort([request_id])

    def submit(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams,
               group: OutputGroup, *, priority: int = 0, lora_request: LoRARequest | None = None,
               cache_salt: str | None = None, resumed_output_tokens: int = 0,
               mm_items: tuple[MultiModalItem, ...] = (), kv_transfer: RemoteKV | None = None) -> Future[None]:
        """Queue a request whose outputs go to ``group``; the future fails with InvalidRequestError /
        QueueFullError if the core refuses it (then nothing reaches ``group`` for it). Many requests may
        share a group: each step then reaches it as one ``deliver`` call (what the gRPC ``Stream`` uses).
        ``lora_request``: its adapter (None: the base model); a first use loads it on the engine thread.
        ``cache_salt``: vLLM's prefix-cache salt (None: none); ``resumed_output_tokens``: the prompt's last ids that
        are output delivered by another engine (request migration); ``mm_items``: the prompt's images;
        ``kv_transfer``: its part in prefill/decode disaggregation (None: none)."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop has stopped")
        done: Future[None] = Future()
        self._commands.put(_Add(request_id, prompt_token_ids, params, priority, group, done, lora_request,
                                cache_salt, resumed_output_tokens, mm_items, kv_transfer))
        return done

    async def pool(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray, params: PoolingParams, *,
                   token_type_ids: Sequence[int] | None = None, priority: int = 0) -> EngineCoreOutput:
        """Add a pooling request and return its one output: ``pooled`` set, or an ABORT / ERROR finish without
        it. Raises what the core's ``add_pooling_request`` raises; cancelling the call aborts the request."""
        group = _RequestQueue(asyncio.get_running_loop())
        arrival = time.monotonic()

        def add(core: EngineCore) -> None:   # on the engine thread: the sink is registered with the request
            core.add_pooling_request(request_id, prompt_token_ids, params, token_type_ids=token_type_ids,
                                     priority=priority, arrival_time=arrival)
            self._sinks[request_id] = group

        try:
            await self.call(add)
            return await group.queue.get()
        except asyncio.CancelledError:
            self.abort([request_id])
            raise

    def abort(self, targets: list[str | SequenceId]) -> None:
        """End whole requests (an id) or single sequences (a SequenceId); see EngineCore.abort_requests."""
        self._commands.put(_Abort(list(targets)))

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run ``fn(core)`` on the engine thread between steps (e.g. ``EngineCore.info``)."""
        done: Future[Any] = Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._commands.put(_Stop())
        self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._build is not None:
            try:
                self.core = self._build()
            except BaseException as e:
                logger.error("building the engine core failed: %s", e)  # the traceback goes with `started`
                self._dead = e
                self.started.set_exception(e)
                self._refuse_queued(EngineDeadError(f"the engine core could not be built: {e}"))
                return
        core = self.core
        core.output_sink = self._hand_back   # a multi-step step streams each decode pass's tokens as it ends
        if self._log_stats_interval:
            self._stats = StatsLogger(core, self._log_stats_interval)
        if self._collect_metrics:
            self.metrics = EngineMetrics(core)
        self.started.set_result(None)
        try:
            self._loop(core)
        except WorkerFailedError as e:
            self._die(e)
        finally:
            core.close()   # the replica's other ranks stop with the loop

    def _loop(self, core: EngineCore) -> None:
        metrics = self.metrics
        observed = self._stats is not None or metrics is not None
        idle_wait = min(self._stats.interval_s, HEALTH_CHECK_INTERVAL_S) if self._stats else HEALTH_CHECK_INTERVAL_S
        while True:
            block = not core.has_unfinished_requests()
            try:
                # Idle: wake up at the stats interval so the last busy interval still gets its line, and to check
                # the replica's health.
                cmd = self._commands.get(block=block, timeout=idle_wait if block else None)
            except queue.Empty:
                cmd = None
                core.check_health()
            if self._stats is not None:
                self._stats.maybe_log()
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    self._fail_all(EngineDeadError("engine stopped"))
                    return
                try:
                    self._handle(cmd)
                except Exception:  # a bad command never ends the loop
                    logger.exception("engine command failed")
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not core.has_unfinished_requests():
                continue
            last = core.last_step if observed else None
            try:
                outputs = core.step()
            except WorkerFailedError:
                raise
            except Exception as e:  # a failed step ends the requests in it, never the process
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            # A step that ran the model has new StepStats (one that only handed back aborted outputs has not).
            if observed and core.last_step is not None and core.last_step is not last:
                if self._stats is not None:
                    self._stats.record_step(core.last_step.duration_s)
                if metrics is not None:
                    metrics.record_step(core.last_step.num_batched_tokens)
            self._hand_back(outputs)

    def _hand_back(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs to their groups: one ``call_soon_threadsafe`` per event loop."""
        if self.metrics is not None:
            self.metrics.record_outputs(outputs)
        groups: dict[int, tuple[OutputGroup, list[EngineCoreOutput]]] = {}
        sinks = self._sinks
        for out in outputs:
            group = sinks.pop(out.request_id, None) if out.request_finished else sinks.get(out.request_id)
            if group is None:
                continue
            groups.setdefault(id(group), (group, []))[1].append(out)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputGroup, list[EngineCoreOutput]]]] = {}
        for group, outs in groups.values():
            by_loop.setdefault(group.loop, []).append((group, outs))
        for loop, batches in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, batches)
            except RuntimeError:  # that loop is closed: nobody is left to read these outputs
                pass

    def _handle(self, cmd: _Add | _Abort | _Call) -> None:
        # A caller that gave up (cancelled, deadline) before we got here has a cancelled future: skip it.
        if isinstance(cmd, (_Add, _Call)) and not cmd.done.set_running_or_notify_cancel():
            return
        if isinstance(cmd, _Add):
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, priority=cmd.priority,
                                      lora_request=cmd.lora_request, arrival_time=cmd.arrival_time,
                                      cache_salt=cmd.cache_salt, resumed_output_tokens=cmd.resumed_output_tokens,
                                      mm_items=cmd.mm_items, kv_transfer=cmd.kv_transfer)
            except BaseException as e:
                cmd.done.set_exception(e)
            else:
                self._sinks[cmd.request_id] = cmd.group
                cmd.done.set_result(None)
                if self.metrics is not None:
                    self.metrics.record_admitted(cmd.params)
        elif isinstance(cmd, _Abort):
            self.core.abort_requests(cmd.targets)
        else:
            try:
                cmd.done.set_result(cmd.fn(self.core))
            except BaseException as e:
                cmd.done.set_exception(e)

    def _die(self, error: WorkerFailedError) -> None:
        """A rank of the replica died: every request in flight ends with an error, the engine refuses new ones,
        and ``failed`` tells the server to stop serving and exit."""
        logger.error("engine failed: %s", error)
        self._dead = error
        self._fail_all(error)
        self.core.close()
        self.failed.set_result(error)
        self._refuse_queued(EngineDeadError(f"the engine failed: {error}"))

    def _refuse_queued(self, error: BaseException) -> None:
        """The core never came up: fail every command, queued now or later, until shutdown."""
        while not isinstance(cmd := self._commands.get(), _Stop):
            if isinstance(cmd, (_Add, _Call)) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        """End every sequence of every in-flight request with an ERROR output and free its blocks."""
        self.core.abort_requests(list(self._sinks), reason=FinishReason.ERROR)
        self._hand_back(self.core.step())  # nothing is left to run: the step hands back the ERROR outputs
        # A request the scheduler had already ended (aborted just before the failed step took its output)
        # still gets exactly one terminal output.
        self._hand_back([EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, request_finished=True)
                         for rid in list(self._sinks)])
        if self.metrics is not None:
            self.metrics.forget_requests()
