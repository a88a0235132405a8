from __future__ import annotations

import math

import pytest

from common.errors import InvalidRequestError
from engine.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {3: -101.0}}, "logit_bias"),
        ({"seed": "7"}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_argument_names_its_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [5, 100]}, "stop_token_ids"),
    ],
)
def test_token_ids_out_of_vocab_rejected_by_validate(kwargs: dict[str, object], field: str) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]  # fine without a vocabulary
    with pytest.raises(InvalidRequestError) as info:
        params.validate(vocab_size=100)
    assert info.value.field == field


def test_in_vocab_token_ids_pass_validate() -> None:
    SamplingParams(logit_bias={99: 100.0, 0: -100.0}, stop_token_ids=[0, 99]).validate(vocab_size=100)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"logprobs": 0},
        {"logprobs": 20},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.5},
        {"seed": -3},
    ],
)
def test_edge_values_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("top_k", [0, -1, None])
def test_disabled_top_k_is_none(top_k: int | None) -> None:
    assert SamplingParams(top_k=top_k).top_k is None


def test_normalization_of_stop_and_logit_bias() -> None:
    params = SamplingParams(stop="###", logit_bias={"7": 2})  # type: ignore[arg-type, dict-item]
    assert params.stop == ["###"]
    assert params.logit_bias == {7: 2.0}
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
