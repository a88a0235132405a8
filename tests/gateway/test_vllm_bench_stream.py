"""Streams read the way ``vllm bench serve`` reads them, over a real socket with aiohttp.

vLLM's benchmark client (``vllm/benchmarks/lib/endpoint_request_func.py``, ``StreamedResponseHandler`` and
``async_request_openai_completions`` / ``..._chat_completions``) takes each network read from
``response.content.iter_any()``, strips its whitespace, and only then appends it to a buffer that it splits on
blank lines. A read that holds just an SSE comment (``: keep-alive\\n\\n``) loses its separator that way, the
next event is glued to it, and no blank line ever ends that buffer again: the request "never received a valid
chunk". The parser below repeats that algorithm step for step, so these tests fail where vLLM's client does.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from gateway.__main__ import build_parser, settings_from_args
from tests.gateway.conftest import SERVED, GatewayFactory

pytestmark = pytest.mark.anyio


class BenchStreamBuffer:
    """vLLM's StreamedResponseHandler: incremental UTF-8 decode, split on blank lines, and a trailing
    ``data: `` message taken whole when it is ``[DONE]`` or parses as JSON."""

    def __init__(self) -> None:
        self.pending = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, read: bytes) -> list[str]:
        self.pending += self.decoder.decode(read)
        complete = []
        while "\n\n" in self.pending:
            head, self.pending = self.pending.split("\n\n", 1)
            if head.strip():
                complete.append(head.strip())
        if self.pending.startswith("data: "):
            body = self.pending[len("data: "):].strip()
            if body == "[DONE]" or (body and _is_json(body)):
                complete.append(self.pending.strip())
                self.pending = ""
        return complete


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@dataclass
class BenchResult:
    success: bool = False
    text: str = ""
    output_tokens: int | None = None
    chunks: list[str] = field(default_factory=list)


async def bench_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, chat: bool) -> BenchResult:
    """One request as vLLM's request function makes it: a request is a success when at least one chunk with
    ``choices`` was parsed (its TTFT)."""
    result = BenchResult()
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return result
        buffer = BenchStreamBuffer()
        async for read in response.content.iter_any():
            read = read.strip()   # the step that drops a comment's blank line
            if not read:
                continue
            for message in buffer.feed(read):
                if message.startswith(":"):
                    continue
                payload = message.removeprefix("data: ")
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if choices := data.get("choices"):
                    piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                    result.success = True
                    result.text += piece or ""
                    result.chunks.append(payload)
                elif usage := data.get("usage"):
                    result.output_tokens = usage.get("completion_tokens")
    return result


async def burst(url: str, prompts: list[str]) -> list[BenchResult]:
    """Every prompt at once, half as completions and half as chat, each streamed with usage as vLLM asks."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        calls = []
        for i, prompt in enumerate(prompts):
            options = {"model": SERVED, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
            if i % 2:
                calls.append(bench_request(session, f"{url}/v1/chat/completions",
                                           {**options, "messages": [{"role": "user", "content": prompt}]},
                                           chat=True))
            else:
                calls.append(bench_request(session, f"{url}/v1/completions", {**options, "prompt": prompt},
                                           chat=False))
        return list(await asyncio.gather(*calls))


def cli_defaults() -> dict[str, Any]:
    """The stream settings ``sluice gateway`` runs with when given no flags (``sluice serve`` passes none)."""
    defaults = settings_from_args(build_parser().parse_args([]), {})
    return {"keepalive_interval": defaults.keepalive_interval, "first_event_timeout": defaults.first_event_timeout}


# One multiplexing mode is enough here: the waits are the gateway's, not the backend call's.
@pytest.mark.parametrize("tokenizer_mux", [True], ids=["mux"])
async def test_vllm_bench_parser_completes_every_request_of_a_burst_queued_past_5s(
        make_gateway: GatewayFactory) -> None:
    """Every request waits 5.5 s for its first token (as a burst queued behind a full batch does): longer than
    the 5 s keep-alive interval the gateway used to default to, and than the wait before its 200 is sent."""
    prompts = ["slow:5.5"] * 4 + ["gap:0.3"] * 2
    async with make_gateway(live=True, **cli_defaults()) as gw:
        results = await burst(gw.url, prompts)
    assert [r.success for r in results] == [True] * len(prompts)
    assert [r.text for r in results] == ["Hello world"] * len(prompts)
    assert [r.output_tokens for r in results] == [3] * len(prompts)


async def test_opt_in_keepalives_break_the_vllm_bench_parser(make_gateway: GatewayFactory) -> None:
    """Why keep-alive is off by default: with comments on, vLLM's client loses these streams (and the parser
    above is faithful enough to show it)."""
    prompts = ["slow:0.6"] * 3 + ["gap:0.3"] * 3
    async with make_gateway(live=True, keepalive_interval=0.05) as gw:
        results = await burst(gw.url, prompts)
    assert [r.text == "Hello world" for r in results] == [False] * len(prompts)
