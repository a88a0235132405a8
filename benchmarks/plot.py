"""Plots of benchmark result files: output throughput and TTFT percentile against load for several
servers on one chart, and latency CDFs.

    python -m benchmarks.plot results/*.json --out results/sweep.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Doc = dict[str, Any]


def load_results(paths: Sequence[str | Path]) -> list[Doc]:
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]


def load_axis(doc: Doc) -> tuple[str, list[float]]:
    """The x of each run: concurrency for closed-loop sweeps, request rate for open loops."""
    runs = doc["runs"]
    if all(r["mode"] == "closed" for r in runs):
        return "concurrency", [float(r["concurrency"]) for r in runs]
    return "request rate (req/s)", [float(r["request_rate"]) for r in runs]


def series(doc: Doc, metric: str, percentile: float) -> list[float | None]:
    """Per run: 'output_throughput' (tok/s) or a latency percentile in ms, e.g. metric='ttft'."""
    if metric == "output_throughput":
        return [r["output_throughput"] for r in doc["runs"]]
    return [r[metric].get(f"p{percentile:g}_ms") for r in doc["runs"]]


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of samples <= each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _latencies(run: Doc, key: str) -> list[float]:
    return [row[key] for row in run.get("requests", []) if row.get(key) is not None]


def plot(docs: Sequence[Doc], out: str | Path, *, percentile: float = 99.0) -> None:
    import matplotlib  # lazily: the benchmark itself does not need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (ax_tput, ax_ttft), (ax_cdf_ttft, ax_cdf_e2e) = axes
    xlabel = "concurrency"
    all_xs: set[float] = set()
    for doc in docs:
        label = doc.get("label", "?")
        xlabel, xs = load_axis(doc)
        all_xs.update(x for x in xs if 0 < x < float("inf"))
        ax_tput.plot(xs, series(doc, "output_throughput", percentile), marker="o", label=label)
        ttft = [float("nan") if v is None else v for v in series(doc, "ttft", percentile)]
        ax_ttft.plot(xs, ttft, marker="o", label=label)
        # CDFs at each server's heaviest load, where systems differ most.
        heaviest = doc["runs"][-1]
        load = f"c={heaviest['concurrency']}" if heaviest["mode"] == "closed" else f"rate={heaviest['request_rate']}"
        for ax, key in ((ax_cdf_ttft, "ttft_ms"), (ax_cdf_e2e, "e2el_ms")):
            values = _latencies(heaviest, key)
            if values:
                ax.step(*cdf(values), where="post", label=f"{label} {load}")
    for ax in (ax_tput, ax_ttft):
        ax.set_xscale("log", base=2)
        if all_xs:  # label the loads measured, not powers of two
            ax.set_xticks(sorted(all_xs), [f"{x:g}" for x in sorted(all_xs)])
            ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_title("Output throughput")
    ax_ttft.set_ylabel(f"TTFT p{percentile:g} (ms)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_title(f"TTFT p{percentile:g}")
    for ax, name in ((ax_cdf_ttft, "TTFT"), (ax_cdf_e2e, "end-to-end latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    machine = docs[0].get("machine", {}) if docs else {}
    fig.suptitle(f"{machine.get('cpu_model') or ''} ({machine.get('cpu_cores')} cores)".strip())
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result JSON files of benchmarks.bench")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--percentile", type=float, default=99.0, help="TTFT percentile to plot against load")
    args = p.parse_args(argv)
    plot(load_results(args.results), args.out, percentile=args.percentile)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
