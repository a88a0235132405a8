"""A tiny random Qwen3 checkpoint that thinks: a word-level vocabulary with ``<think>`` / ``</think>`` as added
tokens (not special, as Qwen3 and DeepSeek-R1 ship them), the pieces of a small JSON answer, and a chat template
that opens the thinking block as DeepSeek-R1-0528's does. Sampling is steered with logit_bias on its words."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tests.engine.executor.checkpoints import write_checkpoint

SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
TAGS = ["<think>", "</think>"]
# A JSON object with one enum field, and no whitespace token: the answer ends within a few tokens.
JSON_PIECES = ["{", "}", '"', ":", ",", "answer", "yes", "no"]
WORDS = ["hi", "hmm", "Ġhmm", "Ġok", "Ġfine"]
VOCAB = [*SPECIAL, *TAGS, *JSON_PIECES, *WORDS]
VOCAB += [f"w{i}" for i in range(128 - len(VOCAB))]
ID = {token: i for i, token in enumerate(VOCAB)}
EOS = ID["</s>"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>{% endif %}")
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


def write_thinking_checkpoint(path: Path) -> Path:
    """The checkpoint in ``path`` (a directory that exists)."""
    write_checkpoint("qwen3", path)
    tokenizer = Tokenizer(models.WordLevel(dict(ID), unk_token="<unk>"))
    # Punctuation apart: llguidance tokenizes the bytes a grammar forces with the tokenizer itself.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                       pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE,
         "add_bos_token": False}))
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = EOS
    (path / "config.json").write_text(json.dumps(config))
    return path
