"""Async scheduling gives the tokens of sync scheduling (greedy and seeded, n > 1, penalties, preemption, prefix hits,
aborts mid-step, stops), every KV block returns, and the next step's inputs are ready before a slowed step ends."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from tests.lora_factory import save_tiny_model

EOS = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("async")
    paths = {}
    for arch, seed in (("llama", 1), ("qwen2", 3)):
        paths[arch] = root / arch
        save_tiny_model(paths[arch], arch, seed)
    return paths


def prompts(count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(3, 128, size=shared)]
    return [prefix + [int(t) for t in rng.integers(3, 128, size=int(rng.integers(2, 40)))] for _ in range(count)]


def engine(model: Path, async_scheduling: bool, **config: Any) -> EngineCore:
    cfg = EngineConfig(model=str(model), async_scheduling=async_scheduling, disable_log_stats=True,
                       **{"dtype": "float32", "num_kv_blocks": 256, **config})
    return EngineCore(cfg, show_progress=False)


def run(core: EngineCore, batch: list[list[int]], params: list[SamplingParams], *,
        abort_at: dict[int, list[str]] | None = None) -> dict[tuple[str, int], tuple[list[int], str | None]]:
    """Every sequence's tokens and finish reason; ``abort_at``: request ids aborted after that many steps."""
    for i, (prompt, p) in enumerate(zip(batch, params)):
        core.add_request(str(i), prompt, p)
    got: dict[tuple[str, int], tuple[list[int], str | None]] = {}
    finals: dict[tuple[str, int], int] = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            key = (out.request_id, out.index)
            tokens, _ = got.get(key, ([], None))
            got[key] = (tokens + list(out.new_token_ids), None if out.finish_reason is None else
                        out.finish_reason.value)
            if out.finish_reason is not None:
                finals[key] = finals.get(key, 0) + 1
        steps += 1
        for request_id in (abort_at or {}).get(steps, []):
            core.abort_requests([request_id])
        core.scheduler.block_manager.check_invariants([r for r in core.scheduler.requests.values() if r.block_ids])
    assert core.scheduler.block_manager.num_free_blocks == core.num_blocks   # every block came back
    assert set(finals.values()) <= {1} and set(finals) == set(got)          # one terminal output each
    return got


def both(model: Path, batch: list[list[int]], params: list[SamplingParams], **kw: Any
         ) -> tuple[dict[tuple[str, int], tuple[list[int], str | None]], EngineCore]:
    abort_at = kw.pop("abort_at", None)
    sync = run(engine(model, False, **kw), batch, params, abort_at=abort_at)
    core = engine(model, True, **kw)
    assert core.async_scheduling
    got = run(core, batch, params, abort_at=abort_at)
    assert got == sync
    return got, core


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_and_seeded_tokens_equal_sync_scheduling(checkpoints: dict[str, Path], arch: str) -> None:
    batch = prompts(24)

    def params(stops: dict[int, int]) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=int(7 + i % 13), temperature=0.0 if i % 3 == 0 else 0.9, seed=i,
                               top_p=0.9 if i % 2 else 1.0, logprobs=2 if i % 5 == 0 else None, ignore_eos=True,
                               stop_token_ids=[stops[i]] if i in stops else []) for i in range(len(batch))]

    free = run(engine(checkpoints[arch], False), batch, params({}))
    # Every fourth request stops at its third token (a stop token met while the step ahead is scheduled).
    stops = {i: free[(str(i), 0)][0][2] for i in range(1, len(batch), 4)}
    got, core = both(checkpoints[arch], batch, params(stops), max_num_batched_tokens=48)
    assert all(got[(str(i), 0)][1] == "stop" and len(got[(str(i), 0)][0]) <= 3 for i in stops)
    assert core.scheduler.num_preemptions == 0


def test_eos_length_and_max_model_len_end_sequences_as_in_sync(checkpoints: dict[str, Path]) -> None:
    """EOS met while the next step is already scheduled (that row's token is dropped), and max_tokens and
    max_model_len limits, which the scheduler must not run past with a pending token."""
    batch = prompts(16, seed=1)
    params = [SamplingParams(max_tokens=None if i % 2 else 40, temperature=0.8, seed=100 + i) for i in range(16)]
    got, _ = both(checkpoints["llama"], batch, params, max_model_len=48)
    reasons = {reason for _, reason in got.values()}
    assert "length" in reasons and "eos" in reasons


def test_n_best_of_penalties_and_min_tokens_run_synchronously_and_equal(checkpoints: dict[str, Path]) -> None:
    batch = prompts(8, seed=2)
    params = [SamplingParams(n=3, seed=1, max_tokens=10), SamplingParams(best_of=3, n=2, seed=2, max_tokens=8),
              SamplingParams(repetition_penalty=1.3, seed=3, max_tokens=12),
              SamplingParams(min_tokens=6, seed=4, max_tokens=9), SamplingParams(temperature=0.0, max_tokens=14),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, seed=5, max_tokens=10),
              SamplingParams(n=2, temperature=0.0, max_tokens=6), SamplingParams(seed=6, max_tokens=11)]
    got, _ = both(checkpoints["qwen2"], batch, params)
    assert len(got) == 3 + 2 + 1 + 1 + 1 + 1 + 2 + 1


def test_preemption_prefix_hits_and_aborts_mid_step(checkpoints: dict[str, Path]) -> None:
    """Few blocks: sequences are preempted while the step ahead of them runs (their pending token is kept and
    recomputed); a shared prefix gives cache hits; requests aborted while a step runs end once, freeing blocks."""
    batch = prompts(12, seed=3, shared=20)
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 1.0, seed=7 * i, ignore_eos=True)
              for i in range(12)]
    got, core = both(checkpoints["llama"], batch, params, num_kv_blocks=14, block_size=8,
                     abort_at={3: ["1", "4"], 6: ["7"]})
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.prefix_cache_hits > 0
    assert {got[(r, 0)][1] for r in ("1", "4", "7")} == {"abort"}


@pytest.mark.parametrize("async_on", [True, False])
def test_the_next_steps_inputs_are_ready_before_a_slow_step_ends(checkpoints: dict[str, Path], async_on: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass slowed by 0.2 s: while step N runs, step N + 1 is scheduled and prepared (its staging
    buffers filled), so its prepare ends before step N's forward does; with async off it comes after."""
    core = engine(checkpoints["llama"], async_on)
    runner = core.executor.worker.runner  # type: ignore[attr-defined]
    stage = runner.stage
    events: list[tuple[str, float]] = []
    lock = threading.Lock()
    real_run, real_prepare = stage.run, runner.prepare

    def slow_run(*args: Any) -> Any:
        time.sleep(0.2)
        result = real_run(*args)
        with lock:
            events.append(("forward end", time.monotonic()))
        return result

    def timed_prepare(out: Any) -> Any:
        prepared = real_prepare(out)
        with lock:
            events.append(("prepared", time.monotonic()))
        return prepared

    monkeypatch.setattr(stage, "run", slow_run)
    monkeypatch.setattr(runner, "prepare", timed_prepare)
    core.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    core.close()
    assert len(tokens) == 4
    ends = [t for k, t in events if k == "forward end"]
    prepared = [t for k, t in events if k == "prepared"]
    assert len(ends) == len(prepared) == 4
    # Step k + 1 was prepared before step k's forward pass ended (async), or after it (sync).
    assert [p < e for p, e in zip(prepared[1:], ends)] == [async_on] * 3
