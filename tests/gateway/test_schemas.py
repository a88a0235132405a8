"""Request parsing: defaults, spellings and conversions (the 400s are in test_error_matrix)."""

from __future__ import annotations

import pytest

from gateway.backend import ChatTurn, GenerationParams, Prompt
from gateway.errors import ApiError
from gateway.fields import parse_json_object
from gateway.schemas import parse_chat, parse_completion, parse_detokenize, parse_tokenize


def test_completion_defaults() -> None:
    req = parse_completion({"prompt": "hi"}, max_n=16)
    assert req.prompts == (Prompt(text="hi"),)
    assert req.params == GenerationParams(max_tokens=16)
    assert (req.is_chat, req.model, req.stream, req.include_usage) == (False, None, False, False)


def test_chat_defaults_have_no_max_tokens() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "x"}]}, max_n=16)
    assert req.params == GenerationParams()
    assert req.prompts == (Prompt(chat=(ChatTurn("user", "x"),), add_generation_prompt=True),)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7},
                     max_n=16)
    assert req.params.max_tokens == 7


def test_integral_floats_are_integers() -> None:
    assert parse_completion({"prompt": "x", "max_tokens": 16.0, "n": 2.0}, max_n=16).params.max_tokens == 16


def test_stream_interval_in_both_endpoints() -> None:
    assert parse_completion({"prompt": "x", "stream_interval": 8}, max_n=16).params.stream_interval == 8
    chat = {"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_interval": 3}
    assert parse_chat(chat, max_n=16).params.stream_interval == 3
    assert parse_completion({"prompt": "x"}, max_n=16).params.stream_interval is None


@pytest.mark.parametrize(("top_k", "expected"), [(-1, None), (0, None), (1, 1), (50, 50)])
def test_top_k_disabled_spellings(top_k: int, expected: int | None) -> None:
    assert parse_completion({"prompt": "x", "top_k": top_k}, max_n=16).params.top_k == expected


def test_nulls_read_as_absent() -> None:
    req = parse_completion({"prompt": "x", "temperature": None, "stop": None, "n": None, "stream": None,
                            "logprobs": None, "max_tokens": None}, max_n=16)
    assert req.params == GenerationParams(max_tokens=16)


def test_completion_logprobs_zero_still_returns_logprobs() -> None:
    params = parse_completion({"prompt": "x", "logprobs": 0}, max_n=16).params
    assert (params.logprobs, params.top_logprobs) == (True, 0)


def test_stop_string_and_stream_options() -> None:
    req = parse_completion({"prompt": "x", "stop": "END", "stream": True, "stream_options": {"include_usage": True}},
                           max_n=16)
    assert req.params.stop == ("END",)
    assert (req.stream, req.include_usage) == (True, True)


def test_prompt_shapes() -> None:
    assert parse_completion({"prompt": [1, 2]}, 16).prompts == (Prompt(token_ids=(1, 2)),)
    assert parse_completion({"prompt": [[1], [2, 3]]}, 16).prompts == (Prompt(token_ids=(1,)),
                                                                        Prompt(token_ids=(2, 3)))
    assert parse_completion({"prompt": ["a", "b"]}, 16).prompts == (Prompt(text="a"), Prompt(text="b"))


def test_max_n_is_the_settings_value() -> None:
    assert parse_completion({"prompt": "x", "n": 4}, max_n=4).params.n == 4
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", "n": 5}, max_n=4)
    assert (info.value.status, info.value.param) == (400, "n")


def test_chat_without_generation_prompt() -> None:
    req = parse_chat({"messages": [{"role": "assistant", "content": "Sure"}], "add_generation_prompt": False}, 16)
    assert req.prompts[0].add_generation_prompt is False


def test_tokenize_and_detokenize() -> None:
    req = parse_tokenize({"prompt": "x", "add_special_tokens": False})
    assert (req.prompt, req.add_special_tokens, req.return_token_strs) == (Prompt(text="x"), False, False)
    assert parse_tokenize({"prompt": "x"}).add_special_tokens is None
    assert parse_detokenize({"tokens": []}).token_ids == ()


def test_tokenize_chat_takes_tools_and_template_fields_as_chat_completions_does() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "chat_template": "{{ 1 }}",
            "chat_template_kwargs": {"enable_thinking": False}}
    prompt = parse_tokenize(body).prompt
    assert prompt == parse_chat(body, 16).prompts[0]
    assert [t.name for t in prompt.tools] == ["f"]
    assert (prompt.chat_template, prompt.chat_template_kwargs) == ("{{ 1 }}", '{"enable_thinking": false}')


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'"s"', b'{"a": Infinity}', b"\xff\xfe"])
def test_bodies_that_are_not_json_objects(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_json_object(raw)
    assert info.value.status == 400 and info.value.param is None
