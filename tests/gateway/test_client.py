"""The gRPC client: channel targets, message conversion, status mapping, balancing."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backend import (
    ChatTurn,
    FinishReason,
    GenerationParams,
    Prompt,
    PromptTokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from gateway.client import GrpcBackend, delta_from_pb, generate_request_to_pb, grpc_target
from gateway.errors import BackendError, BackendErrorKind
from proto.sluice.v1 import common_pb2, generation_pb2
from tests.gateway.fakes import FakeServer, start_fake_server


def test_targets() -> None:
    assert grpc_target(["127.0.0.1:5001", "127.0.0.1:5002"]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert grpc_target(["tokenizer:5001"]) == "dns:///tokenizer:5001"
    assert grpc_target([" dns:///tok.svc:5001 "]) == "dns:///tok.svc:5001"
    assert grpc_target(["ipv4:10.0.0.1:1,10.0.0.2:1"]) == "ipv4:10.0.0.1:1,10.0.0.2:1"
    assert grpc_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    assert grpc_target(["localhost:1", "127.0.0.2:2"]) == "ipv4:127.0.0.1:1,127.0.0.2:2"


@pytest.mark.parametrize("addrs", [[], ["", " "], ["127.0.0.1:1", "[::1]:2"], ["127.0.0.1:1", "noport"]])
def test_bad_targets(addrs: list[str]) -> None:
    with pytest.raises(ValueError):
        grpc_target(addrs)


def test_defaults_leave_optional_fields_unset() -> None:
    req = generate_request_to_pb(Prompt(text="hi"), GenerationParams(), "rid")
    assert req.request_id == "rid" and req.text == "hi" and req.n == 1
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed"):
        assert not req.sampling.HasField(name), name
    assert not req.stopping.HasField("max_tokens")
    assert not req.response.HasField("skip_special_tokens")
    assert not req.response.logprobs and req.response.top_logprobs == 0
    assert not req.response.HasField("stream_interval")


def test_every_parameter_is_converted() -> None:
    params = GenerationParams(n=3, temperature=0.0, top_p=0.5, top_k=4, min_p=0.05, presence_penalty=1.0,
                              frequency_penalty=-1.0, repetition_penalty=1.1, logit_bias={5: -1.5}, seed=-3,
                              max_tokens=9, min_tokens=2, stop=("a", "b"), stop_token_ids=(1, 2), ignore_eos=True,
                              include_stop_str_in_output=True, skip_special_tokens=False, logprobs=True,
                              top_logprobs=4, echo=True, stream_interval=5)
    req = generate_request_to_pb(Prompt(token_ids=(7, 8)), params, "r")
    assert list(req.token_ids.ids) == [7, 8] and req.n == 3
    s = req.sampling
    assert s.HasField("temperature") and s.temperature == 0.0  # greedy is a value, not "unset"
    assert (s.top_p, s.top_k, s.seed) == (0.5, 4, -3)
    assert s.min_p == pytest.approx(0.05) and s.repetition_penalty == pytest.approx(1.1)
    assert (s.presence_penalty, s.frequency_penalty) == (1.0, -1.0)
    assert dict(s.logit_bias) == {5: -1.5}
    st = req.stopping
    assert (st.max_tokens, st.min_tokens, list(st.stop), list(st.stop_token_ids)) == (9, 2, ["a", "b"], [1, 2])
    assert st.ignore_eos and st.include_stop_str_in_output
    r = req.response
    assert r.HasField("skip_special_tokens") and not r.skip_special_tokens
    assert r.logprobs and r.top_logprobs == 4 and r.echo
    assert r.HasField("stream_interval") and r.stream_interval == 5


def test_chat_prompt_is_converted() -> None:
    prompt = Prompt(chat=(ChatTurn("system", "s"), ChatTurn("user", "u", "bob")), add_generation_prompt=False)
    req = generate_request_to_pb(prompt, GenerationParams(), "r")
    assert [(m.role, m.content, m.HasField("name")) for m in req.chat.messages] == [
        ("system", "s", False), ("user", "u", True)]
    assert req.chat.messages[1].name == "bob"
    assert req.chat.HasField("add_generation_prompt") and not req.chat.add_generation_prompt


@pytest.mark.parametrize(("pb", "reason"), [
    (common_pb2.FINISH_REASON_UNSPECIFIED, None),
    (common_pb2.FINISH_REASON_STOP, FinishReason.STOP),
    (common_pb2.FINISH_REASON_LENGTH, FinishReason.LENGTH),
    (common_pb2.FINISH_REASON_EOS, FinishReason.EOS),
    (common_pb2.FINISH_REASON_STOP_STRING, FinishReason.STOP_STRING),
    (common_pb2.FINISH_REASON_ABORTED, FinishReason.ABORTED),
    (common_pb2.FINISH_REASON_TIME_LIMIT, FinishReason.TIME_LIMIT),
    (common_pb2.FINISH_REASON_ERROR, FinishReason.ERROR),
    (common_pb2.FINISH_REASON_TOOL_CALLS, FinishReason.TOOL_CALLS),
])
def test_finish_reasons(pb: int, reason: FinishReason | None) -> None:
    assert delta_from_pb(generation_pb2.GenerateResponse(finish_reason=pb)).finish_reason is reason


def test_openai_finish_reasons() -> None:
    assert [r.openai for r in FinishReason] == ["stop", "length", "stop", "stop", "abort", "length", "error",
                                              "tool_calls"]


def test_delta_conversion() -> None:
    msg = generation_pb2.GenerateResponse(index=2, text="ab", token_ids=[4, 5], stop_token_id=9,
                                          finish_reason=common_pb2.FINISH_REASON_STOP,
                                          usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=4,
                                                                 cached_tokens=1))
    lp = msg.logprobs.add(token_id=4, text="a", text_bytes=b"a", logprob=-0.25)
    lp.top_logprobs.add(token_id=6, text="c", text_bytes=b"c", logprob=-2.0)
    d = delta_from_pb(msg)
    assert (d.index, d.text, d.token_ids, d.stop_reason) == (2, "ab", (4, 5), 9)
    assert d.usage == Usage(3, 4, 1)
    assert d.logprobs[0].token_id == 4 and d.logprobs[0].top[0].text == "c"
    assert delta_from_pb(generation_pb2.GenerateResponse(stop_string="END")).stop_reason == "END"
    assert delta_from_pb(generation_pb2.GenerateResponse()).stop_reason is None


def test_delta_tool_calls_and_prompt_logprobs() -> None:
    msg = generation_pb2.GenerateResponse(tool_calls=[
        generation_pb2.ToolCallDelta(index=1, id="c1", name="f", arguments='{"a"'),
        generation_pb2.ToolCallDelta(index=1, arguments=": 1}")])
    first = msg.prompt_logprobs.add(token_id=5, text="Hi")
    second = msg.prompt_logprobs.add(token_id=6, text="!", logprob=-0.5)
    second.top_logprobs.add(token_id=7, text="?", text_bytes=b"?", logprob=-0.25)
    d = delta_from_pb(msg)
    assert d.tool_calls == (ToolCallDelta(1, "c1", "f", '{"a"'), ToolCallDelta(1, "", "", ": 1}"))
    assert d.prompt_logprobs == (PromptTokenLogprob(5, "Hi", None),
                                 PromptTokenLogprob(6, "!", -0.5, (TopLogprob(7, "?", b"?", -0.25),)))
    assert not first.HasField("logprob")


pytest_anyio = pytest.mark.anyio


@pytest_anyio
@pytest.mark.parametrize(("code", "kind"), [
    ("INVALID_ARGUMENT", BackendErrorKind.INVALID_ARGUMENT),
    ("FAILED_PRECONDITION", BackendErrorKind.FAILED_PRECONDITION),
    ("ALREADY_EXISTS", BackendErrorKind.ALREADY_EXISTS),
    ("RESOURCE_EXHAUSTED", BackendErrorKind.RESOURCE_EXHAUSTED),
    ("UNAVAILABLE", BackendErrorKind.UNAVAILABLE),
    ("DEADLINE_EXCEEDED", BackendErrorKind.DEADLINE_EXCEEDED),
    ("NOT_FOUND", BackendErrorKind.NOT_FOUND),
    ("INTERNAL", BackendErrorKind.INTERNAL),
    ("PERMISSION_DENIED", BackendErrorKind.INTERNAL),
])
@pytest.mark.parametrize("mux", [False, True], ids=["call", "mux"])
async def test_status_codes_become_backend_errors(fake_server: FakeServer, code: str, kind: BackendErrorKind,
                                                  mux: bool) -> None:
    backend = GrpcBackend.connect([fake_server.address], mux=mux)
    try:
        call = backend.generate(Prompt(text=f"abort:{code}:why"), GenerationParams(), request_id="r1", timeout=5)
        with pytest.raises(BackendError) as info:
            async for _ in call:
                pass
        assert info.value.kind is kind and info.value.message == "why"
        assert fake_server.servicer.request_ids == ["r1"]
    finally:
        await backend.close()


@pytest_anyio
async def test_round_robin_over_every_address() -> None:
    servers = [await start_fake_server() for _ in range(2)]
    backend = GrpcBackend.connect([s.address for s in servers])
    try:
        for _ in range(10):
            deltas = [d async for d in backend.generate(Prompt(text="x"), GenerationParams(), request_id="r",
                                                        timeout=5)]
            assert "".join(d.text for d in deltas) == "Hello world"
        counts = [len(s.servicer.generate_requests) for s in servers]
        assert sum(counts) == 10 and min(counts) >= 3, counts
        assert await backend.check_ready(timeout=2)
    finally:
        await backend.close()
        for s in servers:
            await s.server.stop(0)


@pytest_anyio
@pytest.mark.parametrize("mux", [False, True], ids=["call", "mux"])
async def test_cancel_reaches_the_server(fake_server: FakeServer, mux: bool) -> None:
    backend = GrpcBackend.connect([fake_server.address], mux=mux)
    try:
        call = backend.generate(Prompt(text="stall"), GenerationParams(), request_id="r", timeout=None)
        async for delta in call:
            assert delta.text == "Hel"
            call.cancel()
            break
        await asyncio.wait_for(fake_server.servicer.cancelled.wait(), 10)
    finally:
        await backend.close()


@pytest_anyio
async def test_mux_carries_concurrent_requests_on_one_stream_in_batched_messages(fake_server: FakeServer) -> None:
    backend = GrpcBackend.connect([fake_server.address], mux=True)
    try:
        async def one(i: int) -> str:
            call = backend.generate(Prompt(text="gap:0.01"), GenerationParams(n=2), request_id=f"r{i}",
                                    timeout=None)
            return "".join(d.text for d in [d async for d in call] if d.index == 0)

        texts = await asyncio.gather(*(one(i) for i in range(8)))
        assert texts == ["Hello world"] * 8
        servicer = fake_server.servicer
        starts = [r for r in servicer.stream_requests if r.WhichOneof("action") == "generate"]
        assert sorted(r.generate.request_id for r in starts) == [f"r{i}" for i in range(8)]
        # 8 requests x (6 deltas + an end): far fewer messages than items, the deltas of one step together.
        assert servicer.stream_messages < 8 * 7 / 2, servicer.stream_messages
    finally:
        await backend.close()


@pytest_anyio
async def test_mux_balances_over_every_address() -> None:
    servers = [await start_fake_server() for _ in range(2)]
    backend = GrpcBackend.connect([s.address for s in servers], mux=True)
    try:
        for _ in range(6):  # one at a time: taken in turn
            deltas = [d async for d in backend.generate(Prompt(text="x"), GenerationParams(), request_id="r",
                                                        timeout=5)]
            assert "".join(d.text for d in deltas) == "Hello world"
        assert [len(s.servicer.generate_requests) for s in servers] == [3, 3]
        stalled = [backend.generate(Prompt(text="stall"), GenerationParams(), request_id=f"s{i}", timeout=None)
                   for i in range(4)]  # held open: each goes where fewer are open
        for call in stalled:
            async for _ in call:
                break
        assert [len(s.servicer.generate_requests) for s in servers] == [5, 5]
        for call in stalled:
            call.cancel()
    finally:
        await backend.close()
        for s in servers:
            await s.server.stop(0)


@pytest_anyio
async def test_mux_stream_failure_fails_its_open_requests_and_the_next_request_opens_a_new_stream(
        fake_server: FakeServer) -> None:
    backend = GrpcBackend.connect([fake_server.address], mux=True)
    try:
        # Connected first: the connection's health watch (a call the fake server runs as a task) stays open.
        await backend.model_info(timeout=5)
        await asyncio.sleep(0.2)
        tasks_before = len(asyncio.all_tasks())
        open_call = backend.generate(Prompt(text="stall"), GenerationParams(), request_id="a", timeout=None)
        async for delta in open_call:
            assert delta.text == "Hel"
            break
        failing = backend.generate(Prompt(text="streamfail:INTERNAL"), GenerationParams(), request_id="b",
                                   timeout=None)
        for call in (open_call, failing):
            with pytest.raises(BackendError) as info:
                async for _ in call:
                    pass
            # The requests did not cause the stream's failure: unavailable (a 503 to retry), not a 500.
            assert info.value.kind is BackendErrorKind.UNAVAILABLE and "INTERNAL" in info.value.message
        await asyncio.sleep(0.2)
        assert len(asyncio.all_tasks()) == tasks_before  # the failed call's reader and request writer ended
        deltas = [d async for d in backend.generate(Prompt(text="x"), GenerationParams(), request_id="c",
                                                    timeout=5)]
        assert "".join(d.text for d in deltas) == "Hello world"
    finally:
        await backend.close()


@pytest_anyio
async def test_mux_deadline_ends_the_request_and_cancels_it_on_the_stream(fake_server: FakeServer) -> None:
    backend = GrpcBackend.connect([fake_server.address], mux=True)
    try:
        call = backend.generate(Prompt(text="stall"), GenerationParams(), request_id="r", timeout=1.0)
        got = []
        with pytest.raises(BackendError) as info:
            async for delta in call:
                got.append(delta.text)
        assert got == ["Hel"] and info.value.kind is BackendErrorKind.DEADLINE_EXCEEDED
        await asyncio.wait_for(fake_server.servicer.cancelled.wait(), 5)
        sent = fake_server.servicer.stream_requests
        assert sent[0].timeout_ms == 1000 and sent[-1].cancel and sent[-1].id == sent[0].id
    finally:
        await backend.close()


@pytest_anyio
async def test_unary_calls(fake_server: FakeServer) -> None:
    backend = GrpcBackend.connect([fake_server.address])
    try:
        tok = await backend.tokenize(Prompt(text="a b"), add_special_tokens=False, return_token_strs=True,
                                     request_id="r", timeout=5)
        assert (tok.token_ids, tok.max_model_len, tok.token_strs) == ((1, 2), 2048, ("a", "b"))
        sent = fake_server.servicer.unary_requests[-1]
        assert isinstance(sent, generation_pb2.TokenizeRequest)
        assert sent.HasField("add_special_tokens") and not sent.add_special_tokens
        assert await backend.detokenize((3,), request_id="r", timeout=5) == "t3"
        info = await backend.model_info(timeout=5)
        assert (info.model_name, info.max_model_len) == ("fake-model", 2048)
    finally:
        await backend.close()


@pytest_anyio
async def test_readiness_follows_the_health_service(fake_server: FakeServer) -> None:
    backend = GrpcBackend.connect([fake_server.address])
    try:
        assert await backend.check_ready(timeout=2)  # "" SERVING, the Generation service not registered
        await fake_server.set_serving(False, "sluice.v1.Generation")
        assert not await backend.check_ready(timeout=2)  # the named service wins
        await fake_server.set_serving(True, "sluice.v1.Generation")
        await fake_server.set_serving(False, "")
        # The whole server's NOT_SERVING takes it out of the channel's rotation (gRPC health checking watches ""),
        # so no check reaches it: not ready, until it serves again.
        assert await ready_within(backend, False) and await ready_within(backend, False, 0.3)
        await fake_server.set_serving(True, "")
        assert await ready_within(backend, True)
    finally:
        await backend.close()


async def ready_within(backend: GrpcBackend, expected: bool, seconds: float = 2.0) -> bool:
    """Whether ``check_ready`` answers ``expected`` within ``seconds`` (and, for a long wait, still does at its
    end): health news reaches the channel a moment after the server changes."""
    deadline = asyncio.get_running_loop().time() + seconds
    while await backend.check_ready(timeout=1) != expected:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest_anyio
async def test_unhealthy_services_are_skipped_and_a_request_refused_before_its_first_token_moves_on() -> None:
    """Two tokenizer services (two replicas): one reporting NOT_SERVING (its engine is down) gets no new request,
    the gateway stays ready while the other serves; one that fails a request UNAVAILABLE before its first delta
    (it had not yet heard its engine die) has that request move to the other, once; after a delta, or with any
    other error, the error is the request's."""
    servers = [await start_fake_server() for _ in range(2)]
    for mux in (True, False):
        backend = GrpcBackend.connect([s.address for s in servers], mux=mux)
        try:
            await servers[1].set_serving(False)
            assert await ready_within(backend, True)
            before = [len(s.servicer.generate_requests) for s in servers]
            for i in range(6):
                deltas = [d.text async for d in backend.generate(Prompt(text="x"), GenerationParams(),
                                                                 request_id=f"h{i}", timeout=5)]
                assert deltas == ["Hel", "lo", " world"]
            after = [len(s.servicer.generate_requests) for s in servers]
            assert (after[0] - before[0], after[1] - before[1]) == (6, 0), (mux, before, after)
            await servers[1].set_serving(True)
            await servers[0].set_serving(False)
            assert await ready_within(backend, True)
            await servers[1].set_serving(False)
            assert await ready_within(backend, False)   # no replica serves
            await servers[0].set_serving(True)
            await servers[1].set_serving(True)
            assert await ready_within(backend, True)
            # Both healthy: an UNAVAILABLE before the first delta moves on, each service tried once.
            for i in range(4):
                before = [len(s.servicer.generate_requests) for s in servers]
                call = backend.generate(Prompt(text="abort-once:UNAVAILABLE:gone"), GenerationParams(),
                                        request_id=f"f{mux}{i}", timeout=5)
                deltas = [d.text async for d in call]
                assert deltas == ["Hel", "lo", " world"]
                after = [len(s.servicer.generate_requests) for s in servers]
                assert after[0] - before[0] == 1 and after[1] - before[1] == 1, (mux, before, after)
            with pytest.raises(BackendError) as info:   # every service refuses: the last error is the request's
                [d async for d in backend.generate(Prompt(text="abort:UNAVAILABLE:gone"), GenerationParams(),
                                                   request_id="all", timeout=5)]
            assert info.value.kind is BackendErrorKind.UNAVAILABLE and info.value.message == "gone"
            for prompt, kind in (("midfail:UNAVAILABLE", BackendErrorKind.UNAVAILABLE),
                                 ("abort:RESOURCE_EXHAUSTED:full", BackendErrorKind.RESOURCE_EXHAUSTED)):
                before = [len(s.servicer.generate_requests) for s in servers]
                with pytest.raises(BackendError) as info:
                    [d async for d in backend.generate(Prompt(text=prompt), GenerationParams(), request_id="m",
                                                       timeout=5)]
                assert info.value.kind is kind
                after = [len(s.servicer.generate_requests) for s in servers]
                assert sum(after) - sum(before) == 1, (mux, prompt)   # not tried again
        finally:
            await backend.close()
    for s in servers:
        await s.server.stop(0)


@pytest_anyio
async def test_readiness_without_a_health_service_asks_for_the_model() -> None:
    fake = await start_fake_server(with_health=False)
    backend = GrpcBackend.connect([fake.address])
    try:
        assert await backend.check_ready(timeout=2)
        assert len(fake.servicer.unary_requests) == 1
        await fake.server.stop(0)
        assert not await backend.check_ready(timeout=0.5)
    finally:
        await backend.close()
