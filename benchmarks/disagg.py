"""Prefill/decode disaggregation (issue 40): what a decode engine spends to go on with a prompt a prefill engine
computed — pulling the prompt's KV blocks (shared memory on one host, Mooncake over TCP) — against computing the
prompt itself, as a colocated engine (or a decode engine whose pull failed) does. One process, engines in turn.

    python -m benchmarks.disagg --lengths 256 1024 2048 --out benchmarks/results/disagg.json

For each prompt length and transport: a fresh random prompt (no prefix cache hit anywhere) goes to a prefill engine
(``do_remote_decode``: the prompt and its first token), then to a decode engine as prompt + that token, which pulls
the blocks and samples the second token. Measured: the prefill engine's time to its first token, the decode
engine's time from ``add_request`` to its first token (the pull, then the prompt's last partial block and one
token), the pull alone (``sluice:kv_transfer_seconds``) and its bytes per second. The colocated line is one engine
computing the same prompt and sampling two tokens: its time to the second token less its first is a decode step,
and its time to the first is what the decode engine would spend computing the prompt instead of pulling it.
Figures are medians of ``--repeats`` prompts per point.
"""
# ruff: noqa: E402  (the engine's process settings come before torch's import)
from __future__ import annotations

from engine.entrypoints.process import set_openmp_defaults

set_openmp_defaults()   # what the offline LLM does before torch loads

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, default_model_path
from engine.core.engine_core import EngineCore
from engine.core.kv_transfer_params import RemoteKV
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams
from engine.kv_transfer_config import KVTransferConfig

CONNECTORS = {"shm": "SharedMemoryConnector", "mooncake": "MooncakeConnector"}


def make_core(ns: argparse.Namespace, connector: str | None, role: str | None) -> EngineCore:
    transfer = None if connector is None or role is None else KVTransferConfig(CONNECTORS[connector], role)
    return EngineCore(EngineConfig(model=ns.model, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_mib * 2**20,
                                   max_num_batched_tokens=max(ns.lengths) + 16, async_scheduling=False,
                                   kv_transfer_config=transfer), show_progress=False)


def until_first(core: EngineCore, count: int = 1) -> tuple[float, list[EngineCoreOutput]]:
    """Seconds until ``count`` tokens have come back (and every output); the engine is drained after."""
    times, outputs = token_times(core)
    return times[count - 1], outputs


def token_times(core: EngineCore) -> tuple[list[float], list[EngineCoreOutput]]:
    """Seconds from now at which each token came back, and the outputs; runs the engine until it is idle."""
    start, outputs, times = time.perf_counter(), [], []
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.append(out)
            times += [time.perf_counter() - start] * len(out.new_token_ids)
    assert times, "no token came back"
    return times, outputs


def prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(length)]


def run(ns: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    colocated = make_core(ns, None, None)
    vocab = colocated.vocab_size
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for length in ns.lengths:
        until_first(_add(colocated, "warm", prompt(rng, length, vocab), greedy))
        firsts, steps = [], []
        for r in range(ns.repeats):
            times, _ = token_times(_add(colocated, f"c{length}-{r}", prompt(rng, length, vocab), greedy))
            firsts.append(times[0])
            steps.append(times[1] - times[0])
        results.append({"mode": "colocated", "prompt_tokens": length, "first_token_ms": _ms(firsts),
                        "decode_step_ms": _ms(steps)})
    colocated.close()
    for transport in ns.transports:
        producer, consumer = make_core(ns, transport, "kv_producer"), make_core(ns, transport, "kv_consumer")
        block_bytes = consumer.scheduler.kv_transfer.block_bytes if consumer.scheduler.kv_transfer else 0
        for length in ns.lengths:
            rows: list[tuple[float, float, float, int]] = []
            for r in range(ns.repeats + 1):   # the first of each length warms up
                ids = prompt(rng, length, vocab)
                producer.add_request(f"p{length}-{r}", ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True),
                                     kv_transfer=RemoteKV(do_remote_decode=True))
                prefill_s, outs = until_first(producer)
                handoff = outs[-1]
                assert handoff.kv_transfer is not None
                counters = consumer.scheduler.kv_transfer.counters if consumer.scheduler.kv_transfer else None
                assert counters is not None
                counters.latencies.clear()
                received = counters.blocks_received
                consumer.add_request(f"d{length}-{r}", ids + handoff.new_token_ids,
                                     SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                     resumed_output_tokens=1, kv_transfer=handoff.kv_transfer)
                decode_s, _ = until_first(consumer)
                producer.release_kv_holds({f"p{length}-{r}": counters.blocks_received - received})
                if r:
                    rows.append((prefill_s, decode_s, counters.latencies[0], counters.blocks_received - received))
            blocks = rows[0][3]
            pull = [row[2] for row in rows]
            results.append({"mode": transport, "prompt_tokens": length, "blocks": blocks,
                            "bytes": blocks * block_bytes, "prefill_first_token_ms": _ms([r[0] for r in rows]),
                            "decode_first_token_ms": _ms([r[1] for r in rows]), "pull_ms": _ms(pull),
                            "pull_gb_per_s": round(blocks * block_bytes / statistics.median(pull) / 1e9, 2)})
        producer.close()
        consumer.close()
    return {"command": "python -m benchmarks.disagg " + " ".join(ns.argv),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
            "model": ns.model, "dtype": ns.dtype, "results": results}


def _add(core: EngineCore, rid: str, ids: list[int], params: SamplingParams) -> EngineCore:
    core.add_request(rid, ids, params)
    return core


def _ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1)


def table(report: dict[str, Any]) -> str:
    lines = ["| mode | prompt tokens | blocks (MB) | prefill engine: first token ms | decode engine: first token ms "
             "| pull ms | pull GB/s | colocated: first token ms / decode step ms |",
             "|---|---|---|---|---|---|---|---|"]
    colocated = {r["prompt_tokens"]: r for r in report["results"] if r["mode"] == "colocated"}
    for r in report["results"]:
        if r["mode"] == "colocated":
            continue
        c = colocated[r["prompt_tokens"]]
        lines.append(f"| {r['mode']} | {r['prompt_tokens']} | {r['blocks']} ({r['bytes'] / 1e6:.1f}) | "
                     f"{r['prefill_first_token_ms']} | {r['decode_first_token_ms']} | {r['pull_ms']} | "
                     f"{r['pull_gb_per_s']} | {c['first_token_ms']} / {c['decode_step_ms']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=default_model_path())
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--transports", nargs="+", choices=sorted(CONNECTORS), default=["shm", "mooncake"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args(argv)
    ns.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    report = run(ns)
    report["table"] = table(report)
    print(report["table"])
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
