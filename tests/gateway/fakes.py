"""A fake ``sluice.v1.Generation`` server (grpc.aio, 127.0.0.1) for the gateway's tests.

What it does is chosen by the prompt (the text, or the last chat message):
  * ``abort:CODE:details`` — fails the call with that gRPC status;
  * ``abort-once:CODE:details`` — the same, on the first fake server a request (by ``request_id``) reaches;
    any other server then answers it as usual (a replica whose engine just died, then a healthy one);
  * ``busy:SECONDS`` — fails with RESOURCE_EXHAUSTED and a ``retry-after`` trailer;
  * ``slow:SECONDS`` — waits before the first message;
  * ``stall`` — sends one message, then waits until cancelled;
  * ``midfail:CODE`` — sends one message, then fails the call with that status;
  * ``gap:SECONDS`` — waits between messages;
  * ``fail`` — ends choice 0 with FINISH_REASON_ERROR;
  * ``streamfail:CODE`` — on a GenerateStream, fails the whole stream with that status;
  * ``toolcalls`` — each sequence calls get_weather({"city": "Paris"}) in two
    deltas, then get_time({}), and ends with TOOL_CALLS (no text);
  * ``json`` — each sequence generates the JSON text of ``JSON_ANSWER`` in pieces;
  * anything else — each of the n sequences generates "Hel", "lo", " world"
    (token ids 10, 11, 12), interleaved, then ends: LENGTH when max_tokens cut
    it, STOP_STRING with the first stop string if any were given, else EOS.
Prompt tokens: the number of words of the text, or of token ids.
With ``echo`` (text prompts), each sequence's first text starts with the
prompt; with ``prompt_logprobs`` (or echo with logprobs) its first message
carries one entry per word (of the text, or of the chat messages): token id i + 1, text " word" (the first without the
space, and without a logprob), logprob -0.25 * i, and ``prompt_logprobs`` (else
``top_logprobs``) alternatives: id 200 + j, text "pj", logprob -1 - j.
``GenerateStream`` runs the same behaviours per request, multiplexed.

LoRA: a request's ``model`` (empty: the base model) must be one of ``lora_adapters``
(name → base model name), else NOT_FOUND as the tokenizer service answers; GetModelInfo
lists them when ``lora_enabled``; Load/UnloadLoRAAdapter change them with the proto's
status codes: FAILED_PRECONDITION unless ``runtime_lora``, ALREADY_EXISTS, NOT_FOUND,
and INVALID_ARGUMENT for a ``lora_path`` starting with "bad".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PIECES = (("Hel", 10), ("lo", 11), (" world", 12))
JSON_ANSWER = {"name": "Ada", "age": 36}
JSON_PIECES = (('{"name": ', 30), ('"Ada", ', 31), ('"age": 36}', 32))
TOOL_CALLS = (  # (index, id, name, arguments fragment) per step
    (0, "call_0", "get_weather", '{"city": '),
    (0, "", "", '"Paris"}'),
    (1, "call_1", "get_time", "{}"),
)
MODEL_NAME = "fake-model"
# Request ids an ``abort-once:`` prompt was refused for, on whichever fake server came first.
_REFUSED_ONCE: set[str] = set()


def command_of(req: generation_pb2.GenerateRequest) -> str:
    kind = req.WhichOneof("input")
    if kind == "text":
        return req.text
    if kind == "chat":
        return req.chat.messages[-1].content if req.chat.messages else ""
    return ""


def prompt_tokens_of(req: generation_pb2.GenerateRequest) -> int:
    kind = req.WhichOneof("input")
    if kind == "token_ids":
        return len(req.token_ids.ids)
    if kind == "chat":
        return sum(len(m.content.split()) + 3 for m in req.chat.messages)  # 3: the template's role header
    return len(req.text.split())


@dataclass
class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    generate_requests: list[generation_pb2.GenerateRequest] = field(default_factory=list)
    unary_requests: list[object] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # x-request-id metadata of each call
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    stream_messages: int = 0  # GenerateStream messages sent
    stream_requests: list[generation_pb2.GenerateStreamRequest] = field(default_factory=list)
    lora_enabled: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)
    runtime_lora: bool = True
    lora_requests: list[object] = field(default_factory=list)  # Load/UnloadLoRAAdapter requests
    reset_ok: bool = True  # ResetPrefixCache's answer (False: an engine's requests hold blocks)
    resets: int = 0  # ResetPrefixCache calls

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.generate_requests.append(request)
        self.request_ids.append(dict(context.invocation_metadata()).get("x-request-id", ""))
        command = command_of(request)
        try:
            async for msg in self._generate(request, command, context):
                yield msg
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished.set()

    async def _generate(self, request, command, context):  # type: ignore[no-untyped-def]
        if request.model and request.model not in self.lora_adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._not_found(request.model))
        if command.startswith("abort:") or (command.startswith("abort-once:")
                                            and request.request_id not in _REFUSED_ONCE):
            _REFUSED_ONCE.add(request.request_id)
            _, code, details = command.split(":", 2)
            await context.abort(grpc.StatusCode[code], details)
        if command.startswith("busy:"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full",
                                trailing_metadata=(("retry-after", command.split(":")[1]),))
        if command.startswith("slow:"):
            await asyncio.sleep(float(command.split(":")[1]))
        gap = float(command.split(":")[1]) if command.startswith("gap:") else 0.0
        n = request.n or 1
        prompt_tokens = prompt_tokens_of(request)
        max_tokens = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else None
        pieces = JSON_PIECES if command == "json" else PIECES
        steps = len(pieces) if max_tokens is None else min(len(pieces), max_tokens)
        completion_tokens = 0
        for step in range(steps):
            for index in range(n):
                piece, token = pieces[step]
                text = "" if command == "toolcalls" else piece
                if step == 0 and request.response.echo and request.WhichOneof("input") == "text":
                    text = request.text + text
                completion_tokens += 1
                msg = generation_pb2.GenerateResponse(
                    request_id=request.request_id, index=index, text=text, token_ids=[token],
                    usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                           cached_tokens=1))
                if command == "toolcalls":
                    call_index, call_id, name, arguments = TOOL_CALLS[step]
                    msg.tool_calls.add(index=call_index, id=call_id, name=name, arguments=arguments)
                if step == 0:
                    _add_prompt_logprobs(msg, request)
                if request.response.logprobs:
                    lp = msg.logprobs.add(token_id=token, text=piece, text_bytes=piece.encode(), logprob=-0.5)
                    for k in range(request.response.top_logprobs):
                        lp.top_logprobs.add(token_id=100 + k, text=f"alt{k}", text_bytes=f"alt{k}".encode(),
                                            logprob=-1.0 - k)
                if step == steps - 1:
                    _finish(msg, request, max_tokens, steps, fail=command == "fail" and index == 0)
                yield msg
                if command.startswith("midfail:"):
                    await context.abort(grpc.StatusCode[command.split(":")[1]], "engine died at 127.0.0.1:1")
                if command == "stall":
                    await asyncio.sleep(3600)
            if gap:
                await asyncio.sleep(gap)

    async def GenerateStream(self, request_iterator, context):  # type: ignore[no-untyped-def]
        """The same behaviours, multiplexed: a task per request, items batched as they queue up."""
        out: asyncio.Queue[generation_pb2.GenerateStreamItem | None] = asyncio.Queue()
        tasks: dict[int, asyncio.Task[None]] = {}
        cancelled: set[int] = set()

        async def run(id_: int, request: generation_pb2.GenerateRequest) -> None:
            self.generate_requests.append(request)
            self.request_ids.append(request.request_id)
            code, details, retry_after = grpc.StatusCode.OK, "", 0
            try:
                async for msg in self._generate(request, command_of(request), _RequestContext()):
                    out.put_nowait(generation_pb2.GenerateStreamItem(id=id_, response=msg))
            except _Aborted as e:
                code, details, retry_after = e.code, e.details, e.retry_after
            except asyncio.CancelledError:
                self.cancelled.set()
                if id_ not in cancelled:
                    raise
                code, details = grpc.StatusCode.CANCELLED, "cancelled"
            else:
                self.finished.set()
            del tasks[id_]
            out.put_nowait(generation_pb2.GenerateStreamItem(id=id_, end=True, status_code=code.value[0],
                                                             status_message=details,
                                                             retry_after_seconds=retry_after))

        async def read() -> None:
            async for r in request_iterator:
                self.stream_requests.append(r)
                if r.WhichOneof("action") == "generate" and command_of(r.generate).startswith("streamfail:"):
                    out.put_nowait(generation_pb2.GenerateStreamItem(id=r.id, status_message=command_of(r.generate)))
                elif r.WhichOneof("action") == "generate":
                    tasks[r.id] = asyncio.create_task(run(r.id, r.generate))
                elif r.cancel and r.id in tasks:
                    cancelled.add(r.id)
                    tasks[r.id].cancel()
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        half_closed = False
        try:
            while not (half_closed and not tasks and out.empty()):
                items = []
                item = await out.get()
                while True:
                    if item is None:
                        half_closed = True
                    elif item.status_message.startswith("streamfail:"):
                        await context.abort(grpc.StatusCode[item.status_message.split(":")[1]], "stream failed")
                    else:
                        items.append(item)
                    if out.empty():
                        break
                    item = out.get_nowait()
                if items:
                    self.stream_messages += 1
                    yield generation_pb2.GenerateStreamResponse(items=items)
        finally:
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()

    def _not_found(self, model: str) -> str:
        return f"model: {model!r} is neither the served model nor a loaded LoRA adapter"

    async def Tokenize(self, request, context):  # type: ignore[no-untyped-def]
        self.unary_requests.append(request)
        if request.model and request.model not in self.lora_adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._not_found(request.model))
        if request.HasField("chat"):
            words = " ".join(m.content for m in request.chat.messages).split()
        else:
            words = request.text.split()
        ids = list(range(1, len(words) + 1))
        return generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=2048,
                                               token_strs=words if request.return_token_strs else [])

    async def Detokenize(self, request, context):  # type: ignore[no-untyped-def]
        self.unary_requests.append(request)
        if request.model and request.model not in self.lora_adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._not_found(request.model))
        return generation_pb2.DetokenizeResponse(text=" ".join(f"t{i}" for i in request.token_ids))

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        self.unary_requests.append(request)
        resp = generation_pb2.GetModelInfoResponse(model_name=MODEL_NAME, max_model_len=2048, vocab_size=1000,
                                                   lora_enabled=self.lora_enabled)
        for name, base in self.lora_adapters.items():
            resp.lora_adapters.add(name=name, base_model_name=base)
        return resp

    async def LoadLoRAAdapter(self, request, context):  # type: ignore[no-untyped-def]
        self.lora_requests.append(request)
        if not self.runtime_lora:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updating is off")
        if request.lora_name in self.lora_adapters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"lora_name: {request.lora_name!r} is loaded")
        if request.lora_path.startswith("bad"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"lora_path: {request.lora_path}/adapter_config.json: r: 64 is above "
                                "--max-lora-rank 16")
        base = request.base_model_name or MODEL_NAME
        self.lora_adapters[request.lora_name] = base
        return common_pb2.LoadLoRAAdapterResponse(
            adapter=common_pb2.LoRAAdapter(name=request.lora_name, base_model_name=base))

    async def UnloadLoRAAdapter(self, request, context):  # type: ignore[no-untyped-def]
        self.lora_requests.append(request)
        if not self.runtime_lora:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updating is off")
        if self.lora_adapters.pop(request.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter named {request.lora_name!r}")
        return common_pb2.UnloadLoRAAdapterResponse()

    async def ResetPrefixCache(self, request, context):  # type: ignore[no-untyped-def]
        self.resets += 1
        return common_pb2.ResetPrefixCacheResponse(ok=self.reset_ok)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after: int) -> None:
        super().__init__(details)
        self.code, self.details, self.retry_after = code, details, retry_after


class _RequestContext:
    """What ``_generate`` needs of a context, for one request of a GenerateStream: an abort that ends
    the request with its status instead of the whole call (a retry-after trailer goes in the item)."""

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        raise _Aborted(code, details, int(dict(trailing_metadata).get("retry-after", 0)))


def _add_prompt_logprobs(msg: generation_pb2.GenerateResponse, request: generation_pb2.GenerateRequest) -> None:
    r = request.response
    if r.HasField("prompt_logprobs"):
        alternatives = r.prompt_logprobs
    elif r.echo and r.logprobs:
        alternatives = r.top_logprobs
    else:
        return
    words = " ".join(m.content for m in request.chat.messages).split() if request.HasField("chat") else \
        request.text.split()
    for i, word in enumerate(words):
        entry = msg.prompt_logprobs.add(token_id=i + 1, text=word if i == 0 else f" {word}")
        if i == 0:
            continue
        entry.logprob = -0.25 * i
        for j in range(alternatives):
            entry.top_logprobs.add(token_id=200 + j, text=f"p{j}", text_bytes=f"p{j}".encode(), logprob=-1.0 - j)


def _finish(msg: generation_pb2.GenerateResponse, request: generation_pb2.GenerateRequest,
            max_tokens: int | None, steps: int, *, fail: bool) -> None:
    if fail:
        msg.finish_reason = common_pb2.FINISH_REASON_ERROR
        msg.error_message = "device lost at /work/secret/path"
    elif max_tokens is not None and steps == max_tokens:
        msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
    elif msg.tool_calls:
        msg.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
    elif request.stopping.stop:
        msg.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
        msg.stop_string = request.stopping.stop[0]
    else:
        msg.finish_reason = common_pb2.FINISH_REASON_EOS


@dataclass
class FakeServer:
    server: grpc.aio.Server
    port: int
    servicer: FakeGeneration
    health: HealthServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool, service: str = "") -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)


_USED_PORTS: set[int] = set()


async def start_fake_server(*, with_health: bool = True) -> FakeServer:
    """Serves the fake Generation API and (unless told not to) grpc.health.v1 with
    the whole server ("") SERVING."""
    server = grpc.aio.server()
    servicer = FakeGeneration()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = HealthServicer()
    if with_health:
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    if port in _USED_PORTS:
        # A port an earlier fake server had: a channel of an earlier test may still hold a connection
        # to it in grpc's process-wide subchannel pool, and a new channel to the same target would
        # share that connection, which the earlier server's stop(0) ends with a GOAWAY (a rare
        # UNAVAILABLE in an unrelated test). Take another port.
        await server.stop(0)
        return await start_fake_server(with_health=with_health)
    _USED_PORTS.add(port)
    await server.start()
    fake = FakeServer(server, port, servicer, health)
    if with_health:
        await fake.set_serving(True)
    return fake
