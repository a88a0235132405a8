"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's metadata.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary, merges, token types
and special ids as metadata. We read only that key/value section (not the tensors) and rebuild the
tokenizer llama.cpp would run: byte-level BPE (``gpt2``) with the split regexes llama.cpp picks by
``tokenizer.ggml.pre``, or SentencePiece BPE (``llama``) ordered by token scores with byte fallback.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF value types -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# llama.cpp's split regexes (llama-vocab.cpp), applied one after another, each splitting the pieces
# the previous one left ("isolated": matches and the text between them both become pieces).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_STARCODER = (r"\p{N}", _GPT2)  # starcoder, smollm & co: every digit alone, then GPT-2's split

PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe",
                     "lfm2", "midm-2.0"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez"), (_QWEN2,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("starcoder", "smollm", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _STARCODER),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "trillion"), (_GPT2,)),
}


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF file says about its tokenizer, with the rebuilt `tokenizers.Tokenizer`."""

    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_ids: tuple[int, ...]   # end-of-turn / end-of-message ids llama.cpp also stops on
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def read_gguf_metadata(path: str, *, until: Callable[[dict[str, object]], bool] | None = None
                       ) -> dict[str, object]:
    """The key/value metadata of a GGUF file (the tensor data is never read); with ``until``, only as far as
    the first key after which ``until(metadata so far)`` holds (a model's settings come before its vocabulary)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = _read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            meta[key] = _read_value(f, value_type)
            if until is not None and until(meta):
                break
        return meta


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, value_type: int) -> object:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALAR:
            fmt = _SCALAR[item_type]
            size = struct.calcsize(fmt)
            # One bulk unpack: vocabularies have 10^5 entries.
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(size * count)))
        return [_read_value(f, item_type) for _ in range(count)]
    if value_type in _SCALAR:
        fmt = _SCALAR[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    raise ValueError(f"unknown GGUF value type {value_type}")


def load_gguf_tokenizer(path: str) -> GGUFTokenizer:
    """Rebuild the tokenizer of a GGUF file."""
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]  # type: ignore[assignment]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)  # type: ignore[assignment]
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta)
        default_add_bos = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, meta)
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        default_add_bos = True
    else:
        raise ValueError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    _add_special_tokens(backend, tokens, token_types)

    def token_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}")
        return value if isinstance(value, int) and 0 <= value < len(tokens) else None

    eot = tuple(i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None)
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(
        backend=backend,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        eot_token_ids=eot,
        unk_token_id=token_id("unknown_token_id"),
        pad_token_id=token_id("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the alphabet byte-level vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _byte_level_bpe(tokens: list[str], meta: dict[str, object]) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (some converters store special tokens raw) is respelled in it.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]  # type: ignore[attr-defined]
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    splits = PRE_TOKENIZER_SPLITS.get(pre, (_GPT2,))  # llama.cpp's "default" is GPT-2's split too
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], meta: dict[str, object]) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    raw_merges = meta.get("tokenizer.ggml.merges")
    if raw_merges:
        merges = [tuple(m.split(" ", 1)) for m in raw_merges]  # type: ignore[attr-defined]
    else:
        scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)  # type: ignore[assignment]
        merges = _merges_from_scores(tokens, scores, vocab)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges: every split of a token into two tokens, best-scored result first
    (llama.cpp's SPM tokenizer merges the pair whose merged token scores highest)."""
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores):
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both are
    matched whole in text (as llama.cpp does) instead of being cut into pieces."""
    # Only tokens the model spells as they are: a "control" token outside a byte-level alphabet is a
    # converter mislabel, and adding it would grow the vocabulary past the model's embedding size.
    def known(t: str) -> bool:
        return bool(t) and backend.token_to_id(t) is not None

    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL and known(t)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED and known(t)]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
