"""Request migration (issue 44): the pause a stream sees when its engine dies and it moves to the other replica.

    python -m benchmarks.migration --out migration.json

One ``sluice serve -dp 2 --routing round_robin`` stack (the default model unless ``--model``); ``--concurrency``
streams at once, each ``--output-len`` tokens (greedy, ``ignore_eos``), every token timed as it arrives. Once every
stream has ``--kill-after`` tokens, replica 0's engine is SIGKILLed; its streams move to replica 1 and go on. For
each stream: its normal gap (median time between tokens before the kill) and its pause (the largest gap between
tokens after the kill). A moved stream is one the tokenizer services logged as moved (its request id). Reported:
the moved streams' pause (median, largest) against the normal gap, the pause of the streams that did not move
(they share the survivor's steps, the moved requests' prefill included), and that every stream ended with all
its tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.report import machine_info, utc_timestamp
from benchmarks.routing import Stack


@dataclass
class StreamTimes:
    request_id: str = ""
    times: list[float] = field(default_factory=list)   # monotonic arrival of each token
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None


async def one_stream(client: aiohttp.ClientSession, url: str, model: str, i: int, output_len: int,
                     out: StreamTimes) -> None:
    body = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out.request_id = f"migration-bench-{i}"   # the id the tokenizer services log
    async with client.post(url, json=body, headers={"x-request-id": out.request_id}) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = line
                continue
            for choice in chunk["choices"]:
                if choice["text"] or choice["finish_reason"] is None:
                    out.times.append(time.monotonic())
                if choice["finish_reason"] is not None:
                    out.finish_reasons.append(choice["finish_reason"])
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]


def engine_pid(stack: Stack) -> int:
    assert stack.proc is not None
    children = subprocess.run(["pgrep", "-P", str(stack.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if argv[1:3] == ["-m", "engine"] and argv[argv.index("--port") + 1] == str(stack.engine_port):
            return int(pid)
    raise LookupError("replica 0's engine not found")


async def run(stack: Stack, ns: argparse.Namespace) -> tuple[list[StreamTimes], float]:
    url = f"http://127.0.0.1:{stack.port}/v1/completions"
    streams = [StreamTimes() for _ in range(ns.concurrency)]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        tasks = [asyncio.ensure_future(one_stream(client, url, stack.model, i, ns.output_len, s))
                 for i, s in enumerate(streams)]
        while not all(len(s.times) >= ns.kill_after for s in streams):
            await asyncio.sleep(0.005)
        killed_at = time.monotonic()
        os.kill(engine_pid(stack), signal.SIGKILL)
        await asyncio.gather(*tasks)
    return streams, killed_at


def gaps(s: StreamTimes, killed_at: float) -> tuple[float, float]:
    """(median gap between tokens before the kill, the largest gap after it: the pause), in seconds. Tokens the
    dead engine had sent before it died may still arrive just after the kill, so the pause is the largest gap
    ending after it, not the one spanning the kill's instant."""
    before = [b - a for a, b in zip(s.times, s.times[1:]) if b < killed_at]
    after = [b - a for a, b in zip(s.times, s.times[1:]) if b > killed_at]
    return statistics.median(before), max(after)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: Sluice's default model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kill-after", type=int, default=32, help="tokens every stream has when the engine dies")
    p.add_argument("--serve-flags", default="", help="more `sluice serve` flags, space-separated")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    ns = p.parse_args(argv)
    flags = ["-dp", "2", "--num-threads", "1", "--routing", "round_robin", "--max-num-seqs", str(ns.concurrency),
             "--disable-log-stats", *(["--model", ns.model] if ns.model else []), *ns.serve_flags.split()]
    log = Path(tempfile.mkdtemp(prefix="migration-bench-")) / "serve.log"
    with Stack(flags, log) as stack:
        streams, killed_at = asyncio.run(run(stack, ns))
        time.sleep(1.0)   # the log lines are written
    moved_ids = set(re.findall(r"request (\S+) moved from", log.read_text()))
    complete = all(s.error is None and s.finish_reasons == ["length"] and s.completion_tokens == ns.output_len
                   for s in streams)
    rows = [(s.request_id in moved_ids, *gaps(s, killed_at)) for s in streams]
    moved = [(normal, across) for was_moved, normal, across in rows if was_moved]
    stayed = [(normal, across) for was_moved, normal, across in rows if not was_moved]
    summary: dict[str, Any] = {
        "streams": len(streams), "moved": len(moved), "all_complete": complete,
        "normal_gap_ms_median": 1000 * statistics.median(n for _, n, _ in rows),
        "moved_pause_ms_median": 1000 * statistics.median(a for _, a in moved) if moved else None,
        "moved_pause_ms_max": 1000 * max(a for _, a in moved) if moved else None,
        "stayed_pause_ms_median": 1000 * statistics.median(a for _, a in stayed) if stayed else None,
    }
    print(json.dumps(summary, indent=1))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"date": utc_timestamp(), "machine": machine_info(), "settings": vars(ns),
                                            "serve_flags": flags, "summary": summary,
                                            "streams": [asdict(s) for s in streams], "killed_at": killed_at},
                                           indent=1))
    print(f"log in {log}", file=sys.stderr)
    return 0 if complete else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
