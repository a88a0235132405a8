"""Side-by-side comparison: start each system on 127.0.0.1, wait until it is ready, run the same
benchmark sweep against it, stop it; then write one markdown table and one plot.

    python -m benchmarks.compare --systems sluice,llamacpp,vllm --concurrency 1,8,32 --num-prompts 64

Peers come from their own virtualenvs (benchmarks/install_peers.sh). Command templates may use
{python} (this interpreter), {port} (the HTTP port benchmarked), {engine_port} and {tokenizer_port}
(more free ports, for Sluice's internal gRPC services), {gguf} (default model file), {hf_dir} and {peers}.
A system named BASE-VARIANT (e.g. sluice-t2) runs BASE's command plus its --extra-args, with its --env
variables: ``--systems sluice,sluice-onednn --env sluice-onednn=SLUICE_AMX_LINEAR=0`` compares an engine switch
served, in one run. ``--ca-certs sluice-tls=ca.pem`` benchmarks a variant whose --extra-args serve HTTPS
(docs/security.md has the whole TLS-against-plain command).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks import bench, plot
from benchmarks.report import machine_info, utc_timestamp
from benchmarks.vllm_bench import VllmBench
from common.procs import free_port, stop_process

PEERS_DIR = Path(__file__).resolve().parent / ".peers"

DEFAULT_COMMANDS: dict[str, str] = {
    "sluice": ("{python} -m services.cli serve --host 127.0.0.1 --port {port} --engine-port {engine_port} "
               "--tokenizer-port {tokenizer_port}"),
    "llamacpp": ("{peers}/venv-llama/bin/python -m llama_cpp.server --model {gguf} --host 127.0.0.1 --port {port} "
                 "--n_ctx 2048 --n_threads 1 --n_threads_batch 1 --logits_all False --interrupt_requests False "
                 "--model_alias smollm2"),
    "vllm": ("{peers}/venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model {hf_dir} "
             "--served-model-name smollm2 --host 127.0.0.1 --port {port} --dtype bfloat16 --max-model-len 2048"),
}
# llama.cpp has no ignore_eos: bias SmolLM2's end tokens away so every request has its full length.
DEFAULT_BENCH_ARGS: dict[str, tuple[str, ...]] = {"llamacpp": ("--force-length-logit-bias", "0,2")}
DEFAULT_ENV: dict[str, dict[str, str]] = {
    "vllm": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
}
READY_PATHS: dict[str, str] = {"sluice": "/ready"}  # others: GET /v1/models answering 200


@dataclass(frozen=True)
class SystemSpec:
    name: str
    command: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    bench_args: tuple[str, ...] = ()
    ready_path: str = "/v1/models"
    # The server speaks HTTPS, verified against this CA file (--ca-certs NAME=PEM); None: plain HTTP.
    ca_certs: str | None = None

    @property
    def origin(self) -> str:
        return f"{'http' if self.ca_certs is None else 'https'}://127.0.0.1:{self.port}"  # this machine only

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"


def base_name(name: str) -> str:
    """``sluice-t2`` -> ``sluice``: a variant of a known system (same defaults, more arguments)."""
    return name if name in DEFAULT_COMMANDS else name.split("-", 1)[0]


def build_system(name: str, template: str, port: int, *, gguf: str, hf_dir: str,
                 extra_args: str = "", env: Mapping[str, str] | None = None, ca_certs: str | None = None) -> SystemSpec:
    command = template.format(python=sys.executable, port=port, engine_port=free_port(),
                              tokenizer_port=free_port(), gguf=gguf, hf_dir=hf_dir, peers=PEERS_DIR)
    base = base_name(name)
    return SystemSpec(name=name, command=(*shlex.split(command), *shlex.split(extra_args)), port=port,
                      env={**DEFAULT_ENV.get(base, {}), **(env or {})}, bench_args=DEFAULT_BENCH_ARGS.get(base, ()),
                      ready_path=READY_PATHS.get(base, "/v1/models"), ca_certs=ca_certs)


def parse_name_values(items: Sequence[str], flag: str) -> dict[str, str]:
    """``["llamacpp=32", "sluice-t2=--num-threads 2"]`` -> {name: value}."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} expects NAME=VALUE, got {item!r}")
        out[name.strip()] = value
    return out


def parse_env(items: Sequence[str]) -> dict[str, dict[str, str]]:
    """``["sluice-x=SLUICE_AMX_LINEAR=0", "sluice-x=OMP_NUM_THREADS=1"]`` -> {system: {variable: value}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, assignment = item.partition("=")
        var, sep2, value = assignment.partition("=")
        if not (sep and sep2 and name.strip() and var.strip()):
            raise ValueError(f"--env expects NAME=VARIABLE=VALUE, got {item!r}")
        out.setdefault(name.strip(), {})[var.strip()] = value
    return out


def step_plan(concurrency: str, num_prompts: str, cap: int | None) -> list[tuple[str, int]]:
    """(concurrency list, measured requests) per bench call: one call for the whole sweep when
    ``num_prompts`` is one number, else one call per step (one count per concurrency); ``cap``
    bounds every count (llama.cpp serves one request at a time, so large steps only cost time)."""
    conc = [c.strip() for c in concurrency.split(",") if c.strip()]
    counts = [int(n) for n in num_prompts.split(",") if n.strip()]
    if len(counts) == 1:
        return [(",".join(conc), min(counts[0], cap) if cap else counts[0])]
    if len(counts) != len(conc):
        raise ValueError(f"--num-prompts has {len(counts)} counts for {len(conc)} concurrency steps")
    return [(c, min(n, cap) if cap else n) for c, n in zip(conc, counts)]


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, ca_certs: str | None = None) -> None:
    """Poll ``url`` until it answers 200 (HTTPS verified against ``ca_certs``); fail early when the process
    dies."""
    deadline = time.monotonic() + timeout_s
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_certs) if ca_certs is not None else True
    with httpx.Client(timeout=5.0, trust_env=False, verify=verify) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with code {proc.returncode} before it was ready")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s ({url})")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the process group we started (servers spawn workers), SIGKILL after the grace."""
    stop_process(proc, grace_s, group=True)


def merge_results(parts: Sequence[Path], out: Path) -> None:
    """One result document from per-step bench calls: the first call's header, every call's runs."""
    docs = plot.load_results(parts)
    merged = {**docs[0], "runs": [run for d in docs for run in d["runs"]],
              "command": " ; ".join(d["command"] for d in docs)}
    merged["config"] = {**docs[0]["config"], "num_prompts": [d["config"]["num_prompts"] for d in docs]}
    out.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")


def run_system(spec: SystemSpec, bench_argv: Sequence[str], out_dir: Path, ready_timeout_s: float,
               steps: Sequence[tuple[str, int]] = (), vllm_bench: VllmBench | None = None) -> Path | None:
    """Start, benchmark and stop one system; returns its result file (None on failure, logged). The client is
    benchmarks.bench, or ``vllm bench serve`` when ``vllm_bench`` is given."""
    if not Path(spec.command[0]).exists() and "/" in spec.command[0]:
        print(f"[{spec.name}] skipped: {spec.command[0]} missing (run benchmarks/install_peers.sh)", flush=True)
        return None
    log_path = out_dir / f"{spec.name}.log"
    result = out_dir / f"{spec.name}.json"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
    print(f"[{spec.name}] starting: {env + ' ' if env else ''}{shlex.join(spec.command)} (log {log_path})", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **spec.env})
        try:
            started = time.monotonic()
            wait_ready(proc, f"{spec.origin}{spec.ready_path}", ready_timeout_s, spec.ca_certs)
            print(f"[{spec.name}] ready after {time.monotonic() - started:.0f} s", flush=True)
            if vllm_bench is not None:
                return vllm_bench.run(spec.name, spec.base_url.removesuffix("/v1"), steps, out_dir)
            common = [*bench_argv, *spec.bench_args, "--base-url", spec.base_url, "--label", spec.name,
                      *(["--ca-certs", spec.ca_certs] if spec.ca_certs is not None else [])]
            if len(steps) <= 1:
                plan = [(steps[0] if steps else None, result)]
            else:  # per-step calls; a different seed per step keeps later steps off the prefix cache
                plan = [(step, out_dir / f"{spec.name}.step{i}.json") for i, step in enumerate(steps)]
            for i, (step, path) in enumerate(plan):
                load = [] if step is None else ["--concurrency", step[0], "--num-prompts", str(step[1])]
                seed = [] if len(plan) == 1 else ["--seed", str(1000 * (i + 1))]
                rc = bench.main([*common, *load, *seed, "--result-file", str(path)])
                if rc != 0:
                    print(f"[{spec.name}] benchmark exit code {rc}", flush=True)
            if len(plan) > 1 and all(path.exists() for _, path in plan):
                merge_results([path for _, path in plan], result)
            return result if result.exists() else None
        except (RuntimeError, TimeoutError) as e:
            print(f"[{spec.name}] failed: {e} (see {log_path})", flush=True)
            return None
        finally:
            stop(proc)


def _cell(v: Any, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown_table(docs: Sequence[dict[str, Any]]) -> str:
    """One row per (system, load point)."""
    lines = ["| system | load | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT mean (ms) | ITL p99 (ms) "
             "| E2EL p99 (ms) | ok / failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for doc in docs:
        for run in doc["runs"]:
            load = f"c={run['concurrency']}" if run["mode"] == "closed" else f"{run['request_rate']} req/s"
            ttft, tpot = run["ttft"], run["tpot"]
            lines.append(
                f"| {doc['label']} | {load} | {run['request_throughput']:.2f} | {run['output_throughput']:.1f} "
                f"| {_cell(ttft.get('p50_ms'))} / {_cell(ttft.get('p99_ms'))} | {_cell(tpot['mean_ms'], '{:.1f}')} "
                f"| {_cell(run['itl'].get('p99_ms'), '{:.1f}')} | {_cell(run['e2el'].get('p99_ms'))} "
                f"| {run['completed']} / {run['failed']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="sluice,llamacpp,vllm")
    p.add_argument("--out-dir", default=None, help="default benchmarks/results/compare-<time>")
    for name in DEFAULT_COMMANDS:
        p.add_argument(f"--{name}-cmd", default=DEFAULT_COMMANDS[name], help=f"command template for {name}")
    p.add_argument("--gguf", default=None, help="GGUF model file (default: Sluice's default model)")
    p.add_argument("--hf-dir", default=str(PEERS_DIR / "smollm2-hf"), help="HF directory of the model (vLLM)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for each server")
    p.add_argument("--extra-args", action="append", default=[], metavar="NAME=ARGS",
                   help="more arguments for one system's command, e.g. 'sluice-t2=--num-threads 2' (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VARIABLE=VALUE",
                   help="an environment variable for one system's server, e.g. 'sluice-onednn=SLUICE_AMX_LINEAR=0' "
                        "(repeatable)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", default="64",
                   help="measured requests per step: one number, or one per --concurrency step")
    p.add_argument("--ca-certs", action="append", default=[], metavar="NAME=PEM",
                   help="one system serves HTTPS, verified against this CA file, e.g. 'sluice-tls=ca.pem' with its "
                        "--extra-args turning TLS on (repeatable)")
    p.add_argument("--max-prompts", action="append", default=[], metavar="NAME=N",
                   help="cap one system's requests per step, e.g. llamacpp=32 (repeatable)")
    p.add_argument("--client", choices=("bench", "vllm-bench"), default="bench",
                   help="the load generator: benchmarks.bench, or vLLM's `vllm bench serve` from the peer venv "
                        "(random dataset, ignore_eos, temperature 1.0; its saved results fill the same table)")
    p.add_argument("--vllm-bin", default=str(PEERS_DIR / "venv-vllm" / "bin" / "vllm-cli"),
                   help="the `vllm` command --client vllm-bench runs")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (bench: 106; vllm-bench: 256)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (bench: 64; vllm-bench: 128)")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="vllm-bench: a random prefix of this many tokens shared by every prompt, before its "
                        "--input-len own tokens (vLLM's --random-prefix-len)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--bench-args", default="",
                   help="more benchmarks.bench options as one string: --bench-args='--seed 1 --goodput ttft:500'")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if base_name(n) not in DEFAULT_COMMANDS]
    if unknown:
        print(f"unknown systems {unknown}; known: {list(DEFAULT_COMMANDS)}", file=sys.stderr)
        return 2
    if args.gguf is None:
        from engine.config import default_model_path
        args.gguf = default_model_path()
    out_dir = Path(args.out_dir or Path(__file__).resolve().parent / "results" / f"compare-{int(time.time())}")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        extra = parse_name_values(args.extra_args, "--extra-args")
        envs = parse_env(args.env)
        caps = {k: int(v) for k, v in parse_name_values(args.max_prompts, "--max-prompts").items()}
        cas = parse_name_values(args.ca_certs, "--ca-certs")
        plans = {n: step_plan(args.concurrency, args.num_prompts, caps.get(n)) for n in names}
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    vllm_bench = args.client == "vllm-bench"
    if vllm_bench and cas:
        print("--ca-certs works with --client bench only", file=sys.stderr)
        return 2
    args.input_len = args.input_len or (256 if vllm_bench else 106)
    args.output_len = args.output_len or (128 if vllm_bench else 64)
    if args.prefix_len and not vllm_bench:
        print("--prefix-len works with --client vllm-bench (benchmarks.bench has --shared-prefix-len)", file=sys.stderr)
        return 2
    client = VllmBench(Path(args.vllm_bin), args.hf_dir, args.input_len, args.output_len,
                       endpoint=args.endpoint, prefix_len=args.prefix_len) if vllm_bench else None
    if client is not None and not client.binary.exists():
        print(f"{client.binary} missing (run benchmarks/install_peers.sh vllm)", file=sys.stderr)
        return 2
    bench_argv = ["--input-len", str(args.input_len), "--output-len", str(args.output_len),
                  "--warmup", str(args.warmup), "--endpoint", args.endpoint, *shlex.split(args.bench_args)]
    results: list[Path] = []
    for name in names:
        spec = build_system(name, getattr(args, f"{base_name(name)}_cmd"), free_port(), gguf=args.gguf,
                            hf_dir=args.hf_dir, extra_args=extra.get(name, ""), env=envs.get(name),
                            ca_certs=cas.get(name))
        path = run_system(spec, bench_argv, out_dir, args.ready_timeout, plans[name], vllm_bench=client)
        if path is not None:
            results.append(path)
    if not results:
        print("no system produced results", file=sys.stderr)
        return 1
    docs = plot.load_results(results)
    machine = machine_info()
    md = "\n".join([
        f"# Serving comparison, {utc_timestamp()}", "",
        f"Command: `{shlex.join(['python', '-m', 'benchmarks.compare', *argv])}`  ",
        f"Machine: {machine['cpu_model']}, {machine['cpu_cores']} cores  ",
        f"Workload: {args.num_prompts} requests, ~{args.input_len}-token prompts"
        + (f" after a shared {args.prefix_len}-token prefix" if args.prefix_len else "")
        + f", {args.output_len} output tokens, "
        f"streamed `/v1/{'chat/' if args.endpoint == 'chat' else ''}completions`"
        + (", client `vllm bench serve` (random dataset, ignore_eos, temperature 1.0)" if vllm_bench else ""), "",
        markdown_table(docs), "",
        *[f"- {d['label']}: `{d['command']}`" for d in docs], ""])
    (out_dir / "summary.md").write_text(md, encoding="utf-8")
    plot.plot(docs, out_dir / "sweep.png")
    (out_dir / "systems.json").write_text(json.dumps({d["label"]: d["config"] for d in docs}, indent=1),
                                          encoding="utf-8")
    print(md)
    print(f"wrote {out_dir / 'summary.md'} and {out_dir / 'sweep.png'}")
    return 0 if len(results) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
