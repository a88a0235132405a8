"""AsyncEngine: the core's thread survives callers that give up, every request ends once, and the core is
built on the thread that steps it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from common.errors import EngineDeadError, QueueFullError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.entrypoints.async_engine import AsyncEngine, _Add, _Call
from tests.lora_factory import make_tiny_model
from tests.procs import ROOT, free_port

pytestmark = pytest.mark.slow


class _Nowhere:
    """An output group nobody reads."""

    loop = None

    def deliver(self, outputs: list[object]) -> None:
        raise AssertionError("a cancelled add must produce no output")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_hf_tokenizer: Any) -> EngineConfig:
    """Engine settings for a tiny random checkpoint with the default model's tokenizer (the served engine reads
    it): these tests are about threads and calls, not the model, and it loads in a fraction of the time."""
    path = tmp_path_factory.mktemp("tiny")
    default_hf_tokenizer.save_pretrained(path)
    make_tiny_model(vocab_size=len(default_hf_tokenizer), eos_token_id=default_hf_tokenizer.eos_token_id,
                    bos_token_id=default_hf_tokenizer.bos_token_id).save_pretrained(path)
    return EngineConfig(model=str(path), dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(tiny: EngineConfig, request: pytest.FixtureRequest) -> AsyncEngine:
    """The served engine's thread, with steps scheduled one after another and with async scheduling."""
    eng = AsyncEngine(EngineCore(tiny.with_changes(async_scheduling=request.param)))
    yield eng
    eng.shutdown()


def test_cancelled_callers_do_not_kill_the_engine_thread(engine: AsyncEngine) -> None:
    # A call and an add whose callers already gave up (their futures are cancelled) are skipped.
    call: Future[object] = Future()
    call.cancel()
    engine._commands.put(_Call(lambda core: core.info(), call))  # noqa: SLF001
    add: Future[None] = Future()
    add.cancel()
    engine._commands.put(_Add("gone", [1, 2, 3], SamplingParams(max_tokens=2), 0, _Nowhere(), add))  # noqa: SLF001

    async def after() -> dict[str, object]:
        return await engine.call(lambda core: core.info())

    info = asyncio.run(after())
    assert engine.is_alive
    assert info["num_waiting"] == 0 and info["num_running"] == 0  # the cancelled add never ran


def test_stream_ends_with_one_terminal_output_and_early_exit_aborts(engine: AsyncEngine) -> None:
    async def run() -> tuple[list[FinishReason | None], int]:
        reasons = []
        async for out in engine.generate("full", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                                            ignore_eos=True)):
            reasons.append(out.finish_reason)
        got = 0
        async for out in engine.generate("early", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
            got += len(out.new_token_ids)
            if got >= 2:
                break  # leaving early aborts the request
        for _ in range(100):
            info = await engine.call(lambda core: core.info())
            if info["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        return reasons, info["free_kv_blocks"] - info["total_kv_blocks"]

    reasons, free_minus_total = asyncio.run(run())
    assert reasons[-1] is FinishReason.LENGTH and all(r is None for r in reasons[:-1])
    assert free_minus_total == 0


def test_a_request_arrives_when_submitted_not_when_the_busy_engine_thread_takes_it(engine: AsyncEngine) -> None:
    # The engine thread is busy (a 0.3 s call standing in for a long step) when the request comes: its queue time
    # and TTFT count that wait, as a client sees it (vLLM's clocks start at its frontend too).
    async def run() -> tuple[float, float, Any]:
        busy = asyncio.ensure_future(engine.call(lambda core: time.sleep(0.3)))
        await asyncio.sleep(0.05)   # the call is running on the engine thread
        submitted = time.monotonic()
        times = None
        async for out in engine.generate("late", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2,
                                                                            ignore_eos=True)):
            times = out.times if out.times is not None else times
        await busy
        return submitted, time.monotonic(), times

    submitted, ended, times = asyncio.run(run())
    assert times is not None and times.first_scheduled is not None and times.first_token is not None
    assert submitted <= times.arrival < submitted + 0.05          # stamped when submitted
    assert times.first_scheduled - times.arrival >= 0.2          # then waited for the busy thread
    assert times.first_token <= ended


def test_a_step_reaches_the_event_loop_once_for_all_its_requests(engine: AsyncEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # One call_soon_threadsafe (one wake-up of the loop) per step, however many requests ran in it.
    import engine.entrypoints.async_engine as async_engine

    handbacks: list[int] = []
    deliver_all = async_engine._deliver_all  # noqa: SLF001

    def counted(batches: list[tuple[object, list[object]]]) -> None:
        handbacks.append(sum(len(outs) for _, outs in batches))
        deliver_all(batches)

    monkeypatch.setattr(async_engine, "_deliver_all", counted)

    async def run() -> tuple[dict[str, list[int]], int]:
        steps_before = await engine.call(lambda core: core.total_steps)

        async def one(rid: str, prompt: list[int]) -> list[int]:
            return [t async for out in engine.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=5,
                                                                                   ignore_eos=True))
                    for t in out.new_token_ids]

        prompts = {f"h{i}": [5 + i, 6, 7] for i in range(4)}
        tokens = await asyncio.gather(*(one(rid, p) for rid, p in prompts.items()))
        return dict(zip(prompts, tokens)), await engine.call(lambda core: core.total_steps) - steps_before

    tokens, steps = asyncio.run(run())
    assert all(len(t) == 5 for t in tokens.values())
    assert sum(handbacks) == 20  # every output, each once
    assert len(handbacks) <= steps < 20  # batched: one hand-back per step, not one per output
    assert max(handbacks) == 4  # a decode step's four outputs came together


class _SchedulerCore:
    """The EngineCore calls AsyncEngine makes, around a real Scheduler and no model (every sample is token 7)."""

    def __init__(self, config: EngineConfig) -> None:
        self.scheduler = Scheduler(config, 1024, eos_token_ids={2}, max_model_len=4096)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                    lora_request: object = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, resumed_output_tokens: int = 0,
                    mm_items: tuple[object, ...] = (), kv_transfer: object = None) -> None:
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params, priority=priority,
                                           arrival_time=arrival_time, cache_salt=cache_salt))

    def abort_requests(self, targets: list[str], *, reason: FinishReason = FinishReason.ABORT) -> None:
        for request_id in targets:
            self.scheduler.abort_request(request_id, reason=reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        return self.scheduler.update_from_output(out, {seq_id: [7] for s in out.scheduled
                                                       for seq_id in s.sample_seq_ids})

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Collect:
    """An output group that counts each request's terminal outputs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.finished: list[str] = []

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        self.finished += [out.request_id for out in outputs if out.request_finished]


def test_a_burst_on_an_idle_engine_is_refused_only_past_the_free_seats_and_the_queue() -> None:
    # The case through the engine thread: 64 seats, 16 queue places, 100 adds handled before any step
    # (the thread is held by a call while they queue up, so all land in one batch): 80 in, 20 QueueFullError.
    core = _SchedulerCore(EngineConfig(max_num_seqs=64, max_queued_requests=16))
    eng = AsyncEngine(lambda: core)  # type: ignore[arg-type, return-value]
    gate = threading.Event()
    held: Future[object] = Future()
    eng._commands.put(_Call(lambda c: gate.wait(10), held))  # noqa: SLF001

    async def run() -> tuple[list[str], list[str], list[str]]:
        group = _Collect(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        adds = {f"r{i}": eng.submit(f"r{i}", [5, 6, 7], params, group) for i in range(100)}
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in adds.values()),
                                                        return_exceptions=True), 10)
        refused = [rid for rid, r in zip(adds, results) if isinstance(r, QueueFullError)]
        accepted = [rid for rid, r in zip(adds, results) if r is None]
        for _ in range(500):
            if len(group.finished) >= len(accepted):
                break
            await asyncio.sleep(0.01)
        return accepted, refused, group.finished

    try:
        accepted, refused, finished = asyncio.run(run())
        assert held.result() is True   # the adds really waited behind the held thread
        assert accepted == [f"r{i}" for i in range(80)] and refused == [f"r{i}" for i in range(80, 100)]
        assert sorted(finished, key=lambda rid: int(rid[1:])) == accepted   # each accepted one ends, once
        assert eng.is_alive and not core.has_unfinished_requests()
    finally:
        eng.shutdown()


def test_launch_builds_the_core_on_the_thread_that_steps_it(tiny: EngineConfig) -> None:
    # Loading (and warm-up) on the stepping thread keeps one OpenMP pool per process (see AsyncEngine).
    built_on: list[int] = []

    def build() -> EngineCore:
        built_on.append(threading.get_ident())
        return EngineCore(tiny)

    async def run() -> tuple[AsyncEngine, int, list[FinishReason | None]]:
        eng = await AsyncEngine.launch(build)
        reasons = [out.finish_reason async for out in
                   eng.generate("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))]
        return eng, await eng.call(lambda core: threading.get_ident()), reasons

    eng, stepping_thread, reasons = asyncio.run(run())
    try:
        assert eng.started.done() and eng.is_alive
        assert built_on == [stepping_thread] and stepping_thread != threading.get_ident()
        assert reasons[-1] is FinishReason.LENGTH
    finally:
        eng.shutdown()


def test_launch_raises_what_the_build_raised_and_refuses_requests() -> None:
    def build() -> EngineCore:
        raise FileNotFoundError("no model at /nowhere")

    async def run() -> AsyncEngine:
        eng = AsyncEngine(build)
        # Queued before the build failed, or sent after: either way it fails, it never hangs.
        queued = asyncio.ensure_future(eng.call(lambda core: core.info()))
        with pytest.raises(FileNotFoundError, match="/nowhere"):
            await asyncio.wrap_future(eng.started)
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate("x", [1, 2], SamplingParams(max_tokens=2)):
                pass
        later = asyncio.ensure_future(eng.call(lambda core: core.info()))
        results = await asyncio.wait_for(asyncio.gather(queued, later, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(FileNotFoundError):
            await AsyncEngine.launch(build)
        return eng

    eng = asyncio.run(run())
    assert not eng.is_alive
    eng.shutdown(timeout=5)
    assert not eng._thread.is_alive()  # noqa: SLF001


_SERVE_THREADS = """
import asyncio, json, os, signal, sys, threading
import grpc
import engine.core.engine_core as core_mod
import engine.entrypoints.grpc_servicer as server
from engine.config import EngineConfig
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc

seen = {"init": [], "step": set()}
init, step = core_mod.EngineCore.__init__, core_mod.EngineCore.step
def traced_init(self, *a, **k):
    seen["init"].append(threading.get_ident())
    init(self, *a, **k)
def traced_step(self):
    seen["step"].add(threading.get_ident())
    return step(self)
core_mod.EngineCore.__init__, core_mod.EngineCore.step = traced_init, traced_step
port, model = int(sys.argv[1]), sys.argv[2]

async def main():
    ready = asyncio.Event()
    config = EngineConfig(model=model, dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1)
    serving = asyncio.ensure_future(server.serve(config, "127.0.0.1", port, ready=ready))
    await asyncio.wait([asyncio.ensure_future(ready.wait()), serving], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        serving.result()  # a build that failed: its error, not a wait for a ready that never comes
    steps_at_ready = set(seen["step"])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        request = engine_pb2.EngineGenerateRequest(request_id="r")
        request.prompt_token_ids.ids.extend([5, 6, 7])
        request.stopping.max_tokens = 3
        request.stopping.ignore_eos = True
        tokens = [i async for m in engine_pb2_grpc.EngineStub(ch).Generate(request) for i in m.token_ids]
    os.kill(os.getpid(), signal.SIGTERM)
    await serving
    print(json.dumps({"init": seen["init"], "step": sorted(seen["step"]), "warm_up": sorted(steps_at_ready),
                      "loop": threading.get_ident(), "tokens": len(tokens)}))

asyncio.run(main())
"""


def test_engine_process_loads_warms_up_and_steps_on_one_thread(tmp_path: Path, tiny: EngineConfig) -> None:
    # The served engine: model load, warm-up and every request's steps on one thread, not the event loop's.
    script = tmp_path / "serve_threads.py"
    script.write_text(_SERVE_THREADS, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script), str(free_port()), str(tiny.model)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["tokens"] == 3
    assert len(seen["init"]) == 1 and seen["warm_up"] == seen["init"]  # warm-up stepped before ready
    assert seen["step"] == seen["init"] and seen["init"][0] != seen["loop"]
