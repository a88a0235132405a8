"""EngineCore.add_request against the engine's settings (--max-logprobs, --scheduling-policy), and priority
preemption on a real model: a preempted request's greedy tokens are those it gets alone, every block returns."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.args import add_engine_args, config_from_args
from tests.engine.core.tiny_llama import save_tiny_llama

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [5, 17, 33, 9, 41, 60, 3, 77, 12, 90], "b": [8, 21, 64, 30, 99, 11, 45, 70, 6, 52],
           "c": [15, 25, 35, 45, 55, 65, 75, 85, 95, 105, 115, 125]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return path


def _core(path: Path, **kw: object) -> EngineCore:
    args: dict[str, object] = dict(model=str(path), dtype="float32", block_size=4, num_kv_blocks=64)
    args.update(kw)
    return EngineCore(EngineConfig(**args))  # type: ignore[arg-type]


def _drain(core: EngineCore, outputs: list[EngineCoreOutput]) -> None:
    while core.has_unfinished_requests():
        outputs.extend(core.step())


def _tokens(outputs: list[EngineCoreOutput]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def _alone(core: EngineCore, rid: str, max_tokens: int) -> list[int]:
    core.add_request(f"{rid}-alone", PROMPTS[rid], SamplingParams(max_tokens=max_tokens, **GREEDY))  # type: ignore[arg-type]
    outputs: list[EngineCoreOutput] = []
    _drain(core, outputs)
    return _tokens(outputs)[f"{rid}-alone"]


@pytest.mark.parametrize(("field", "value", "limit", "refused"), [
    ("logprobs", 21, None, True), ("logprobs", 20, None, False),
    ("prompt_logprobs", 21, None, True), ("prompt_logprobs", 20, None, False),
    ("logprobs", 31, 30, True), ("logprobs", 30, 30, False),
    ("prompt_logprobs", 1, 0, True), ("prompt_logprobs", 0, 0, False),
])
def test_max_logprobs_bounds_logprobs_and_prompt_logprobs(checkpoint: Path, field: str, value: int,
                                                          limit: int | None, refused: bool) -> None:
    core = _core(checkpoint) if limit is None else _core(checkpoint, max_logprobs=limit)
    params = SamplingParams(max_tokens=1, **{field: value})  # type: ignore[arg-type]
    if not refused:
        core.add_request("r", [5, 6, 7], params)
        assert core.scheduler.num_waiting == 1
        return
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("r", [5, 6, 7], params)
    assert info.value.field == field
    assert f"at most {limit if limit is not None else 20} (the engine's --max-logprobs)" in str(info.value)
    assert not core.has_unfinished_requests()


def test_max_logprobs_flag_and_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).max_logprobs == 20
    assert config_from_args(parser.parse_args(["--max-logprobs", "50"])).max_logprobs == 50
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(max_logprobs=-1)
    assert info.value.field == "max_logprobs"
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{field: -1})  # type: ignore[arg-type]
        assert info.value.field == field


def test_fcfs_refuses_a_priority(checkpoint: Path) -> None:
    core = _core(checkpoint)
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1), priority=-1)
    assert info.value.field == "priority" and "--scheduling-policy priority" in str(info.value)
    assert not core.has_unfinished_requests()
    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1), priority=0)
    assert core.scheduler.num_waiting == 1


@pytest.mark.parametrize("full", ["seats", "blocks"])
def test_a_high_priority_arrival_preempts_the_lowest_priority_request(checkpoint: Path, full: str) -> None:
    # seats: max_num_seqs is reached. blocks: a and b hold 8 of 10 blocks and c's 12-token prompt needs 3.
    limits = {"max_num_seqs": 2} if full == "seats" else {"num_kv_blocks": 10}
    core = _core(checkpoint, scheduling_policy="priority", **limits)
    a = core.add_request("a", PROMPTS["a"], SamplingParams(max_tokens=10, **GREEDY), priority=1)  # type: ignore[arg-type]
    b = core.add_request("b", PROMPTS["b"], SamplingParams(max_tokens=10, **GREEDY), priority=2)  # type: ignore[arg-type]
    outputs: list[EngineCoreOutput] = []
    for _ in range(4):
        outputs.extend(core.step())
    assert core.info()["free_kv_blocks"] == (56 if full == "seats" else 2)
    core.add_request("c", PROMPTS["c"], SamplingParams(max_tokens=4, **GREEDY), priority=-1)  # type: ignore[arg-type]
    outputs.extend(core.step())
    assert (a.num_preemptions, b.num_preemptions, core.scheduler.num_preemptions) == (0, 1, 1)
    _drain(core, outputs)
    # c ran ahead of b; exactly one terminal output per request; every block back.
    ends = [o.request_id for o in outputs if o.finished]
    assert sorted(ends) == ["a", "b", "c"] and ends.index("c") < ends.index("b")
    assert [o.request_id for o in outputs if o.request_finished] == ends
    assert core.info()["free_kv_blocks"] == core.num_blocks
    got = _tokens(outputs)
    assert got == {"a": _alone(core, "a", 10), "b": _alone(core, "b", 10), "c": _alone(core, "c", 4)}
    assert len(got["b"]) == 10
