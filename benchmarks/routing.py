"""Routing across data-parallel replicas: ``kv_aware`` against ``round_robin`` and ``least_loaded`` on a multi-tenant
workload (issue 41's), one ``sluice serve -dp 2`` stack per policy, started in turn with the same settings.

    python -m benchmarks.routing --out routing.json

Each tenant has a system prompt of ``--system-len`` tokens; each request is a tenant's system prompt followed by a
short user turn of its own (``--user-len`` tokens) and asks for ``--output-len`` tokens (streamed, ``ignore_eos``).
Tenants are drawn at random for each request (the same sequence for every policy), ``--concurrency`` clients in a
closed loop. Prompts are token ids (exact lengths). Each replica's KV pool (``--num-kv-blocks``) holds the system
prompts of half the tenants and two more, so a policy that sends every tenant to every replica evicts what it will
need again. Reported per policy: TTFT p50 / p99, output tokens per second, and the hit rate (cached prompt tokens
over prompt tokens, from ``usage.prompt_tokens_details``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.report import machine_info, utc_timestamp
from common.procs import free_port, grpc_serving

POLICIES = ("kv_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class Outcome:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def workload(tenants: int, system_len: int, user_len: int, requests: int, seed: int) -> list[list[int]]:
    """``requests`` prompts: a random tenant's system prompt and a user turn of its own, as token ids."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 49000) for _ in range(system_len)] for _ in range(tenants)]
    return [systems[rng.randrange(tenants)] + [rng.randrange(100, 49000) for _ in range(user_len)]
            for _ in range(requests)]


async def one_request(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int
                      ) -> Outcome:
    """One streamed completion: the time to its first content chunk, to its end, and its usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    async with client.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for line in resp.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            chunk = json.loads(text[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices", ())):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return Outcome((first or end) - start, end - start, usage.get("prompt_tokens", len(prompt)),
                   (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                   usage.get("completion_tokens", 0))


async def closed_loop(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int
                      ) -> tuple[list[Outcome], float]:
    outcomes: list[Outcome] = []
    queue = list(reversed(prompts))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        async def worker() -> None:
            while queue:
                outcomes.append(await one_request(client, url, model, queue.pop(), output_len))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - start


class Stack:
    """``sluice serve`` as a child process on free ports, ready when both engines serve and the gateway does."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self.port, self.engine_port, self.tokenizer_port = free_port(), free_port(), free_port()
        self.flags, self.log = flags, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.model = ""

    def __enter__(self) -> Stack:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "serve", "--port", str(self.port), "--engine-port",
                 str(self.engine_port), "--tokenizer-port", str(self.tokenizer_port), "--engine-metrics-port", "0",
                 *self.flags], stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not (self._ready() and all(grpc_serving(f"127.0.0.1:{self.engine_port + r}", "sluice.v1.Engine")
                                         for r in (0, 1))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sluice serve did not become ready; see {self.log}")
            time.sleep(0.5)
        time.sleep(2.0)   # the tokenizer services have seen both engines (and subscribed to their KV events)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=10) as r:
            self.model = json.load(r)["data"][0]["id"]
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(outcomes: list[Outcome], wall_s: float) -> dict[str, float]:
    ttft = [o.ttft_s * 1e3 for o in outcomes]
    return {"requests": len(outcomes), "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 99),
            "output_tok_s": sum(o.output_tokens for o in outcomes) / wall_s,
            "requests_s": len(outcomes) / wall_s,
            "hit_rate": sum(o.cached_tokens for o in outcomes) / sum(o.prompt_tokens for o in outcomes),
            "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--model", default=None, help="default: Sluice's default model")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="each replica's KV pool (default: half the tenants' system prompts and two more, plus the "
                        "running requests' own blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-flags", default="", help="more `sluice serve` flags, space-separated")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    block = 16
    blocks = args.num_kv_blocks or ((args.tenants // 2 + 2) * (args.system_len // block)
                                    + args.concurrency * ((args.user_len + args.output_len) // block + 2))
    prompts = workload(args.tenants, args.system_len, args.user_len, args.requests, args.seed)
    flags = ["-dp", "2", "--num-threads", "1", "--num-kv-blocks", str(blocks), "--max-num-seqs",
             str(args.concurrency), "--disable-log-stats", *(["--model", args.model] if args.model else []),
             *args.serve_flags.split()]
    results: dict[str, Any] = {"date": utc_timestamp(), "machine": machine_info(), "settings": vars(args),
                               "num_kv_blocks": blocks, "serve_flags": flags, "policies": {}}
    log_dir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    for policy in args.policies.split(","):
        with Stack([*flags, "--routing", policy], log_dir / f"{policy}.log") as stack:
            url = f"http://127.0.0.1:{stack.port}/v1/completions"
            outcomes, wall = asyncio.run(closed_loop(url, stack.model, prompts, args.output_len, args.concurrency))
        results["policies"][policy] = summary = summarize(outcomes, wall)
        print(f"{policy:>13}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p99 {summary['ttft_p99_ms']:.0f} ms, "
              f"{summary['output_tok_s']:.1f} output tok/s, hit rate {summary['hit_rate']:.1%}", flush=True)
        results["policies"][policy]["outcomes"] = [asdict(o) for o in outcomes]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"logs in {log_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
