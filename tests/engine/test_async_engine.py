"""AsyncEngine: the core's thread survives callers that give up, and every request ends once."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from engine.async_engine import AsyncEngine, _Add, _Call
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> AsyncEngine:
    eng = AsyncEngine(EngineCore(EngineConfig(dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1)))
    yield eng
    eng.shutdown()


def test_cancelled_callers_do_not_kill_the_engine_thread(engine: AsyncEngine) -> None:
    # A call and an add whose callers already gave up (their futures are cancelled) are skipped.
    call: Future[object] = Future()
    call.cancel()
    engine._commands.put(_Call(lambda core: core.info(), call))  # noqa: SLF001
    add: Future[None] = Future()
    add.cancel()
    engine._commands.put(_Add("gone", [1, 2, 3], SamplingParams(max_tokens=2), 0, lambda out: None, add))  # noqa: SLF001

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
