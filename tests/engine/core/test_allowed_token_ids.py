"""vLLM's ``allowed_token_ids`` on real engine steps (tiny random Llama): every sampled token is one of them,
greedy or sampled, and a request without them is left alone in the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import BeamSearch, SamplingParams
from tests.engine.core.tiny_llama import save_tiny_llama

PROMPT = [5, 17, 33, 9, 41, 60, 3, 77, 12, 90]
ALLOWED = [7, 40, 99]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return path


def _core(path: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=64))


def _run(core: EngineCore, requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for rid, params in requests.items():
        core.add_request(rid, PROMPT, params)
    outputs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    tokens: dict[str, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def test_every_sampled_token_is_an_allowed_one(checkpoint: Path) -> None:
    core = _core(checkpoint)
    tokens = _run(core, {
        "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=ALLOWED),
        "sampled": SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, n=1,
                                  allowed_token_ids=ALLOWED),
        "free": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    })
    assert len(tokens["greedy"]) == len(tokens["sampled"]) == 12
    assert set(tokens["greedy"]) <= set(ALLOWED) and set(tokens["sampled"]) <= set(ALLOWED)
    assert not set(tokens["free"]) <= set(ALLOWED)  # the mask is what kept them in: without it, others come
    # One allowed token: the output is that token throughout.
    assert _run(core, {"one": SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                             allowed_token_ids=[40])})["one"] == [40] * 5


def test_a_sequence_with_allowed_token_ids_samples_one_token_per_step() -> None:
    # As a grammar's sequence: kept off speculative and multi-step lookahead, every token through the sampler.
    assert SamplingParams(allowed_token_ids=ALLOWED).follows_each_token
    assert not SamplingParams().follows_each_token


@pytest.mark.parametrize(("params", "message"), [
    (dict(allowed_token_ids=[7, 128]), "token id [128] out of range [0, 128)"),
    (dict(allowed_token_ids=[]), "must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[7], beam_search=BeamSearch(2), temperature=0.0), "is not supported with beam search"),
])
def test_allowed_token_ids_outside_the_vocabulary_empty_or_with_beams_are_refused(
        checkpoint: Path, params: dict[str, object], message: str) -> None:
    core = _core(checkpoint)
    with pytest.raises(InvalidRequestError) as e:
        core.add_request("r", PROMPT, SamplingParams(max_tokens=4, **params))  # type: ignore[arg-type]
    assert e.value.field == "allowed_token_ids" and message in e.value.message
