"""Structured outputs end to end through the offline API on the default model, each output checked by a
parser no one here wrote: ``json`` + ``jsonschema``, ``re``, ``lark``."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from common.errors import InvalidRequestError
from engine.entrypoints.llm import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}

ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=32, seed=0)


def _prompt(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


def _sampled(spec: StructuredOutputsParams, count: int, max_tokens: int, **kw: object) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, structured_outputs=spec, **kw)
            for i in range(count)]


def _assert_idle(llm: LLM) -> None:
    core = llm.engine
    assert not core.has_unfinished_requests()
    assert core.scheduler.block_manager.num_free_blocks == core.num_blocks
    structured = core.executor.worker.runner.structured  # type: ignore[union-attr]
    assert structured is not None and structured.matchers == {}  # every ended sequence's matcher released


def test_sampled_json_validates_against_a_nested_schema(llm: LLM) -> None:
    prompt = _prompt(llm, "Describe a user of a web site as JSON.")
    outs = llm.generate([prompt] * 20, _sampled(StructuredOutputsParams(json=PERSON), 20, max_tokens=200))
    texts = [o.outputs[0].text for o in outs]
    for out, text in zip(outs, texts):
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
        assert list(json.loads(text)) == list(PERSON["properties"])  # in the schema's order
    assert len(set(texts)) > 1  # sampled, not 20 copies of one answer
    _assert_idle(llm)


def test_sampled_regex_choice_and_lark_grammar_outputs_parse(llm: LLM) -> None:
    regex = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]+)?"
    outs = llm.generate([_prompt(llm, "Write a product code.")] * 8,
                        _sampled(StructuredOutputsParams(regex=regex), 8, max_tokens=32))
    for o in outs:
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text

    choices = ["red", "green", "blue", "dark purple"]
    outs = llm.generate([_prompt(llm, "Name a color.")] * 8,
                        _sampled(GuidedDecodingParams(choice=choices), 8, max_tokens=16))  # vLLM's old name
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs)

    parser = lark.Lark(ARITHMETIC)
    outs = llm.generate([_prompt(llm, "Write an arithmetic expression.")] * 8,
                        _sampled(StructuredOutputsParams(grammar=ARITHMETIC), 8, max_tokens=48))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        parser.parse(o.outputs[0].text)
    _assert_idle(llm)


def test_constrained_and_unconstrained_greedy_rows_match_their_runs_alone(llm: LLM) -> None:
    prompts = [_prompt(llm, "Describe a user as JSON."), _prompt(llm, "Tell me about the sea."),
               _prompt(llm, "Pick a color."), _prompt(llm, "Count to five.")]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PERSON)),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(choice=["red", "green"])),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    unconstrained = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=60))[0].outputs[0].token_ids
    assert alone[0] != unconstrained  # the constraint did change the greedy tokens
    _assert_idle(llm)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
     "structured_outputs.json"),
    (StructuredOutputsParams(regex="([0-9]"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: expr\nexpr: NUMBER +"), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_queuing(llm: LLM, spec: StructuredOutputsParams,
                                                                      field: str) -> None:
    core = llm.engine
    with pytest.raises(InvalidRequestError) as e:
        core.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert e.value.field == field
    assert core.scheduler.get_request("bad") is None
    assert core.scheduler.num_waiting == 0
    _assert_idle(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a" * (64 * 1024 + 1)}, "structured_outputs.regex"),
    ({"json_object": False}, "structured_outputs"),
])
def test_structured_outputs_params_name_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field


def test_guided_decoding_is_the_old_name_of_structured_outputs() -> None:
    spec = GuidedDecodingParams(regex="a+")
    params = SamplingParams(guided_decoding=spec)
    assert params.structured_outputs is spec and params.guided_decoding is None
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(guided_decoding=spec, structured_outputs=spec)
    assert e.value.field == "guided_decoding"


def test_too_few_tokens_for_the_grammar_end_with_length(llm: LLM) -> None:
    out = llm.generate(_prompt(llm, "A user as JSON."),
                       SamplingParams(temperature=0.0, max_tokens=6,
                                      structured_outputs=StructuredOutputsParams(json=PERSON)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith("{")
    _assert_idle(llm)


def test_a_complete_grammar_ends_the_sequence_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(_prompt(llm, "Yes or no?"),
                       SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, min_tokens=10,
                                      structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0]
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    _assert_idle(llm)


def test_every_sequence_of_n_follows_the_schema(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = llm.generate(_prompt(llm, "Describe a user of a web site as JSON."), params)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len({o.text for o in outs}) > 1
    _assert_idle(llm)


def test_any_json_object(llm: LLM) -> None:
    outs = llm.generate([_prompt(llm, "A JSON object please.")] * 4,
                        _sampled(StructuredOutputsParams(json_object=True), 4, max_tokens=120))
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished
    for o in finished:
        assert isinstance(json.loads(o.text), dict)
