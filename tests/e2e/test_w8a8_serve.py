"""`sluice serve --quantization w8a8` end to end: the official openai SDK gets the offline API's W8A8 answer, the
engine's log names the int8 layers, and a quantization Sluice does not run is refused before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.core.sampling_params import SamplingParams
from engine.entrypoints.llm import LLM
from tests.procs import ROOT, ServeStack

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("serve-w8a8"), "--quantization", "w8a8", "--dtype", "bfloat16",
                   "--max-num-seqs", "4", "--kv-cache-memory", "256MiB")
    s.start()
    yield s
    s.stop()


def test_openai_sdk_gets_the_offline_w8a8_answer(stack: ServeStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    served = client.chat.completions.create(model=model, messages=QUESTION,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=MAX_TOKENS)
    llm = LLM(dtype="bfloat16", quantization="w8a8", kv_cache_memory="64MiB", max_num_seqs=4)
    try:
        offline = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    finally:
        llm.close()
    assert served.choices[0].message.content == offline.text and offline.text
    assert served.usage is not None and served.usage.completion_tokens == len(offline.token_ids)
    # The served engine really runs the int8 layers (the 120 projections and the lm_head), as its log says.
    log = stack.log.read_text(errors="replace")
    assert "W8A8 int8: 121 linears" in log
    # oneDNN's int8 GEMM, or the portable path on a CPU without VNNI
    assert re.search(r"linear layers: 121 (Portable)?W8A8", log)


def test_a_quantization_sluice_does_not_run_is_refused_naming_it(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--quantization", "fp8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "fp8" in proc.stderr and "w8a8" in proc.stderr
