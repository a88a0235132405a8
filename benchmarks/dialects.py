"""What the REST dialect layer costs: served throughput through TGI's ``POST /generate`` against
``POST /v1/completions``, the same stack, the same workload, in one run.

    python -m benchmarks.dialects --prompts 64 --concurrency 32 --input-tokens 128 --output-tokens 64 \\
        --rounds 3 --out benchmarks/results/dialects.json

One ``sluice serve`` (default model and engine settings of ``benchmarks/overhead.py``); each round runs both
sides, the first one alternating. A side keeps ``--concurrency`` whole (non-streamed) greedy requests in flight
over ``--prompts`` prompts of about ``--input-tokens`` tokens, ``--output-tokens`` at most each: ``openai``
sends ``{"prompt", "max_tokens", "temperature": 0}``, ``tgi`` sends ``{"inputs", "parameters":
{"max_new_tokens", "do_sample": false}}`` (TGI has no ``ignore_eos``, so neither side asks for it). Every run
gets prompts of its own (the prefix cache serves no run from another); its output tokens are the engine's own
count (``vllm:generation_tokens_total`` on the stack's ``/metrics``, before and after), the same counter for both
sides. Before measuring, each side's greedy text of a few prompts is checked to be the other's. With
``--mixed-rounds``, waves of both sides' requests together follow (alternating in one queue, so that they share
every engine step and whatever else loads the machine), and each side's median request latency is compared.

Wall-clock throughput on a shared machine moves with other processes' load; the CPU seconds each process of the
stack spent in a run (``/proc``) do not, so the gateway's CPU per request is reported beside it: the dialect
layer's whole cost is there.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.overhead import EngineSettings, Workload, make_prompts, rest_stack, stack_cpu_s

SIDES = ("openai", "tgi")


@dataclass
class Run:
    side: str
    round: int
    wall_s: float
    requests: int
    output_tokens: int
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process: gateway, tokenizer, engine

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def gateway_ms_per_request(self) -> float:
        return 1000 * self.cpu_s.get("gateway", 0.0) / self.requests


def generation_tokens(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:generation_tokens_total")


def request(side: str, base: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The side's URL and body."""
    if side == "openai":
        return f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0}
    return f"{base}/generate", {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "do_sample": False}}


def text_of(side: str, body: dict[str, Any]) -> str:
    return str(body["choices"][0]["text"] if side == "openai" else body["generated_text"])


async def _drive(sides: list[str], base: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
                 ) -> tuple[list[str], list[float]]:
    """Prompt i through ``sides[i]``, ``concurrency`` at a time, in prompt order; each one's text and latency."""
    import asyncio

    from benchmarks.client import make_client

    texts = [""] * len(prompts)
    latencies = [0.0] * len(prompts)
    todo = list(reversed(range(len(prompts))))
    async with make_client(900) as client:

        async def worker() -> None:
            while todo:
                i = todo.pop()
                url, body = request(sides[i], base, model, prompts[i], max_tokens)
                t0 = time.perf_counter()
                async with client.post(url, json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{sides[i]}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
                    texts[i] = text_of(sides[i], await resp.json())
                latencies[i] = time.perf_counter() - t0

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return texts, latencies


def run_side(side: str, base: str, model: str, prompts: list[str], workload: Workload, round_: int,
             stack_pid: int) -> Run:
    from benchmarks.runner import run_async

    before, cpu_before = generation_tokens(base), stack_cpu_s(stack_pid)
    t0 = time.perf_counter()
    run_async(_drive([side] * len(prompts), base, model, prompts, workload.output_tokens, workload.concurrency))
    wall = time.perf_counter() - t0
    cpu = {role: round(s - cpu_before.get(role, 0.0), 3) for role, s in stack_cpu_s(stack_pid).items()}
    return Run(side, round_, wall, len(prompts), round(generation_tokens(base) - before), cpu)


def run_mixed(base: str, model: str, prompts: list[str], workload: Workload) -> dict[str, float]:
    """One wave of both sides' requests together (alternating), so that they share every engine step and
    whatever else runs on the machine: each side's median latency."""
    from benchmarks.runner import run_async

    sides = [SIDES[i % 2] for i in range(len(prompts))]
    _, latencies = run_async(_drive(sides, base, model, prompts, workload.output_tokens, workload.concurrency))
    return {s: statistics.median(t for t, side in zip(latencies, sides) if side == s) for s in SIDES}


def summarize(runs: list[Run]) -> dict[str, Any]:
    med = {s: statistics.median(r.output_tok_s for r in runs if r.side == s) for s in SIDES}
    gateway = {s: statistics.median(r.gateway_ms_per_request for r in runs if r.side == s) for s in SIDES}
    rounds = sorted({r.round for r in runs})
    per_round = [next(r.output_tok_s for r in runs if r.round == k and r.side == "tgi")
                 / next(r.output_tok_s for r in runs if r.round == k and r.side == "openai") for k in rounds]
    return {"median_output_tok_s": med, "tgi_over_openai_median": med["tgi"] / med["openai"],
            "tgi_over_openai_per_round": per_round, "median_of_round_ratios": statistics.median(per_round),
            "median_gateway_cpu_ms_per_request": gateway}


def markdown(runs: list[Run], summary: dict[str, Any]) -> str:
    lines = ["| round | route | requests | output tokens | wall (s) | output tok/s | gateway CPU ms / request |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        route = "`/v1/completions`" if r.side == "openai" else "`/generate` (TGI)"
        lines.append(f"| {r.round} | {route} | {r.requests} | {r.output_tokens} | {r.wall_s:.2f} | "
                     f"{r.output_tok_s:.1f} | {r.gateway_ms_per_request:.2f} |")
    ratios = ", ".join(f"{x:.3f}" for x in summary["tgi_over_openai_per_round"])
    gateway = summary["median_gateway_cpu_ms_per_request"]
    lines.append(f"\nTGI ÷ OpenAI output tok/s, medians: {summary['tgi_over_openai_median']:.3f}; per round: "
                 f"{ratios} (median {summary['median_of_round_ratios']:.3f}). Gateway CPU per request, medians: "
                 f"OpenAI {gateway['openai']:.2f} ms, TGI {gateway['tgi']:.2f} ms.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dialects", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="each round runs both sides, the first one alternating")
    p.add_argument("--mixed-rounds", type=int, default=0,
                   help="then waves of both sides' requests together, each side's latency compared")
    p.add_argument("--check", type=int, default=4, help="prompts whose greedy text must match across sides")
    p.add_argument("--out", default="benchmarks/results/dialects.json", help="JSON; the .md is written beside it")
    ns = p.parse_args(argv)
    workload = Workload(ns.prompts, ns.input_tokens, ns.output_tokens, ns.concurrency)
    settings = EngineSettings()
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks.runner import run_async
    from engine.config import default_model_path
    from engine.text import Tokenizer

    tokenizer = Tokenizer.from_pretrained(default_model_path())
    doc: dict[str, Any] = {"benchmark": "dialects",
                           "command": " ".join(["python -m benchmarks.dialects", *(argv or sys.argv[1:])]),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
                           "workload": asdict(workload), "engine": asdict(settings)}
    runs: list[Run] = []
    mixed: list[dict[str, float]] = []
    with rest_stack(settings, out.parent) as stack:
        base = stack.base_url.removesuffix("/v1")
        check = make_prompts(tokenizer, Workload(ns.check, ns.input_tokens), "check")
        texts = {s: run_async(_drive([s] * ns.check, base, stack.model, check, ns.output_tokens, ns.check))[0]
                 for s in SIDES}
        if texts["openai"] != texts["tgi"]:
            raise SystemExit(f"the sides' greedy texts differ: {texts}")
        warm = make_prompts(tokenizer, Workload(ns.concurrency, 16), "warm")
        for side in SIDES:
            run_async(_drive([side] * len(warm), base, stack.model, warm, 4, ns.concurrency))
        for r in range(ns.rounds):
            for side in SIDES[r % 2:] + SIDES[:r % 2]:
                prompts = make_prompts(tokenizer, workload, f"run {r} {side}")
                runs.append(run_side(side, base, stack.model, prompts, workload, r, stack.pid))
                x = runs[-1]
                print(f"round {r} {side:6s}: {x.output_tokens} tokens in {x.wall_s:.2f} s = {x.output_tok_s:.1f} "
                      f"tok/s, CPU s {x.cpu_s}", flush=True)
        for r in range(ns.mixed_rounds):
            mixed.append(run_mixed(base, stack.model, make_prompts(tokenizer, workload, f"mixed {r}"), workload))
            print(f"mixed {r}: median latency (s) {mixed[-1]}", flush=True)
    summary = summarize(runs) if runs else {}
    doc.update(runs=[dict(asdict(x), output_tok_s=x.output_tok_s) for x in runs], summary=summary, mixed=mixed)
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    table = markdown(runs, summary) if runs else ""
    if mixed:
        ratios = [m["tgi"] / m["openai"] for m in mixed]
        doc["mixed_latency_ratio_median"] = statistics.median(ratios)
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        table += ("\n\nBoth sides in the same waves, TGI ÷ OpenAI median request latency per wave: "
                  + ", ".join(f"{x:.3f}" for x in ratios) + f" (median {statistics.median(ratios):.3f})")
    out.with_suffix(".md").write_text(f"`{doc['command']}` — {doc['date']}\n\n{table}\n", encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
