"""The engine's token-level gRPC server (``sluice.v1.Engine``): wire types in, domain types out.

Protobuf messages are converted here (``engine.entrypoints.grpc_wire``, ``grpc_lora``) and nowhere else; the
core behind the AsyncEngine sees only token ids, SamplingParams and LoRARequests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np

from common.errors import EngineDeadError, InvalidRequestError
from common.grpc_errors import ERROR_REASON_KEY, retry_after_s, status_for
from common.grpc_server import bind, new_server, stop_event
from common.logs import REQUEST_ID
from common.stream_mux import SinkMux
from common.tls import GrpcTls
from common.tracing import Tracing
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.kv_events import ZmqEventPublisher
from engine.core.lora_request import LoRARequest
from engine.core.multimodal import MultiModalItem
from engine.core.outputs import EngineCoreOutput
from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.draft_check import check_draft_tokenizer
from engine.entrypoints.generation_config import generation_defaults, log_defaults
from engine.entrypoints.grpc_lora import adapters_to_pb, load_adapter, unload_adapter
from engine.entrypoints.grpc_multimodal import items_from_pb
from engine.entrypoints.grpc_wire import (
    abort_targets_from_pb,
    kv_transfer_from_pb,
    output_to_pb,
    pool_output_to_pb,
    pooling_info_fields,
    pooling_params_from_pb,
    sampling_params_from_pb,
    wire_error,
)
from engine.entrypoints.lora_registry import LoRARegistry
from engine.entrypoints.metrics import serve_metrics
from engine.entrypoints.model_limits import engine_max_request_bytes, model_context_length
from engine.entrypoints.request_observer import RequestObserver
from engine.entrypoints.stats_logger import DEFAULT_INTERVAL_S
from engine.text import Tokenizer
from engine.worker.structured_output import GrammarVocabulary
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Engine"


class ShmNotRegisteredError(InvalidRequestError):
    """The prompt names a shared-memory segment this engine has not registered (it restarted since): on the
    wire, INVALID_ARGUMENT with ERROR_REASON_SHM_NOT_REGISTERED, which tells the caller to register again."""

    reason = engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED


def _connectable(endpoint: str | None, *, always_bound: bool = False) -> str:
    """A ZMQ endpoint the engine binds, as a client on this host connects to it (a "*" or "::" host as loopback);
    "" for none, an inproc one (this process's only) or one the engine connects out to (the PUB socket binds only a
    wildcard, ipc or inproc address: vLLM's rule)."""
    if not endpoint or endpoint.startswith("inproc://"):
        return ""
    if not (always_bound or "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")):
        return ""
    return endpoint.replace("*", "127.0.0.1").replace("[::]", "[::1]")


def error_reason(error: BaseException) -> int:
    """The ErrorReason a refusal carries on the wire (ERROR_REASON_UNSPECIFIED for most)."""
    return error.reason if isinstance(error, ShmNotRegisteredError) else engine_pb2.ERROR_REASON_UNSPECIFIED


# -- the servicer ---------------------------------------------------------------------------------------------
class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Registered before the server starts; answers UNAVAILABLE until the engine is attached (warm-up).

    ``registry``: the engine's LoRA adapters by name (None: an empty one, made from the engine's settings);
    ``observer``: a span and log lines per request (None: neither is on)."""

    def __init__(self, engine: AsyncEngine | None = None, registry: LoRARegistry | None = None,
                 observer: RequestObserver | None = None) -> None:
        self._engine = engine
        self._registry = registry
        self.observer = observer
        self.counters = {"shm_handoffs": 0, "inline_handoffs": 0, "finished_requests": 0, "stream_calls": 0}
        self._shm: Any = None  # ShmReader, created on first registration
        # Tells callers a restarted engine from this one (GetInfoResponse.instance_id).
        self.instance_id = uuid.uuid4().hex
        # The model's default sampling parameters for the fields a request leaves unset (--generation-config).
        self.sampling_defaults: dict[str, Any] = {}

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None or not self._engine.is_alive:
            raise EngineDeadError("the engine is starting or stopped")
        return self._engine

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    def registry(self) -> LoRARegistry:
        if self._registry is None:
            self._registry = LoRARegistry(self.engine.core.config)
        return self._registry

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a request names (empty: the base model, without touching the registry)."""
        return self.registry.resolve(name) if name else None

    def read_prompt(self, request: engine_pb2.EngineGenerateRequest) -> tuple[np.ndarray, int | None]:
        """The prompt ids of a request, and the shared-memory slot to acknowledge when they came that way."""
        if not request.request_id:
            raise InvalidRequestError("request_id", "is required")
        released_slot: int | None = None
        which = request.WhichOneof("prompt")
        if which == "prompt_shm":
            from proto.shm import ShmRef, ShmRefError

            ref = request.prompt_shm
            if self._shm is None or not self._shm.is_registered(ref.segment):
                raise ShmNotRegisteredError("prompt_shm", f"segment {ref.segment!r} is not registered")
            try:
                ids = self._shm.read(ShmRef(ref.segment, ref.offset, ref.length, ref.slot))
            except ShmRefError as e:
                raise InvalidRequestError(f"prompt_shm.{e.field}", str(e)) from e
            prompt = ids  # the int32 copy out of the segment is what the engine core keeps
            released_slot = ref.slot
            self.counters["shm_handoffs"] += 1
        elif which == "prompt_token_ids":
            # upb's repeated field exports __array__: one C copy, no Python ints (47 µs at 128k).
            prompt = np.asarray(request.prompt_token_ids.ids)
            self.counters["inline_handoffs"] += 1
        else:
            raise InvalidRequestError("prompt", "one of prompt_token_ids or prompt_shm is required")
        return prompt, released_slot

    def read_mm_items(self, request: engine_pb2.EngineGenerateRequest) -> tuple[MultiModalItem, ...]:
        """The request's images (``multi_modal_items``), their tensors read inline or from a registered segment."""
        if not request.multi_modal_items:
            return ()
        return items_from_pb(request.multi_modal_items, self._read_shm_units)

    def _read_shm_units(self, ref: engine_pb2.SharedMemoryRef) -> np.ndarray:
        from proto.shm import ShmRef, ShmRefError

        if self._shm is None or not self._shm.is_registered(ref.segment):
            raise InvalidRequestError("multi_modal_items", f"shared-memory segment {ref.segment!r} is not registered")
        try:
            units: np.ndarray = self._shm.read(ShmRef(ref.segment, ref.offset, ref.length, ref.slot))
        except ShmRefError as e:
            raise InvalidRequestError(f"multi_modal_items.shm.{e.field}", str(e)) from e
        return units

    async def Generate(self, request: engine_pb2.EngineGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        engine = self.engine
        try:
            prompt, released_slot = self.read_prompt(request)
        except ShmNotRegisteredError as e:
            context.set_trailing_metadata(((ERROR_REASON_KEY, engine_pb2.ErrorReason.Name(e.reason)),))
            raise
        params = sampling_params_from_pb(request, self.sampling_defaults)
        mm_items = self.read_mm_items(request)
        lora = self.lora_request(request.lora_adapter)   # an unknown name: NOT_FOUND (common.grpc_errors)
        label = request.client_request_id or request.request_id
        REQUEST_ID.set(label)  # this call's task serves this request only
        observer = self.observer
        if observer is not None:
            observer.added(request.request_id, label, len(prompt), params)
        first = True
        try:
            async for out in engine.generate(request.request_id, prompt, params, priority=request.priority,
                                             lora_request=lora, cache_salt=request.cache_salt or None,
                                             resumed_output_tokens=request.resumed_output_tokens,
                                             mm_items=mm_items, kv_transfer=kv_transfer_from_pb(request)):
                msg = output_to_pb(out)
                if first and released_slot is not None:
                    msg.released_shm_slot = released_slot
                first = False
                self.counters["finished_requests"] += out.request_finished
                if observer is not None and out.request_finished:
                    observer.finished(out, label, request.trace_headers, len(prompt), params)
                yield msg
        except InvalidRequestError as e:  # refused by the core (e.g. a constraint that does not compile)
            raise wire_error(e) from e

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineStreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        call = _StreamCall(self, self.engine)
        self.counters["stream_calls"] += 1
        await context.send_initial_metadata(())  # the caller sends nothing before this (EngineStream)
        async for msg in call.mux.run(request_iterator):
            yield msg

    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> engine_pb2.AbortResponse:
        if request.kv_blocks_pulled:   # a prefill engine's holds whose decode engine went on
            pulled = dict(request.kv_blocks_pulled)
            await self.engine.call(lambda core: core.release_kv_holds(pulled))
        self.engine.abort(abort_targets_from_pb(request))
        return engine_pb2.AbortResponse()

    async def GetInfo(self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.GetInfoResponse:
        info, stats, usage = await self.engine.call(
            lambda core: (core.info(), core.scheduler_stats(), core.scheduler.block_manager.usage()))
        return engine_pb2.GetInfoResponse(
            model_name=info["model"], max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
            eos_token_ids=info["eos_token_ids"], bos_token_id=info["bos_token_id"],
            block_size=info["block_size"], total_kv_blocks=info["total_kv_blocks"],
            free_kv_blocks=info["free_kv_blocks"], num_running=info["num_running"],
            num_waiting=info["num_waiting"], device=info["device"], dtype=info["dtype"],
            counters=engine_pb2.EngineCounters(
                shm_handoffs=self.counters["shm_handoffs"], inline_handoffs=self.counters["inline_handoffs"],
                finished_requests=self.counters["finished_requests"], stream_calls=self.counters["stream_calls"],
                prefix_cache_query_tokens=stats["prefix_cache_queries"],
                prefix_cache_hit_tokens=stats["prefix_cache_hits"], preemptions=stats["num_preemptions"]),
            lora_enabled=self.registry.enabled, lora_adapters=adapters_to_pb(self.registry),
            instance_id=self.instance_id, kv_cache_usage=usage, kv_role=info["kv_role"],
            kv_transport=info["kv_transport"], **self._prefix_cache_info(),
            **pooling_info_fields(self.engine.core.runner, self.engine.core.pooling))

    async def Pool(self, request: engine_pb2.EnginePoolRequest, context: grpc.aio.ServicerContext
                   ) -> engine_pb2.EnginePoolResponse:
        """One pooling request (engine.worker.pooling_runner): batched with the others by the scheduler; a call
        cancelled aborts it, a request aborted (Abort) or failed by the engine ends the call ABORTED / INTERNAL."""
        if not request.request_id:
            raise InvalidRequestError("request_id", "is required")
        REQUEST_ID.set(request.client_request_id or request.request_id)
        prompt = np.asarray(request.prompt_token_ids.ids)
        out = await self.engine.pool(request.request_id, prompt, pooling_params_from_pb(request),
                                     token_type_ids=list(request.token_type_ids) or None, priority=request.priority)
        self.counters["finished_requests"] += 1
        if out.pooled is None:
            aborted = out.finish_reason is FinishReason.ABORT
            await context.abort(grpc.StatusCode.ABORTED if aborted else grpc.StatusCode.INTERNAL,
                                f"pooling request {request.request_id!r} was "
                                f"{'aborted' if aborted else 'failed by the engine'}")
        return pool_output_to_pb(out)

    def _prefix_cache_info(self) -> dict[str, Any]:
        """GetInfo's prefix-cache fields: what a router needs to hash prompts as this engine does and to follow its
        KV events (engine.core.kv_events)."""
        core = self.engine.core
        config = core.config
        info: dict[str, Any] = {"prefix_caching": config.enable_prefix_caching,
                                "prefix_caching_hash_algo": config.prefix_caching_hash_algo}
        publisher = core.kv_event_publisher
        if isinstance(publisher, ZmqEventPublisher) and config.kv_events_config is not None:
            info.update(kv_events_endpoint=_connectable(publisher.endpoint),
                        kv_events_replay_endpoint=_connectable(publisher.replay_endpoint, always_bound=True),
                        kv_events_topic=config.kv_events_config.topic)
        return info

    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
                              ) -> common_pb2.LoadLoRAAdapterResponse:
        return await load_adapter(self.engine, self.registry, request)

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoRAAdapterResponse:
        return await unload_adapter(self.engine, self.registry, request)

    async def ResetPrefixCache(self, request: common_pb2.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext) -> common_pb2.ResetPrefixCacheResponse:
        """vLLM's ``reset_prefix_cache``, run on the engine thread between two steps: ok is False, and nothing
        changed, while a request holds blocks (KV events: AllBlocksCleared when it is done)."""
        ok = await self.engine.call(lambda core: core.reset_prefix_cache())
        if not ok:
            logger.warning("prefix cache not reset: requests hold KV blocks")
        return common_pb2.ResetPrefixCacheResponse(ok=ok)

    async def RegisterSharedMemory(self, request: engine_pb2.RegisterSharedMemoryRequest,
                                   context: grpc.aio.ServicerContext) -> engine_pb2.RegisterSharedMemoryResponse:
        from proto.shm import ShmReader

        if self._shm is None:
            self._shm = ShmReader()
        try:
            self._shm.register(request.segment, request.size_bytes)
        except (OSError, ValueError) as e:
            # The caller falls back to inline ids (another host, no shared /dev/shm).
            return engine_pb2.RegisterSharedMemoryResponse(ok=False, error=f"cannot open segment: {e}")
        return engine_pb2.RegisterSharedMemoryResponse(ok=True)


class _StreamCall:
    """The requests of one ``Stream`` call, handed to the engine: the protocol of
    :class:`common.stream_mux.SinkMux` and the call's :class:`~engine.entrypoints.async_engine.OutputGroup`,
    which gathers a step's outputs of its requests into one message."""

    def __init__(self, servicer: EngineServicer, engine: AsyncEngine) -> None:
        self.loop = asyncio.get_running_loop()
        self._servicer = servicer
        self._engine = engine
        self._observer = servicer.observer
        # With an observer: what it needs at each live request's end (the caller's id, its parent's context, prompt
        # length, params).
        self._observed: dict[str, tuple[str, dict[str, str], int, SamplingParams]] = {}
        # Live requests: id -> shm slot to acknowledge with the first output (None: none, or done).
        self.mux: SinkMux[str, int | None, engine_pb2.EngineStreamRequest, engine_pb2.EngineStreamResponse] = \
            SinkMux(self)

    def receive(self, msg: engine_pb2.EngineStreamRequest) -> None:
        if msg.HasField("generate"):
            self._add(msg.generate)
        elif msg.HasField("abort"):
            live = self.mux.requests
            targets = [t for t in abort_targets_from_pb(msg.abort)
                       if (t if isinstance(t, str) else t.request_id) in live]
            if targets:
                self._engine.abort(targets)

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort(list(request_ids))

    def _add(self, request: engine_pb2.EngineGenerateRequest) -> None:
        rid = request.request_id
        try:
            if rid in self.mux.requests:
                raise InvalidRequestError("request_id", f"request {rid!r} is already running")
            prompt, released_slot = self._servicer.read_prompt(request)
            params = sampling_params_from_pb(request, self._servicer.sampling_defaults)
            lora = self._servicer.lora_request(request.lora_adapter)
            done = self._engine.submit(rid, prompt, params, self, priority=request.priority, lora_request=lora,
                                       cache_salt=request.cache_salt or None,
                                       resumed_output_tokens=request.resumed_output_tokens,
                                       mm_items=self._servicer.read_mm_items(request),
                                       kv_transfer=kv_transfer_from_pb(request))
        except Exception as e:  # noqa: BLE001 — refused: the error entry is its terminal event
            self._refuse(rid, e)
            return
        self.mux.open(rid, released_slot)
        if (observer := self._observer) is not None:
            label = request.client_request_id or rid
            observer.added(rid, label, len(prompt), params)
            self._observed[rid] = (label, dict(request.trace_headers), len(prompt), params)
        done.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._added, rid, f))

    def _added(self, rid: str, done: Future[None]) -> None:
        if (error := done.exception()) is not None:
            self._observed.pop(rid, None)
            self._refuse(rid, error)
            self.mux.finish(rid)

    def _refuse(self, rid: str, error: BaseException) -> None:
        wired = wire_error(error)
        code, message = status_for(wired)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request %s refused: %r", rid, error, extra={"request_id": rid})
        msg = engine_pb2.EngineStreamResponse()
        entry = msg.errors.add(request_id=rid, code=code.value[0], message=message, reason=error_reason(error))
        if (retry := retry_after_s(wired)) is not None:
            entry.retry_after_s = retry
        self.mux.send(msg)

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs of this call's requests (OutputGroup; runs on the event loop)."""
        msg = engine_pb2.EngineStreamResponse()
        counters = self._servicer.counters
        live = self.mux.requests
        finished: list[EngineCoreOutput] = []
        for out in outputs:
            rid = out.request_id
            if rid not in live:
                continue
            pb = output_to_pb(out)
            pb.request_id = rid
            if (slot := live[rid]) is not None:
                pb.released_shm_slot = slot
                live[rid] = None
            msg.outputs.append(pb)
            if out.request_finished:
                counters["finished_requests"] += 1
                self.mux.finish(rid)
                finished.append(out)
        if msg.outputs:
            self.mux.send(msg)
        if self._observer is not None:  # after the outputs left: spans and log lines never hold them up
            for out in finished:
                if (observed := self._observed.pop(out.request_id, None)) is not None:
                    self._observer.finished(out, *observed)


def warm_up(core: EngineCore) -> None:
    """One short request through the whole step path before the server reports SERVING."""
    if core.pooling is not None:
        core.add_pooling_request("__warmup__", [core.model_config.bos_token_id or 1] * 8,
                                 PoolingParams(task=core.pooling.tasks[0]))
        while core.has_unfinished_requests():
            core.step()
        return
    core.add_request("__warmup__", [core.model_config.bos_token_id or 1] * 8,
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()


async def serve(config: EngineConfig, host: str, port: int, *, shutdown_grace: float = 10.0,
                ready: asyncio.Event | None = None, tracing: Tracing | None = None, log_requests: bool = False,
                metrics_host: str = "127.0.0.1", metrics_port: int = 0, tls: GrpcTls | None = None) -> None:
    """The engine process's servers: gRPC on ``host:port`` (with TLS when ``tls`` is given), and with
    ``metrics_port`` the ``vllm:*`` Prometheus metrics on ``metrics_host:metrics_port``
    (engine.entrypoints.metrics), once the model is loaded. Returns after SIGTERM / SIGINT and a drain; raises
    WorkerFailedError when a rank of the replica died (health NOT_SERVING first, every request ended).
    ``tracing``: a span per request (None: off); ``log_requests``: a line per request added and finished."""
    metrics_registry, metrics_server = serve_metrics(metrics_host, metrics_port) if metrics_port else (None, None)
    # Sized before the model loads (the server answers health meanwhile): --max-model-len, else the model's own.
    max_model_len = config.max_model_len or model_context_length(config.model_path)
    server, health_service = new_server(SERVICE_NAME, max_receive_bytes=engine_max_request_bytes(max_model_len))
    await health_service.set_serving(False)
    registry = LoRARegistry(config)
    observer = (RequestObserver(config.model_name, tracing=tracing, log_requests=log_requests)
                if tracing is not None or log_requests else None)
    servicer = EngineServicer(registry=registry, observer=observer)
    servicer.sampling_defaults = generation_defaults(config.generation_config, config.model_path)
    log_defaults(servicer.sampling_defaults, config.generation_config)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    bound = bind(server, host, port, tls)
    await server.start()
    logger.info("engine gRPC listening on %s:%d%s (loading model)", host, bound,
                "" if tls is None else " with mutual TLS" if tls.mutual else " with TLS")
    stop = stop_event()

    def build() -> EngineCore:
        # The core never reads text: the vocabulary structured outputs mask with is loaded here, at the edge.
        tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model_path)
        check_draft_tokenizer(config, tokenizer)
        core = EngineCore(config, grammar_vocabulary=GrammarVocabulary.from_tokenizer(tokenizer))
        registry.load_startup_modules(core)   # a bad --lora-modules adapter stops start-up with its message
        warm_up(core)
        return core

    # Loaded, warmed up and stepped on the engine's own thread: one OpenMP pool (see AsyncEngine).
    engine = await AsyncEngine.launch(build,
                                      log_stats_interval=None if config.disable_log_stats else DEFAULT_INTERVAL_S,
                                      collect_metrics=metrics_registry is not None)
    if metrics_registry is not None and engine.metrics is not None:
        metrics_registry.register(engine.metrics)
        logger.info("engine metrics at http://%s:%d/metrics", metrics_host, metrics_port)
    servicer.attach(engine)
    # Everything loaded so far lives as long as the process: out of the collector's sight, no full collection
    # walks it again while serving or at exit (vLLM's engine freezes its start-up heap the same way).
    gc.collect()
    gc.freeze()
    await health_service.set_serving(True)
    logger.info("engine ready: %s on %s:%d", config.model_name, host, bound)
    if ready is not None:
        ready.set()
    failed = asyncio.wrap_future(engine.failed)
    stopping = asyncio.ensure_future(stop.wait())
    waits: list[asyncio.Future[Any]] = [failed, stopping]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    error = failed.result() if failed.done() else None
    if error is not None:   # every request in flight has its error: stop serving, and exit for a restart
        logger.error("engine failed, exiting: %s", error)
    else:
        failed.cancel()   # (cancels engine.failed too: nothing is waiting on it any more)
        logger.info("draining (grace %.1fs)", shutdown_grace)
    await health_service.set_serving(False)
    await server.stop(shutdown_grace)
    engine.shutdown()
    if metrics_server is not None:
        metrics_server.shutdown()
    if error is not None:
        raise error
