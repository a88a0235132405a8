"""`sluice serve` of a tiny random DeepSeek-V3 checkpoint (latent attention, routed and shared experts, noaux_tc
routing) answers the official openai SDK with transformers' own greedy text; a mixture-of-experts checkpoint with an
option Sluice does not run is refused before anything starts, naming the option."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from tests.engine.models.moe_factory import greedy_reference, write_checkpoint
from tests.procs import ROOT, ServeStack

pytestmark = pytest.mark.slow

SERVED = "tiny-deepseek"
PROMPT_IDS = [5, 17, 42, 9, 88, 23, 61]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    return write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple[PreTrainedModel, Path]) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("serve-moe"), "--model", str(checkpoint[1]), "--served-model-name",
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
    expected_ids = greedy_reference(hf, PROMPT_IDS, MAX_TOKENS)
    assert out.choices[0].text == Tokenizer.from_file(str(path / "tokenizer.json")).decode(expected_ids)
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == \
        (len(PROMPT_IDS), MAX_TOKENS)


def test_an_unsupported_moe_option_exits_2_naming_it(tmp_path: Path) -> None:
    _, path = write_checkpoint("deepseek_v3", tmp_path, topk_method="group_limited_greedy")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "topk_method='group_limited_greedy'" in proc.stderr and "noaux_tc" in proc.stderr
