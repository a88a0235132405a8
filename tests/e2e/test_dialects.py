"""Issue 39's dialects end to end on the shared `sluice serve` (default model; n-gram speculation puts several
tokens in one delta): TGI's own Python client (`text_generation`, sync and async) and plain HTTP on Triton's
generate extension get the greedy text the OpenAI route gives for the same prompt and token budget, streamed
and whole; bad bodies get each dialect's error."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
import text_generation
from text_generation.errors import ValidationError

from tests.e2e.conftest import SHARED_SERVED
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Repeat this list exactly three times: red, green, blue, yellow, red, green,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def greedy(shared_stack: ServeStack) -> dict[str, str]:
    """The OpenAI route's greedy text of each prompt."""
    client = openai.OpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return {p: client.completions.create(model=SHARED_SERVED, prompt=p, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text for p in PROMPTS}


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def sse(body: bytes) -> list[Any]:
    return [json.loads(line[len(b"data:"):]) for line in body.split(b"\n") if line.startswith(b"data:")]


def test_tgi_client_gets_the_greedy_text(shared_stack: ServeStack, greedy: dict[str, str]) -> None:
    client = text_generation.Client(shared_stack.base_url, timeout=120)
    for prompt, text in greedy.items():
        whole = client.generate(prompt, max_new_tokens=MAX_TOKENS)
        assert whole.generated_text == text
        assert whole.details.generated_tokens == len(whole.details.tokens)
        events = list(client.generate_stream(prompt, max_new_tokens=MAX_TOKENS))
        assert "".join(e.token.text for e in events if not e.token.special) == text
        assert events[-1].generated_text == text
        assert events[-1].details is not None
        assert events[-1].details.generated_tokens == whole.details.generated_tokens == len(events)


def test_tgi_async_client_gets_the_greedy_text(shared_stack: ServeStack, greedy: dict[str, str]) -> None:
    async def run() -> None:
        client = text_generation.AsyncClient(shared_stack.base_url, timeout=120)
        for prompt, text in greedy.items():
            assert (await client.generate(prompt, max_new_tokens=MAX_TOKENS)).generated_text == text
            tokens = [e.token async for e in client.generate_stream(prompt, max_new_tokens=MAX_TOKENS)]
            assert "".join(t.text for t in tokens if not t.special) == text

    asyncio.run(run())


def test_tgi_bad_bodies(shared_stack: ServeStack) -> None:
    client = text_generation.Client(shared_stack.base_url, timeout=120)
    with pytest.raises(ValidationError, match="parameters.watermark"):
        client.generate("Hi", watermark=True)
    status, body = post(f"{shared_stack.base_url}/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": -1}})
    assert status == 422
    assert json.loads(body) == {"error": "`parameters.max_new_tokens`: input should be greater than or equal to 1.",
                                "error_type": "validation"}


def test_triton_generate_gets_the_greedy_text(shared_stack: ServeStack, greedy: dict[str, str]) -> None:
    url = f"{shared_stack.base_url}/v2/models/{SHARED_SERVED}"
    for prompt, text in greedy.items():
        body = {"text_input": prompt, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0}}
        status, whole = post(f"{url}/generate", body)
        assert status == 200
        assert json.loads(whole) == {"model_name": SHARED_SERVED, "model_version": "1", "text_output": text}
        status, streamed = post(f"{url}/generate_stream", body)
        assert status == 200
        assert "".join(e["text_output"] for e in sse(streamed)) == text


def test_triton_bad_bodies(shared_stack: ServeStack) -> None:
    url = f"{shared_stack.base_url}/v2/models/{SHARED_SERVED}"
    status, body = post(f"{url}/generate", {"text_input": "Hi", "parameters": {"typical_p": 0.5}})
    assert (status, json.loads(body)) == (400, {"error": "`parameters.typical_p` is not supported: typical decoding "
                                                         "is not implemented."})
    status, body = post(f"{shared_stack.base_url}/v2/models/other/generate", {"text_input": "Hi"})
    assert (status, json.loads(body)) == (404, {"error": "The model `other` does not exist."})


def test_tgi_truncate_keeps_the_prompts_last_tokens(shared_stack: ServeStack, greedy: dict[str, str]) -> None:
    prompt = PROMPTS[1]
    client = text_generation.Client(shared_stack.base_url, timeout=120)
    cut = client.generate(prompt, max_new_tokens=MAX_TOKENS, truncate=4, decoder_input_details=True)
    assert len(cut.details.prefill) == 4
    openai_client = openai.OpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=120)
    same = openai_client.completions.create(model=SHARED_SERVED, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"truncate_prompt_tokens": 4}).choices[0].text
    assert cut.generated_text == same != greedy[prompt]


def test_triton_bad_words_never_appear(shared_stack: ServeStack, greedy: dict[str, str]) -> None:
    prompt = PROMPTS[0]
    word = greedy[prompt].split()[0].strip(".,")
    status, whole = post(f"{shared_stack.base_url}/v2/models/{SHARED_SERVED}/generate", {
        "text_input": prompt, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0, "bad_words": [word]}})
    assert status == 200
    assert word in greedy[prompt] and word not in json.loads(whole)["text_output"]
