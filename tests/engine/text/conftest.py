"""Shared fixtures: the default model's tokenizer (ours and transformers' reference), loaded once."""

from __future__ import annotations

import pytest

from engine.config import default_model_path
from engine.text import Tokenizer


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_pretrained(gguf_path)


@pytest.fixture(scope="session")
def reference(default_hf_tokenizer):  # type: ignore[no-untyped-def]
    """transformers' own tokenizer for the same GGUF file: a reference no one here wrote (tests/conftest.py)."""
    return default_hf_tokenizer


SPM_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "▁h", "he", "ll", "llo", "▁hello", "▁w", "or", "▁wor",
              "▁world", "!", "▁the", "t", "a", "n", "▁a", "▁an", "▁and"]


@pytest.fixture(scope="session")
def tiny_spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A GGUF holding only a tiny SentencePiece ("llama") vocabulary: scores, byte tokens, a user-defined token."""
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path_factory.mktemp("spm") / "tiny.gguf")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<|user|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0]
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] + eos_token }}"
                             "{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
