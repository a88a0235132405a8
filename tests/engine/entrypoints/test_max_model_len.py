"""max_model_len defaults to the model's declared context (no cap of our own); when the KV cache cannot hold one
sequence of it, start-up says so with the arithmetic, and a default length is lowered to what fits."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from engine import LLM
from tests.engine.executor.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint("llama", tmp_path_factory.mktemp("long"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16384}))
    return path


def test_the_models_context_is_the_default_past_8192(long_context: Path) -> None:
    llm = LLM(str(long_context), dtype="float32", num_kv_blocks=1100, block_size=16)   # 17,600 tokens
    assert llm.engine.max_model_len == 16384


def test_a_cache_too_small_for_one_sequence_is_named_with_its_arithmetic(long_context: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
        default = LLM(str(long_context), dtype="float32", num_kv_blocks=8, block_size=16)
    assert default.engine.max_model_len == 128
    assert "8 blocks x 16 tokens = 128 tokens, fewer than max_model_len 16384" in caplog.text
    assert "max_model_len lowered to 128" in caplog.text
    asked = LLM(str(long_context), dtype="float32", num_kv_blocks=8, block_size=16, max_model_len=1024)
    assert asked.engine.max_model_len == 1024   # asked for: kept, its requests end where the cache is full
