"""The tokenizer service: the public text-level ``sluice.v1.Generation`` API in front of one engine, or of several
(data-parallel replicas: each request goes to one, chosen by ``services.tokenizer.routing``).

Text in (tokenize, chat template), token ids to the engine (shared memory when
co-located, inline otherwise), text deltas back (incremental detokenizer with
stop strings held back; a matched stop string aborts the engine request).

With tracing on, each generation gets a span (child of the request's ``trace_headers``, or of
a ``Generate`` call's ``traceparent`` metadata) from its arrival to its last delta, covering
tokenizing and templating; its context goes on to the engine in the engine request's
``trace_headers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from common.errors import InvalidRequestError
from common.logs import REQUEST_ID
from common.tracing import Tracing, trace_headers_of
from engine.text import IncrementalDetokenizer, Tokenizer
from proto.shm import ShmRing
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.tokenizer.disagg import Disaggregation
from services.tokenizer.engine_request import bad_words_to_pb, check_options, engine_options
from services.tokenizer.engine_stream import EngineStream, error_reason
from services.tokenizer.engines import Engine
from services.tokenizer.limits import InputLimits
from services.tokenizer.lora import LoRAAdapter, adapters_from_pb, adapters_to_pb, model_not_found
from services.tokenizer.migration import EngineCall, MigrationMetrics, MigrationSettings
from services.tokenizer.multimodal import ChatImages, MediaSettings, has_parts
from services.tokenizer.multiplexer import Multiplexer
from services.tokenizer.outputs import SequenceOutput, Usage
from services.tokenizer.pooling import check_generate, classify, embed, score
from services.tokenizer.prompt import PromptBuilder
from services.tokenizer.reasoning import Reasoning, plan_reasoning
from services.tokenizer.routing import Decision, Router, RoutingSettings
from services.tokenizer.tools import ToolSettings, plan_tools

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)

SPAN_NAME = "sluice.v1.Generation/Generate"
# Prompts longer than this are routed off the event loop (hashing their blocks takes ~20 us a block).
_ROUTE_OFF_LOOP_TOKENS = 16384


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    lora_enabled: bool = False
    lora_adapters: tuple[LoRAAdapter, ...] = ()
    runner: str = "generate"  # "generate" or "pooling" (GetInfoResponse.runner)
    pooling_tasks: tuple[str, ...] = ()
    embedding_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()

    def has_adapter(self, name: str) -> bool:
        return any(a.name == name for a in self.lora_adapters)


@dataclass
class _Handoff:
    """How the prompt ids travel to the engine: a shm slot (released on ack) or inline."""

    ring: ShmRing | None
    slot: int | None = None
    released: bool = False

    def release(self) -> None:
        if self.ring is not None and self.slot is not None and not self.released:
            self.released = True
            self.ring.release(self.slot)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, engines: grpc.aio.Channel | Sequence[Engine], *, served_model_name: str,
                 shm_tokens: int = 0, tools: ToolSettings | None = None,
                 limits: InputLimits | None = None, tracing: Tracing | None = None,
                 log_requests: bool = False, engine_address: str | None = None,
                 reasoning: Reasoning | None = None, routing: RoutingSettings | None = None,
                 migration: MigrationSettings | None = None, migration_metrics: MigrationMetrics | None = None,
                 images: ChatImages | None = None) -> None:
        """``images``: a vision-language model's processor (None: text only, requests with parts refused);
        ``engines``: the engines behind this service (a channel: the one engine there, at ``engine_address``,
        for the log); ``reasoning``: the reasoning parser that splits chat outputs (``--reasoning-parser``), None:
        none; ``routing``: how a request's engine is chosen (``--routing``); ``migration``: see migration.py."""
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.engines = ([Engine(engines, engine_address)] if isinstance(engines, grpc.aio.Channel)
                        else list(engines))
        self.router = Router(routing or RoutingSettings())
        # KV events are followed where routing reads them: kv_aware over several engines.
        self._follow_kv_events = (len(self.engines) > 1
                                  and self.router.settings.policy_for(len(self.engines)) == "kv_aware")
        self.tracing = tracing
        # Engine keys: this service's random prefix (several services share one engine) and a counter.
        self._key_prefix = f"tok-{uuid.uuid4().hex[:12]}"
        self._keys_issued = 0
        self.log_requests = log_requests
        self.prompts = PromptBuilder(tokenizer, limits or InputLimits())
        self.tools = tools or ToolSettings()
        self.served_model_name = served_model_name
        self._ring = ShmRing(shm_tokens) if shm_tokens > 0 else None
        self.draining = False
        self._streams: set[Multiplexer] = set()
        self.migration = migration or MigrationSettings()
        self.migration_metrics = migration_metrics or MigrationMetrics()
        self.disagg = Disaggregation(self.router)   # prefill/decode engines among ours: services/tokenizer/disagg.py
        self.images = images or ChatImages(None, MediaSettings(), served_model_name)

    # -- engine handshake ---------------------------------------------------------------------------------
    async def engine_info(self, refresh: bool = False, *, timeout: float | None = 10,
                          engine: Engine | None = None) -> EngineInfo:
        """The model and LoRA adapters of ``engine`` (None: one that is up; the replicas serve the same model),
        asked again when ``refresh`` or unknown. ``timeout`` bounds a caller's wait, not the engine's life: a slow
        answer says nothing about whether it is gone.

        Every answer names the engine process (``instance_id``): one that differs from the last is a restarted
        engine, whoever asked, and whether or not the connection dropped in between (a proxy may keep it)."""
        engine = engine or next((e for e in self.engines if e.up), self.engines[0])
        if engine.info is None or refresh:
            r = await engine.get_info(timeout)
            if self._follow_kv_events:
                engine.follow_kv_events(r)
            engine.info = EngineInfo(r.model_name, r.max_model_len, r.vocab_size, list(r.eos_token_ids),
                                     r.bos_token_id if r.HasField("bos_token_id") else None,
                                     r.lora_enabled, adapters_from_pb(list(r.lora_adapters)),
                                     runner=r.runner or "generate", pooling_tasks=tuple(r.pooling_tasks),
                                     embedding_size=r.embedding_size, is_matryoshka=r.is_matryoshka,
                                     matryoshka_dimensions=tuple(r.matryoshka_dimensions), labels=tuple(r.labels))
        return engine.info

    async def ensure_shm(self, engine: Engine | None = None) -> bool:
        """Register this service's ring with ``engine`` (None: the first) once, again after it restarts
        (:meth:`Engine.ensure_shm`)."""
        return await (engine or self.engines[0]).ensure_shm(self._ring, f"tokenizer-{id(self)}")

    def engine_restarted(self, engine: Engine | None = None) -> None:
        """``engine`` (None: every one) is a new process: it gets our ring and is asked its info again, and its
        cache is known empty (:meth:`Engine.restarted`)."""
        for e in [engine] if engine is not None else self.engines:
            e.restarted()

    # The single-engine view (the first engine): for callers and tests written before several engines.
    @property
    def engine(self) -> engine_pb2_grpc.EngineStub:
        return self.engines[0].stub

    @property
    def engine_stream(self) -> EngineStream:
        return self.engines[0].stream

    @engine_stream.setter
    def engine_stream(self, stream: EngineStream) -> None:
        self.engines[0].stream = stream

    @property
    def _info(self) -> EngineInfo | None:
        return self.engines[0].info

    @_info.setter
    def _info(self, info: EngineInfo | None) -> None:
        self.engines[0].info = info

    def drain(self) -> None:
        """Shutting down: open GenerateStreams take no new requests and end once theirs have finished
        (new calls are refused by the server itself)."""
        self.draining = True
        for stream in self._streams:
            stream.wake()

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.prompts.close()
        if self._ring is not None:
            self._ring.close()

    @contextlib.asynccontextmanager
    async def engine_for(self, token_ids: list[int] | np.ndarray, *, lora_name: str = "", cache_salt: str = ""
                         ) -> AsyncIterator[engine_pb2_grpc.EngineStub]:
        """The engine to send one request to, held for as long as the request runs there (counted as that
        engine's load meanwhile): chosen by ``--routing`` among the engines that are up."""
        engine, _ = await self._route(token_ids, lora_name, cache_salt)
        try:
            yield engine.stub
        finally:
            engine.open_requests -= 1

    def all_engines(self) -> list[engine_pb2_grpc.EngineStub]:
        """Every engine behind this service (for calls that go to each: ResetPrefixCache)."""
        return [e.stub for e in self.engines]

    async def _route(self, token_ids: list[int] | np.ndarray, lora_name: str, cache_salt: str
                     ) -> tuple[Engine, Decision]:
        """The engine for a prompt, among those up (all of them when none is: the call fails as it would), counted
        as one of its open requests from here (in the same turn of the event loop as the choice, so requests that
        arrive together see each other): the caller takes one off when the request ends."""
        candidates = [e for e in self.engines if e.up] or self.engines
        if len(candidates) == 1:
            candidates[0].open_requests += 1
            return candidates[0], Decision(0, "single")
        ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
        hashes = None
        if len(ids) > _ROUTE_OFF_LOOP_TOKENS and self.router.settings.policy_for(len(candidates)) == "kv_aware":
            hashes = await self.prompts.off_loop(self.router.hash_prompt, candidates, ids,
                                                 lora_name=lora_name or None, cache_salt=cache_salt or None)
            candidates = [e for e in self.engines if e.up] or self.engines   # as they are now
        decision = self.router.choose(candidates, ids, lora_name=lora_name or None, cache_salt=cache_salt or None,
                                      hashes=hashes)
        candidates[decision.choice].open_requests += 1
        return candidates[decision.choice], decision

    # -- public RPCs --------------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = request.request_id or _metadata(context, "x-request-id") or f"gen-{uuid.uuid4().hex}"
        await context.send_initial_metadata((("x-request-id", request_id),))
        if self.tracing is not None and not request.trace_headers:  # a gRPC client's own context
            request.trace_headers.update(trace_headers_of(dict(context.invocation_metadata() or ())))
        async for out in self.generate(request, request_id, timeout=context.time_remaining()):
            yield out

    async def GenerateStream(self, request_iterator: AsyncIterator[generation_pb2.GenerateStreamRequest],
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        mux = Multiplexer(self)
        self._streams.add(mux)
        try:
            async for message in mux.run(request_iterator):
                yield message
        finally:
            self._streams.discard(mux)

    def generate(self, request: generation_pb2.GenerateRequest, request_id: str, *, timeout: float | None
                 ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One request's deltas, for ``Generate`` and ``GenerateStream`` alike; errors raise (typed, or the
        engine call's ``AioRpcError``). ``timeout``: seconds left of the caller's deadline, for the engine call."""
        if self.tracing is None:
            return self._generate(request, request_id, timeout, None)
        return self._traced(self.tracing, request, request_id, timeout)

    async def _traced(self, tracing: Tracing, request: generation_pb2.GenerateRequest, request_id: str,
                      timeout: float | None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """:meth:`_generate` in a span: from the request's arrival to its last delta (or its error)."""
        span = tracing.start_span(SPAN_NAME, parent=request.trace_headers, attributes={
            "rpc.system": "grpc", "rpc.service": "sluice.v1.Generation", "rpc.method": "Generate",
            "gen_ai.request.id": request_id, "gen_ai.request.n": request.n or 1})
        deltas = self._generate(request, request_id, timeout, span)
        first = True
        try:
            async for out in deltas:
                if first:
                    span.add_event("first_response")
                    first = False
                yield out
        except Exception as error:  # a cancelled call is not an error of the request
            span.record_exception(error)
            span.set_status(tracing.error_status)
            raise
        finally:
            await deltas.aclose()
            span.end()

    async def _generate(self, request: generation_pb2.GenerateRequest, request_id: str, timeout: float | None,
                        span: Span | None) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        # Each request's deltas are read by a task of its own (its Generate call's, or one per request of a
        # GenerateStream): lines it logs carry its id from here on.
        REQUEST_ID.set(request_id)
        check_generate(await self.engine_info(), self.served_model_name)
        check_options(request)
        adapter = await self.lora_adapter(request.model, engine_resolves=True)
        plan = plan_tools(request, self.tools)
        prompt_ids, images = await self.prompt_inputs(request)  # exact length against max_model_len: the engine's
        n = request.n or 1
        # A tool parser whose call markers are special tokens (Mistral's [TOOL_CALLS]) needs them in the text, as
        # vLLM's does: then the default keeps special tokens, and the special token that ends the output is left out.
        parser_keeps = plan.parser is not None and plan.parser.keeps_special_tokens
        skip_special = (request.response.skip_special_tokens
                        if request.response.HasField("skip_special_tokens") else not parser_keeps)
        echo = self._echo_text(request, prompt_ids) if request.response.echo else None
        # The engine's key for the request is Sluice's own, unique in this service's life: never the caller's id,
        # which two requests may share and a caller may reuse while an earlier abort is still on its way.
        key = self.new_engine_key()
        options = engine_options(request, key, n, plan.guided, adapter)
        if request.bad_words:
            options.bad_words_token_ids.extend(
                await self.prompts.off_loop(bad_words_to_pb, list(request.bad_words), self.tokenizer))
        thinking = plan_reasoning(request, self.reasoning, prompt_ids, constrained=options.HasField("guided"))
        if thinking.engine is not None:
            options.reasoning.CopyFrom(thinking.engine)
        seqs = {i: SequenceOutput(i, self.tokenizer, IncrementalDetokenizer(
            self.tokenizer, prompt_ids, skip_special_tokens=skip_special, stop=list(request.stopping.stop),
            include_stop_str_in_output=request.stopping.include_stop_str_in_output), tools=plan.stream(), echo=echo,
            reasoning=thinking.stream(), drop_final_special=parser_keeps and not skip_special)
            for i in range(n)}
        usage = Usage(prompt=len(prompt_ids))
        source = request.token_ids if request.WhichOneof("input") == "token_ids" else None
        # Counted there until the end. Prefill and decode engines among ours: by role (prefill sets kv_transfer).
        routed = self.disagg.route(self.engines, options, prompt_ids)
        engine, route = routed or await self._route(prompt_ids, adapter, request.cache_salt)
        try:
            engine_req, handoff = await self.engine_request(options, prompt_ids, source=source, engine=engine)
            engine_req.multi_modal_items.extend(images)
        except BaseException:
            engine.open_requests -= 1
            raise
        engine_req.client_request_id = request_id
        if span is not None and self.tracing is not None:
            span.add_event("prompt_ready", {"gen_ai.usage.prompt_tokens": len(prompt_ids)})
            if len(self.engines) > 1:
                span.set_attributes({"sluice.routing.engine": engine.address or "", "sluice.routing.policy":
                                     route.policy, "sluice.routing.matched_tokens": route.matched_tokens})
            self.tracing.inject(span, engine_req.trace_headers)
        time_limit = request.stopping.time_limit_ms / 1000 if request.stopping.HasField("time_limit_ms") else None
        deadline = time.monotonic() + time_limit if time_limit else None
        if self.log_requests:  # as vLLM's, once the prompt is ready: a refused request was answered with its error
            logger.info("Received request %s (engine key %s): %d prompt tokens, n=%d%s", request_id, key,
                        len(prompt_ids), n, f"; to {engine.name} ({route.describe()})" if len(self.engines) > 1 else "")
        make_call = EngineCall if routed is None else self.disagg.call
        call = make_call(self, engine, engine_req, handoff, prompt_ids, request_id=request_id, timeout=timeout,
                         deadline=deadline)
        try:
            async for msg in _with_deadline(call, deadline):
                if msg is None:  # the time limit elapsed
                    await call.abort()
                    for seq in seqs.values():
                        if not seq.finished:
                            seq.finished = True
                            yield seq.final(request_id, usage, common_pb2.FINISH_REASON_TIME_LIMIT)
                    return
                usage.cached = msg.cached_tokens or usage.cached
                live = seqs.get(msg.index)
                if live is None or live.finished:
                    continue  # ended here by a stop string: what the engine sends until its abort lands
                seq = live
                out = seq.delta(request_id, msg, usage, request.response)
                if out is None:
                    continue
                yield out
                if seq.finished and msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    # A stop string ended it here while the engine still runs it.
                    if all(s.finished for s in seqs.values()):
                        return  # nothing left to read: leaving the call aborts the engine request
                    asyncio.ensure_future(call.abort(seq.index))  # its siblings go on
            # The engine ended the call after the request's last message (request_done): it decides that.
        except grpc.aio.AioRpcError as e:
            if error_reason(e) == engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED:
                call.engine.shm_registered = False  # it restarted and forgot our ring; next call re-registers
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, e.initial_metadata(),
                                           e.trailing_metadata(), "engine restarted; retry") from e
            raise
        finally:
            call.engine.open_requests -= 1   # where it ran last
            await call.aclose()  # unfinished: aborts the engine request; gives back the prompt's slot
            if self.log_requests:
                logger.info("Finished request %s", request_id)

    def _echo_text(self, request: generation_pb2.GenerateRequest, prompt_ids: list[int] | np.ndarray) -> str:
        """The prompt as the client gave it: its text, or its ids decoded as they are (special tokens too)."""
        if request.WhichOneof("input") == "text":
            return request.text
        return self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)

    def new_engine_key(self) -> str:
        self._keys_issued += 1
        return f"{self._key_prefix}-{self._keys_issued}"

    async def engine_request(self, req: engine_pb2.EngineGenerateRequest, prompt_ids: list[int] | np.ndarray, *,
                             source: common_pb2.TokenIds | None = None, engine: Engine | None = None
                             ) -> tuple[engine_pb2.EngineGenerateRequest, _Handoff]:
        """``req`` for ``engine`` (None: the first) with ``prompt_ids``: a shm reference when the ring has room
        and the engine maps it, else inline ids (copied message to message from ``source``, the public request's
        token ids, when given)."""
        handoff = _Handoff(None)
        if await self.ensure_shm(engine) and self._ring is not None:
            ref = self._ring.put(prompt_ids)
            if ref is not None:
                handoff = _Handoff(self._ring, ref.slot)
                req.prompt_shm.CopyFrom(engine_pb2.SharedMemoryRef(segment=ref.segment, offset=ref.offset,
                                                                   length=ref.length, slot=ref.slot))
                return req, handoff
        if source is not None:
            req.prompt_token_ids.CopyFrom(source)  # 1.4 ms for 128k ids, against 15 ms to extend from an array
        else:
            req.prompt_token_ids.ids.extend(prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else prompt_ids)
        return req, handoff

    async def prompt_inputs(self, request: generation_pb2.GenerateRequest
                            ) -> tuple[list[int] | np.ndarray, list[engine_pb2.MultiModalItem]]:
        """The prompt's ids and its images: a chat with content parts through the model's processor."""
        if request.WhichOneof("input") != "chat" or not has_parts(request.chat):
            return await self.prompt_ids(request), []
        max_model_len = (await self.engine_info()).max_model_len
        return await self.images.prompt(request, max_model_len, self.prompts.max_chars(max_model_len),
                                        self.prompts.off_loop)

    async def prompt_ids(self, request: generation_pb2.GenerateRequest) -> list[int] | np.ndarray:
        """The prompt's token ids (``PromptBuilder.prompt_ids``): refused unread when too long to fit."""
        return await self.prompts.prompt_ids(request, (await self.engine_info()).max_model_len)

    async def lora_adapter(self, model: str, *, engine_resolves: bool = False) -> str:
        """The LoRA adapter ``model`` names: "" for the served model (or no name). Another name is an adapter's
        when the engine serves LoRA: as it is when ``engine_resolves`` (a generation: the engine refuses an
        unknown one itself, and knows of an unload before any copy here), else checked against the engine's
        list (refreshed once on a miss); NOT_FOUND otherwise."""
        if not model or model == self.served_model_name:
            return ""
        info = await self.engine_info()
        if info.lora_enabled and (engine_resolves or info.has_adapter(model)):
            return model
        if info.lora_enabled:
            info = await self.engine_info(refresh=True)
            if info.has_adapter(model):
                return model
        raise model_not_found(model, self.served_model_name, lora_enabled=info.lora_enabled)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> generation_pb2.TokenizeResponse:
        await self.lora_adapter(request.model)
        info = await self.engine_info()
        if request.WhichOneof("input") == "chat" and has_parts(request.chat):   # images: the processor's ids
            processed = await self.images.processed(request.chat, self.prompts.max_chars(info.max_model_len),
                                                    self.prompts.off_loop)
            ids = processed.prompt_token_ids
        elif request.WhichOneof("input") == "chat":
            add = request.add_special_tokens if request.HasField("add_special_tokens") else False
            text = await self.prompts.render(request.chat, info.max_model_len)
            ids = await self.prompts.off_loop(self.tokenizer.encode, text, add_special_tokens=add)
        else:
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self.prompts.encode("prompt", request.text, info.max_model_len, add_special_tokens=add)
        resp = generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=info.max_model_len)
        if request.return_token_strs:
            resp.token_strs.extend(self.tokenizer.convert_ids_to_tokens(ids))
        return resp

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> generation_pb2.DetokenizeResponse:
        await self.lora_adapter(request.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is out of range [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return generation_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids),
                                                                            skip_special_tokens=skip))

    async def ApplyChatTemplate(self, request: generation_pb2.ApplyChatTemplateRequest,
                                context: grpc.aio.ServicerContext) -> generation_pb2.ApplyChatTemplateResponse:
        await self.lora_adapter(request.model)
        text = await self.prompts.render(request.chat, (await self.engine_info()).max_model_len)
        return generation_pb2.ApplyChatTemplateResponse(
            text=text, token_ids=await self.prompts.off_loop(self.tokenizer.encode, text, add_special_tokens=False))

    async def GetModelInfo(self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> generation_pb2.GetModelInfoResponse:
        await self.lora_adapter(request.model)
        info = await self.engine_info(refresh=True)
        resp = generation_pb2.GetModelInfoResponse(
            model_name=self.served_model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids, has_chat_template=self.tokenizer.chat_template is not None,
            lora_enabled=info.lora_enabled,
            lora_adapters=adapters_to_pb(info.lora_adapters), runner=info.runner,
            pooling_tasks=info.pooling_tasks, embedding_size=info.embedding_size, is_matryoshka=info.is_matryoshka,
            matryoshka_dimensions=info.matryoshka_dimensions, labels=info.labels)
        if info.bos_token_id is not None:
            resp.bos_token_id = info.bos_token_id
        return resp

    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
                              ) -> common_pb2.LoadLoRAAdapterResponse:
        """Forwarded to every engine, whose status comes back as it is (ALREADY_EXISTS, INVALID_ARGUMENT naming
        the adapter's file, FAILED_PRECONDITION when runtime updating is off): the first engine's answer, or the
        first error once each was asked."""
        if request.lora_name == self.served_model_name:
            # The engine may know the model by another name; requests with this one would never reach it.
            raise InvalidRequestError("lora_name", f"{request.lora_name!r} is the served model's name")
        responses = await self._to_every_engine(lambda stub: stub.LoadLoRAAdapter(
            request, timeout=context.time_remaining()))
        resp: common_pb2.LoadLoRAAdapterResponse = responses[0]
        return resp

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> common_pb2.UnloadLoRAAdapterResponse:
        """Forwarded to every engine, whose status comes back as it is (NOT_FOUND for an unknown name)."""
        responses = await self._to_every_engine(lambda stub: stub.UnloadLoRAAdapter(
            request, timeout=context.time_remaining()))
        resp: common_pb2.UnloadLoRAAdapterResponse = responses[0]
        return resp

    async def _to_every_engine(self, call: Any) -> list[Any]:
        """``call(stub)`` on each engine in turn (a LoRA adapter change, which each replica must see); their
        answers, or the first error once every engine was asked. Their info is asked again on the next lookup
        (the adapter list changed, or may have)."""
        answers: list[Any] = []
        error: grpc.aio.AioRpcError | None = None
        for engine in self.engines:
            try:
                answers.append(await call(engine.stub))
            except grpc.aio.AioRpcError as e:
                error = error or e
            finally:
                engine.info = None
        if error is not None:
            raise error
        return answers

    # -- pooling (services/tokenizer/pooling.py) ----------------------------------------------------------
    async def Embed(self, request: generation_pb2.EmbedRequest, context: grpc.aio.ServicerContext
                    ) -> generation_pb2.EmbedResponse:
        return await embed(self, request, context)

    async def Score(self, request: generation_pb2.ScoreRequest, context: grpc.aio.ServicerContext
                    ) -> generation_pb2.ScoreResponse:
        return await score(self, request, context)

    async def Classify(self, request: generation_pb2.ClassifyRequest, context: grpc.aio.ServicerContext
                       ) -> generation_pb2.ClassifyResponse:
        return await classify(self, request, context)

    async def ResetPrefixCache(self, request: common_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
                               ) -> common_pb2.ResetPrefixCacheResponse:
        """Every engine's prefix cache forgotten, all asked at once: ok only when each one reset (an engine whose
        requests hold blocks refuses; one that cannot be reached counts as not reset)."""
        timeout = context.time_remaining()
        calls = [stub.ResetPrefixCache(request, timeout=timeout) for stub in self.all_engines()]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                logger.warning("prefix cache reset did not reach an engine: %s", answer)
        return common_pb2.ResetPrefixCacheResponse(ok=all(not isinstance(a, BaseException) and a.ok for a in answers))


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


async def _with_deadline(call: Any, deadline: float | None) -> AsyncIterator[Any]:
    """Iterate a response stream; yield None once when ``deadline`` (monotonic) passes first."""
    it = call.__aiter__()
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            msg = await asyncio.wait_for(it.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            yield None
            return
        yield msg
