"""The architecture of a decoder-only model, read from a Hugging Face ``config.json``.

(GGUF metadata is mapped onto the same object in ``gguf_loader``; the mixture-of-experts and latent-attention parts
are read in ``engine.models.moe_config``.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.model_context import declared_context
from engine.models.moe_config import MOE_ARCHITECTURES, MlaConfig, MoeConfig, mla_from_hf, moe_from_hf

# model_type values this engine implements: the Llama block layout, and the mixture-of-experts families (Mixtral
# and Qwen-MoE on Llama/Qwen attention; DeepSeek-V2/V3 on multi-head latent attention).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "glm",
                           "glm4", "internlm3", "helium", "seed_oss", "smollm3", "granite") + MOE_ARCHITECTURES
# Encoders the pooling runner runs (engine.models.bert); their ModelConfig says only what the engine core reads.
ENCODER_ARCHITECTURES = ("bert", "roberta", "xlm-roberta", "modernbert")
# The MLP activations: SiLU (every family) or GELU's tanh approximation (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is "linear", "llama3" (Llama 3.1 style), "yarn" (YaRN: frequencies
    between ``beta_fast`` and ``beta_slow`` rotations blended from interpolated to kept, cos and sin scaled by
    ``attention_factor``; DeepSeek-V2/V3, Qwen2.5's long-context configs), "dynamic" (NTK-aware: the base raised
    for a context ``factor`` times ``original_max_position_embeddings``) or "longrope" (Phi-3: per-frequency divisors,
    ``short_factor`` for contexts up to ``original_max_position_embeddings``, ``long_factor`` beyond)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_from_hf(scaling: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """transformers' ``_compute_yarn_parameters`` reading of a yarn ``rope_scaling`` / ``rope_parameters``."""
    original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_mscale(factor))
    return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                       beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                       attention_factor=float(attention), truncate=bool(scaling.get("truncate", True)))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias=True)
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-frequency divisors of the RoPE inverse frequencies (llama.cpp's ``rope_freqs`` tensor).
    rope_freq_factors: tuple[float, ...] | None = None
    moe: MoeConfig | None = None  # routed experts (in ``moe.moe_layers``), shared experts
    mla: MlaConfig | None = None  # multi-head latent attention (DeepSeek) instead of q/k/v heads
    # Sliding-window attention: a query sees the last ``sliding_window`` keys (itself included), in the layers of
    # ``sliding_layers`` (None: every layer; Qwen2's max_window_layers and transformers' layer_types pick some).
    sliding_window: int | None = None
    sliding_layers: frozenset[int] | None = None
    # Gemma 3: GeGLU, queries scaled by query_pre_attn_scalar, embeddings by sqrt(hidden), norms of (1 + weight)
    # (the offset is added to the weights at load), a norm after attention and around the MLP, local layers on
    # their own rope base, logits soft-capped.
    hidden_act: str = "silu"
    attn_scale: float | None = None          # None: head_dim ** -0.5
    embed_scale: bool = False
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    rope_local_theta: float | None = None
    rope_local_layers: frozenset[int] = frozenset()
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None   # Gemma 2: attention scores soft-capped before the softmax
    # RoPE over the first ``partial_rotary_factor`` of each head (Phi-4-mini, GLM); GLM rotates adjacent pairs of
    # dimensions (GPT-J's interleaved layout) where the others rotate the two halves.
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    nope_layers: frozenset[int] = frozenset()   # SmolLM3: layers whose queries and keys are not rotated
    # Granite: embeddings times embedding_multiplier, each block's output times residual_multiplier before its
    # residual add, logits divided by logits_scaling (queries scaled by attention_multiplier: attn_scale)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # A vision-language model's image placeholder token, whose embeddings its images' replace (None: text only).
    image_token_id: int | None = None
    # M-RoPE (Qwen2-VL): the rotary frequencies in sections rotated by a token's temporal, height and width
    # positions; the runner then passes positions [3, T] (None: positions [T])
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES + ENCODER_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS and self.architecture not in ENCODER_ARCHITECTURES:  # bert.py's own
            raise ValueError(f"{self.architecture}: hidden_act={self.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")

    @property
    def rotary_dim(self) -> int:
        """The dimensions RoPE rotates in each head: all of them, the first ``partial_rotary_factor`` of them, or
        MLA's ``qk_rope_head_dim``."""
        return self.mla.qk_rope_head_dim if self.mla is not None else int(self.head_dim * self.partial_rotary_factor)

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None for full attention."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.moe_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def merge_eos(*groups: tuple[int, ...]) -> tuple[int, ...]:
    """Union of eos id groups, first-seen order."""
    seen: dict[int, None] = {}
    for group in groups:
        for token_id in group:
            seen[token_id] = None
    return tuple(seen)


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the transformers v5 ``rope_parameters`` dict or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    if rope_type == "yarn":
        return theta, yarn_from_hf(scaling, int(cfg.get("max_position_embeddings", 4096)))
    if rope_type == "dynamic":
        return theta, RopeScaling("dynamic", float(scaling["factor"]),
                                  original_max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)))
    if rope_type in ("longrope", "su"):   # "su": Phi-3's first name for it
        return theta, longrope_from_hf(scaling, cfg)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                     "(supported: default, linear, llama3, yarn, dynamic, longrope)")


def longrope_from_hf(scaling: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """transformers' ``_compute_longrope_parameters`` reading: the context ratio as the factor when none is given,
    and the attention factor sqrt(1 + ln(factor) / ln(original)) when none is given."""
    original = int(scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or 0)
    if not original:
        raise ValueError("longrope rope scaling without original_max_position_embeddings")
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", 4096)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       attention_factor=float(attention),
                       short_factor=tuple(float(v) for v in scaling["short_factor"]),
                       long_factor=tuple(float(v) for v in scaling["long_factor"]))



def config_from_hf(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None, has_lm_head: bool) -> ModelConfig:
    """Builds a ModelConfig from ``config.json`` (and ``generation_config.json`` when present).

    ``has_lm_head``: whether the checkpoint stores ``lm_head.weight``; decides tying when config.json
    does not say.
    """
    arch = cfg.get("model_type", "")
    if cfg.get("mlp_bias", cfg.get("bias") if arch == "internlm3" else None):
        raise ValueError("mlp_bias=True is not supported")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    mla = mla_from_hf(cfg, arch)
    head_dim = (mla.qk_head_dim if mla is not None else None) or cfg.get("head_dim") or hidden // num_heads
    # GLM's projections carry q/k/v biases unless the config says otherwise; InternLM3's hub configs say qkv_bias
    bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("glm", "glm4"))))
    if mla is not None and bias:
        raise ValueError("attention_bias=True is not supported with multi-head latent attention")
    theta, scaling = rope_from_hf(cfg)
    tie = cfg.get("tie_word_embeddings")
    generation_cfg = generation_cfg or {}
    window, window_layers = sliding_window_from_hf(cfg, arch)
    gemma = (gemma3_from_hf(cfg) if arch == "gemma3_text" else gemma2_from_hf(cfg) if arch == "gemma2"
             else {"sandwich_norms": True} if arch == "glm4" else granite_from_hf(cfg) if arch == "granite"
             else {"nope_layers": frozenset(i for i, rope in enumerate(_smollm3_rope_layers(cfg)) if not rope)}
             if arch == "smollm3" else {})
    per_type = cfg.get("rope_parameters")
    if arch == "gemma3_text" and isinstance(per_type, dict) and "full_attention" in per_type:
        # transformers 5 writes one rope per layer type: the global layers' is the model's
        theta, scaling = rope_from_hf({**cfg, "rope_parameters": per_type["full_attention"], "rope_scaling": None})
    if arch == "phi3" and scaling is not None and scaling.rope_type == "yarn":
        raise ValueError("phi3: rope_scaling 'yarn' is Phi's longrope there (transformers reads it so), which is not "
                         "supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    partial = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                           cfg.get("partial_rotary_factor")) or 1.0)
    if mla is not None and partial != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor={partial} with multi-head latent attention is not supported")
    if not 0 < partial <= 1 or int(int(head_dim) * partial) % 2:
        raise ValueError(f"{arch}: partial_rotary_factor={partial} must leave an even number of rotated dimensions "
                         f"of head_dim {head_dim}")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        # MLA has one latent per token, not key-value heads: its num_key_value_heads is not read
        num_kv_heads=num_heads if mla is not None else int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=declared_context(cfg),
        tie_word_embeddings=bool(tie) if tie is not None else not has_lm_head,
        # Qwen2 always has q/k/v bias and never an o_proj bias, GLM's flag is for q/k/v only; Llama/Qwen3's covers
        # all four.
        attention_bias=True if arch in ("qwen2", "qwen2_moe") else bias,
        o_proj_bias=(bool(cfg.get("attention_out_bias", False)) if arch == "seed_oss"
                     else bias and arch not in ("qwen2", "qwen2_moe", "glm", "glm4", "helium")),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=merge_eos(_token_ids(cfg.get("eos_token_id")), _token_ids(generation_cfg.get("eos_token_id"))),
        moe=moe_from_hf(cfg, arch),
        mla=mla,
        sliding_window=window,
        sliding_layers=window_layers,
        hidden_act=str(act),
        partial_rotary_factor=partial,
        rope_interleaved=arch in ("glm", "glm4", "helium"),
        **gemma,
    )


def _smollm3_rope_layers(cfg: dict[str, Any]) -> list[int]:
    """SmolLM3's ``no_rope_layers``: per layer, 1 where queries and keys are rotated (default: all but every
    ``no_rope_layer_interval``-th)."""
    listed = cfg.get("no_rope_layers")
    if listed is not None:
        return [int(v) for v in listed]
    interval = int(cfg.get("no_rope_layer_interval", 4))
    return [int((i + 1) % interval != 0) for i in range(int(cfg["num_hidden_layers"]))]


def granite_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers as transformers' ``modeling_granite`` applies them."""
    return dict(attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))


def gemma2_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's quirks as ModelConfig fields, as transformers' ``modeling_gemma2`` computes them: Gemma 3's minus
    the q/k norms and the local rope base, plus attention-score soft-capping."""
    softcap, attn_softcap = cfg.get("final_logit_softcapping"), cfg.get("attn_logit_softcapping")
    return dict(attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5, embed_scale=True,
                norm_weight_offset=1.0, sandwich_norms=True,
                final_logit_softcapping=float(softcap) if softcap else None,
                attn_logit_softcapping=float(attn_softcap) if attn_softcap else None)


def gemma3_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text's quirks as ModelConfig fields, as transformers' ``modeling_gemma3`` computes them."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"gemma3_text: use_bidirectional_attention={cfg['use_bidirectional_attention']!r} is not "
                         "supported")
    params = cfg.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    if (params.get("sliding_attention") or {}).get("rope_type", "default") != "default":
        raise ValueError("gemma3_text: rope scaling of the sliding layers is not supported")
    softcap = cfg.get("final_logit_softcapping")
    return dict(attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5, embed_scale=True,
                norm_weight_offset=1.0, sandwich_norms=True, rope_local_theta=float(local),
                rope_local_layers=frozenset(i for i, t in enumerate(_gemma3_layer_types(cfg))
                                            if t == "sliding_attention"),
                final_logit_softcapping=float(softcap) if softcap else None,
                attn_logit_softcapping=float(cfg["attn_logit_softcapping"]) if cfg.get("attn_logit_softcapping")
                else None)


def _gemma3_layer_types(cfg: dict[str, Any]) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    pattern = int(cfg.get("sliding_window_pattern", 6))
    layers = int(cfg["num_hidden_layers"])
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def sliding_window_from_hf(cfg: dict[str, Any], arch: str) -> tuple[int | None, frozenset[int] | None]:
    """(window, the layers that use it) as transformers reads them. Qwen2 / Qwen3 (and their MoE) only with
    ``use_sliding_window``; Qwen2 / Qwen3 / Qwen2-MoE per layer from ``layer_types`` when the config lists them, else
    Qwen2 and Qwen3 from layer ``max_window_layers`` on and Qwen2-MoE on the even layers below it (transformers'
    rules); Mistral, Mixtral and Qwen3-MoE in every layer (transformers ignores their ``layer_types``). A window no
    shorter than the context changes nothing and is dropped."""
    window = cfg.get("sliding_window")
    layers = int(cfg["num_hidden_layers"])
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3") and not cfg.get("use_sliding_window", False):
        window = None
    if arch not in ("mistral", "ministral", "mixtral", "phi3", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2",
                    "gemma3_text", "smollm3") or not window:
        return None, None
    window = int(window)
    if window < 0:
        raise ValueError(f"sliding_window={window} must be positive")
    if window >= int(cfg.get("max_position_embeddings", 4096)):
        return None, None
    if arch == "smollm3" and cfg.get("layer_types") is None:   # its default: the layers without rope slide
        cfg = {**cfg, "layer_types": ["full_attention" if rope else "sliding_attention"
                                      for rope in _smollm3_rope_layers(cfg)]}
    types = (cfg.get("layer_types") if arch in ("qwen2", "qwen3", "qwen2_moe", "ministral", "smollm3")
             else _gemma3_layer_types(cfg) if arch == "gemma3_text"
             else cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(layers)] if arch == "gemma2" else None)
    max_window_layers = int(cfg.get("max_window_layers", layers))
    if types is not None:
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported (full_attention, sliding_attention)")
        chosen = frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    elif arch in ("qwen2", "qwen3", "smollm3"):
        chosen = frozenset(range(max_window_layers, layers))
    elif arch == "qwen2_moe":
        chosen = frozenset(i for i in range(layers) if (i + 1) % 2 and i < max_window_layers)
    else:
        chosen = frozenset(range(layers))
    if not chosen:
        return None, None
    return window, None if len(chosen) == layers else chosen
