"""Serving benchmark for any OpenAI-compatible server (Sluice, vLLM, llama.cpp), like vLLM's
benchmark_serving: streamed requests, closed-loop concurrency sweeps or Poisson open loop, and a JSON
result that carries the command, machine and per-request latencies.

    python -m benchmarks.bench --base-url http://127.0.0.1:8000/v1 --concurrency 1,8,32 \\
        --num-prompts 64 --input-len 128 --output-len 64 --result-file results/sluice.json
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.client import Target, make_client
from benchmarks.metrics import DEFAULT_PERCENTILES, RequestResult, RunSummary, Slo, parse_slo, summarize
from benchmarks.report import format_summary, machine_info, request_rows, utc_timestamp
from benchmarks.runner import run_async, run_closed_loop, run_open_loop
from benchmarks.workload import (
    RequestSpec,
    TokenCounter,
    approx_token_count,
    load_dataset,
    parse_range,
    poisson_arrivals,
    synthetic_requests,
    tokenizer_counter,
)


@dataclass(frozen=True)
class LoadPoint:
    """One step of a sweep: a closed loop at ``concurrency``, or an open loop at ``request_rate``
    (requests/s, Poisson) with ``concurrency`` as an optional cap on requests in flight."""

    concurrency: int | None
    request_rate: float | None = None

    @property
    def mode(self) -> str:
        return "closed" if self.request_rate is None else "open"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI base URL ('/v1' added if missing)")
    s.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server was started with: requests name them in turn instead of --model")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    s.add_argument("--api-key", default=None)
    s.add_argument("--ca-certs", default=None, metavar="PEM",
                   help="verify an https --base-url against these CA certificates (default: the system's roots)")
    s.add_argument("--label", default=None, help="name of this server in tables and plots")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds a whole request may take")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", default=None,
                      help="closed loop: comma list swept in order (default 1); with --request-rate: cap in flight")
    load.add_argument("--request-rate", default=None, help="open loop: requests/s, Poisson; comma list or inf")
    load.add_argument("--num-prompts", type=int, default=64, help="measured requests per sweep step")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each step")
    load.add_argument("--seed", type=int, default=0)
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (approximate without --tokenizer)")
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--input-len-range", default=None, help="LO:HI uniform prompt lengths (overrides --input-len)")
    w.add_argument("--output-len-range", default=None, help="LO:HI uniform output lengths")
    w.add_argument("--dataset", default=None, help='JSONL of {"prompt": ..., "output_len": ...}')
    w.add_argument("--shared-prefix-groups", type=int, default=0, help="k groups of prompts sharing a prefix")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of each group's prefix")
    w.add_argument("--tokenizer", default=None, help="GGUF/HF dir to size prompts exactly; 'default' = default model")
    r = p.add_argument_group("request")
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos")
    r.add_argument("--force-length-logit-bias", nargs="?", const="0,2", default=None, metavar="EOS_IDS",
                   help="send logit_bias {eos: -100} (servers without ignore_eos; default ids 0,2 = SmolLM2)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    o.add_argument("--percentiles", default="50,90,99")
    o.add_argument("--result-file", default=None)
    o.add_argument("--save-detailed", action="store_true", help="also store every inter-token gap")
    o.add_argument("--disable-tqdm", action="store_true")
    return p


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    conc = [int(c) for c in _floats(args.concurrency)] if args.concurrency else []
    if args.request_rate is None:
        return [LoadPoint(concurrency=c) for c in conc or [1]]
    if len(conc) > 1:
        raise ValueError("with --request-rate, --concurrency is one cap, not a sweep")
    return [LoadPoint(concurrency=conc[0] if conc else None, request_rate=rate)
            for rate in _floats(args.request_rate)]


def make_specs(args: argparse.Namespace, count: TokenCounter, step: int) -> list[RequestSpec]:
    """Warm-up plus measured requests of one sweep step; each step gets fresh indices, so a step never
    hits the prefix cache that an earlier step filled (dataset prompts repeat: they are the user's)."""
    total = args.warmup + args.num_prompts
    if args.dataset:
        return load_dataset(args.dataset, total, count=count, default_output_len=args.output_len)
    in_range = parse_range(args.input_len_range) if args.input_len_range else (args.input_len, args.input_len)
    out_range = parse_range(args.output_len_range) if args.output_len_range else (args.output_len, args.output_len)
    return synthetic_requests(total, in_range, out_range, seed=args.seed + step, count=count,
                              first_index=step * total, shared_prefix_groups=args.shared_prefix_groups,
                              shared_prefix_len=args.shared_prefix_len)


async def resolve_model(client: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    """The first model of GET {base_url}/models; ValueError when the server gives none."""
    url = f"{base_url}/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client.get(url, headers=headers) as resp:
        if resp.status != 200:
            body = (await resp.read()).decode("utf-8", errors="replace")
            raise ValueError(f"GET {url}: HTTP {resp.status}: {body[:200]}")
        doc = await resp.json(content_type=None)  # whatever the content-type header says
    models = doc.get("data") if isinstance(doc, dict) else None
    if not models:
        raise ValueError(f"GET {url}: no models listed; pass --model")
    return str(models[0]["id"])


async def run_point(client: aiohttp.ClientSession, target: Target, point: LoadPoint, specs: list[RequestSpec],
                    warmup: int, seed: int, show_progress: bool) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm

    if warmup:
        await run_closed_loop(client, target, specs[:warmup], point.concurrency or warmup)
    measured = specs[warmup:]
    desc = f"c={point.concurrency}" if point.request_rate is None else f"rate={point.request_rate:g}"
    with tqdm(total=len(measured), desc=desc, disable=not show_progress) as bar:
        def done(_: RequestResult) -> None:
            bar.update(1)
        if point.request_rate is None:
            assert point.concurrency is not None
            return await run_closed_loop(client, target, measured, point.concurrency, on_done=done)
        arrivals = poisson_arrivals(len(measured), point.request_rate, seed)
        return await run_open_loop(client, target, measured, arrivals, max_concurrency=point.concurrency,
                                   on_done=done)


def _target(args: argparse.Namespace, base_url: str, model: str) -> Target:
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    bias_ids = tuple(int(x) for x in args.force_length_logit_bias.split(",")) if args.force_length_logit_bias else ()
    return Target(base_url=base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                  ignore_eos=args.ignore_eos, logit_bias_eos_ids=bias_ids, temperature=args.temperature,
                  extra_body=extra, lora_modules=tuple(args.lora_modules or ()))


async def run_benchmark(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run every step of the sweep; returns the result document (also written to --result-file)."""
    base_url = args.base_url.rstrip("/")
    base_url = base_url if base_url.endswith("/v1") else base_url + "/v1"
    percentiles = _floats(args.percentiles) or list(DEFAULT_PERCENTILES)
    slo: Slo | None = parse_slo(args.goodput) if args.goodput else None
    count = tokenizer_counter(args.tokenizer) if args.tokenizer else approx_token_count
    points = load_points(args)
    async with make_client(args.timeout, args.ca_certs) as client:
        model = args.model or await resolve_model(client, base_url, args.api_key)
        target = _target(args, base_url, model)
        runs = []
        for step, point in enumerate(points):
            specs = make_specs(args, count, step)
            results, duration = await run_point(client, target, point, specs, args.warmup, args.seed + step,
                                                not args.disable_tqdm)
            summary = summarize(results, max(duration, 1e-9), percentiles=percentiles, slo=slo)
            print(format_summary(summary, point.concurrency, point.request_rate), flush=True)
            runs.append(_run_document(point, summary, results, args.save_detailed))
    return {
        "label": args.label or f"{model}@{base_url}",
        "command": shlex.join(["python", "-m", "benchmarks.bench", *argv]),
        "timestamp": utc_timestamp(),
        "machine": machine_info(),
        "config": {"base_url": base_url, "model": model, "endpoint": args.endpoint, "num_prompts": args.num_prompts,
                   "warmup": args.warmup, "seed": args.seed, "input_len": args.input_len,
                   "output_len": args.output_len, "input_len_range": args.input_len_range,
                   "output_len_range": args.output_len_range, "dataset": args.dataset,
                   "shared_prefix_groups": args.shared_prefix_groups, "shared_prefix_len": args.shared_prefix_len,
                   "tokenizer": args.tokenizer, "ignore_eos": target.ignore_eos,
                   "logit_bias_eos_ids": list(target.logit_bias_eos_ids), "temperature": target.temperature,
                   "extra_body": dict(target.extra_body)},
        "slo": None if slo is None else {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms},
        "percentiles": percentiles,
        "runs": runs,
    }


def _run_document(point: LoadPoint, summary: RunSummary, results: list[RequestResult],
                  detailed: bool) -> dict[str, Any]:
    rate = point.request_rate
    return {"mode": point.mode, "concurrency": point.concurrency,
            # JSON has no infinity: "inf" marks an open loop that sends everything at once.
            "request_rate": "inf" if rate is not None and math.isinf(rate) else rate,
            "num_requests": len(results), **summary.to_dict(), "requests": request_rows(results, detailed)}


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when every sweep step completed at least one request, else 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        doc = run_async(run_benchmark(args, argv))
    except (ValueError, OSError, aiohttp.ClientError) as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return 1
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0 if all(run["completed"] > 0 for run in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
