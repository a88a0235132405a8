"""Tiny random pooling checkpoints (float32) with the sentence-transformers files the hub's models carry, so Sluice and
the reference (``SentenceTransformer`` / ``CrossEncoder`` from PyPI) read the very same directory.

Every factory writes into ``path`` and returns it. Tokenizers: a WordPiece vocabulary of lowercase letters, digits and
a few words (any lowercase English text encodes), saved as tokenizer.json + tokenizer_config.json, so both
``transformers.AutoTokenizer`` and ``engine.text.tokenizer.Tokenizer`` load it. The sentence-transformers files are
written in the format the hub's models use (``sentence_transformers.models.*`` modules, ``pooling_mode_*_token``
keys), which sentence-transformers still reads.
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForSequenceClassification,
    Qwen3Model,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

_WORDS = ("the", "a", "cat", "dog", "sat", "on", "mat", "query", "passage", "what", "is", "capital", "of", "france",
          "paris", "hello", "world")
_PIECES = (list(string.ascii_lowercase) + list(string.digits) + list(".,?!'-:")
           + ["##" + c for c in string.ascii_lowercase + string.digits])

CLASSIFIER_LABELS = ("negative", "neutral", "positive")
MATRYOSHKA_DIMENSIONS = (8, 16, 32)

_BERT_SIZES: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=128, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


def save_tiny_bert_embedder(path: Path, seed: int = 0) -> Path:
    """A BERT encoder (``BertModel``) with mean pooling and a Normalize module, like all-MiniLM-L6-v2."""
    vocab = _write_bert_tokenizer(path)
    config = BertConfig(vocab_size=len(vocab), type_vocab_size=2, pad_token_id=0, **_BERT_SIZES)
    _save(BertModel(config), path, seed)
    write_sentence_transformers(path, dim=config.hidden_size, pooling="mean", normalize=True)
    return path


def save_tiny_matryoshka_embedder(path: Path, seed: int = 3) -> Path:
    """A BERT encoder with CLS pooling and a Normalize module, trained (so its config says) for the Matryoshka sizes
    ``MATRYOSHKA_DIMENSIONS``, as vLLM reads them from config.json."""
    vocab = _write_bert_tokenizer(path)
    config = BertConfig(vocab_size=len(vocab), type_vocab_size=2, pad_token_id=0, **_BERT_SIZES)
    config.is_matryoshka = True
    config.matryoshka_dimensions = list(MATRYOSHKA_DIMENSIONS)
    _save(BertModel(config), path, seed)
    write_sentence_transformers(path, dim=config.hidden_size, pooling="cls", normalize=True)
    return path


def save_tiny_xlm_roberta_embedder(path: Path, seed: int = 4) -> Path:
    """An XLM-RoBERTa encoder shaped as bge-m3 (CLS pooling, Normalize; padding_idx 1, so positions start at 2)."""
    vocab = _write_roberta_tokenizer(path)
    config = XLMRobertaConfig(vocab_size=len(vocab), type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2, **{**_BERT_SIZES, "max_position_embeddings": 130})
    _save(XLMRobertaModel(config), path, seed)
    write_sentence_transformers(path, dim=config.hidden_size, pooling="cls", normalize=True)
    return path


def save_tiny_modernbert_embedder(path: Path, seed: int = 8) -> Path:
    """A ModernBERT encoder (``ModernBertModel``) with mean pooling and a Normalize module; a local window of 4
    positions either side (``local_attention`` 8) and a global layer every third, so a short text already meets
    the window."""
    vocab = _write_bert_tokenizer(path)
    config = ModernBertConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, max_position_embeddings=128, local_attention=8,
                              global_attn_every_n_layers=3, pad_token_id=0, cls_token_id=vocab["[CLS]"],
                              sep_token_id=vocab["[SEP]"], bos_token_id=None, eos_token_id=None)
    _save(ModernBertModel(config), path, seed)
    write_sentence_transformers(path, dim=config.hidden_size, pooling="mean", normalize=True)
    return path


def save_tiny_modernbert_classifier(path: Path, seed: int = 9) -> Path:
    """A ModernBERT sequence classifier (three labels, ``classifier_pooling`` mean)."""
    vocab = _write_bert_tokenizer(path)
    config = ModernBertConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, max_position_embeddings=128, local_attention=8,
                              global_attn_every_n_layers=3, pad_token_id=0, cls_token_id=vocab["[CLS]"],
                              sep_token_id=vocab["[SEP]"], bos_token_id=None, eos_token_id=None,
                              classifier_pooling="mean", num_labels=len(CLASSIFIER_LABELS),
                              id2label=dict(enumerate(CLASSIFIER_LABELS)),
                              label2id={label: i for i, label in enumerate(CLASSIFIER_LABELS)})
    _save(ModernBertForSequenceClassification(config), path, seed)
    return path


def save_tiny_decoder_embedder(path: Path, seed: int = 1) -> Path:
    """A Qwen3 decoder (``Qwen3Model``, as Qwen3-Embedding is saved) with last-token pooling and a Normalize module.
    Its tokenizer appends an end token ("[SEP]"), whose hidden state is the embedding."""
    vocab = _write_decoder_tokenizer(path)
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-6, pad_token_id=vocab["[PAD]"], eos_token_id=vocab["[SEP]"],
                         tie_word_embeddings=False)
    _save(Qwen3Model(config), path, seed)
    write_sentence_transformers(path, dim=config.hidden_size, pooling="lasttoken", normalize=True)
    return path


def save_tiny_cross_encoder(path: Path, seed: int = 2) -> Path:
    """A BERT cross-encoder (``BertForSequenceClassification``, one label): a pair's relevance score, as
    ms-marco-MiniLM is saved (no sentence-transformers module files; ``CrossEncoder`` applies a sigmoid)."""
    vocab = _write_bert_tokenizer(path)
    config = BertConfig(vocab_size=len(vocab), type_vocab_size=2, pad_token_id=0, num_labels=1, **_BERT_SIZES)
    _save(BertForSequenceClassification(config), path, seed)
    return path


def save_tiny_xlm_roberta_cross_encoder(path: Path, seed: int = 5) -> Path:
    """An XLM-RoBERTa cross-encoder (``XLMRobertaForSequenceClassification``, one label), bge-reranker's shape."""
    vocab = _write_roberta_tokenizer(path)
    config = XLMRobertaConfig(vocab_size=len(vocab), type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2, num_labels=1, **{**_BERT_SIZES, "max_position_embeddings": 130})
    _save(XLMRobertaForSequenceClassification(config), path, seed)
    return path


def save_tiny_classifier(path: Path, seed: int = 6) -> Path:
    """A BERT sequence classifier with three labels named in ``id2label`` (``CLASSIFIER_LABELS``)."""
    vocab = _write_bert_tokenizer(path)
    config = BertConfig(vocab_size=len(vocab), type_vocab_size=2, pad_token_id=0, num_labels=len(CLASSIFIER_LABELS),
                        id2label=dict(enumerate(CLASSIFIER_LABELS)),
                        label2id={label: i for i, label in enumerate(CLASSIFIER_LABELS)}, **_BERT_SIZES)
    _save(BertForSequenceClassification(config), path, seed)
    return path


def save_tiny_decoder_classifier(path: Path, seed: int = 7) -> Path:
    """A Qwen3 decoder sequence classifier (``Qwen3ForSequenceClassification``, three labels): the score head reads the
    last token's hidden state."""
    vocab = _write_decoder_tokenizer(path)
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-6, pad_token_id=vocab["[PAD]"], eos_token_id=vocab["[SEP]"],
                         num_labels=len(CLASSIFIER_LABELS), id2label=dict(enumerate(CLASSIFIER_LABELS)),
                         label2id={label: i for i, label in enumerate(CLASSIFIER_LABELS)}, tie_word_embeddings=False)
    _save(Qwen3ForSequenceClassification(config), path, seed)
    return path


# ---- pieces ---------------------------------------------------------------------------------------------------------

def _save(model: PreTrainedModel, path: Path, seed: int) -> None:
    """Spread the weights out (transformers' init makes every text embed alike, which hides errors) and save."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name.lower() and name.endswith("weight")
            param.copy_(1 + 0.2 * noise if is_norm else (0.5 if "embed" in name else 0.15) * noise)
    model.save_pretrained(path)


def write_sentence_transformers(path: Path, *, dim: int, pooling: str, normalize: bool) -> None:
    """modules.json, sentence_bert_config.json, config_sentence_transformers.json, 1_Pooling/config.json and (with
    ``normalize``) 2_Normalize, as sentence-transformers 2.x/3.x saved them to the hub."""
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(parents=True, exist_ok=True)
    _dump(path / "modules.json", modules)
    _dump(path / "sentence_bert_config.json", {"max_seq_length": 128, "do_lower_case": False})
    _dump(path / "config_sentence_transformers.json",
          {"__version__": {"sentence_transformers": "3.0.1"}, "prompts": {}, "default_prompt_name": None,
           "similarity_fn_name": "cosine"})
    (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    _dump(path / "1_Pooling" / "config.json",
          {"word_embedding_dimension": dim, "pooling_mode_cls_token": pooling == "cls",
           "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
           "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
           "pooling_mode_lasttoken": pooling == "lasttoken", "include_prompt": True})


def _wordpiece(vocab: dict[str, int]) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(vocab, unk_token=next(t for t in vocab if "unk" in t.lower())))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def _vocab(special: tuple[str, ...]) -> dict[str, int]:
    return {t: i for i, t in enumerate(dict.fromkeys((*special, *_PIECES, *_WORDS)))}


def _write_bert_tokenizer(path: Path) -> dict[str, int]:
    """BERT's specials ([PAD] 0 ... [SEP] 3) and post-processor: [CLS] A [SEP] (B [SEP] with segment 1); the
    tokenizer returns the segment ids (``model_input_names``), so a cross-encoder reads them."""
    vocab = _vocab(("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))
    tok = _wordpiece(vocab)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=128,
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(path)
    return vocab


def _write_roberta_tokenizer(path: Path) -> dict[str, int]:
    """RoBERTa's specials (<s> 0, <pad> 1, </s> 2, <unk> 3) and post-processor: <s> A </s> (</s> B </s>)."""
    vocab = _vocab(("<s>", "<pad>", "</s>", "<unk>", "<mask>"))
    tok = _wordpiece(vocab)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                            model_max_length=128).save_pretrained(path)
    return vocab


def _write_decoder_tokenizer(path: Path) -> dict[str, int]:
    """No start token, an end token "[SEP]" appended to every text (Qwen3-Embedding appends <|endoftext|>); "[PAD]"
    pads (right padding: transformers' sequence classifiers read the last token that is not the pad token)."""
    vocab = _vocab(("[PAD]", "[UNK]", "[SEP]"))
    tok = _wordpiece(vocab)
    tok.post_processor = processors.TemplateProcessing(
        single="$A [SEP]", pair="$A [SEP] $B:1 [SEP]:1", special_tokens=[("[SEP]", vocab["[SEP]"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[SEP]",
                            model_max_length=256).save_pretrained(path)
    return vocab


def _dump(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
