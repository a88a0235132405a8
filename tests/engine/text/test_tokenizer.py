"""engine/text/tokenizer.py and gguf_tokenizer.py against transformers and `tokenizers` themselves."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.text import Tokenizer
from engine.text.gguf_tokenizer import read_gguf_metadata

VARIED = [
    "Hello, world! The capital of France is Paris.",
    "def square(x: int) -> int:\n    return x ** 2  # why not\n\n\nprint(square(3))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "a   b\t\tc \n \n  end",
    "    indented\n\tTabbed\r\nwindows line",
    "12345 678.9 3,141,592 and 2024-06-01",
    "I ❤️ Rust 🦀 and 👩‍👩‍👧 families 🎉🎉",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "ünïcödé Ωμέγα Привет мир",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>",
    "it's I'LL we've THEY'RE",
    "",
    " ",
    "\n\n\n",
]


def test_gguf_encode_matches_transformers(smollm: Tokenizer, reference) -> None:  # type: ignore[no-untyped-def]
    for text in VARIED:
        ids = smollm.encode(text)
        assert ids == reference.encode(text), text
        assert smollm.decode(ids, skip_special_tokens=False) == text
        assert smollm.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


def test_gguf_special_ids_match_transformers(smollm: Tokenizer, reference) -> None:  # type: ignore[no-untyped-def]
    assert smollm.vocab_size == len(reference) == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id) == (reference.bos_token_id, reference.eos_token_id) == (1, 2)
    assert smollm.eos_token_ids == {2}
    assert smollm.bos_token == "<|im_start|>" and smollm.eos_token == "<|im_end|>"
    # The 17 control tokens of the file (<|endoftext|> .. <empty_output>) are special.
    assert smollm.all_special_ids == set(range(17))
    assert set(reference.all_special_ids) <= smollm.all_special_ids
    assert smollm.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_special_tokens_in_text_stay_whole_and_can_be_skipped(smollm: Tokenizer) -> None:
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1 and ids.count(2) == 1
    assert smollm.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_gguf_digits_split_as_llama_cpp_and_the_original_repo(smollm: Tokenizer, reference) -> None:  # type: ignore[no-untyped-def]
    """tokenizer.ggml.pre = "smollm": llama.cpp splits every digit off first, as the model's own tokenizer.json
    does (Digits(individual) + ByteLevel). transformers' GGUF loader skips that split, so it differs on
    whitespace before a digit; the original pre-tokenizer over transformers' vocabulary is the reference."""
    assert smollm.convert_ids_to_tokens(smollm.encode("a  2")) == ["a", "ĠĠ", "2"]
    original = copy.deepcopy(reference.backend_tokenizer)
    original.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      pre_tokenizers.ByteLevel(add_prefix_space=False)])
    alphabet = list("ab AB12 \n\t'’.,!?😀中é²<|>_") + ["<|im_start|>", "<|endoftext|>", " 12", "  ", "x\u00b9"]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
        assert smollm.encode(text) == original.encode(text).ids, text
        assert smollm.decode(smollm.encode(text), skip_special_tokens=False) == text


def test_token_to_bytes_exposes_partial_utf8(smollm: Tokenizer) -> None:
    text = "🦀 中文 👩‍👩‍👧"
    ids = smollm.encode(text)
    pieces = [smollm.token_to_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    partial = [p for p in pieces if not _is_utf8(p)]
    assert partial, "expected byte-level tokens holding part of a character"
    assert smollm.token_to_bytes(1) == b"<|im_start|>"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_gguf_metadata_reader(gguf_path: str) -> None:
    meta = read_gguf_metadata(gguf_path)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152  # type: ignore[arg-type]
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # type: ignore[index]
    assert meta["tokenizer.ggml.token_type"][:18] == [3] * 17 + [1]  # type: ignore[index]
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_sentencepiece_gguf_matches_transformers(tiny_spm_gguf: str) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(tiny_spm_gguf),
                                                     gguf_file=os.path.basename(tiny_spm_gguf))
    tok = Tokenizer.from_pretrained(tiny_spm_gguf)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (len(ref), 1, 2, 0)
    for text in ["hello world!", " hello  world", "the and an", "héllo ☃ world", "hello<|user|>world", "", "\n x"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == 1  # llama vocabularies get BOS unless the file says otherwise
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    # "☃" is not in the vocabulary: byte fallback, three <0xXX> tokens, and back.
    assert tok.convert_ids_to_tokens(tok.encode("☃", add_special_tokens=False)[1:]) == ["<0xE2>", "<0x98>", "<0x83>"]
    assert tok.decode(tok.encode("a ☃")) == "a ☃"
    assert tok.token_to_bytes(3 + 0xE2) == b"\xe2"


# ---- Hugging Face directories -------------------------------------------------------------------

def _tiny_backend() -> HFTokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|user|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizers", "def f(x): return x"]
    backend.train_from_iterator(corpus * 20, trainer=trainer)
    return backend


def _write_hf_dir(directory: Path, config: dict[str, object], **files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    _tiny_backend().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)
    return directory


TEXTS = ["hello world", "the lazy dog <|user|> jumps", "ünïcode 🦀 new", "  spaces\n\n", "<s>x</s>"]


def test_hf_directory_encodes_as_tokenizers_does(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "plain", {"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                           "chat_template": "{{ messages[0]['content'] }}"})
    tok = Tokenizer.from_pretrained(str(d))
    raw = HFTokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == raw.encode(text).ids
        assert tok.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.all_special_ids == {0, 1, 2}
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.encode("<|user|>") == [2]
    assert tok.decode([0, *raw.encode("hi").ids, 1, 2]) == "hi"
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_hf_directory_add_bos_eos_and_extra_files(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "bos", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                         "add_eos_token": True, "chat_template": "from config"},
                      chat_template__jinja="from file",
                      generation_config__json=json.dumps({"eos_token_id": [1, 2]}))
    tok = Tokenizer.from_pretrained(str(d))
    raw = HFTokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.encode("hello world") == [0, *raw.encode("hello world").ids, 1]
    assert tok.encode("hello world", add_special_tokens=False) == raw.encode("hello world").ids
    assert tok.chat_template == "from file"  # chat_template.jinja wins over tokenizer_config.json
    assert tok.eos_token_ids == {1, 2}


def test_hf_directory_named_templates(tmp_path: Path) -> None:
    d = _write_hf_dir(tmp_path / "named", {"chat_template": [{"name": "tool_use", "template": "T"},
                                                             {"name": "default", "template": "D"}]})
    tok = Tokenizer.from_pretrained(str(d))
    assert tok.chat_template == "D"
    assert tok.bos_token_id is None and tok.eos_token_ids == set()


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        Tokenizer.from_pretrained(str(tmp_path / "nope"))
