"""The tokenizer service: the public text-level ``sluice.v1.Generation`` API in front of one engine.

Text in (tokenize, chat template), token ids to the engine (shared memory when
co-located, inline otherwise), text deltas back (incremental detokenizer with
stop strings held back; a matched stop string aborts the engine request).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from common.errors import InvalidRequestError
from common.stream_mux import TaskMux
from engine.text import IncrementalDetokenizer, Tokenizer
from proto.shm import ShmRing
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.tokenizer.engine_stream import EngineStream, error_reason

logger = logging.getLogger(__name__)

_MAX_STOP_STRINGS = 16
_MAX_STOP_LEN = 256
_MAX_TOP_LOGPROBS = 20


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None


@dataclass
class _Seq:
    """Detokenization state of one of a request's n sequences."""

    index: int
    detok: IncrementalDetokenizer
    completion_tokens: int = 0
    finished: bool = False


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


@dataclass
class _Usage:
    prompt: int
    cached: int = 0
    per_seq: dict[int, int] = field(default_factory=dict)

    def pb(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.prompt, completion_tokens=sum(self.per_seq.values()),
                                cached_tokens=self.cached)


_ENGINE_FINISH = {
    common_pb2.FINISH_REASON_EOS: common_pb2.FINISH_REASON_EOS,
    common_pb2.FINISH_REASON_STOP: common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORTED: common_pb2.FINISH_REASON_ABORTED,
    common_pb2.FINISH_REASON_ERROR: common_pb2.FINISH_REASON_ERROR,
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, engine_channel: grpc.aio.Channel, *, served_model_name: str,
                 model_path: str, shm_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.engine = engine_pb2_grpc.EngineStub(engine_channel)
        self.engine_stream = EngineStream(self.engine)
        self.served_model_name = served_model_name
        self.model_path = model_path
        self._info: EngineInfo | None = None
        self._ring = ShmRing(shm_tokens) if shm_tokens > 0 else None
        self._shm_registered = False
        self.draining = False
        self._streams: set[_Multiplexer] = set()

    # -- engine handshake ---------------------------------------------------------------------------------
    async def engine_info(self, refresh: bool = False) -> EngineInfo:
        if self._info is None or refresh:
            r = await self.engine.GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
            self._info = EngineInfo(r.model_name, r.max_model_len, r.vocab_size, list(r.eos_token_ids),
                                    r.bos_token_id if r.HasField("bos_token_id") else None)
        return self._info

    async def ensure_shm(self) -> bool:
        """Register this replica's ring with the engine once (again after an engine restart)."""
        if self._ring is None:
            return False
        if not self._shm_registered:
            try:
                r = await self.engine.RegisterSharedMemory(engine_pb2.RegisterSharedMemoryRequest(
                    segment=self._ring.name, size_bytes=self._ring.size_bytes, owner=f"tokenizer-{id(self)}"),
                    timeout=5)
            except grpc.aio.AioRpcError:
                return False
            self._shm_registered = r.ok
            if not r.ok:
                logger.warning("engine cannot map our shared memory (%s); sending prompt ids inline", r.error)
                self._ring.close()
                self._ring = None
        return self._shm_registered

    def engine_restarted(self) -> None:
        """A new engine process knows neither our ring nor its info: hand both over again."""
        self._shm_registered = False
        self._info = None
        self.engine_stream.reset()

    def drain(self) -> None:
        """Shutting down: open GenerateStreams take no new requests and end once theirs have finished
        (new calls are refused by the server itself)."""
        self.draining = True
        for stream in self._streams:
            stream.wake()

    def close(self) -> None:
        self.engine_stream.close()
        if self._ring is not None:
            self._ring.close()

    # -- public RPCs --------------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = request.request_id or _metadata(context, "x-request-id") or f"gen-{uuid.uuid4().hex}"
        await context.send_initial_metadata((("x-request-id", request_id),))
        async for out in self.generate(request, request_id, timeout=context.time_remaining()):
            yield out

    async def GenerateStream(self, request_iterator: AsyncIterator[generation_pb2.GenerateStreamRequest],
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        mux = _Multiplexer(self)
        self._streams.add(mux)
        try:
            async for message in mux.run(request_iterator):
                yield message
        finally:
            self._streams.discard(mux)

    async def generate(self, request: generation_pb2.GenerateRequest, request_id: str, *, timeout: float | None
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One request's deltas, for ``Generate`` and ``GenerateStream`` alike; errors raise (typed, or the
        engine call's ``AioRpcError``). ``timeout``: seconds left of the caller's deadline, for the engine call."""
        self._check_model(request.model)
        prompt_ids = self.prompt_ids(request)  # its length against max_model_len: the engine's to check
        stop = list(request.stopping.stop)
        if len(stop) > _MAX_STOP_STRINGS or any(len(s) > _MAX_STOP_LEN or not s for s in stop):
            raise InvalidRequestError("stop", f"at most {_MAX_STOP_STRINGS} non-empty stop strings of at most "
                                              f"{_MAX_STOP_LEN} characters")
        if request.response.top_logprobs > _MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {_MAX_TOP_LOGPROBS}]")
        if request.response.HasField("stream_interval") and request.response.stream_interval < 1:
            raise InvalidRequestError("stream_interval", "must be an integer >= 1")
        n = request.n or 1
        skip_special = (request.response.skip_special_tokens
                        if request.response.HasField("skip_special_tokens") else True)
        seqs = {i: _Seq(i, IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=skip_special,
                                                  stop=stop,
                                                  include_stop_str_in_output=request.stopping.include_stop_str_in_output))
                for i in range(n)}
        usage = _Usage(prompt=len(prompt_ids))
        source = request.token_ids if request.WhichOneof("input") == "token_ids" else None
        engine_req, handoff = await self.engine_request(request, request_id, prompt_ids, n, source=source)
        time_limit = request.stopping.time_limit_ms / 1000 if request.stopping.HasField("time_limit_ms") else None
        deadline = time.monotonic() + time_limit if time_limit else None
        call = self.engine_stream.generate(engine_req, timeout=timeout, metadata=(("x-request-id", request_id),))
        try:
            async for msg in _with_deadline(call, deadline):
                if msg is None:  # the time limit elapsed
                    await self._abort_engine(request_id)
                    for seq in seqs.values():
                        if not seq.finished:
                            seq.finished = True
                            yield self._final(request_id, seq, usage, common_pb2.FINISH_REASON_TIME_LIMIT)
                    return
                if msg.HasField("released_shm_slot"):
                    handoff.release()
                usage.cached = msg.cached_tokens or usage.cached
                live = seqs.get(msg.index)
                if live is None or live.finished:
                    continue  # ended here by a stop string: what the engine sends until its abort lands
                seq = live
                out = self._delta(request_id, seq, msg, usage, request.response)
                if out is None:
                    continue
                yield out
                if seq.finished and msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    # A stop string ended it here while the engine still runs it.
                    if all(s.finished for s in seqs.values()):
                        return  # nothing left to read: leaving the call aborts the engine request
                    asyncio.ensure_future(self._abort_engine(request_id, seq.index))  # its siblings go on
            # The engine ended the call after the request's last message (request_done): it decides that.
        except grpc.aio.AioRpcError as e:
            if error_reason(e) == engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED:
                self._shm_registered = False  # the engine restarted and forgot our ring; next call re-registers
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, e.initial_metadata(),
                                           e.trailing_metadata(), "engine restarted; retry") from e
            raise
        finally:
            handoff.release()
            await call.aclose()  # unfinished: aborts the engine request

    def _delta(self, request_id: str, seq: _Seq, msg: engine_pb2.EngineGenerateResponse, usage: _Usage,
               options: generation_pb2.ResponseOptions) -> generation_pb2.GenerateResponse | None:
        ids = list(msg.token_ids)
        before = seq.detok.num_output_tokens
        delta = seq.detok.add_tokens(ids) if ids else None
        # Under a stream interval a message holds several tokens: those after a stop string are not
        # generated as far as the client is concerned (not returned, not counted).
        del ids[seq.detok.num_output_tokens - before:]
        seq.completion_tokens += len(ids)
        usage.per_seq[seq.index] = seq.completion_tokens
        text = delta.text if delta else ""
        out = generation_pb2.GenerateResponse(request_id=request_id, index=seq.index, text=text, token_ids=ids,
                                              usage=usage.pb())
        if options.logprobs:
            for tok, lp in zip(ids, msg.logprobs):
                entry = out.logprobs.add(token_id=tok, logprob=lp.logprob, text=self._token_text(tok),
                                         text_bytes=self.tokenizer.token_to_bytes(tok))
                tops = sorted(lp.top_logprobs, key=lambda t: -t.logprob)[: options.top_logprobs]
                for t in tops:
                    entry.top_logprobs.add(token_id=t.token_id, logprob=t.logprob, text=self._token_text(t.token_id),
                                           text_bytes=self.tokenizer.token_to_bytes(t.token_id))
        if delta is not None and delta.stop_string is not None:
            seq.finished = True
            out.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
            out.stop_string = delta.stop_string
            return out
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            seq.finished = True
            out.text += seq.detok.finish()
            if seq.detok.stop_string is not None:
                out.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
                out.stop_string = seq.detok.stop_string
            else:
                out.finish_reason = _ENGINE_FINISH.get(msg.finish_reason, common_pb2.FINISH_REASON_ERROR)
                if out.finish_reason == common_pb2.FINISH_REASON_STOP and ids:
                    out.stop_token_id = ids[-1]
                if out.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    out.error_message = msg.error_message or "the engine failed while generating"
            return out
        return out if (text or ids) else None

    def _final(self, request_id: str, seq: _Seq, usage: _Usage,
               reason: common_pb2.FinishReason) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=request_id, index=seq.index, text=seq.detok.finish(),
                                               usage=usage.pb(), finish_reason=reason)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_to_bytes(token_id).decode("utf-8", errors="replace")

    async def _abort_engine(self, request_id: str, index: int | None = None) -> None:
        """Abort the engine request, or only its sequence ``index`` (its siblings go on)."""
        abort = (engine_pb2.AbortRequest(request_ids=[request_id]) if index is None else
                 engine_pb2.AbortRequest(sequences=[engine_pb2.SequenceRef(request_id=request_id, index=index)]))
        try:
            await self.engine.Abort(abort, timeout=5)
        except grpc.aio.AioRpcError:
            logger.warning("abort of %s (sequence %s) did not reach the engine", request_id,
                           "all" if index is None else index)

    async def engine_request(self, request: generation_pb2.GenerateRequest, request_id: str,
                              prompt_ids: list[int] | np.ndarray, n: int, *, source: common_pb2.TokenIds | None = None
                              ) -> tuple[engine_pb2.EngineGenerateRequest, _Handoff]:
        """The engine request for ``prompt_ids``: a shm reference when the ring has room, else inline ids
        (copied message to message from ``source``, the public request's token ids, when given)."""
        st = request.stopping
        stopping = engine_pb2.EngineStoppingCriteria(min_tokens=st.min_tokens, stop_token_ids=st.stop_token_ids,
                                                     ignore_eos=st.ignore_eos)
        if st.HasField("max_tokens"):
            stopping.max_tokens = st.max_tokens
        req = engine_pb2.EngineGenerateRequest(request_id=request_id, sampling=request.sampling, stopping=stopping,
                                               priority=request.priority, n=n)
        if request.response.logprobs:
            req.logprobs = request.response.top_logprobs
        if request.response.HasField("stream_interval"):
            req.stream_interval = request.response.stream_interval
        handoff = _Handoff(None)
        if await self.ensure_shm() and self._ring is not None:
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

    def prompt_ids(self, request: generation_pb2.GenerateRequest) -> list[int] | np.ndarray:
        """The prompt's token ids: text encoded, chat messages rendered with the chat template and
        encoded, or the given ids as an array; an empty or missing prompt is an InvalidRequestError."""
        which = request.WhichOneof("input")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt", "the prompt is empty")
            ids: list[int] | np.ndarray = self.tokenizer.encode(request.text, add_special_tokens=True)
        elif which == "chat":
            ids = self.tokenizer.encode(self._render(request.chat), add_special_tokens=False)
        elif which == "token_ids":
            # Kept as an array (upb's repeated field exports __array__: 47 µs for 128k ids): it goes into
            # the shared-memory ring with one memcpy and the engine keeps it as is, no Python ints on the way.
            ids = np.asarray(request.token_ids.ids)
        else:
            raise InvalidRequestError("prompt", "one of text, chat or token_ids is required")
        if len(ids) == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        return ids

    def _render(self, chat: generation_pb2.Chat) -> str:
        if not chat.messages:
            raise InvalidRequestError("messages", "at least one message is required")
        messages: list[dict[str, Any]] = []
        for m in chat.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.HasField("name"):
                msg["name"] = m.name
            messages.append(msg)
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        template = chat.chat_template if chat.HasField("chat_template") else None
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen, chat_template=template)

    def _check_model(self, model: str) -> None:
        if model and model != self.served_model_name:
            raise InvalidRequestError("model", f"model {model!r} is not served here "
                                               f"(serving {self.served_model_name!r})")

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> generation_pb2.TokenizeResponse:
        self._check_model(request.model)
        which = request.WhichOneof("input")
        if which == "chat":
            add = request.add_special_tokens if request.HasField("add_special_tokens") else False
            ids = self.tokenizer.encode(self._render(request.chat), add_special_tokens=add)
        else:
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = self.tokenizer.encode(request.text, add_special_tokens=add)
        info = await self.engine_info()
        resp = generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=info.max_model_len)
        if request.return_token_strs:
            resp.token_strs.extend(self.tokenizer.convert_ids_to_tokens(ids))
        return resp

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> generation_pb2.DetokenizeResponse:
        self._check_model(request.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is out of range [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return generation_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids),
                                                                            skip_special_tokens=skip))

    async def ApplyChatTemplate(self, request: generation_pb2.ApplyChatTemplateRequest,
                                context: grpc.aio.ServicerContext) -> generation_pb2.ApplyChatTemplateResponse:
        self._check_model(request.model)
        text = self._render(request.chat)
        return generation_pb2.ApplyChatTemplateResponse(
            text=text, token_ids=self.tokenizer.encode(text, add_special_tokens=False))

    async def GetModelInfo(self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> generation_pb2.GetModelInfoResponse:
        self._check_model(request.model)
        info = await self.engine_info(refresh=True)
        resp = generation_pb2.GetModelInfoResponse(
            model_name=self.served_model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids, has_chat_template=self.tokenizer.chat_template is not None,
            model_path=self.model_path)
        if info.bos_token_id is not None:
            resp.bos_token_id = info.bos_token_id
        return resp


class _Multiplexer:
    """One ``GenerateStream`` call: the protocol of :class:`common.stream_mux.TaskMux`, a task per open request
    whose items go out batched (a step's deltas for every request of the stream in one message), each request
    ending with exactly one end item that carries the status its own ``Generate`` call would have ended with."""

    def __init__(self, servicer: GenerationServicer) -> None:
        self._servicer = servicer
        self._mux: TaskMux[int, generation_pb2.GenerateStreamRequest, generation_pb2.GenerateResponse,
                           generation_pb2.GenerateStreamItem, generation_pb2.GenerateStreamResponse] = TaskMux(self)
        self.wake()

    def run(self, requests: AsyncIterator[generation_pb2.GenerateStreamRequest]
            ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        return self._mux.run(requests)

    def wake(self) -> None:
        """Shutting down: take no new requests, end once the open ones have (half-closed or not)."""
        if self._servicer.draining:
            self._mux.drain()

    def receive(self, req: generation_pb2.GenerateStreamRequest) -> None:
        action = req.WhichOneof("action")
        if action == "generate":
            if req.id in self._mux.requests:
                raise InvalidRequestError("id", f"request {req.id} is still open on this stream")
            if self._servicer.draining:
                self._mux.end(req.id, grpc.StatusCode.UNAVAILABLE, "the tokenizer service is shutting down")
                return
            timeout = req.timeout_ms / 1000 if req.timeout_ms else None
            request_id = req.generate.request_id or f"gen-{uuid.uuid4().hex}"
            self._mux.spawn(req.id, self._servicer.generate(req.generate, request_id, timeout=timeout),
                            timeout=timeout, name=request_id)
        elif action == "cancel":
            self._mux.cancel(req.id)
        else:
            raise InvalidRequestError("action", "each message needs `generate` or `cancel`")

    def item(self, id_: int, response: generation_pb2.GenerateResponse) -> generation_pb2.GenerateStreamItem:
        return generation_pb2.GenerateStreamItem(id=id_, response=response)

    def end_item(self, id_: int, code: grpc.StatusCode, message: str, last: generation_pb2.GenerateStreamItem | None
                 ) -> generation_pb2.GenerateStreamItem | None:
        item = last if last is not None and last.id == id_ and not last.end else generation_pb2.GenerateStreamItem(
            id=id_)
        item.end = True
        item.status_code = code.value[0]
        item.status_message = message
        return None if item is last else item

    def pack(self, items: list[generation_pb2.GenerateStreamItem]) -> generation_pb2.GenerateStreamResponse:
        return generation_pb2.GenerateStreamResponse(items=items)


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
