"""The engine's token-level gRPC server (``sluice.v1.Engine``): wire types in, domain types out.

Protobuf messages are converted here and nowhere else; the core behind the
AsyncEngine sees only token ids and SamplingParams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np

from common.errors import EngineDeadError, InvalidRequestError
from common.grpc_errors import ERROR_REASON_KEY, status_for
from common.grpc_server import bind, new_server, stop_event
from common.stream_mux import SinkMux
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.request import FinishReason, PromptLogprobs, SequenceId
from engine.core.sampling_params import BeamSearch, EarlyStopping, SamplingParams, StructuredOutputsParams
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.stats_logger import DEFAULT_INTERVAL_S
from engine.text import Tokenizer
from engine.worker.structured_output import GrammarVocabulary
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Engine"
_FINISH_TO_PB = {
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORTED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}

_EARLY_STOPPING: dict[int, EarlyStopping] = {
    common_pb2.BEAM_STOPPING_UNSPECIFIED: False,
    common_pb2.BEAM_STOPPING_EARLY: True,
    common_pb2.BEAM_STOPPING_NEVER: "never",
}


class ShmNotRegisteredError(InvalidRequestError):
    """The prompt names a shared-memory segment this engine has not registered (it restarted since): on the
    wire, INVALID_ARGUMENT with ERROR_REASON_SHM_NOT_REGISTERED, which tells the caller to register again."""

    reason = engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED


def error_reason(error: BaseException) -> int:
    """The ErrorReason a refusal carries on the wire (ERROR_REASON_UNSPECIFIED for most)."""
    return error.reason if isinstance(error, ShmNotRegisteredError) else engine_pb2.ERROR_REASON_UNSPECIFIED


# -- wire ↔ domain --------------------------------------------------------------------------------------------
def sampling_params_from_pb(req: engine_pb2.EngineGenerateRequest) -> SamplingParams:
    s, st = req.sampling, req.stopping
    kw: dict[str, Any] = {"n": req.n or 1}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if s.HasField(name):
            kw[name] = getattr(s, name)
    if s.HasField("top_k"):
        kw["top_k"] = s.top_k or None
    if s.HasField("seed"):
        kw["seed"] = s.seed
    if s.logit_bias:
        kw["logit_bias"] = dict(s.logit_bias)
    kw["max_tokens"] = st.max_tokens if st.HasField("max_tokens") else None
    kw["min_tokens"] = st.min_tokens
    kw["stop_token_ids"] = list(st.stop_token_ids)
    kw["ignore_eos"] = st.ignore_eos
    if req.HasField("logprobs"):
        kw["logprobs"] = req.logprobs
    if req.HasField("prompt_logprobs"):
        kw["prompt_logprobs"] = req.prompt_logprobs   # above --max-logprobs: refused by the core
    if req.HasField("stream_interval"):
        kw["stream_interval"] = req.stream_interval  # 0 is refused by SamplingParams as INVALID_ARGUMENT
    if req.best_of:
        kw["best_of"] = req.best_of
    if req.HasField("beam_search"):
        kw["beam_search"] = beam_search_from_pb(req.beam_search, kw["n"])
    if req.HasField("guided"):
        kw["structured_outputs"] = structured_outputs_from_pb(req.guided)
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise wire_error(e) from e


# StructuredOutputsParams' fields (in errors as structured_outputs.<name>) and GuidedDecoding's on the wire.
_GUIDED_FIELDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                  "grammar": "grammar"}


def structured_outputs_from_pb(guided: common_pb2.GuidedDecoding) -> StructuredOutputsParams | None:
    """The constraint of a GuidedDecoding oneof (None when unset); InvalidRequestError naming ``guided.<kind>``."""
    kind = guided.WhichOneof("kind")
    try:
        if kind is None:
            return None
        if kind == "json_schema":
            return StructuredOutputsParams(json=guided.json_schema)
        if kind == "json_object":
            if not guided.json_object:
                raise InvalidRequestError("guided.json_object", "must be true when set")
            return StructuredOutputsParams(json_object=True)
        if kind == "regex":
            return StructuredOutputsParams(regex=guided.regex)
        if kind == "choice":
            return StructuredOutputsParams(choice=list(guided.choice.choices))
        return StructuredOutputsParams(grammar=guided.grammar)
    except InvalidRequestError as e:
        raise wire_error(e) from e


def wire_error(error: BaseException) -> BaseException:
    """A refusal naming a structured-outputs field, renamed to the field of EngineGenerateRequest.guided the
    caller sent (``structured_outputs.json`` → ``guided.json_schema``); any other error as it is."""
    if not isinstance(error, InvalidRequestError):
        return error
    prefix, _, name = error.field.partition(".")
    if prefix != "structured_outputs":
        return error
    renamed = InvalidRequestError(f"guided.{_GUIDED_FIELDS[name]}" if name in _GUIDED_FIELDS else "guided",
                                  error.message)
    renamed.__cause__ = error
    return renamed


def beam_search_from_pb(msg: common_pb2.BeamSearch, n: int) -> BeamSearch:
    if msg.early_stopping not in _EARLY_STOPPING:
        raise InvalidRequestError("beam_search.early_stopping", f"unknown value {msg.early_stopping}")
    return BeamSearch(beam_width=msg.beam_width or n,
                      length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
                      early_stopping=_EARLY_STOPPING[msg.early_stopping])


def abort_targets_from_pb(msg: engine_pb2.AbortRequest) -> list[str | SequenceId]:
    """Whole requests (their ids) and single sequences (SequenceId) to abort."""
    targets: list[str | SequenceId] = list(msg.request_ids)
    targets += [SequenceId(ref.request_id, ref.index) if ref.HasField("index") else ref.request_id
                for ref in msg.sequences]
    return targets


def output_to_pb(out: EngineCoreOutput) -> engine_pb2.EngineGenerateResponse:
    msg = engine_pb2.EngineGenerateResponse(
        index=out.index, token_ids=out.new_token_ids, prompt_tokens=out.num_prompt_tokens,
        cached_tokens=out.num_cached_tokens, request_done=out.request_finished,
        finish_reason=_FINISH_TO_PB[out.finish_reason] if out.finish_reason else common_pb2.FINISH_REASON_UNSPECIFIED)
    if out.cumulative_logprob is not None:
        msg.cumulative_logprob = out.cumulative_logprob
    for lp, top in out.new_logprobs or ():
        msg.logprobs.add(logprob=lp, top_logprobs=[engine_pb2.TokenIdLogprob(token_id=t, logprob=v)
                                                   for t, v in top.items()])
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(prompt_logprobs_to_pb(out.prompt_logprobs))
    return msg


def prompt_logprobs_to_pb(plp: PromptLogprobs) -> list[common_pb2.PromptTokenLogprob]:
    """One entry per prompt token, ids and numbers only (the engine has no text); the first has no logprob."""
    token_ids = plp.token_ids.tolist()
    entries = [common_pb2.PromptTokenLogprob(token_id=token_ids[0])]
    for token_id, lp, ids, lps in zip(token_ids[1:], plp.logprobs.tolist(), plp.top_ids.tolist(),
                                      plp.top_logprobs.tolist()):
        entries.append(common_pb2.PromptTokenLogprob(
            token_id=token_id, logprob=lp,
            top_logprobs=[common_pb2.PromptTopLogprob(token_id=t, logprob=v) for t, v in zip(ids, lps)]))
    return entries


# -- the servicer ---------------------------------------------------------------------------------------------
class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Registered before the server starts; answers UNAVAILABLE until the engine is attached (warm-up)."""

    def __init__(self, engine: AsyncEngine | None = None) -> None:
        self._engine = engine
        self.counters = {"shm_handoffs": 0, "inline_handoffs": 0, "finished_requests": 0, "stream_calls": 0}
        self._shm: Any = None  # ShmReader, created on first registration

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None or not self._engine.is_alive:
            raise EngineDeadError("the engine is starting or stopped")
        return self._engine

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

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

    async def Generate(self, request: engine_pb2.EngineGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        engine = self.engine
        try:
            prompt, released_slot = self.read_prompt(request)
        except ShmNotRegisteredError as e:
            context.set_trailing_metadata(((ERROR_REASON_KEY, engine_pb2.ErrorReason.Name(e.reason)),))
            raise
        params = sampling_params_from_pb(request)
        first = True
        try:
            async for out in engine.generate(request.request_id, prompt, params, priority=request.priority):
                msg = output_to_pb(out)
                if first and released_slot is not None:
                    msg.released_shm_slot = released_slot
                first = False
                self.counters["finished_requests"] += out.request_finished
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
        self.engine.abort(abort_targets_from_pb(request))
        return engine_pb2.AbortResponse()

    async def GetInfo(self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.GetInfoResponse:
        info, stats = await self.engine.call(lambda core: (core.info(), core.scheduler_stats()))
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
                prefix_cache_hit_tokens=stats["prefix_cache_hits"], preemptions=stats["num_preemptions"]))

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
            params = sampling_params_from_pb(request)
            done = self._engine.submit(rid, prompt, params, self, priority=request.priority)
        except Exception as e:  # noqa: BLE001 — refused: the error entry is its terminal event
            self._refuse(rid, e)
            return
        self.mux.open(rid, released_slot)
        done.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._added, rid, f))

    def _added(self, rid: str, done: Future[None]) -> None:
        if (error := done.exception()) is not None:
            self._refuse(rid, error)
            self.mux.finish(rid)

    def _refuse(self, rid: str, error: BaseException) -> None:
        code, message = status_for(wire_error(error))
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request %s refused: %r", rid, error)
        msg = engine_pb2.EngineStreamResponse()
        msg.errors.add(request_id=rid, code=code.value[0], message=message, reason=error_reason(error))
        self.mux.send(msg)

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs of this call's requests (OutputGroup; runs on the event loop)."""
        msg = engine_pb2.EngineStreamResponse()
        counters = self._servicer.counters
        live = self.mux.requests
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
        if msg.outputs:
            self.mux.send(msg)


def warm_up(core: EngineCore) -> None:
    """One short request through the whole step path before the server reports SERVING."""
    core.add_request("__warmup__", [core.model_config.bos_token_id or 1] * 8,
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()


async def serve(config: EngineConfig, host: str, port: int, *, shutdown_grace: float = 10.0,
                ready: asyncio.Event | None = None) -> None:
    server, health_service = new_server(SERVICE_NAME)
    await health_service.set_serving(False)
    servicer = EngineServicer()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    bound = bind(server, host, port)
    await server.start()
    logger.info("engine gRPC listening on %s:%d (loading model)", host, bound)
    stop = stop_event()

    def build() -> EngineCore:
        # The core never reads text: the vocabulary structured outputs mask with is loaded here, at the edge.
        tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model_path)
        core = EngineCore(config, grammar_vocabulary=GrammarVocabulary.from_tokenizer(tokenizer))
        warm_up(core)
        return core

    # Loaded, warmed up and stepped on the engine's own thread: one OpenMP pool (see AsyncEngine).
    engine = await AsyncEngine.launch(build,
                                      log_stats_interval=None if config.disable_log_stats else DEFAULT_INTERVAL_S)
    servicer.attach(engine)
    await health_service.set_serving(True)
    logger.info("engine ready: %s on %s:%d", config.model_name, host, bound)
    if ready is not None:
        ready.set()
    await stop.wait()
    logger.info("draining (grace %.1fs)", shutdown_grace)
    await health_service.set_serving(False)
    await server.stop(shutdown_grace)
    engine.shutdown()
