"""One streamed request to an OpenAI-compatible server, timed chunk by chunk, and the SSE parsing under it."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from benchmarks.metrics import RequestResult
from benchmarks.workload import RequestSpec

Endpoint = Literal["completions", "chat"]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Target:
    """The server under test and what every request asks of it."""

    base_url: str  # up to and including /v1, e.g. http://127.0.0.1:8000/v1
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    ignore_eos: bool = True  # vLLM extension: generate exactly max_tokens
    # For servers without ignore_eos (llama.cpp): bias these EOS ids to -100 to force the length.
    logit_bias_eos_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    # LoRA adapters (vLLM bench's --lora-modules): request i names lora_modules[i % len] instead of ``model``.
    lora_modules: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        model = self.lora_modules[spec.index % len(self.lora_modules)] if self.lora_modules else self.model
        body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.logit_bias_eos_ids:
            body["logit_bias"] = {str(i): -100 for i in self.logit_bias_eos_ids}
        body.update(self.extra_body)
        return body


class LineSplitter:
    """Cuts a byte stream into lines at b"\\n" (dropping a b"\\r" before it) and decodes each line once it is
    complete, so an event or a UTF-8 character split across network reads comes out whole. No length limit:
    aiohttp's own line reading raises LineTooLong past a cap (128 KiB in 3.8, 512 KiB in 3.14)."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> list[str]:
        """The lines that ``chunk`` completes, without their line endings."""
        self._pending += chunk
        if b"\n" not in chunk:  # look at the new bytes only: a long line arriving in pieces stays linear
            return []
        end = self._pending.rfind(b"\n")
        lines = [_decode_line(line) for line in self._pending[:end].split(b"\n")]
        del self._pending[:end + 1]
        return lines

    def flush(self) -> str | None:
        """The last line when the stream ends without a line ending."""
        if not self._pending:
            return None
        line, self._pending = _decode_line(self._pending), bytearray()
        return line


def _decode_line(line: bytearray) -> str:
    # errors="replace": a stray byte costs one event its text, not the whole request.
    return (line[:-1] if line.endswith(b"\r") else line).decode("utf-8", errors="replace")


class SseDecoder:
    """Turns the lines of a text/event-stream into the data of each event (WHATWG SSE rules):
    ``data:`` lines accumulate until a blank line; comments (``: ping``) and other fields are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line without its line ending; returns an event's data when the line completes one."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None  # keep-alive comment
        name, sep, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """Data pending when the stream ends without a final blank line."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclass(frozen=True)
class StreamChunk:
    """What one SSE event of a completion stream carries."""

    text: str = ""  # content delta; "" for role-only, finish-only and usage chunks
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    done: bool = False  # the [DONE] sentinel


def parse_chunk(data: str) -> StreamChunk:
    """Parse the data of one event of /v1/completions or /v1/chat/completions streaming."""
    if data.strip() == "[DONE]":
        return StreamChunk(done=True)
    obj = json.loads(data)
    if not isinstance(obj, dict):
        return StreamChunk(error=f"unexpected event {data[:100]!r}")
    if obj.get("error"):
        err = obj["error"]
        return StreamChunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    parts = []
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        parts.append(choice.get("text") or delta.get("content") or "")
    usage = obj.get("usage") or {}
    return StreamChunk(text="".join(parts), prompt_tokens=usage.get("prompt_tokens"),
                       completion_tokens=usage.get("completion_tokens"))


class _StreamState:
    """What the events of one response have told so far."""

    def __init__(self) -> None:
        self.chunk_times: list[float] = []
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error: str | None = None
        self.done_at: float | None = None

    def on_event(self, data: str, now: float) -> None:
        chunk = parse_chunk(data)
        if chunk.error is not None:
            self.error = chunk.error
        if chunk.done:
            self.done_at = now
        if chunk.text:
            self.chunk_times.append(now)
        # The last usage seen wins: some servers repeat cumulative usage on every chunk.
        if chunk.prompt_tokens is not None:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.completion_tokens is not None:
            self.completion_tokens = chunk.completion_tokens


async def send_request(client: aiohttp.ClientSession, target: Target, spec: RequestSpec,
                       clock: Clock = time.perf_counter) -> RequestResult:
    """Send one streamed request and time its content chunks; failures become an error, never raise."""
    state = _StreamState()
    start = clock()
    try:
        async with client.post(target.url, json=target.body(spec), headers=target.headers()) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode("utf-8", errors="replace")
                state.error = f"HTTP {resp.status}: {body[:200]}"
            else:
                await _read_events(resp, state, clock)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, OSError) as e:
        state.error = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:200]
    # e2e ends at [DONE] when the server sends it, else when the stream closes.
    end = state.done_at if state.done_at is not None else clock()
    if state.error is None and not state.chunk_times:
        state.error = "no content in the stream"
    return RequestResult(
        prompt_tokens=state.prompt_tokens if state.prompt_tokens is not None else spec.prompt_len,
        start=start, chunk_times=tuple(state.chunk_times), end=end,
        output_tokens=state.completion_tokens if state.completion_tokens is not None else len(state.chunk_times),
        error=state.error)


async def _read_events(resp: aiohttp.ClientResponse, state: _StreamState, clock: Clock) -> None:
    lines, events = LineSplitter(), SseDecoder()
    async for chunk in resp.content.iter_any():
        now = clock()  # once per network read, before parsing: parse time is the client's, not the server's
        for line in lines.feed(chunk):
            data = events.feed(line)
            if data is not None:
                state.on_event(data, now)
    last = lines.flush()
    if last is not None:
        events.feed(last)  # not empty, so it cannot end an event: the flush below does
    tail = events.flush()
    if tail is not None:
        state.on_event(tail, clock())


def make_client(timeout_s: float | None, ca_certs: str | None = None) -> aiohttp.ClientSession:
    """No connection cap (aiohttp defaults to 100, which would throttle concurrency 128), no proxies from
    the environment (a benchmark must reach the server directly), ``timeout_s`` for a whole request
    (None: no limit); HTTPS servers verified against ``ca_certs`` (a PEM file; None: the system's roots).
    Create it inside the event loop that uses it."""
    tls: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_certs) if ca_certs is not None else True
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=tls), trust_env=False,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s, connect=30.0))
