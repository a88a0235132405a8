"""Serving overhead: output tokens/s through the served stack vs the in-process ``LLM.generate``.

    python -m benchmarks.overhead --prompts 32 --input-tokens 128 --output-tokens 64 --concurrency 32 \\
        --rounds 5 --repeat 1 --out benchmarks/results/overhead.json

The same workload, the same engine settings, in the same run, on the sides ``--sides`` names:

* ``rest``: the full stack, ``sluice serve`` (gateway → tokenizer service → engine, shared-memory
  handoff on, as deployed), driven over HTTP by an aiohttp client on uvloop (``sluice bench``'s request
  body and connection settings) keeping ``--concurrency`` streamed ``/v1/completions`` requests in
  flight and draining each stream without parsing it, token counts from its final ``usage`` chunk;
* ``rest-calls``: the same with ``sluice serve --no-tokenizer-mux`` (a ``Generate`` call per request
  from the gateway to the tokenizer service instead of one multiplexed ``GenerateStream``);
* ``rest-si``: the full stack with every request asking for ``--stream-interval``;
* ``grpc``: an engine process and a tokenizer-service process on 127.0.0.1, driven through the public
  ``sluice.v1.Generation`` API by a grpc.aio client, also on uvloop (no gateway);
* ``in-process``: with those processes stopped, ``engine.LLM(...)`` in this process given every prompt
  at once.

Greedy, ``ignore_eos``, text prompts of about ``--input-tokens`` tokens. Each measured run is preceded by
a short warm-up; every run gets its own prompt prefix so the prefix cache never serves one run from
another. Rounds rotate which side goes first, since a shared machine's load drifts. Load from other
processes only ever slows a run down, so besides the ratio of medians the ratio of the best runs is
reported. The issue's target (≥ 95 %) is judged on the full stack (``rest``) when it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from common.procs import free_port, grpc_serving, stop_process

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.95
_FILLER = ("The harbour master kept a ledger of every ship that entered the bay, noting its cargo, its crew, "
           "the weather on the day it arrived and the price of salt in the market that morning. ")


@dataclass(frozen=True)
class Workload:
    prompts: int = 32
    input_tokens: int = 128
    output_tokens: int = 64
    concurrency: int = 32


@dataclass(frozen=True)
class EngineSettings:
    """Given to both sides: engine CLI flags for the process, keyword arguments for ``LLM``."""

    dtype: str = "auto"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str = "1GiB"
    num_threads: int | None = None
    seed: int = 0

    def cli_flags(self) -> list[str]:
        return [x for k, v in asdict(self).items() if v is not None for x in (f"--{k.replace('_', '-')}", str(v))]

    def llm_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


SIDES = ("rest", "rest-calls", "rest-si", "grpc", "in-process")
DEFAULT_SIDES = ("rest", "grpc", "in-process")
# rest-si: the full stack again, each request asking for a stream interval (--stream-interval, default 4).
# rest-calls: the full stack with `sluice serve --no-tokenizer-mux` (the gateway makes a Generate call per
# request instead of multiplexing them on one GenerateStream).
DEFAULT_STREAM_INTERVAL = 4


@dataclass
class RunResult:
    side: str            # one of SIDES
    round: int
    repeat: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    # CPU seconds (user + system, every thread) during the run, by process: engine, tokenizer, gateway
    # (the served sides) and client (this process); empty for in-process.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


CPU_ROLES = ("engine", "tokenizer", "gateway", "client")
_ROLES = (("-m engine", "engine"), ("-m services.tokenizer", "tokenizer"), ("-m gateway", "gateway"))


def stack_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds so far of ``root_pid``'s descendant processes by role (engine, tokenizer, gateway; replicas
    summed), from Linux's /proc (every thread of a process counted); {} where there is no /proc."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[pid] = int(fields[1])
        stats[pid] = fields
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, fields in stats.items():
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, root_pid):
            ancestor = parents.get(ancestor)
        if ancestor != root_pid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = next((name for key, name in _ROLES if key in cmdline), None)
        if role is not None:
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_prompts(tokenizer: Any, workload: Workload, tag: str) -> list[str]:
    """``workload.prompts`` texts of about ``input_tokens`` tokens each, all different from their first token."""
    filler_ids = tokenizer.encode(_FILLER * (workload.input_tokens // 20 + 2), add_special_tokens=False)
    prompts = []
    for i in range(workload.prompts):
        head = f"[{tag} #{i}] "
        budget = workload.input_tokens - len(tokenizer.encode(head, add_special_tokens=False))
        prompts.append(head + tokenizer.decode(filler_ids[:max(budget, 1)]))
    return prompts


# -- the gRPC side ----------------------------------------------------------------------------------------
@contextmanager
def _process(args: list[str], log: Path, service: str, port: int, timeout: float = 600) -> Iterator[str]:
    """``python -m …`` on 127.0.0.1:``port``, yielded once its health service says SERVING; SIGTERM after."""
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not grpc_serving(addr, service):
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args[0]} not serving after {timeout:.0f} s; see {log}")
            time.sleep(0.5)
        yield addr
    finally:
        stop_process(proc, 30)


@contextmanager
def grpc_stack(settings: EngineSettings, log_dir: Path) -> Iterator[str]:
    """An engine and a tokenizer service (shm handoff on, as deployed); yields the public API's address."""
    engine_port, tok_port = free_port(), free_port()
    with _process(["engine", "--port", str(engine_port), *settings.cli_flags()], log_dir / "overhead-engine.log",
                  "sluice.v1.Engine", engine_port) as engine_addr:
        with _process(["services.tokenizer", "--engine", engine_addr, "--port", str(tok_port)],
                      log_dir / "overhead-tokenizer.log", "sluice.v1.Generation", tok_port) as addr:
            yield addr


class RestStack(NamedTuple):
    base_url: str  # …/v1
    model: str
    pid: int  # of `sluice serve`, the processes' parent


@contextmanager
def rest_stack(settings: EngineSettings, log_dir: Path, timeout: float = 600,
               serve_flags: tuple[str, ...] = ()) -> Iterator[RestStack]:
    """``sluice serve``: gateway, tokenizer service and engine as deployed (plus ``serve_flags``)."""
    import httpx

    from benchmarks.compare import stop, wait_ready

    port, engine_port, tokenizer_port = free_port(), free_port(), free_port()
    with open(log_dir / "overhead-serve.log", "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--engine-port", str(engine_port), "--tokenizer-port",
                                 str(tokenizer_port), *settings.cli_flags(), *serve_flags],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, f"{base}/ready", timeout)
        with httpx.Client(timeout=10, trust_env=False) as client:
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
        yield RestStack(f"{base}/v1", model, proc.pid)
    finally:
        stop(proc)


async def _rest_workload(base_url: str, model: str, prompts: list[str], output_tokens: int, concurrency: int,
                         timeout: float, stream_interval: int | None = None) -> tuple[int, int]:
    """Every prompt through /v1/completions, streamed, ``concurrency`` at a time; (prompt, output tokens).
    With ``stream_interval`` each request body asks for it (vLLM's field).

    Each stream is drained without parsing its chunks (this client shares the cores with the stack it
    measures); the counts come from the final ``usage`` chunk (``stream_options.include_usage``)."""
    from benchmarks.client import Target, make_client
    from benchmarks.workload import RequestSpec

    target = Target(base_url=base_url, model=model, endpoint="completions", ignore_eos=True, temperature=0.0)
    totals = [0, 0]
    queue = list(reversed(prompts))
    async with make_client(timeout) as client:

        async def worker() -> None:
            while queue:
                body = target.body(RequestSpec(0, queue.pop(), 0, output_tokens))
                if stream_interval is not None:
                    body["stream_interval"] = stream_interval
                tail = b""
                async with client.post(target.url, json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
                    async for chunk in resp.content.iter_any():
                        tail = (tail + chunk)[-16384:]
                usage = _final_usage(tail)
                if usage["completion_tokens"] != output_tokens:
                    raise RuntimeError(f"a REST request ended after {usage['completion_tokens']} tokens")
                totals[0] += usage["prompt_tokens"]
                totals[1] += usage["completion_tokens"]

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return totals[0], totals[1]


def _final_usage(tail: bytes) -> dict[str, int]:
    """The ``usage`` of the last data event of an SSE stream's tail; raises on an error event or none."""
    events = [e.strip() for e in tail.replace(b"\r\n", b"\n").split(b"\n\n")]
    payloads = [e[len(b"data:"):].strip() for e in events if e.startswith(b"data:")]
    payloads = [x for x in payloads if x and x != b"[DONE]"]
    if not payloads:
        raise RuntimeError(f"no data event at the end of the stream: {tail[-300:]!r}")
    last = json.loads(payloads[-1])
    if last.get("error") or not last.get("usage"):
        raise RuntimeError(f"the stream did not end with a usage chunk: {payloads[-1][:300]!r}")
    return {k: int(last["usage"][k]) for k in ("prompt_tokens", "completion_tokens")}


def run_rest(base_url: str, model: str, prompts: list[str], workload: Workload, round_: int, repeat: int,
             timeout: float = 900, stream_interval: int | None = None, side: str | None = None) -> RunResult:
    """The ``rest`` side (or ``side``), ``rest-si`` when the requests ask for ``stream_interval``."""
    from benchmarks.runner import run_async

    t0 = time.perf_counter()
    prompt_tokens, output_tokens = run_async(
        _rest_workload(base_url, model, prompts, workload.output_tokens, workload.concurrency, timeout,
                       stream_interval))
    side = side or ("rest" if stream_interval is None else "rest-si")
    return RunResult(side, round_, repeat, time.perf_counter() - t0,
                     prompt_tokens, output_tokens)


async def _grpc_workload(addr: str, prompts: list[str], output_tokens: int, concurrency: int,
                         timeout: float) -> tuple[int, int]:
    """Every prompt through Generation.Generate, ``concurrency`` at a time; (prompt tokens, output tokens)."""
    import grpc

    from common.tls import aio_channel
    from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    totals = [0, 0]
    queue = list(reversed(prompts))
    async with aio_channel(addr, None) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def worker() -> None:
            while queue:
                request = generation_pb2.GenerateRequest(text=queue.pop())
                request.sampling.temperature = 0.0
                request.stopping.max_tokens = output_tokens
                request.stopping.ignore_eos = True
                last = None
                # A bounded deadline: an engine whose core thread died leaves streams open forever.
                async for response in stub.Generate(request, timeout=timeout):
                    last = response
                if last is None or last.finish_reason != common_pb2.FINISH_REASON_LENGTH:
                    raise RuntimeError(f"request ended without FINISH_REASON_LENGTH: {last}")
                totals[0] += last.usage.prompt_tokens
                totals[1] += last.usage.completion_tokens

        async def watchdog() -> None:
            # The tokenizer service reports NOT_SERVING once the engine stops answering GetInfo (a dead
            # core thread leaves open streams hanging): fail the run instead of waiting for the deadline.
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health, misses = health_pb2_grpc.HealthStub(channel), 0
            while True:
                await asyncio.sleep(2)
                try:
                    r = await health.Check(health_pb2.HealthCheckRequest(service="sluice.v1.Generation"), timeout=10)
                    serving = r.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.aio.AioRpcError:
                    serving = False
                misses = 0 if serving else misses + 1
                if misses >= 3:
                    raise EngineDied("the tokenizer service reports the engine down")

        work = asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        guard = asyncio.ensure_future(watchdog())
        try:
            pending: list[asyncio.Future[Any]] = [work, guard]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if guard.done():
                work.cancel()
                guard.result()  # raises EngineDied
            await work
        finally:
            guard.cancel()
    return totals[0], totals[1]


class EngineDied(RuntimeError):
    """The engine process stopped serving during a run."""


def run_grpc(addr: str, prompts: list[str], workload: Workload, round_: int, repeat: int,
             timeout: float = 900) -> RunResult:
    from benchmarks.runner import run_async

    t0 = time.perf_counter()
    prompt_tokens, output_tokens = run_async(
        _grpc_workload(addr, prompts, workload.output_tokens, workload.concurrency, timeout))
    return RunResult("grpc", round_, repeat, time.perf_counter() - t0, prompt_tokens, output_tokens)


# -- the in-process side ----------------------------------------------------------------------------------
def run_in_process(llm: Any, prompts: list[str], workload: Workload, round_: int, repeat: int) -> RunResult:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    if any(o.outputs[0].finish_reason != "length" for o in outputs):
        raise RuntimeError("an in-process request did not end by length")
    return RunResult("in-process", round_, repeat, wall, sum(len(o.prompt_token_ids) for o in outputs),
                     sum(len(o.outputs[0].token_ids) for o in outputs))


# -- one benchmark ----------------------------------------------------------------------------------------
def run_overhead(workload: Workload, settings: EngineSettings, rounds: int, repeat: int, log_dir: Path,
                 on_result: Callable[[list[RunResult]], object] = lambda results: None,
                 crashes: list[str] | None = None, max_attempts: int = 3,
                 sides: tuple[str, ...] = DEFAULT_SIDES,
                 stream_interval: int = DEFAULT_STREAM_INTERVAL) -> list[RunResult]:
    """All runs; ``on_result`` sees the list after each one (so a crash later keeps what was measured).
    Engine crashes are appended to ``crashes`` and the round's gRPC side is redone."""
    crashes = crashes if crashes is not None else []
    from engine.config import default_model_path
    from engine.text import Tokenizer

    tokenizer = Tokenizer.from_pretrained(default_model_path())
    warm = Workload(prompts=min(4, workload.prompts), input_tokens=16, output_tokens=4, concurrency=4)
    results: list[RunResult] = []

    def measure(side: str, r: int, once: Any, stack_pid: int | None = None) -> None:
        once(make_prompts(tokenizer, warm, f"warm {r}{side}"), warm, r, -1)
        for k in range(repeat):
            # A fresh prefix per run (same length on both sides): no run is served from another's cache.
            prompts = make_prompts(tokenizer, workload, f"run {r}.{k}{side}")
            before = stack_cpu_s(stack_pid) if stack_pid else {}
            client = _own_cpu_s()
            x = once(prompts, workload, r, k)
            if stack_pid:
                after = stack_cpu_s(stack_pid)
                cpu = {role: round(after[role] - before.get(role, 0.0), 2) for role in after}
                x = replace(x, cpu_s=dict(cpu, client=round(_own_cpu_s() - client, 2)))
            results.append(x)
            on_result(results)
            x = results[-1]
            print(f"round {r}.{k} {side:10s}: {x.output_tokens} tokens in {x.wall_s:.2f} s = "
                  f"{x.output_tok_s:.1f} tok/s", flush=True)

    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # each side goes first in turn
            if side in ("rest", "rest-calls", "rest-si"):
                si = stream_interval if side == "rest-si" else None
                flags = ("--no-tokenizer-mux",) if side == "rest-calls" else ()
                with rest_stack(settings, log_dir, serve_flags=flags) as stack:
                    measure(side, r, lambda p, w, r_, k, s=side, si=si: run_rest(stack.base_url, stack.model,
                                                                                 p, w, r_, k, stream_interval=si,
                                                                                 side=s),
                            stack.pid)
            elif side == "grpc":
                for attempt in range(max_attempts):
                    done = len(results)
                    try:
                        with grpc_stack(settings, log_dir) as addr:
                            measure(side, r, lambda p, w, r_, k: run_grpc(addr, p, w, r_, k))
                        break
                    except EngineDied as e:
                        del results[done:]  # a round's gRPC runs all come from one engine process
                        crashes.append(f"round {r}, attempt {attempt}: {e}")
                        print(f"round {r} grpc: {e}; starting a fresh stack", flush=True)
                else:
                    raise EngineDied(f"round {r}: the engine died in {max_attempts} attempts")
            else:
                from engine.entrypoints.llm import LLM

                llm = LLM(**settings.llm_kwargs())
                measure(side, r, lambda p, w, r_, k, llm=llm: run_in_process(llm, p, w, r_, k))
                del llm  # free the model and KV cache before the next round's processes start
    return results


def summarize(results: list[RunResult]) -> dict[str, Any]:
    """Per served side, its ratio to in-process: of the median runs, of the best runs, of each round's
    medians. ``ratio`` / ``met`` are the full stack's (``rest``) when it ran, else gRPC's."""
    by_side = {side: [x.output_tok_s for x in results if x.side == side] for side in SIDES}
    by_side = {side: v for side, v in by_side.items() if v}
    if "in-process" not in by_side or len(by_side) < 2:
        raise ValueError("summarize needs in-process runs and at least one served side")
    median = {side: statistics.median(v) for side, v in by_side.items()}
    best = {side: max(v) for side, v in by_side.items()}
    out: dict[str, Any] = {"target": TARGET_RATIO, "sides": {}}
    for side in by_side:
        out[f"{side.replace('-', '_')}_tok_s_median"] = median[side]
        out[f"{side.replace('-', '_')}_tok_s_best"] = best[side]
    for side in (s for s in SIDES if s in by_side and s != "in-process"):
        per_round = []
        for r in sorted({x.round for x in results if x.side == side}):
            mine = [statistics.median(x.output_tok_s for x in results if x.round == r and x.side == s)
                    for s in (side, "in-process")]
            per_round.append(mine[0] / mine[1])
        out["sides"][side] = {"ratio": median[side] / median["in-process"],
                              "ratio_best": best[side] / best["in-process"], "ratio_per_round": per_round}
        runs = [x for x in results if x.side == side and x.cpu_s]
        if runs:  # CPU seconds per 1000 output tokens, median over the side's runs
            out["sides"][side]["cpu_s_per_1k_tokens"] = {
                role: statistics.median(1000 * x.cpu_s.get(role, 0.0) / x.output_tokens for x in runs)
                for role in CPU_ROLES}
    judged = next(s for s in ("rest", "grpc", "rest-calls", "rest-si") if s in out["sides"])
    out.update(judged=judged, ratio=out["sides"][judged]["ratio"], ratio_best=out["sides"][judged]["ratio_best"],
               ratio_per_round=out["sides"][judged]["ratio_per_round"])
    out["met"] = out["ratio"] >= TARGET_RATIO
    return out


def markdown(results: list[RunResult], summary: dict[str, Any] | None) -> str:
    lines = ["| run | side | prompt tokens | output tokens | wall (s) | output tok/s | CPU s: "
             + " / ".join(CPU_ROLES) + " |", "|---:|---|---:|---:|---:|---:|---:|"]
    for x in results:
        cpu = " / ".join(f"{x.cpu_s[role]:.2f}" if role in x.cpu_s else "–" for role in CPU_ROLES)
        lines.append(f"| {x.round}.{x.repeat} | {x.side} | {x.prompt_tokens} | {x.output_tokens} | {x.wall_s:.2f} | "
                     f"{x.output_tok_s:.1f} | {cpu if x.cpu_s else '–'} |")
    if summary is None:
        return "\n".join(lines + ["", "(incomplete: the benchmark stopped before every run was done)"])
    lines.append("")
    names = {"rest": "full stack (REST)", "rest-si": "full stack (REST), requests with stream_interval",
             "rest-calls": "full stack (REST), a Generate call per request (--no-tokenizer-mux)",
             "grpc": "gRPC (no gateway)"}
    for side, r in summary["sides"].items():
        key = side.replace("-", "_")
        per_round = ", ".join(f"{v:.3f}" for v in r["ratio_per_round"])
        lines.append(f"{names[side]} / in-process, medians: **{r['ratio']:.3f}** "
                     f"({summary[key + '_tok_s_median']:.1f} / {summary['in_process_tok_s_median']:.1f} tok/s); "
                     f"best runs: {r['ratio_best']:.3f}; per round: {per_round}.")
        if "cpu_s_per_1k_tokens" in r:
            cpu = ", ".join(f"{role} {v:.3f}" for role, v in r["cpu_s_per_1k_tokens"].items())
            lines.append(f"  CPU s per 1000 output tokens (medians): {cpu}.")
    lines.append(f"Target ≥ {TARGET_RATIO:g} (medians, {names[summary['judged']]}): "
                 f"{'met' if summary['met'] else 'NOT met'}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n")[0])
    w, e = Workload(), EngineSettings()
    p.add_argument("--prompts", type=int, default=w.prompts)
    p.add_argument("--input-tokens", type=int, default=w.input_tokens)
    p.add_argument("--output-tokens", type=int, default=w.output_tokens)
    p.add_argument("--concurrency", type=int, default=w.concurrency)
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                   help=f"comma-separated, from {', '.join(SIDES)} (in-process and at least one other)")
    p.add_argument("--rounds", type=int, default=2, help="each round runs every side, the first one rotating")
    p.add_argument("--repeat", type=int, default=2, help="measured runs per side per round")
    p.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                   help="the stream_interval the rest-si side's requests ask for (the target is judged on rest)")
    p.add_argument("--dtype", default=e.dtype)
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    p.add_argument("--kv-cache-memory", default=e.kv_cache_memory)
    p.add_argument("--num-threads", type=int, default=e.num_threads)
    p.add_argument("--out", default="benchmarks/results/overhead.json", help="JSON; the .md is written beside it")
    ns = p.parse_args(argv)
    sides = tuple(x.strip() for x in ns.sides.split(",") if x.strip())
    if (not set(sides) <= set(SIDES) or "in-process" not in sides or len(set(sides)) < 2
            or len(set(sides)) != len(sides)):
        p.error(f"--sides: in-process and at least one of rest, grpc, each once (got {ns.sides!r})")
    workload = Workload(ns.prompts, ns.input_tokens, ns.output_tokens, ns.concurrency)
    if workload.concurrency < workload.prompts:
        print("note: LLM.generate takes every prompt at once; the served sides keep only --concurrency in flight",
              file=sys.stderr)
    settings = EngineSettings(dtype=ns.dtype, max_num_seqs=ns.max_num_seqs,
                              max_num_batched_tokens=ns.max_num_batched_tokens, kv_cache_memory=ns.kv_cache_memory,
                              num_threads=ns.num_threads)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    doc: dict[str, Any] = {
        "benchmark": "overhead", "command": " ".join(["python -m benchmarks.overhead", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "python": platform.python_version(), "workload": asdict(workload), "engine": asdict(settings),
        "rest_si_stream_interval": ns.stream_interval if "rest-si" in sides else None}

    crashes: list[str] = []

    def write(results: list[RunResult], complete: bool) -> str:
        doc.update(complete=complete, engine_crashes=crashes,
                   runs=[dict(asdict(x), output_tok_s=x.output_tok_s) for x in results])
        doc["summary"] = summarize(results) if complete else None
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        table = markdown(results, doc["summary"])
        out.with_suffix(".md").write_text(f"`{doc['command']}` — {doc['date']}\n\n{table}\n", encoding="utf-8")
        return table

    results = run_overhead(workload, settings, ns.rounds, ns.repeat, out.parent, lambda r: write(r, False), crashes,
                           sides=sides, stream_interval=ns.stream_interval)
    table = write(results, True)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
