from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence

import aiohttp
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from benchmarks.client import LineSplitter, SseDecoder, StreamChunk, Target, make_client, parse_chunk, send_request
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


def test_line_splitter_joins_lines_across_reads_and_drops_crlf() -> None:
    lines = LineSplitter()
    assert lines.feed(b"data: a\r\n\r\nda") == ["data: a", ""]
    assert lines.feed(b"ta: b\r") == []
    assert lines.feed(b"\n\ndata: \xc3") == ["data: b", ""]  # the CRLF split between reads
    assert lines.feed(b"\xa9t\xc3\xa9\n") == ["data: \u00e9t\u00e9"]  # and a two-byte character
    assert lines.feed(b"data: " + b"x" * 100_000) == []
    assert lines.feed(b"y\n: ping\ndata: end") == ["data: " + "x" * 100_000 + "y", ": ping"]
    assert lines.flush() == "data: end" and lines.flush() is None


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


STALL = None  # in a scripted response: stop sending without closing


def run_send(parts: Sequence[bytes | None], status: int = 200, timeout_s: float | None = 10.0
             ) -> tuple[RequestResult, list[dict[str, object]]]:
    """send_request against a server that writes ``parts`` one network read apart: it sends part i once
    the client's clock has been read i times since the start, i.e. once the client has timed part i - 1.
    The clock ticks 1.0 per reading (start = 0.0), so a part's events are stamped with its number + 1."""
    readings = 0
    bodies: list[dict[str, object]] = []

    def clock() -> float:
        nonlocal readings
        readings += 1
        return float(readings - 1)

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        bodies.append(await request.json())
        if status != 200:
            return web.Response(status=status, body=b"".join(p or b"" for p in parts))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, part in enumerate(parts):
            while readings < i + 1:  # no timing: wait until the client has read the previous part
                await asyncio.sleep(0.001)
            if part is STALL:
                await asyncio.sleep(3600)
            else:
                await resp.write(part)
        await resp.write_eof()
        return resp

    async def go() -> RequestResult:
        async with RawTestServer(handler) as server, make_client(timeout_s) as client:
            return await send_request(client, Target(base_url=str(server.make_url("/v1")), model="m"), SPEC,
                                      clock=clock)
    return asyncio.run(go()), bodies


def event(data: str) -> bytes:
    return f"data: {data}\r\n\r\n".encode()


TEXT_A, TEXT_B = '{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b"}]}'
USAGE = '{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5}}'


def test_send_request_stamps_each_event_with_the_read_that_completed_it() -> None:
    parts = [b": ping\r\n\r\n", event(TEXT_A), event('{"choices":[{"text":""}]}'), event(TEXT_B) + event(USAGE),
             event("[DONE]")]
    r, bodies = run_send(parts)
    # Readings: start 0, then one per part; "b" and the usage share part 3's; [DONE] ends the request.
    assert r == RequestResult(prompt_tokens=9, start=0.0, chunk_times=(2.0, 4.0), end=5.0, output_tokens=5)
    assert bodies[0]["max_tokens"] == 2 and bodies[0]["stream"] is True and bodies[0]["prompt"] == SPEC.prompt


def test_send_request_parses_an_event_split_across_reads_once_at_the_later_read() -> None:
    a = event(TEXT_A)
    parts = [a[:10], a[10:-3], a[-3:] + event(TEXT_B)[:-1], b"\n"]  # the last cut inside "\r\n\r\n"
    r, _ = run_send(parts)
    assert r.success and r.chunk_times == (3.0, 4.0) and r.output_tokens == 2
    assert r.end == 5.0  # no [DONE]: the clock read after the stream closed


def test_send_request_parses_events_over_64_kib() -> None:
    # 2 MB: over what aiohttp's readline takes in any version (128 KiB in 3.8, 512 KiB in 3.14).
    big = json.dumps({"choices": [{"text": "x" * 2_000_000}]})
    r, _ = run_send([event(big), event(TEXT_B) + event(USAGE) + event("[DONE]")])
    assert r.error is None and len(r.chunk_times) == 2 and r.output_tokens == 5


def test_send_request_counts_chunks_without_usage_and_flushes_an_unterminated_event() -> None:
    parts = [event('{"choices":[{"delta":{"role":"assistant"}}]}'), event('{"choices":[{"delta":{"content":"x"}}]}'),
             b'data: {"choices":[{"delta":{"content":"y"}}]}']  # no usage, no [DONE], no final blank line
    r, _ = run_send(parts)
    assert r.success and r.output_tokens == 2 and r.prompt_tokens == SPEC.prompt_len
    assert r.chunk_times == (2.0, 4.0) and r.end == 5.0  # "y" and the end: clock reads after the stream closed


def test_send_request_http_errors_become_the_result_error() -> None:
    r, _ = run_send([b'{"error":{"message":"boom"}}'], status=500)
    assert r.error == 'HTTP 500: {"error":{"message":"boom"}}' and r.output_tokens == 0 and not r.success
    r, _ = run_send([b"x" * 1000], status=503)
    assert r.error == "HTTP 503: " + "x" * 200


def test_send_request_stream_problems_become_the_result_error() -> None:
    assert run_send([event("[DONE]")])[0].error == "no content in the stream"
    r, _ = run_send([event(TEXT_A), event('{"error":{"message":"engine died"}}')])
    assert r.error == "engine died" and r.chunk_times == (1.0,)
    r, _ = run_send([event(TEXT_A), event("{not json")])
    assert r.error is not None and r.error.startswith("JSONDecodeError: ")
    r, _ = run_send([event(TEXT_A), STALL], timeout_s=0.5)  # make_client's total timeout
    assert r.error is not None and "Timeout" in r.error and r.chunk_times == (1.0,)


def test_send_request_to_a_closed_port_becomes_the_result_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> RequestResult:
        async with make_client(5.0) as client:
            return await send_request(client, Target(base_url=f"http://127.0.0.1:{port}/v1", model="m"), SPEC)
    r = asyncio.run(go())
    assert r.error is not None and r.error.startswith("ClientConnectorError: ") and r.output_tokens == 0


def test_make_client_has_no_connection_cap_no_env_proxies_and_a_total_timeout() -> None:
    async def go() -> None:
        async with make_client(12.5) as client:
            assert isinstance(client.connector, aiohttp.TCPConnector) and client.connector.limit == 0
            assert client.trust_env is False
            assert client.timeout == aiohttp.ClientTimeout(total=12.5, connect=30.0)
        async with make_client(None) as client:
            assert client.timeout == aiohttp.ClientTimeout(total=None, connect=30.0)
    asyncio.run(go())
