"""`sluice serve --reasoning-parser deepseek_r1` of a tiny model that thinks (its template opens the block, as
DeepSeek-R1-0528's): forced to think by logit_bias and closed by thinking_token_budget, it streams its thinking
as reasoning_content, then a JSON answer the schema validates; the official openai SDK reads both."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.procs import ServeStack
from tests.reasoning_checkpoint import ANSWER_SCHEMA, ID, write_thinking_checkpoint

pytestmark = pytest.mark.slow

SERVED = "tiny-thinker"
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    path = write_thinking_checkpoint(tmp_path_factory.mktemp("thinker"))
    stack = ServeStack(tmp_path_factory.mktemp("serve-thinker"), str(path), "--served-model-name", SERVED,
                       "--reasoning-parser", "deepseek_r1", "--dtype", "float32", "--num-kv-blocks", "64",
                       "--max-num-seqs", "4")
    try:
        stack.start()
        yield openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    finally:
        stack.stop()


def ask(client: openai.OpenAI, budget: int, **kw: object) -> object:
    return client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=32,
        logit_bias={str(ID["Ġhmm"]): 100}, response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        extra_body={"thinking_token_budget": budget}, **kw)  # type: ignore[call-overload]


def test_the_thinking_streams_as_reasoning_then_a_schema_valid_answer(client: openai.OpenAI) -> None:
    kinds: list[str] = []
    reasoning, content, finish = [], [], None
    for chunk in ask(client, 3, stream=True):  # type: ignore[attr-defined]
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        if piece:
            reasoning.append(piece)
            kinds.append("reasoning")
        if delta.content:
            content.append(delta.content)
            kinds.append("content")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == " hmm hmm hmm"   # the budget's three tokens; its end tag is no text
    assert kinds == sorted(kinds, key=lambda k: k == "content") and kinds.count("reasoning") == 3
    jsonschema.validate(json.loads("".join(content)), ANSWER_SCHEMA)
    assert finish == "stop"


def test_the_whole_answer_carries_both(client: openai.OpenAI) -> None:
    message = ask(client, 1).choices[0].message  # type: ignore[attr-defined]
    assert message.reasoning_content == " hmm"  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)
