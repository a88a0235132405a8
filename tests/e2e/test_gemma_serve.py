"""`sluice serve` of a tiny random Gemma 3 checkpoint (interleaved sliding-window and global layers on their own
rope bases, GeGLU, sandwich norms, soft-capped logits) answers the official openai SDK with transformers' own
greedy text, on a prompt longer than its window; its generation_config.json (``top_k: 1``) is the default of
requests that set no sampling fields (``--generation-config auto``)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from tests.engine.models.moe_factory import greedy_reference
from tests.engine.models.test_gemma3 import write_gemma3
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

SERVED = "tiny-gemma3"
PROMPT_IDS = [5, 17, 42, 9, 88, 23, 61, 7, 30, 99, 12]   # longer than the window of 6
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    hf, path = write_gemma3(tmp_path_factory.mktemp("gemma3"))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "top_k": 1}))
    return hf, path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple[PreTrainedModel, Path]) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("serve-gemma3"), "--model", str(checkpoint[1]), "--served-model-name",
                   SERVED, "--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", "4")
    try:
        yield s.start()
    finally:
        s.stop()


def test_openai_sdk_gets_transformers_greedy_text(stack: ServeStack, checkpoint: tuple[PreTrainedModel, Path]) -> None:
    hf, path = checkpoint
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=SERVED, prompt=" ".join(f"w{i}" for i in PROMPT_IDS),
                                    max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    expected = greedy_reference(hf, PROMPT_IDS, MAX_TOKENS)
    assert out.choices[0].text == Tokenizer.from_file(str(path / "tokenizer.json")).decode(expected)
    assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS


def test_unseeded_requests_take_the_models_top_k_and_agree(stack: ServeStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    answers = {client.completions.create(model=SERVED, prompt="w5 w9 w33", max_tokens=8).choices[0].text
               for _ in range(6)}
    assert len(answers) == 1
