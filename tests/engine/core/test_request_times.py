"""RequestTimes: the one output that ends a request carries when it arrived, was first scheduled, got its
first token and ended, over all its sequences — on every path that ends a request (the metrics and the
engine's trace span read them)."""
from __future__ import annotations

import time

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams
from tests.engine.core.tiny_llama import save_tiny_llama

PROMPT = [5, 17, 33, 9, 41, 60, 3, 77, 12, 90]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=64))


def _run(core: EngineCore) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    return outputs


@pytest.mark.parametrize("params", [
    dict(max_tokens=5), dict(max_tokens=4, n=3, temperature=1.0, seed=1),
    dict(max_tokens=3, n=2, best_of=3, temperature=1.0, seed=2),
], ids=["one", "n3", "best_of"])
def test_the_last_output_of_a_request_carries_its_times(core: EngineCore, params: dict[str, object]) -> None:
    before = time.monotonic()
    core.add_request("r", PROMPT, SamplingParams(ignore_eos=True, **params))  # type: ignore[arg-type]
    outputs = _run(core)
    timed = [o for o in outputs if o.times is not None]
    assert [o.request_finished for o in timed] == [True]
    assert sum(o.request_finished for o in outputs) == 1
    t = timed[0].times
    assert t is not None and t.first_scheduled is not None and t.first_token is not None
    assert before <= t.arrival <= t.first_scheduled <= t.first_token <= t.finished <= time.monotonic()
    sequences = int(params.get("best_of", params.get("n", 1)))  # type: ignore[call-overload]
    assert t.num_generation_tokens == sequences * int(params["max_tokens"])  # type: ignore[call-overload]
    assert t.num_preemptions == 0


def test_a_request_aborted_while_waiting_has_times_without_a_schedule(core: EngineCore) -> None:
    core.add_request("w", PROMPT, SamplingParams(max_tokens=5))
    core.abort_requests(["w"])
    outputs = _run(core)
    assert len(outputs) == 1 and outputs[0].request_finished
    t = outputs[0].times
    assert t is not None and t.first_scheduled is None and t.first_token is None and t.num_generation_tokens == 0
