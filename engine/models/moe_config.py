"""The mixture-of-experts and multi-head latent attention parts of a model's ``config.json``, read the way
transformers reads them for Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (R1, Kimi-K2).

An option the engine cannot honour is refused here, at load, naming it: never read and then ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Scoring = Literal["softmax", "sigmoid"]
# How a group of experts is scored for grouped top-k: its best expert ("max", DeepSeek-V2's group_limited_greedy)
# or the sum of its two best biased scores ("top2_sum", DeepSeek-V3's noaux_tc).
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class Routing:
    """How a layer picks its experts (``engine.models.layers.moe_routing.select_experts`` computes it)."""

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    num_groups: int | None = None          # grouped top-k: experts split in this many groups ...
    topk_group: int | None = None          # ... of which this many are kept
    group_score: GroupScore = "max"
    correction_bias: bool = False          # noaux_tc: gate.e_score_correction_bias shifts the choice, not the weight
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.num_experts} experts")
        if (self.num_groups is None) != (self.topk_group is None):
            raise ValueError("grouped top-k needs both n_group and topk_group")
        if self.num_groups is not None and self.topk_group is not None:
            if self.num_experts % self.num_groups:
                raise ValueError(f"n_group {self.num_groups} does not divide the {self.num_experts} experts")
            if not 0 < self.topk_group <= self.num_groups:
                raise ValueError(f"topk_group {self.topk_group} must be between 1 and n_group {self.num_groups}")
            if self.topk_group * (self.num_experts // self.num_groups) < self.top_k:
                raise ValueError(f"topk_group {self.topk_group} groups of {self.num_experts // self.num_groups} "
                                 f"experts hold fewer than num_experts_per_tok {self.top_k}")


MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MoeConfig:
    routing: Routing
    intermediate_size: int                 # each routed expert's
    moe_layers: frozenset[int]             # the layers with routed experts; the others have a dense MLP
    shared_intermediate_size: int = 0      # the shared experts' (0: none)
    shared_expert_gate: bool = False       # Qwen2-MoE: the shared expert's output times sigmoid(a gate)


@dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None         # None: q_proj straight from the hidden states
    rope_interleave: bool = True           # DeepSeek's rotary pairs are adjacent dimensions
    softmax_scale: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the cache holds per token and layer: the compressed latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _refuse(arch: str, key: str, value: Any, expected: str) -> None:
    raise ValueError(f"{arch}: {key}={value!r} is not supported ({expected})")


def moe_from_hf(cfg: dict[str, Any], arch: str) -> MoeConfig | None:
    """The routed experts of ``cfg`` (None for a dense model)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        _refuse(arch, "hidden_act", act, "the experts run SiLU-and-mul")
    layers = int(cfg["num_hidden_layers"])
    if arch == "mixtral":
        return MoeConfig(Routing(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), renormalize=True),
                         int(cfg["intermediate_size"]), frozenset(range(layers)))
    if arch in ("qwen2_moe", "qwen3_moe"):
        # the hub's configs say num_experts; transformers 5 writes num_local_experts
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        moe_layers = frozenset(i for i in range(layers)
                               if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0
        return MoeConfig(Routing(num_experts, int(cfg["num_experts_per_tok"]),
                                 renormalize=bool(cfg.get("norm_topk_prob", arch == "qwen3_moe"))),
                         int(cfg["moe_intermediate_size"]), moe_layers, shared, shared_expert_gate=shared > 0)
    # DeepSeek-V2 / V3
    num_experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    if num_experts == 0:
        _refuse(arch, "n_routed_experts", cfg.get("n_routed_experts"), "a DeepSeek model without routed experts")
    freq = int(cfg.get("moe_layer_freq", 1))
    if freq != 1:
        _refuse(arch, "moe_layer_freq", freq, "every layer from first_k_dense_replace on has experts")
    first_dense = int(cfg.get("first_k_dense_replace", 3 if arch == "deepseek_v3" else 0))
    method = cfg.get("topk_method") or ("noaux_tc" if arch == "deepseek_v3" else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if arch == "deepseek_v3" else "softmax")
    groups = cfg.get("n_group")
    topk_group = cfg.get("topk_group")
    if arch == "deepseek_v3":
        if method != "noaux_tc":
            _refuse(arch, "topk_method", method, "DeepSeek-V3 routes with noaux_tc")
        if scoring != "sigmoid":
            _refuse(arch, "scoring_func", scoring, "DeepSeek-V3 scores with sigmoid")
        routing = Routing(num_experts, int(cfg["num_experts_per_tok"]), "sigmoid",
                          renormalize=bool(cfg.get("norm_topk_prob", True)),
                          num_groups=int(groups or 1), topk_group=int(topk_group or 1), group_score="top2_sum",
                          correction_bias=True,
                          routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    else:
        if method not in ("greedy", "group_limited_greedy"):
            _refuse(arch, "topk_method", method, "DeepSeek-V2 routes with greedy or group_limited_greedy")
        if scoring != "softmax":
            _refuse(arch, "scoring_func", scoring, "DeepSeek-V2 scores with softmax")
        grouped = method == "group_limited_greedy"
        if grouped and (groups is None or topk_group is None):
            _refuse(arch, "topk_method", method, "group_limited_greedy needs n_group and topk_group")
        routing = Routing(num_experts, int(cfg["num_experts_per_tok"]),
                          # DeepSeek's own code renormalises when norm_topk_prob (V2 and V2-Lite ship False)
                          renormalize=bool(cfg.get("norm_topk_prob", False)),
                          num_groups=int(groups) if grouped and groups is not None else None,
                          topk_group=int(topk_group) if grouped and topk_group is not None else None,
                          routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    # the multi-token prediction layers after the decoder's (engine.models.mtp) have experts too
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    return MoeConfig(routing, int(cfg["moe_intermediate_size"]), frozenset(range(first_dense, layers + mtp)), shared)


def mla_from_hf(cfg: dict[str, Any], arch: str) -> MlaConfig | None:
    """DeepSeek's latent attention sizes (None for other models). ``softmax_scale`` includes YaRN's
    ``mscale_all_dim`` correction, squared, as transformers' ``yarn_apply_mscale``."""
    if arch not in _DEEPSEEK:
        return None
    import math

    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    q_lora = cfg.get("q_lora_rank")
    scale = (nope + rope) ** -0.5
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        mscale_all_dim = float(scaling.get("mscale_all_dim", 0) or 0)
        factor = float(scaling.get("factor", 1.0))
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return MlaConfig(kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                     v_head_dim=v, q_lora_rank=int(q_lora) if q_lora else None,
                     rope_interleave=bool(cfg.get("rope_interleave", True)) if arch == "deepseek_v3" else True,
                     softmax_scale=scale)
