"""What a pooling model does, read as vLLM reads it: the architecture (an encoder, a decoder as an embedder, a
sequence classifier), the pooling (CLS, mean, last token) and normalisation from the sentence-transformers files
(``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module), Matryoshka sizes from config.json
(``matryoshka_dimensions`` / ``is_matryoshka``), label names from ``id2label``, and ``--pooler-config`` overrides.

``--runner`` and ``--convert`` take vLLM's names: ``auto`` runs the pooling runner for encoder architectures and
``*ForSequenceClassification``, ``--convert embed`` turns a generation model into an embedder (last-token pooling,
normalised, unless its files say otherwise), ``--convert classify`` reads a ``*ForSequenceClassification`` head.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InvalidRequestError

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")

# model_type -> the encoder family engine.models.bert runs.
ENCODER_TYPES = ("bert", "xlm-roberta", "roberta", "modernbert")
# Named so the refusal can say what it is rather than "unknown architecture".
REFUSED_ENCODERS = {"nomic_bert": "nomic-bert is not supported yet: serve a BERT, XLM-RoBERTa or ModernBERT encoder",
                    "new": "gte-new (NewModel) is not supported yet: serve a BERT, XLM-RoBERTa or ModernBERT encoder"}

# sentence-transformers 2.x/3.x keys of 1_Pooling/config.json, and the newer one-field form.
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST6_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
# --pooler-config keys honoured; the others vLLM defines are refused by name.
_POOLER_KEYS = ("pooling_type", "normalize", "use_activation", "activation", "dimensions")


@dataclass(frozen=True)
class PoolingModelInfo:
    """A pooling model's behaviour, decided once at load."""

    kind: str                    # "embed" (an embedder) or "classify" (a sequence classifier / cross-encoder)
    family: str                  # "encoder" (engine.models.bert) or "decoder" (engine.models.llama)
    model_type: str
    pooling_type: str            # one of POOLING_TYPES
    normalize: bool              # embed's default
    use_activation: bool = True  # classify's default
    activation: str = "softmax"  # classify's: "softmax", "sigmoid" or "identity"
    hidden_size: int = 0
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    default_dimensions: int | None = None   # --pooler-config dimensions: embed's size when a request gives none
    architectures: tuple[str, ...] = field(default=())

    @property
    def tasks(self) -> tuple[str, ...]:
        """The Pool tasks served: an embedder's vector (and per-token vectors); a classifier's label scores, and a
        one-label cross-encoder's pair score."""
        if self.kind == "embed":
            return ("embed", "token_embed")
        return ("classify", "score") if self.num_labels == 1 else ("classify",)


def read_hf_config(model: str) -> dict[str, Any]:
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def resolve_runner(model: str, runner: str, convert: str) -> str:
    """``generate`` or ``pooling`` for ``model`` (a directory or a .gguf file): ``runner`` unless auto, then pooling
    for an encoder, a ``*ForSequenceClassification`` / ``*Model`` architecture, a sentence-transformers directory
    (``modules.json``: Qwen3-Embedding's config names ``Qwen3ForCausalLM``), or with ``convert`` embed/classify."""
    if runner not in RUNNERS:
        raise InvalidRequestError("runner", f"unknown runner {runner!r}; expected one of {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise InvalidRequestError("convert", f"unknown convert {convert!r}; expected one of {', '.join(CONVERTS)}")
    if runner != "auto":
        if runner == "generate" and convert in ("embed", "classify"):
            raise InvalidRequestError("convert", f"--convert {convert} needs --runner pooling (or auto)")
        return runner
    if convert in ("embed", "classify"):
        return "pooling"
    cfg = read_hf_config(model)
    archs = [str(a) for a in cfg.get("architectures") or []]
    if cfg.get("model_type") in ENCODER_TYPES or cfg.get("model_type") in REFUSED_ENCODERS:
        return "pooling"
    if (Path(model) / "modules.json").is_file():
        return "pooling"
    if any(a.endswith("ForSequenceClassification") or (a.endswith("Model") and not a.endswith("LMHeadModel"))
           for a in archs):
        return "pooling"
    return "generate"


def parse_pooler_config(text: str | None) -> dict[str, Any]:
    """``--pooler-config``'s JSON object; InvalidRequestError naming a key vLLM defines that is not honoured."""
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError("pooler_config", f"is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("pooler_config", "must be a JSON object")
    for key in obj:
        if key not in _POOLER_KEYS:
            raise InvalidRequestError("pooler_config", f"{key!r} is not supported; supported keys: "
                                                       f"{', '.join(_POOLER_KEYS)}")
    kind = obj.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
        raise InvalidRequestError("pooler_config", f"pooling_type {kind!r} is not supported; expected one of "
                                                   f"{', '.join(POOLING_TYPES)}")
    for key in ("normalize", "use_activation", "activation"):
        if key in obj and not isinstance(obj[key], bool):
            raise InvalidRequestError("pooler_config", f"{key} must be true or false")
    dims = obj.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise InvalidRequestError("pooler_config", "dimensions must be an integer >= 1")
    return obj


def read_pooling_info(model: str, convert: str = "auto", pooler_config: str | None = None) -> PoolingModelInfo:
    """The pooling behaviour of the HF directory ``model``; InvalidRequestError (naming ``model``) for an architecture
    the pooling runner does not run."""
    directory = Path(model)
    if not directory.is_dir():
        raise InvalidRequestError("model", f"{model}: the pooling runner reads a Hugging Face directory (not a GGUF)")
    cfg = read_hf_config(model)
    overrides = parse_pooler_config(pooler_config)
    model_type = str(cfg.get("model_type", ""))
    archs = tuple(str(a) for a in cfg.get("architectures") or [])
    if model_type in REFUSED_ENCODERS:
        raise InvalidRequestError("model", REFUSED_ENCODERS[model_type])
    family = "encoder" if model_type in ENCODER_TYPES else "decoder"
    is_classifier = convert == "classify" or (convert != "embed"
                                              and any(a.endswith("ForSequenceClassification") for a in archs))
    st_pooling, st_normalize = _sentence_transformers(directory)
    if is_classifier:
        num_labels = _num_labels(cfg)
        id2label = cfg.get("id2label") or {}
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
        # ModernBERT's head reads the CLS state or the mean (classifier_pooling); BERT's the CLS state
        default_pool = ("LAST" if family == "decoder" else
                        "MEAN" if cfg.get("classifier_pooling") == "mean" else "CLS")
        activation = _cross_encoder_activation(cfg, num_labels)
        return PoolingModelInfo(
            kind="classify", family=family, model_type=model_type,
            pooling_type=str(overrides.get("pooling_type", default_pool)).upper(), normalize=False,
            use_activation=bool(overrides.get("use_activation", overrides.get("activation", True))),
            activation=activation, hidden_size=int(cfg.get("hidden_size", 0)), num_labels=num_labels, labels=labels,
            architectures=archs)
    pooling = st_pooling or ("CLS" if family == "encoder" else "LAST")
    normalize = st_normalize if st_pooling is not None else family == "decoder"
    dims = cfg.get("matryoshka_dimensions")
    return PoolingModelInfo(
        kind="embed", family=family, model_type=model_type,
        pooling_type=str(overrides.get("pooling_type", pooling)).upper(),
        normalize=bool(overrides.get("normalize", normalize)), hidden_size=int(cfg.get("hidden_size", 0)),
        is_matryoshka=bool(cfg.get("is_matryoshka") or dims), matryoshka_dimensions=tuple(int(d) for d in dims or ()),
        default_dimensions=overrides.get("dimensions"), architectures=archs)


def _num_labels(cfg: dict[str, Any]) -> int:
    if cfg.get("num_labels") is not None:
        return int(cfg["num_labels"])
    id2label = cfg.get("id2label")
    return len(id2label) if id2label else 2


def _cross_encoder_activation(cfg: dict[str, Any], num_labels: int) -> str:
    """sentence-transformers' CrossEncoder default: its config's ``sentence_transformers.activation_fn`` when set
    (Sigmoid, Identity, Tanh...), else a sigmoid for one label; vLLM applies a softmax over several labels."""
    st = cfg.get("sentence_transformers") or {}
    path = st.get("activation_fn") or cfg.get("sbert_ce_default_activation_function")
    if isinstance(path, str):
        name = path.rsplit(".", 1)[-1].lower()
        if name in ("sigmoid", "identity", "softmax", "tanh"):
            return name
    return "sigmoid" if num_labels == 1 else "softmax"


def _sentence_transformers(directory: Path) -> tuple[str | None, bool]:
    """(pooling type, normalise) from modules.json and its Pooling module's config; (None, False) without them."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = json.loads(modules_file.read_text())
    pooling: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _pooling_mode(directory / str(module.get("path", "1_Pooling")) / "config.json")
        elif kind not in ("Transformer",):
            raise InvalidRequestError("model", f"{directory}: sentence-transformers module {kind} "
                                               f"({module.get('type')}) is not supported")
    return pooling, normalize


def _pooling_mode(file: Path) -> str:
    cfg = json.loads(file.read_text()) if file.is_file() else {}
    for key in _ST_UNSUPPORTED:
        if cfg.get(key):
            raise InvalidRequestError("model", f"{file}: {key} pooling is not supported (CLS, mean, last token)")
    if isinstance(cfg.get("pooling_mode"), str):
        mode = cfg["pooling_mode"]
        if mode not in _ST6_MODES:
            raise InvalidRequestError("model", f"{file}: pooling_mode {mode!r} is not supported (cls, mean, lasttoken)")
        return _ST6_MODES[mode]
    chosen = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if len(chosen) != 1:
        raise InvalidRequestError("model", f"{file}: expected exactly one of {', '.join(_ST_MODES)} set")
    return chosen[0]
