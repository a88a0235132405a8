"""``--stream-interval`` (vLLM's name): parsing, forwarding by ``sluice serve``, and the offline API's results
with tokens reported in groups (the grouping itself is tested in test_scheduler and test_engine_stream)."""
from __future__ import annotations

import argparse

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig, default_max_queued_requests
from engine.entrypoints.args import add_engine_args, config_from_args
from services.supervisor import engine_flags


def test_flag_parses_defaults_to_one_and_serve_forwards_it() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).stream_interval == 1
    assert config_from_args(parser.parse_args(["--stream-interval", "8"])).stream_interval == 8
    served = EngineConfig(max_queued_requests=default_max_queued_requests(128))   # as `sluice serve` builds it
    assert engine_flags(served.with_changes(stream_interval=8)) == ["--stream-interval", "8"]
    assert engine_flags(served) == []


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="64MiB", seed=0, num_threads=1)


PROMPT = "Write a short story about a lighthouse keeper."


@pytest.mark.slow
def test_grouped_tokens_give_the_same_greedy_output(llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    one, grouped = llm.generate([PROMPT, PROMPT], [base, base.clone(stream_interval=5)])
    assert grouped.outputs[0].token_ids == one.outputs[0].token_ids and len(one.outputs[0].token_ids) == 24
    assert grouped.outputs[0].text == one.outputs[0].text
    assert grouped.outputs[0].logprobs == one.outputs[0].logprobs
    assert grouped.outputs[0].cumulative_logprob == one.outputs[0].cumulative_logprob


@pytest.mark.slow
def test_a_stop_string_inside_a_group_ends_text_and_tokens_where_it_matched(llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(PROMPT, base)[0].outputs[0]
    # A stop string made of tokens 6 and 7: under an interval of 4 it completes inside the group 5..8.
    pieces = [llm.tokenizer.decode([t]) for t in ref.token_ids]
    stop = "".join(pieces[6:8])
    assert stop.strip() and ref.text.count(stop) == 1, "pick tokens whose text occurs once"
    out = llm.generate(PROMPT, base.clone(stream_interval=4, stop=[stop]))[0].outputs[0]
    assert out.text == ref.text[: ref.text.index(stop)]
    assert out.token_ids == ref.token_ids[:8]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
