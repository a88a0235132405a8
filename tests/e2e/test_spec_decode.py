"""Speculative decoding end to end: `sluice serve --speculative-config '{"method": "ngram", ...}'` (the shared
stack of tests/e2e/conftest.py) answers the official openai client with the text the offline LLM gives without
speculation, streams several tokens per event when proposals are accepted, keeps structured outputs valid
(constrained sequences do not speculate), and counts its proposals under vLLM's metric names."""
from __future__ import annotations

import json
import urllib.request
from typing import Any

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.sampling_params import SamplingParams
from tests.e2e.conftest import SHARED_SERVED, SPEC_CONFIG
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

# Prompts whose continuations repeat what they hold, so n-gram proposals are accepted.
PROMPTS = ["Repeat this list exactly three times: red, green, blue, yellow, red, green, blue, yellow,",
           "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return add(add(a, b), c)\n\n\ndef add4(",
           "The capital of France is"]


@pytest.fixture(scope="module")
def client(shared_stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def spec_counters(stack: ServeStack) -> dict[str, float]:
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_") and sample.labels.get("model_name") == SHARED_SERVED:
                key = sample.name + (f"[{sample.labels['position']}]" if "position" in sample.labels else "")
                found[key] = found.get(key, 0.0) + sample.value
    return found


@pytest.fixture(scope="module")
def offline() -> Any:
    """The default model in this process, without speculation."""
    from engine import LLM

    return LLM(max_num_seqs=2)


def test_greedy_text_is_the_offline_text_without_speculation(shared_stack: ServeStack, client: openai.OpenAI,
                                                             offline: Any) -> None:
    before = spec_counters(shared_stack)
    served = [client.completions.create(model=SHARED_SERVED, prompt=p, max_tokens=40, temperature=0).choices[0].text
              for p in PROMPTS]
    texts = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0))]
    assert served == texts
    after = spec_counters(shared_stack)
    k = SPEC_CONFIG["num_speculative_tokens"]
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert grew["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < grew["vllm:spec_decode_num_accepted_tokens_total"] <= grew["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = [grew[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(k)]
    assert sum(per_pos) == grew["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)   # a position is accepted only after all before it


def test_a_stream_carries_several_accepted_tokens_per_event(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=SHARED_SERVED, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True})
    stream = client.completions.create(model=SHARED_SERVED, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        texts += [c.text for c in chunk.choices if c.text]
    assert "".join(texts) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == 48   # max_tokens holds: never overshot
    assert len(texts) < 48   # some events carried several tokens


def test_structured_outputs_stay_valid_with_speculation_on(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 4}},
              "required": ["colors"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=SHARED_SERVED, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       response_format=fmt, temperature=0, max_tokens=120)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


def test_a_stop_string_inside_accepted_tokens_ends_the_text_where_it_would(client: openai.OpenAI,
                                                                        offline: Any) -> None:
    """Several tokens accepted at once may run past a stop string: the text still ends just before it."""
    served = client.completions.create(model=SHARED_SERVED, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                       stop=["yellow, red"])
    want = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=48, temperature=0, stop=["yellow, red"]))
    assert served.choices[0].text == want[0].outputs[0].text
    assert served.choices[0].finish_reason == want[0].outputs[0].finish_reason == "stop"
