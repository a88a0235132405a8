"""services/tokenizer/prompt.py: a generation request's prompt options, vLLM's ``truncate_prompt_tokens`` (the
last N tokens are kept) and ``add_special_tokens`` (text: default true, chat: default false). The tokenizer is
the default model's with a BOS post-processor added, so that special tokens show."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer

from common.errors import InvalidRequestError
from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, generation_pb2
from services.tokenizer.service import GenerationServicer
from tests.services.test_bounded_input import MAX_MODEL_LEN, chat, refusal, served

BOS = 1


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    base = Tokenizer.from_pretrained(default_model_path())
    return Tokenizer(HFTokenizer.from_str(base.backend.to_str()), bos_token_id=BOS, eos_token_id=2,
                     chat_template=base.chat_template, add_bos_token=True)


def ids_of(tokenizer: Tokenizer, **fields: object) -> list[int]:
    async def body(servicer: GenerationServicer) -> list[int]:
        return [int(i) for i in await servicer.prompt_ids(generation_pb2.GenerateRequest(**fields))]  # type: ignore[arg-type]
    return served(tokenizer, body)


def test_truncate_prompt_tokens_keeps_the_last_n_of_text_chat_and_token_ids(tokenizer: Tokenizer) -> None:
    text = "one two three four five six"
    whole = ids_of(tokenizer, text=text)
    assert whole[0] == BOS and len(whole) > 4
    assert ids_of(tokenizer, text=text, truncate_prompt_tokens=3) == whole[-3:]
    assert ids_of(tokenizer, text=text, truncate_prompt_tokens=len(whole) + 5) == whole
    rendered = ids_of(tokenizer, chat=chat(text))
    assert ids_of(tokenizer, chat=chat(text), truncate_prompt_tokens=4) == rendered[-4:]
    ids = common_pb2.TokenIds(ids=[7, 8, 9, 10])
    assert ids_of(tokenizer, token_ids=ids, truncate_prompt_tokens=2) == [9, 10]
    # Token ids longer than max_model_len fit once truncated.
    long = common_pb2.TokenIds(ids=list(range(MAX_MODEL_LEN + 10)))
    kept = ids_of(tokenizer, token_ids=long, truncate_prompt_tokens=MAX_MODEL_LEN)
    assert kept == list(range(10, MAX_MODEL_LEN + 10))


@pytest.mark.parametrize("keep", [0, MAX_MODEL_LEN + 1])
def test_truncate_prompt_tokens_beyond_max_model_len_or_zero_is_refused(tokenizer: Tokenizer, keep: int) -> None:
    async def body(servicer: GenerationServicer) -> InvalidRequestError:
        err, _ = await refusal(servicer.prompt_ids(generation_pb2.GenerateRequest(text="hi",
                                                                                  truncate_prompt_tokens=keep)))
        return err
    err = served(tokenizer, body)
    assert (err.field, err.message) == ("truncate_prompt_tokens",
                                        f"must be in [1, max_model_len ({MAX_MODEL_LEN})], got {keep}")


def test_add_special_tokens_defaults_to_true_for_text_and_false_for_chat(tokenizer: Tokenizer) -> None:
    text = "hello world"
    with_bos = ids_of(tokenizer, text=text)
    assert with_bos == [BOS, *tokenizer.encode(text, add_special_tokens=False)]
    assert ids_of(tokenizer, text=text, add_special_tokens=True) == with_bos
    assert ids_of(tokenizer, text=text, add_special_tokens=False) == with_bos[1:]
    rendered = ids_of(tokenizer, chat=chat(text))
    assert ids_of(tokenizer, chat=chat(text), add_special_tokens=False) == rendered
    assert ids_of(tokenizer, chat=chat(text), add_special_tokens=True) == [BOS, *rendered]
    # Token ids are used as they are.
    assert ids_of(tokenizer, token_ids=common_pb2.TokenIds(ids=[5, 6]), add_special_tokens=True) == [5, 6]
