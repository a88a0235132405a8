"""The tokenizer Sluice uses: a `tokenizers.Tokenizer` plus the special ids and chat template that
Hugging Face keeps in tokenizer_config.json (or a GGUF keeps in its metadata)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from engine.text.chat import ChatTemplateRenderer
from engine.text.gguf_tokenizer import bytes_to_unicode, load_gguf_tokenizer


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 extra_eos_token_ids: Iterable[int] = (), unk_token_id: int | None = None,
                 pad_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 reads_segment_ids: bool = False) -> None:
        """``add_bos_token``/``add_eos_token`` = None keeps the backend's own post-processor;
        ``reads_segment_ids``: the model takes token_type_ids (``encode_pairs``), as its transformers tokenizer says."""
        self._backend = backend
        self.reads_segment_ids = reads_segment_ids
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.eos_token_ids: set[int] = (set(extra_eos_token_ids)
                                        | ({eos_token_id} if eos_token_id is not None else set()))
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: set[int] = {i for i, tok in added.items() if tok.special} | {
            i for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id) if i is not None} | self.eos_token_ids
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._byte_decoder = self._make_byte_decoder()
        self._chat = ChatTemplateRenderer()
        self._max_token_bytes: int | None = None

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or a .gguf file."""
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            return cls._from_gguf(str(p))
        if p.is_dir():
            return cls._from_hf_dir(p)
        raise FileNotFoundError(f"no tokenizer at {path}: expected a directory with tokenizer.json or a .gguf file")

    @classmethod
    def _from_gguf(cls, path: str) -> Tokenizer:
        g = load_gguf_tokenizer(path)
        return cls(g.backend, bos_token_id=g.bos_token_id, eos_token_id=g.eos_token_id,
                   extra_eos_token_ids=g.eot_token_ids, unk_token_id=g.unk_token_id, pad_token_id=g.pad_token_id,
                   chat_template=g.chat_template, add_bos_token=g.add_bos_token, add_eos_token=g.add_eos_token)

    @classmethod
    def _from_hf_dir(cls, directory: Path) -> Tokenizer:
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            content = token.get("content") if isinstance(token, Mapping) else token
            return backend.token_to_id(content) if isinstance(content, str) else None

        template_file = directory / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else _config_template(config)
        # generation_config.json often lists several end ids (e.g. Llama 3's <|eot_id|> and <|end_of_text|>).
        gen_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        explicit = "add_bos_token" in config or "add_eos_token" in config
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   extra_eos_token_ids=extra, unk_token_id=token_id("unk_token"), pad_token_id=token_id("pad_token"),
                   chat_template=template,
                   add_bos_token=bool(config.get("add_bos_token")) if explicit else None,
                   add_eos_token=bool(config.get("add_eos_token")) if explicit else None,
                   reads_segment_ids=_reads_segment_ids(config))

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """BOS/EOS insertion as transformers' fast tokenizers do it: a template post-processor."""
        bos = self.id_to_token(self.bos_token_id) if add_bos and self.bos_token_id is not None else None
        eos = self.id_to_token(self.eos_token_id) if add_eos and self.eos_token_id is not None else None
        single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
        pair = " ".join(x for x in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
        special = [(t, i) for t, i in ((bos, self.bos_token_id), (eos, self.eos_token_id)) if t is not None]
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special)  # type: ignore[arg-type]

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: 2.5 s for 1.3 MB of text, every other
        # thread stopped), so a long prompt tokenized in a worker thread never stalls the event loop.
        return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], add_special_tokens: bool = True
                     ) -> list[tuple[list[int], list[int]]]:
        """Each (text, text_pair) encoded as one input, as a cross-encoder reads it (BERT: [CLS] a [SEP] b [SEP]):
        its token ids and segment ids (1 for the pair's second text where the post-processor says so), the latter
        empty unless the model reads them (``reads_segment_ids``, as transformers' tokenizer returns them)."""
        encodings = self._backend.encode_batch(list(pairs), add_special_tokens=add_special_tokens)
        return [(list(e.ids), list(e.type_ids) if self.reads_segment_ids else []) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_token(i) for i in ids]

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may be half a UTF-8 character)."""
        token = self.id_to_token(token_id)
        if token_id in self._backend.get_added_tokens_decoder():
            return token.encode("utf-8")
        if self._byte_decoder is not None:
            return bytes(self._byte_decoder[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(token[3:5], 16)])
        return token.replace("▁", " ").encode("utf-8")

    @property
    def max_token_bytes(self) -> int:
        """The most bytes any one token stands for (computed once): no text longer than ``n`` times this
        can encode to ``n`` tokens or fewer, unless a normalizer shortens it first (``backend.normalizer``)."""
        if self._max_token_bytes is None:
            vocab = range(self.vocab_size)
            self._max_token_bytes = max((len(self.token_to_bytes(i)) for i in vocab
                                         if self._backend.id_to_token(i) is not None), default=1)
        return self._max_token_bytes

    def _make_byte_decoder(self) -> dict[str, int] | None:
        """The inverse of GPT-2's byte alphabet when this is a byte-level tokenizer, else None."""
        decoder = self._backend.decoder
        # A decoder's pickled state is its JSON; reading it avoids serializing the whole vocabulary.
        if decoder is None or "ByteLevel" not in decoder.__getstate__().decode("utf-8", "replace"):
            return None
        return {c: b for b, c in bytes_to_unicode().items()}

    # ---- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` into a prompt with the request's template or the model's own."""
        return self._chat.render(chat_template or self.chat_template, messages,
                                 add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens(),
                                 **kwargs)

    def special_tokens(self) -> dict[str, str | None]:
        """The special tokens' texts a chat template sees (``bos_token``, ...)."""
        return {"bos_token": self.bos_token, "eos_token": self.eos_token,
                "unk_token": self._token_or_none(self.unk_token_id),
                "pad_token": self._token_or_none(self.pad_token_id)}

    def _token_or_none(self, token_id: int | None) -> str | None:
        return self.id_to_token(token_id) if token_id is not None else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


# transformers' tokenizer classes whose model_input_names include token_type_ids (the others return none).
_SEGMENT_ID_TOKENIZERS = frozenset({"BertTokenizer", "ElectraTokenizer", "DebertaTokenizer", "DebertaV2Tokenizer",
                                    "MobileBertTokenizer", "ConvBertTokenizer", "SqueezeBertTokenizer",
                                    "LayoutLMTokenizer"})


def _reads_segment_ids(config: Mapping[str, Any]) -> bool:
    """Whether transformers' tokenizer for this config returns token_type_ids: its ``model_input_names`` when the
    config lists them, else its class's."""
    names = config.get("model_input_names")
    if isinstance(names, list):
        return "token_type_ids" in names
    name = config.get("tokenizer_class")
    return isinstance(name, str) and name.removesuffix("Fast") in _SEGMENT_ID_TOKENIZERS


def _config_template(config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates ("default" wins)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
