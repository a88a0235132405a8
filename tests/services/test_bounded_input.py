"""Bounded work per request in the tokenizer service (issue 26, findings 1 and 4): prompts too long to fit are
refused unread, tokenizing runs off the event loop, request chat templates are refused unless trusted and then
stopped by their time and output bounds. The servicer runs in-process against a fake engine that only answers
GetInfo (max_model_len 8192); the tokenizer is the default model's (its longest token: 81 bytes)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import pytest

from common.errors import InvalidRequestError
from common.grpc_server import CHANNEL_OPTIONS, MESSAGE_HEADROOM_BYTES
from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.tokenizer.limits import InputLimits, max_message_bytes
from services.tokenizer.server import public_server
from services.tokenizer.service import GenerationServicer

MAX_MODEL_LEN = 8192
MAX_CHARS = MAX_MODEL_LEN * 81  # the default model's longest token is "\n" and 80 spaces; no normalizer
NESTED_LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
SILENT_LOOP = "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}"
_T = TypeVar("_T")


class InfoEngine(engine_pb2_grpc.EngineServicer):
    async def GetInfo(self, request: Any, context: Any) -> engine_pb2.GetInfoResponse:  # noqa: N802
        return engine_pb2.GetInfoResponse(model_name="fake", max_model_len=MAX_MODEL_LEN, vocab_size=49152,
                                          eos_token_ids=[2], block_size=16)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_pretrained(default_model_path())
    assert tok.max_token_bytes == 81 and tok.backend.normalizer is None  # what MAX_CHARS assumes
    return tok


def served(tokenizer: Tokenizer, body: Callable[[GenerationServicer], Awaitable[_T]], *,
           limits: InputLimits | None = None) -> _T:
    """``body(servicer)`` in a fresh event loop, the servicer's engine an in-process fake."""
    async def main() -> _T:
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(InfoEngine(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servicer = GenerationServicer(tokenizer, channel, served_model_name="m", limits=limits)
        try:
            return await body(servicer)
        finally:
            await servicer.prompts.aclose()
            servicer.close()
            await channel.close()
            await server.stop(None)
    return asyncio.run(main())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chat(content: str, template: str | None = None) -> generation_pb2.Chat:
    c = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content=content)])
    if template is not None:
        c.chat_template = template
    return c


async def refusal(call: Awaitable[object]) -> tuple[InvalidRequestError, float]:
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError) as info:
        await call
    return info.value, time.perf_counter() - start


@pytest.mark.parametrize("case", ["generate-20mb-text", "generate-60mb-chat", "tokenize-30mb-text",
                                  "tokenize-60mb-chat", "apply-template-60mb-chat"])
def test_a_huge_prompt_is_refused_unread_naming_its_field_and_the_limit(tokenizer: Tokenizer, case: str) -> None:
    size = {"generate-20mb-text": 20, "tokenize-30mb-text": 30}.get(case, 60) * 2**20
    text = "word " * (size // 5)
    # The request is built before the service's memory is measured: the test's own 60 MB copies are not the
    # service's growth.
    builders: dict[str, Callable[[], Any]] = {
        "generate-20mb-text": lambda: generation_pb2.GenerateRequest(text=text),
        "generate-60mb-chat": lambda: generation_pb2.GenerateRequest(chat=chat(text)),
        "tokenize-30mb-text": lambda: generation_pb2.TokenizeRequest(text=text),
        "tokenize-60mb-chat": lambda: generation_pb2.TokenizeRequest(chat=chat(text)),
        "apply-template-60mb-chat": lambda: generation_pb2.ApplyChatTemplateRequest(chat=chat(text)),
    }
    request = builders[case]()
    calls: dict[str, Callable[[GenerationServicer], Awaitable[object]]] = {
        "generate-20mb-text": lambda s: s.prompt_ids(request),
        "generate-60mb-chat": lambda s: s.prompt_ids(request),
        "tokenize-30mb-text": lambda s: s.Tokenize(request, None),  # type: ignore[arg-type]
        "tokenize-60mb-chat": lambda s: s.Tokenize(request, None),  # type: ignore[arg-type]
        "apply-template-60mb-chat": lambda s: s.ApplyChatTemplate(request, None),  # type: ignore[arg-type]
    }

    async def body(servicer: GenerationServicer) -> tuple[InvalidRequestError, float, int]:
        await servicer.engine_info()  # the handshake is not what is timed
        before = rss_bytes()
        err, elapsed = await refusal(calls[case](servicer))
        return err, elapsed, rss_bytes() - before

    err, elapsed, grown = served(tokenizer, body)
    field, length = ("messages", len(text) + len("user")) if "chat" in case else ("prompt", len(text))
    assert (err.field, err.message) == (field, f"is {length} characters; at most {MAX_CHARS} can fit in the "
                                               "model's context (max_model_len × the longest token's bytes)")
    # Unread: tokenizing even the 20 MB prompt takes seconds here; the refusal only reads the field's
    # length (upb builds the Python str, tens of ms for 60 MB, more on a loaded machine).
    assert elapsed < 1.0
    assert grown < 100 * 2**20


def test_token_ids_beyond_max_model_len_are_refused_and_up_to_it_pass(tokenizer: Tokenizer) -> None:
    async def body(servicer: GenerationServicer) -> tuple[InvalidRequestError, int]:
        err, _ = await refusal(servicer.prompt_ids(generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[5] * (MAX_MODEL_LEN + 1)))))
        fits = await servicer.prompt_ids(generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[5] * MAX_MODEL_LEN)))
        return err, len(fits)

    err, fitting = served(tokenizer, body)
    assert (err.field, err.message) == ("prompt", f"has {MAX_MODEL_LEN + 1} token ids, more than max_model_len "
                                                  f"({MAX_MODEL_LEN})")
    assert fitting == MAX_MODEL_LEN


def test_a_long_tokenization_leaves_the_event_loop_and_other_requests_free(tokenizer: Tokenizer) -> None:
    """A prompt just under the bound takes seconds to tokenize here; meanwhile a small /tokenize completes
    and the loop never stops for long (with encode on the loop, or holding the GIL, neither would)."""
    big = "héllo wörld, the quick brown fox 123 " * (MAX_CHARS // 37)

    async def ticker(gaps: list[float], stop: asyncio.Event) -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def body(servicer: GenerationServicer) -> tuple[float, bool, float, list[int]]:
        await servicer.engine_info()
        gaps: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(gaps, stop))
        long_call = asyncio.create_task(servicer.Tokenize(generation_pb2.TokenizeRequest(text=big), None))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the long one is under way
        start = time.perf_counter()
        small = await servicer.Tokenize(generation_pb2.TokenizeRequest(text="Hello world"), None)  # type: ignore[arg-type]
        small_s = time.perf_counter() - start
        long_done = long_call.done()
        await long_call
        stop.set()
        await tick
        return small_s, long_done, max(gaps), list(small.token_ids)

    small_s, long_done, max_gap, small_ids = served(tokenizer, body)
    assert small_ids == tokenizer.encode("Hello world")
    assert not long_done  # the small one did not wait for it
    assert small_s < 0.5
    assert max_gap < 0.5


def test_a_request_chat_template_is_refused_by_default(tokenizer: Tokenizer) -> None:
    async def body(servicer: GenerationServicer) -> tuple[InvalidRequestError, float]:
        await servicer.engine_info()
        return await refusal(servicer.prompt_ids(generation_pb2.GenerateRequest(chat=chat("hi", NESTED_LOOP))))

    err, elapsed = served(tokenizer, body)
    assert (err.field, err.message) == ("chat_template", "request chat templates are not allowed on this server; "
                                                         "start it with --trust-request-chat-template to allow them")
    assert elapsed < 1.0  # the template (an endless loop) was never rendered


def test_trusted_request_templates_render_and_are_stopped_by_their_bounds(tokenizer: Tokenizer) -> None:
    """One worker for all: a template renders; the nested loop and a huge string are stopped by the output
    bound, a loop that writes nothing by the time limit (the worker killed, and started again for the next)."""
    limits = InputLimits(trust_request_chat_template=True, template_timeout_s=1.0)
    good = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ tools }}"

    async def body(servicer: GenerationServicer) -> list[tuple[str, str, float] | str]:
        await servicer.engine_info()
        out: list[tuple[str, str, float] | str] = [await servicer.prompts.render(chat("hi", good), MAX_MODEL_LEN)]
        for template in (NESTED_LOOP, SILENT_LOOP, "{{ 'ab ' * 3000000 }}"):
            err, elapsed = await refusal(servicer.prompt_ids(generation_pb2.GenerateRequest(
                chat=chat("hi", template))))
            out.append((err.field, err.message, elapsed))
        out.append(await servicer.prompts.render(chat("again", good), MAX_MODEL_LEN))
        return out

    first, nested, silent, long_output, last = served(tokenizer, body, limits=limits)
    assert first == "<|im_start|><user>hiNone" and last == "<|im_start|><user>againNone"
    too_long = ("chat_template", f"the chat template's output passes {MAX_CHARS} characters")
    for by_output in (nested, long_output):  # "x" 10^10 times: its output passes the bound long before 1 s
        assert isinstance(by_output, tuple)
        assert by_output[:2] == too_long and by_output[2] < 1.0
    assert isinstance(silent, tuple)  # writes nothing: stopped by the time limit, the worker killed
    assert silent[:2] == ("chat_template", "the chat template did not render within 1 s")
    assert 1.0 <= silent[2] < 1.5



def test_the_public_servers_receive_limit_refuses_a_message_too_big_to_fit_and_takes_one_that_may(
        tokenizer: Tokenizer) -> None:
    """Sized from the model as ``serve`` sizes it: a prompt one character past the bound still reaches the
    service (refused by its length check, naming the field); a message one byte past the limit is refused by
    gRPC itself, unread (RESOURCE_EXHAUSTED), as a 60 MB prompt is."""
    tok = tokenizer
    limit = max_message_bytes(MAX_MODEL_LEN, tok.max_token_bytes, normalized=False)
    assert limit == MAX_CHARS + MESSAGE_HEADROOM_BYTES

    async def main() -> list[tuple[grpc.StatusCode, str]]:
        engine = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(InfoEngine(), engine)
        engine_port = engine.add_insecure_port("127.0.0.1:0")
        await engine.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
        server, _ = public_server(tok, MAX_MODEL_LEN, ())
        servicer = GenerationServicer(tok, channel, served_model_name="m")
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as client:
                stub = generation_pb2_grpc.GenerationStub(client)
                over_by_one = generation_pb2.TokenizeRequest(text="x" * (limit - 4))
                assert over_by_one.ByteSize() == limit + 1
                for text in ("x" * (MAX_CHARS + 1), "x" * (limit - 4), "x" * 60 * 2**20):
                    try:
                        await stub.Tokenize(generation_pb2.TokenizeRequest(text=text), timeout=30)
                        out.append((grpc.StatusCode.OK, ""))
                    except grpc.aio.AioRpcError as e:
                        out.append((e.code(), e.details() or ""))
        finally:
            await server.stop(None)
            await servicer.prompts.aclose()
            servicer.close()
            await channel.close()
            await engine.stop(None)
        return out

    fits, over, huge = asyncio.run(main())
    assert fits == (grpc.StatusCode.INVALID_ARGUMENT, f"prompt: is {MAX_CHARS + 1} characters; at most {MAX_CHARS} "
                                                      "can fit in the model's context (max_model_len × the longest "
                                                      "token's bytes)")
    assert over[0] is grpc.StatusCode.RESOURCE_EXHAUSTED and str(limit) in over[1]
    assert huge[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
