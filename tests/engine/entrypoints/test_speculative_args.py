"""--speculative-config as vLLM takes it: whole JSON, its keys one by one (``--speculative-config.key value``), the
``-sc``/``--spec-*`` shorthands; what Sluice cannot run is refused naming the flag and the key."""

from __future__ import annotations

import argparse

import pytest

from common.errors import InvalidRequestError
from engine.config import SpeculativeConfig
from engine.entrypoints.args import add_engine_args, config_from_args
from engine.entrypoints.vllm_compat import normalize_flag_spelling

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=1)
DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="/m/draft")


def _spec(*argv: str) -> SpeculativeConfig | None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(normalize_flag_spelling(argv))).speculative_config


@pytest.mark.parametrize("argv, expected", [
    ((), None),
    (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                              '"prompt_lookup_min": 1}'), NGRAM),
    (("--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "3",
      "--speculative_config.prompt_lookup_max=4", "--speculative-config.prompt-lookup-min", "1"), NGRAM),
    # Keys given one by one are merged over the whole object, wherever it stands.
    (("--speculative-config.num_speculative_tokens", "3", "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 9, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'), NGRAM),
    (("--speculative-config={\"prompt-lookup-max\": 4}", "--speculative-config.num_speculative_tokens=3",
      "--speculative-config.prompt_lookup_min=1"), NGRAM),
    (("-sc", '{"model": "/m/draft", "num_speculative_tokens": 2}'), DRAFT),   # method follows from the model
    (("--spec-model", "/m/draft", "--spec-tokens", "2"), DRAFT),
    (("--spec-method", "ngram", "--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                                                         '"prompt_lookup_min": 1}'), NGRAM),
])
def test_the_flag_and_its_vllm_spellings_set_the_config(argv: tuple[str, ...],
                                                         expected: SpeculativeConfig | None) -> None:
    assert _spec(*argv) == expected


@pytest.mark.parametrize("argv, field, words", [
    (("--speculative-config", "{method: ngram}"), "--speculative-config", "is not valid JSON"),
    (("--speculative-config", "[3]"), "--speculative-config", "must be a JSON object"),
    (("--speculative-config", '{"num_speculative_tokens": 3, "draft_samples": 2}'),
     "--speculative-config.draft_samples", "unknown or unsupported key"),
    (("--speculative-config", '{"method": "eagle", "model": "/m/head", "num_speculative_tokens": 3}'),
     "--speculative-config.method", "'eagle' is not supported"),
    (("--speculative-config.method", "ngram"), "--speculative-config.num_speculative_tokens", "is required"),
    (("--speculative-config.num_speculative_tokens", "0"), "--speculative-config.num_speculative_tokens",
     "must be an integer >= 1"),
    (("--speculative-config", '{"num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}'),
     "--speculative-config.draft_tensor_parallel_size", "is not supported"),
    (("--spec-tokens", "2", "--speculative-config", '{"num_speculative_tokens": 3}'), "--spec-tokens",
     "'num_speculative_tokens', which --speculative-config sets too"),
])
def test_refused_naming_the_flag_and_key(argv: tuple[str, ...], field: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        _spec(*argv)
    assert e.value.field == field and words in e.value.message


def test_keys_given_one_by_one_become_the_flags_json() -> None:
    assert normalize_flag_spelling(["--max_model_len", "64", "--speculative_config.num_speculative_tokens", "3",
                                    "--speculative-config.method=ngram", "--a.b.c", "x", "--model", "/m/a.b"]) == [
        "--max-model-len", "64", "--model", "/m/a.b", "--speculative-config",
        '{"num_speculative_tokens": 3, "method": "ngram"}', "--a", '{"b": {"c": "x"}}']
