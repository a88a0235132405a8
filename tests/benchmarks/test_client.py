from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable

import httpx

from benchmarks.client import SseDecoder, StreamChunk, Target, parse_chunk, send_request
from benchmarks.metrics import RequestResult
from benchmarks.workload import RequestSpec

SPEC = RequestSpec(index=3, prompt="3 the of", prompt_len=4, output_len=2)


def feed_all(lines: list[str]) -> list[str]:
    decoder = SseDecoder()
    events = [d for line in lines if (d := decoder.feed(line)) is not None]
    tail = decoder.flush()
    return events + ([tail] if tail is not None else [])


def test_sse_decoder_skips_comments_and_joins_multiline_data() -> None:
    lines = [": keep-alive", "", "data: {\"a\": 1}", "", "event: message", "id: 7", "data: x", "data:y", "",
             ": ping - 2024-01-01", "data: [DONE]", ""]
    assert feed_all(lines) == ['{"a": 1}', "x\ny", "[DONE]"]


def test_sse_decoder_flushes_an_unterminated_event() -> None:
    assert feed_all(["data: last"]) == ["last"]
    assert feed_all([": only a comment", ""]) == []


def test_parse_chunk_shapes() -> None:
    assert parse_chunk(" [DONE]") == StreamChunk(done=True)
    assert parse_chunk(json.dumps({"choices": [{"index": 0, "text": " Paris"}]})) == StreamChunk(text=" Paris")
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert parse_chunk(json.dumps(role_only)) == StreamChunk(text="")
    assert parse_chunk(json.dumps({"choices": [{"delta": {"content": "Hi"}}], "usage": None})) == StreamChunk(text="Hi")
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    assert parse_chunk(json.dumps(usage)) == StreamChunk(prompt_tokens=9, completion_tokens=4)
    assert parse_chunk(json.dumps({"error": {"message": "queue full"}})) == StreamChunk(error="queue full")


def test_request_bodies() -> None:
    t = Target(base_url="http://127.0.0.1:1/v1/", model="m", api_key="k", logit_bias_eos_ids=(0, 2),
               extra_body={"top_k": 1})
    assert t.url == "http://127.0.0.1:1/v1/completions"
    assert t.headers() == {"Authorization": "Bearer k"}
    assert t.body(SPEC) == {"model": "m", "prompt": "3 the of", "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True,
                            "logit_bias": {"0": -100, "2": -100}, "top_k": 1}
    chat = Target(base_url="http://h/v1", model="m", endpoint="chat", ignore_eos=False)
    assert chat.url == "http://h/v1/chat/completions" and chat.headers() == {}
    assert chat.body(SPEC) == {"model": "m", "messages": [{"role": "user", "content": "3 the of"}],
                               "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
                               "temperature": 0.0}


def run_send(handler: Callable[[httpx.Request], httpx.Response]) -> RequestResult:
    """send_request against a mock transport, with a clock that ticks 1.0 per reading."""
    ticks = itertools.count()

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, Target(base_url="http://test/v1", model="m"), SPEC,
                                      clock=lambda: float(next(ticks)))
    return asyncio.run(go())


def sse(*events: str) -> bytes:
    return "".join(f"{e}\r\n\r\n" for e in events).encode()


def test_send_request_times_content_chunks_and_reads_usage() -> None:
    body = sse(": ping", 'data: {"choices":[{"text":"a"}]}', 'data: {"choices":[{"text":""}]}',
               'data: {"choices":[{"text":"b"}]}',
               'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5}}', "data: [DONE]")
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = run_send(handler)
    # Clock readings: start=0, then one per line; line 4 ends event "a", line 8 the empty-text chunk,
    # line 10 ends "b", line 12 usage and line 14 [DONE], which ends the request.
    assert r == RequestResult(prompt_tokens=9, start=0.0, chunk_times=(4.0, 8.0), end=12.0, output_tokens=5)
    assert seen[0]["max_tokens"] == 2 and seen[0]["stream"] is True


def test_send_request_counts_chunks_without_usage() -> None:
    body = sse('data: {"choices":[{"delta":{"role":"assistant"}}]}', 'data: {"choices":[{"delta":{"content":"x"}}]}',
               'data: {"choices":[{"delta":{"content":"y"}}]}')  # no usage, no [DONE]
    r = run_send(lambda _: httpx.Response(200, content=body))
    assert r.success and r.output_tokens == 2 and r.prompt_tokens == SPEC.prompt_len
    assert r.chunk_times == (4.0, 6.0) and r.end == 7.0  # closed stream: the clock read after the loop


def test_send_request_errors_never_raise() -> None:
    r = run_send(lambda _: httpx.Response(503, json={"error": {"message": "busy"}}))
    assert r.error == 'HTTP 503: {"error":{"message":"busy"}}' and r.output_tokens == 0

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert run_send(refuse).error == "ConnectError: refused"
    assert run_send(lambda _: httpx.Response(200, content=sse("data: [DONE]"))).error == "no content in the stream"
    err = run_send(lambda _: httpx.Response(200, content=sse('data: {"choices":[{"text":"a"}]}',
                                                                 'data: {"error":{"message":"engine died"}}')))
    assert err.error == "engine died" and err.chunk_times == (2.0,)
