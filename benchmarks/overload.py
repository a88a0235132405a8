"""Overload sweep: TTFT of admitted requests, refusals and throughput at 0.5x, 1x, 2x and 4x the sustainable rate, with
the engine's first-token-wait bound (``--max-expected-ttft-ms``) on and off.

The sustainable rate is measured first in the same run, on the same stack: ``max_num_seqs`` closed-loop clients each
send the next request when the last ends, so the batch stays full; their completions per second (clients over mean
latency) are what the stack sustains. Each load point then offers Poisson arrivals (seeded) at a multiple of it for
``--duration`` seconds, streamed, and waits for every request to end. Per point: requests offered, admitted (200),
refused (429, each checked for ``Retry-After`` and an OpenAI error body), other failures, TTFT p50/p99 of the
admitted (client side: request sent to first streamed token), and completed throughput (completions of the point's
requests over the time from its first arrival to its last completion).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.overload --bound-ms 1500 \
        --serve-flag=--kv-cache-memory --serve-flag=256MiB --out benchmarks/results/overload.json

(the stack the end-to-end test serves: ``OMP_WAIT_POLICY=PASSIVE`` for every process, as tests/conftest.py sets it,
and a 256 MiB KV cache. Without both, on the shared 2-core machine of docs/benchmarks.md, the same stack sustained
5-10x fewer requests per second; which of the two mattered was not measured.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from common.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)


@dataclass
class Outcome:
    """One request: when it was sent (seconds from the run's start), how it ended, what the client saw."""

    sent: float
    status: int
    ttft: float | None = None    # seconds from sending to the first streamed token (admitted ones)
    ended: float | None = None   # seconds from the run's start to the end of the stream or the refusal
    retry_after: str | None = None
    error: dict[str, Any] | None = None
    tokens: int = 0              # completion tokens, from the stream's usage


def body(model: str, index: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": f"Request {index}: tell me a story about the sea", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], t0: float) -> Outcome:
    """One streamed completion; a refusal is read as its status, ``Retry-After`` and JSON body."""
    sent = time.monotonic()
    out = Outcome(sent - t0, 0)
    try:
        async with client.stream("POST", url, json=payload) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.retry_after = r.headers.get("retry-after")
                raw = await r.aread()
                try:
                    out.error = json.loads(raw).get("error")
                except ValueError:
                    out.error = {"message": raw.decode(errors="replace")}
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        out.status, out.error = 500, chunk["error"]
                        break
                    if out.ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        out.ttft = time.monotonic() - sent
                    if chunk.get("usage"):
                        out.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        out.status, out.error = -1, {"message": repr(e)}
    out.ended = time.monotonic() - t0
    return out


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=300, trust_env=False,
                             limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))


async def sustainable_rate(base_url: str, model: str, concurrency: int, duration: float, max_tokens: int,
                           headers: dict[str, str] | None = None) -> float:
    """Completions per second of ``concurrency`` closed-loop clients, each sending its next request when the last
    ends, for ``duration`` seconds after a first round that warms the batch up: by Little's law, ``concurrency``
    over the mean latency of the requests sent in that time (every one counts, so a window holding only a few
    completions per client still measures)."""
    url = f"{base_url}/v1/completions"
    latencies: list[float] = []
    async with client() as http:
        http.headers.update(headers or {})
        t0 = time.monotonic()
        await asyncio.gather(*(send(http, url, body(model, -1 - i, max_tokens), t0) for i in range(concurrency)))
        start = time.monotonic()

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() - start < duration:
                out = await send(http, url, body(model, 10_000 * (w + 1) + i, max_tokens), start)
                if out.status == 200 and out.ended is not None:
                    latencies.append(out.ended - out.sent)
                i += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return concurrency * len(latencies) / sum(latencies) if latencies else 0.0


async def offer(base_url: str, model: str, rate: float, duration: float, max_tokens: int, seed: int = 0,
                headers: dict[str, str] | None = None) -> list[Outcome]:
    """Poisson arrivals at ``rate`` per second for ``duration`` seconds; every request's outcome."""
    url = f"{base_url}/v1/completions"
    rng = random.Random(seed)
    async with client() as http:
        http.headers.update(headers or {})
        t0 = time.monotonic()
        tasks: list[asyncio.Task[Outcome]] = []
        at = rng.expovariate(rate)
        while at < duration:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(http, url, body(model, len(tasks), max_tokens), t0)))
            at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    ttfts = [o.ttft for o in admitted if o.ttft is not None]
    done = [o for o in admitted if o.ended is not None]
    span = (max(o.ended for o in done if o.ended is not None) - min(o.sent for o in outcomes)) if done else 0.0
    return {"offered": len(outcomes), "admitted": len(admitted), "refused": len(refused),
            "failed": len(outcomes) - len(admitted) - len(refused),
            "refusals_well_formed": all(o.retry_after and o.error and {"message", "type", "code"} <= set(o.error)
                                        for o in refused),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "throughput_rps": len(done) / span if span > 0 else 0.0}


@contextmanager
def served(flags: list[str], log: Path) -> Iterator[tuple[str, str]]:
    """``sluice serve`` with ``flags`` on free ports: (base URL, model name) once ready; stopped after."""
    from benchmarks.compare import stop, wait_ready

    port = free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--engine-port", str(free_port()), "--tokenizer-port", str(free_port()),
                                 *flags], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, f"{base}/ready", 600)
        model = httpx.get(f"{base}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        yield base, model
    finally:
        stop(proc)


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "load_avg": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def markdown(runs: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    rows = ["| bound | load | offered rps | offered | admitted | refused (429) | TTFT p50 ms | TTFT p99 ms | "
            "completed rps |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        s = r["summary"]
        rows.append(f"| {r['bound']} | {r['multiplier']}x | {r['rate']:.2f} | {s['offered']} | {s['admitted']} | "
                    f"{s['refused']} | {ms(s['ttft_p50_s'])} | {ms(s['ttft_p99_s'])} | {s['throughput_rps']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bound-ms", type=int, default=1500, help="--max-expected-ttft-ms of the bounded runs")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per load point")
    p.add_argument("--measure", type=float, default=8.0, help="seconds of the sustainable-rate measurement")
    p.add_argument("--multipliers", type=float, nargs="+", default=list(MULTIPLIERS))
    p.add_argument("--serve-flag", action="append", default=[], help="further `sluice serve` flags")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    base_flags = ["--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs), *args.serve_flag]
    log = (args.out.parent if args.out else Path(".")) / "overload-serve.log"
    runs: list[dict[str, Any]] = []
    for bound in (args.bound_ms, None):
        flags = base_flags + ([] if bound is None else ["--max-expected-ttft-ms", str(bound)])
        with served(flags, log) as (base, model):
            rate = asyncio.run(sustainable_rate(base, model, args.max_num_seqs, args.measure, args.max_tokens))
            print(f"bound {bound}: sustainable {rate:.2f} requests/s", flush=True)
            for i, m in enumerate(args.multipliers):
                outcomes = asyncio.run(offer(base, model, m * rate, args.duration, args.max_tokens, seed=i))
                run = {"bound": f"{bound} ms" if bound else "off", "multiplier": m, "rate": m * rate,
                       "sustainable_rps": rate, "summary": summarize(outcomes)}
                runs.append(run)
                print(json.dumps(run), flush=True)
    table = markdown(runs)
    print(table)
    if args.out is not None:
        doc = {"command": " ".join(["python -m benchmarks.overload", *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "config": vars(args) | {"out": str(args.out)}, "runs": runs,
               "table": table}
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
