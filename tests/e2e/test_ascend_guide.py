"""The vLLM-Ascend quick start as a new user runs it against Sluice: its ``serve`` line with the model given as a
hub-style relative path (here a tiny random Qwen2 checkpoint at that path), its two curl requests as written (the
path in ``model``), and its ``kill -2`` to stop. vLLM's rule — the served name is the model argument exactly as
given — with the folder's own name kept as an alias."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.engine.models.moe_factory import randomize, write_tokenizer
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    work = tmp_path_factory.mktemp("ascend-guide")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)).eval()
    randomize(hf, 1)
    hf.save_pretrained(work / MODEL)
    write_tokenizer(work / MODEL)
    # `vllm serve Qwen/Qwen2.5-0.5B-Instruct &`, on free ports (the test's only addition)
    s = ServeStack(work, MODEL, cwd=work)
    try:
        yield s.start()
    finally:
        s.stop()


def curl(*args: str) -> dict[str, object]:
    out = subprocess.run(["curl", "-sS", "--fail-with-body", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_guides_curl_requests_answer_with_the_model_as_given(stack: ServeStack) -> None:
    models = curl(f"{stack.base_url}/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL, "Qwen2.5-0.5B-Instruct"]  # type: ignore[index]
    body = '''{
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "prompt": "Beijing is a",
        "max_tokens": 5,
        "temperature": 0
    }'''
    answer = curl(f"{stack.base_url}/v1/completions", "-H", "Content-Type: application/json", "-d", body)
    assert answer["model"] == MODEL
    assert answer["usage"]["completion_tokens"] >= 1   # type: ignore[index]
    # the folder's own name is an alias, with the same greedy answer
    alias = curl(f"{stack.base_url}/v1/completions", "-H", "Content-Type: application/json", "-d",
                 body.replace(MODEL, "Qwen2.5-0.5B-Instruct"))
    assert alias["model"] == "Qwen2.5-0.5B-Instruct"
    assert alias["choices"][0]["text"] == answer["choices"][0]["text"]   # type: ignore[index]


def test_kill_2_stops_it_gracefully(stack: ServeStack) -> None:
    assert stack.proc is not None
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=60) == 0
