"""Handoff benchmark: prompt ids to the engine through shared memory vs inline protobuf (DESIGN §3).

    python -m benchmarks.handoff --sizes 1024,8192,32768,131072 --repeat 100 --token-ids \\
        --out benchmarks/results/handoff.json

The real path end to end, without a model. The server is a separate process
running the engine's own ``EngineServicer`` (same interceptor, same message
limits) in front of a recording stand-in for ``AsyncEngine``: it notes the
moment ``Generate`` hands it the prompt in the form the engine core keeps (an
integer ndarray: the int32 copy out of shared memory, or the array view of
protobuf's repeated field), and answers with one message.

The client builds each request with the tokenizer service's own code:
``inline`` / ``shm`` start from the ``list[int]`` a tokenizer returns for a text
prompt and call ``engine_request`` (``ShmRing.put`` + reference, or
``ids.extend``); with ``--token-ids``, ``inline.ids`` / ``shm.ids`` start from a
public ``GenerateRequest`` carrying ``token_ids`` and call ``prompt_ids`` then
``engine_request`` (``ring.put(array)``, or ``CopyFrom`` of the message). It
sends the request and waits for the first reply, releasing the shm slot on the
acknowledgement as the service does.

Per prompt size and mode: ``send → ids in engine`` (client ``perf_counter`` at
the start of building the request to server ``perf_counter`` when the ids
arrive; both read CLOCK_MONOTONIC, so they compare across processes) and the
round trip to the first reply; median and p90 over ``--repeat`` repetitions,
modes interleaved so that load on a shared machine hits both alike. A
``breakdown`` section times each step of both paths in one process, to show
where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

MODES = ("inline", "shm")
# --token-ids: prompts that arrive as token ids in the public request (the tokenizer service keeps them as
# the array view of the repeated field and copies the message for inline ids), instead of a tokenizer's list.
ID_MODES = ("inline.ids", "shm.ids")
TARGET_RATIO = 5.0
_MSG_LIMIT = 64 * 2**20  # the limit common/grpc_server.py sets for every server


@dataclass(frozen=True)
class HandoffSettings:
    sizes: tuple[int, ...] = (1024, 8192, 32768, 131072)
    repeat: int = 50
    warmup: int = 3
    vocab_size: int = 49152          # SmolLM2's: most ids take 3 bytes as protobuf varints
    shm_tokens: int = 4 * 2**20      # the tokenizer service's default ring
    seed: int = 0
    breakdown_repeat: int = 20
    token_ids: bool = False

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES + ID_MODES if self.token_ids else MODES


@dataclass
class Sample:
    mode: str
    size: int
    send_to_engine_us: float
    round_trip_us: float


@dataclass
class Arrival:
    """What the server saw of one request: when the ids arrived, and whether they are what the engine takes."""

    t: float
    length: int
    form: str                     # "ndarray[int32]" (shm) or "ndarray[uint32]" (protobuf's repeated uint32)
    ids: list[int] | None = None  # kept only when the server was asked to (correctness checks)


@dataclass
class HandoffRun:
    samples: list[Sample] = field(default_factory=list)
    arrivals: dict[str, Arrival] = field(default_factory=dict)


# -- server side (own process) ----------------------------------------------------------------------------
class _DescribedCore:
    """What GetInfo reads of an engine core: a context long enough for every prompt size measured."""

    def __init__(self) -> None:
        from engine.config import EngineConfig

        self.config = EngineConfig(served_model_name="bench")
        self.runner = "generate"
        self.pooling = None
        self.kv_event_publisher = None
        self.scheduler = SimpleNamespace(block_manager=SimpleNamespace(usage=lambda: 0.0))

    def info(self) -> dict[str, Any]:
        return {"model": "bench", "max_model_len": 1 << 20, "vocab_size": 1 << 17, "eos_token_ids": [],
                "bos_token_id": None, "block_size": 16, "total_kv_blocks": 0, "free_kv_blocks": 0, "num_running": 0,
                "num_waiting": 0, "dtype": "float32", "device": "cpu", "kv_role": "", "kv_transport": ""}

    def scheduler_stats(self) -> dict[str, int]:
        return dict.fromkeys(("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"), 0)


class RecordingEngine:
    """Stands in for AsyncEngine behind the real EngineServicer: records the ids it is given, answers at once."""

    def __init__(self, keep_ids: bool) -> None:
        self.keep_ids = keep_ids
        self.arrivals: dict[str, Arrival] = {}
        self.is_alive = True
        self.core = _DescribedCore()   # GetInfo: the tokenizer service bounds prompts by max_model_len

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.core)

    async def generate(self, request_id: str, prompt_token_ids: Any, params: Any,
                       *, priority: int = 0, lora_request: Any = None, cache_salt: str | None = None,
                       resumed_output_tokens: int = 0, mm_items: Any = None,
                       kv_transfer: Any = None) -> AsyncIterator[Any]:
        t = time.perf_counter()  # first thing: the ids are in the engine in the form its core takes
        from engine.core.finish_reason import FinishReason
        from engine.core.outputs import EngineCoreOutput

        yield EngineCoreOutput(request_id, [], finish_reason=FinishReason.LENGTH,
                               num_prompt_tokens=len(prompt_token_ids))
        # Bookkeeping after the reply went out, so that it is in neither timing.
        ids: Any = prompt_token_ids
        form = f"ndarray[{ids.dtype}]" if isinstance(ids, np.ndarray) else type(ids).__name__
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        self.arrivals[request_id] = Arrival(t, len(ids), form, ids if self.keep_ids else None)


async def serve(keep_ids: bool) -> None:
    """The server process (``--serve``): prints its port, serves until stdin closes or says anything,
    then prints what arrived. JSON lines over its own pipes: no pickle across the process boundary."""
    import grpc

    from common.grpc_errors import ErrorMappingInterceptor
    from common.tls import bind_port
    from engine.entrypoints.grpc_servicer import EngineServicer
    from proto.sluice.v1 import engine_pb2_grpc

    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()],
                             options=[("grpc.max_receive_message_length", _MSG_LIMIT), ("grpc.so_reuseport", 0)])
    engine = RecordingEngine(keep_ids)
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
    port = bind_port(server, "127.0.0.1:0", None)
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await server.stop(0)
    print(json.dumps({rid: asdict(a) for rid, a in engine.arrivals.items()}), flush=True)


class HandoffServer:
    """``python -m benchmarks.handoff --serve`` in a child process, on 127.0.0.1 and a free port."""

    def __init__(self, keep_ids: bool = False) -> None:
        args = [sys.executable, "-m", "benchmarks.handoff", "--serve", *(["--keep-ids"] if keep_ids else [])]
        self._proc = subprocess.Popen(args, cwd=Path(__file__).resolve().parent.parent, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdout is not None and self._proc.stdin is not None
        line = self._proc.stdout.readline()  # blocks until the port is printed, or EOF if the child died
        if not line:
            raise RuntimeError(f"handoff server exited with {self._proc.wait()} before serving")
        self.address = f"127.0.0.1:{json.loads(line)['port']}"

    def stop(self) -> dict[str, Arrival]:
        assert self._proc.stdout is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write("stop\n")
            self._proc.stdin.close()
            line = self._proc.stdout.readline()
            self._proc.wait(30)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        return {rid: Arrival(**a) for rid, a in json.loads(line).items()} if line else {}


def _run_async(coro: Any) -> Any:
    """Run on uvloop when installed, as engine/__main__.py and services/tokenizer/__main__.py do,
    without changing the process's event-loop policy (tests run this too)."""
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


# -- client side: the tokenizer service's own request building --------------------------------------------
async def run_client(address: str, settings: HandoffSettings, prompts: dict[int, list[int]]) -> list[
        tuple[str, str, int, float, float]]:
    """(request_id, mode, size, t_send, t_first_reply) per request, warm-up ones included."""
    from common.tls import aio_channel
    from proto.sluice.v1 import generation_pb2
    from services.tokenizer.engine_request import engine_options
    from services.tokenizer.service import GenerationServicer

    channel = aio_channel(address, None, options=[("grpc.max_receive_message_length", _MSG_LIMIT),
                                                  ("grpc.max_send_message_length", _MSG_LIMIT)])
    # Two tokenizer-service servicers on one channel: one with a ring (shm), one without (inline ids).
    # The tokenizer itself is never used by engine_request.
    ring = GenerationServicer(None, channel, served_model_name="bench",  # type: ignore[arg-type]
                              shm_tokens=settings.shm_tokens)
    plain = GenerationServicer(None, channel, served_model_name="bench",  # type: ignore[arg-type]
                               shm_tokens=0)
    services = {mode: ring if mode.startswith("shm") else plain for mode in settings.modes}
    if not await ring.ensure_shm():
        raise RuntimeError("the server could not map the shared-memory ring")
    public = generation_pb2.GenerateRequest()
    public.stopping.max_tokens = 1
    id_requests = {}
    for size, ids in prompts.items():
        id_requests[size] = generation_pb2.GenerateRequest()
        id_requests[size].CopyFrom(public)
        id_requests[size].token_ids.ids.extend(ids)
    records: list[tuple[str, str, int, float, float]] = []
    try:
        for rep in range(settings.warmup + settings.repeat):
            for size in settings.sizes:
                # Alternate which mode goes first, so neither always follows the other's garbage.
                for mode in settings.modes if rep % 2 == 0 else settings.modes[::-1]:
                    rid = f"{mode}-{size}-{rep}"
                    service = services[mode]
                    t0 = time.perf_counter()
                    if mode in ID_MODES:  # what GenerationServicer.Generate does with a token-id prompt
                        ids_public = id_requests[size]
                        t0 = time.perf_counter()
                        ids = await service.prompt_ids(ids_public)
                        request, handoff = await service.engine_request(engine_options(ids_public, rid, 1, None),
                                                                         ids, source=ids_public.token_ids)
                    else:
                        request, handoff = await service.engine_request(engine_options(public, rid, 1, None),
                                                                         prompts[size])
                    if (request.WhichOneof("prompt") == "prompt_shm") != mode.startswith("shm"):
                        raise RuntimeError(f"{rid}: the request went {request.WhichOneof('prompt')}")
                    t1 = None
                    async for msg in service.engine.Generate(request, timeout=60):
                        t1 = t1 or time.perf_counter()
                        if msg.HasField("released_shm_slot"):
                            handoff.release()
                    handoff.release()
                    if t1 is None:
                        raise RuntimeError(f"{rid}: no reply")
                    records.append((rid, mode, size, t0, t1))
    finally:
        ring.close()
        await channel.close()
    return records


def make_prompts(settings: HandoffSettings) -> dict[int, list[int]]:
    """Random ids as a tokenizer returns them: Python lists of ints."""
    rng = np.random.default_rng(settings.seed)
    return {n: rng.integers(0, settings.vocab_size, n).tolist() for n in settings.sizes}


def run_handoff(settings: HandoffSettings, *, keep_ids: bool = False) -> HandoffRun:
    prompts = make_prompts(settings)
    server = HandoffServer(keep_ids)
    try:
        records = _run_async(run_client(server.address, settings, prompts))
    finally:
        arrivals = server.stop()
    run = HandoffRun(arrivals=arrivals)
    for rid, mode, size, t0, t1 in records:
        arrival = arrivals[rid]
        form = "ndarray[int32]" if mode.startswith("shm") else "ndarray[uint32]"
        if arrival.length != size or arrival.form != form:
            raise RuntimeError(f"{rid}: the engine got {arrival.length} ids as {arrival.form}, not {size} as {form}")
        if int(rid.rsplit("-", 1)[1]) >= settings.warmup:
            run.samples.append(Sample(mode, size, (arrival.t - t0) * 1e6, (t1 - t0) * 1e6))
    return run


# -- where the time goes: each step of both paths, in one process ------------------------------------------
def _median_us(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def breakdown(size: int, settings: HandoffSettings) -> dict[str, float]:
    """Median µs of each step of the inline and shm paths for one prompt of ``size`` ids, in one process."""
    from proto.shm import ShmReader, ShmRef, ShmRing
    from proto.sluice.v1 import engine_pb2

    ids = make_prompts(HandoffSettings(sizes=(size,), vocab_size=settings.vocab_size, seed=settings.seed))[size]
    r = settings.breakdown_repeat
    out: dict[str, float] = {}

    def inline_msg() -> engine_pb2.EngineGenerateRequest:
        m = engine_pb2.EngineGenerateRequest(request_id="x")
        m.prompt_token_ids.ids.extend(ids)
        return m

    msg = inline_msg()
    wire = msg.SerializeToString()
    repeated = engine_pb2.EngineGenerateRequest.FromString(wire).prompt_token_ids.ids
    out["inline.extend(list)"] = _median_us(inline_msg, r)
    out["inline.serialize"] = _median_us(msg.SerializeToString, r)
    out["inline.parse"] = _median_us(lambda: engine_pb2.EngineGenerateRequest.FromString(wire), r)
    out["inline.list(repeated)"] = _median_us(lambda: list(repeated), r)
    out["inline.asarray(repeated).tolist()"] = _median_us(lambda: np.asarray(repeated).tolist(), r)
    # What engine/entrypoints/grpc_servicer.py does:
    out["inline.asarray(repeated)"] = _median_us(lambda: np.asarray(repeated), r)
    out["inline.wire_bytes"] = float(len(wire))
    with ShmRing(max(size * 2, 1024)) as ring, ShmReader() as reader:
        reader.register(ring.name, ring.size_bytes)

        def put(src: object) -> ShmRef:
            ref = ring.put(src)  # type: ignore[arg-type]
            assert ref is not None
            ring.release(ref.slot)
            return ref

        ref = put(ids)
        array = np.array(ids, dtype=np.int32)
        out["shm.asarray(list)"] = _median_us(lambda: np.asarray(ids), r)           # inside ShmRing.put: int64
        out["shm.array(list, int32)"] = _median_us(lambda: np.array(ids, dtype=np.int32), r)
        out["shm.put(list)"] = _median_us(lambda: put(ids), r)                       # what the tokenizer does
        out["shm.put(ndarray)"] = _median_us(lambda: put(array), r)
        read = reader.read(ref)
        out["shm.read"] = _median_us(lambda: reader.read(ref), r)                  # frombuffer + copy
        out["shm.tolist"] = _median_us(read.tolist, r)                              # what the engine no longer does
    # The paths as they run: the engine core keeps the array it is handed.
    out["inline.total"] = sum(out[k] for k in ("inline.extend(list)", "inline.serialize", "inline.parse",
                                               "inline.asarray(repeated)"))
    out["shm.total"] = out["shm.put(list)"] + out["shm.read"]
    return out


# -- results ----------------------------------------------------------------------------------------------
RATIOS = {"ratio": ("inline", "shm"), "ratio_ids": ("inline.ids", "shm.ids")}


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def summarize(run: HandoffRun, settings: HandoffSettings) -> list[dict[str, Any]]:
    """Per size: p50 / p90 of each mode and metric, and the ratios of p50s (inline over shm)."""
    rows = []
    for size in settings.sizes:
        row: dict[str, Any] = {"size": size}
        for mode in settings.modes:
            mine = [s for s in run.samples if s.mode == mode and s.size == size]
            for metric in ("send_to_engine_us", "round_trip_us"):
                values = [getattr(s, metric) for s in mine]
                row[f"{mode}.{metric}.p50"] = statistics.median(values)
                row[f"{mode}.{metric}.p90"] = _pct(values, 90)
        for name, (slow, fast) in RATIOS.items():
            if fast in settings.modes:
                for metric in ("send_to_engine_us", "round_trip_us"):
                    row[f"{name}.{metric}"] = row[f"{slow}.{metric}.p50"] / row[f"{fast}.{metric}.p50"]
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    m = "send_to_engine_us"
    tables = [("", "ratio", "")]
    if rows and f"shm.ids.{m}.p50" in rows[0]:
        tables.append((".ids", "ratio_ids", "Prompts given as token ids (`--token-ids`):"))
    lines: list[str] = []
    for suffix, ratio, title in tables:
        inline, shm = f"inline{suffix}", f"shm{suffix}"
        lines += ([title, ""] if title else []) + [
            "| prompt tokens | inline p50 / p90 (µs) | shm p50 / p90 (µs) | inline/shm | "
            "round trip inline p50 (µs) | round trip shm p50 (µs) | inline/shm |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['size']} | {r[f'{inline}.{m}.p50']:.0f} / {r[f'{inline}.{m}.p90']:.0f} | "
                         f"{r[f'{shm}.{m}.p50']:.0f} / {r[f'{shm}.{m}.p90']:.0f} | {r[f'{ratio}.{m}']:.2f}× | "
                         f"{r[f'{inline}.round_trip_us.p50']:.0f} | {r[f'{shm}.round_trip_us.p50']:.0f} | "
                         f"{r[f'{ratio}.round_trip_us']:.2f}× |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def plot(rows: list[dict[str, Any]], modes: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [r["size"] for r in rows]
    for mode in modes:
        ax.plot(sizes, [r[f"{mode}.send_to_engine_us.p50"] for r in rows], marker="o", label=mode)
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="send → ids in engine, p50 (µs)",
           title="Prompt handoff: shared memory vs inline protobuf")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1024,8192,32768,131072", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--breakdown-repeat", type=int, default=20, help="repetitions of each step in the breakdown")
    p.add_argument("--token-ids", action="store_true", help="also measure prompts given as token ids")
    p.add_argument("--out", default="benchmarks/results/handoff.json", help="JSON; .md and .png are written beside it")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)     # the server process
    p.add_argument("--keep-ids", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.serve:
        _run_async(serve(ns.keep_ids))
        return 0
    settings = HandoffSettings(sizes=tuple(int(s) for s in ns.sizes.split(",")), repeat=ns.repeat,
                               warmup=ns.warmup, breakdown_repeat=ns.breakdown_repeat, token_ids=ns.token_ids)
    started = time.time()
    rows = summarize(run := run_handoff(settings), settings)
    largest = rows[-1]
    measured = largest["ratio.send_to_engine_us"]
    result: dict[str, Any] = {
        "benchmark": "handoff", "command": " ".join(["python -m benchmarks.handoff", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), "python": platform.python_version(),
        "settings": asdict(settings), "rows": rows,
        "target": {"ratio": TARGET_RATIO, "size": largest["size"], "metric": "inline/shm, send_to_engine_us p50",
                   "measured": measured, "met": measured >= TARGET_RATIO,
                   "measured_token_ids": largest.get("ratio_ids.send_to_engine_us")},
        "breakdown_us": {str(n): breakdown(n, settings) for n in settings.sizes},
        "samples": [asdict(s) for s in run.samples],
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    table = markdown(rows)
    out.with_suffix(".md").write_text(f"`{result['command']}` — {result['date']}\n\n{table}\n", encoding="utf-8")
    plot(rows, settings.modes, out.with_suffix(".png"))
    print(table)
    print(f"\ntarget ≥ {TARGET_RATIO:g}× at {largest['size']} tokens: {measured:.2f}× — "
          f"{'met' if measured >= TARGET_RATIO else 'NOT met'}")
    if "ratio_ids.send_to_engine_us" in largest:
        ids_ratio = largest["ratio_ids.send_to_engine_us"]
        print(f"prompts given as token ids: {ids_ratio:.2f}× — {'met' if ids_ratio >= TARGET_RATIO else 'NOT met'}")
    print("breakdown at the largest size (µs):",
          json.dumps({k: round(v, 1) for k, v in result["breakdown_us"][str(largest["size"])].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
