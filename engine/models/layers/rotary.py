"""Rotary position embedding with a precomputed cos/sin cache (Hugging Face rotate_half convention)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from engine.device.kernel_choice import KernelChoice
from engine.models.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, context: int | None = None) -> torch.Tensor:
    """float32 [rotary_dim / 2], computed the way transformers does so logits match it exactly.

    ``context``: the longest sequence served (default: the model's declared context), which picks longrope's long
    or short factors as transformers picks them for a sequence of that length.
    """
    dim = config.rotary_dim
    base = config.rope_theta
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "dynamic":
        # transformers raises the base for the length of the sequence in hand, which a paged cache shared by
        # sequences of every length cannot follow; as vLLM, the base is the one for the whole declared context.
        length = scaling.original_max_position_embeddings * scaling.factor
        base = base * ((scaling.factor * length / scaling.original_max_position_embeddings)
                       - (scaling.factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is not None and scaling.rope_type == "yarn":
        inv_freq = _yarn(dim, config.rope_theta, scaling)
    elif scaling is not None and scaling.rope_type == "longrope":
        long = (context or config.max_position_embeddings) > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        inv_freq = 1.0 / (factors * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    elif scaling is not None and scaling.rope_type in ("linear", "llama3"):
        inv_freq = _scale(inv_freq, scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def _yarn(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's blend of interpolated and kept frequencies, as transformers' ``_compute_yarn_parameters``."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos and sin for every position up to max_position_embeddings, each [max_pos, head_dim / 2],
    in the model dtype (transformers also casts cos/sin to the activation dtype before applying them)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        # GLM's interleaved pairs and partial rotation (over the head's first rotary_dim) rotate in torch on every
        # device; the whole-head halves layout has the CPU kernel's and the NPU's operator.
        partial = config.mla is None and config.rotary_dim < config.head_dim
        self.generic = _GenericRotary(config.rotary_dim, config.rope_interleaved) if (
            partial or config.rope_interleaved) else None
        self.rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                              tuple[torch.Tensor, torch.Tensor]] = self.generic or _rotate_pair
        self.context: int | None = None

    def use_kernels(self, choice: KernelChoice) -> None:
        """With the CPU kernels, rotate in place (on the fused projection's output, no copies); on the NPU, with
        torch-npu's ``npu_rotary_mul``."""
        if self.generic is not None:
            return
        if choice.npu_ops is not None:
            self.rotate = _NpuRotary(choice.npu_ops)
        else:
            self.rotate = _rotate_pair if choice.ops is None else _InPlaceRotary(choice.ops)

    @property
    def depends_on_context(self) -> bool:
        """Whether the frequencies depend on the longest sequence served (longrope's long or short factors)."""
        return self.config.rope_scaling is not None and self.config.rope_scaling.rope_type == "longrope"

    def build_cache(self, device: torch.device | str, dtype: torch.dtype, context: int | None = None) -> None:
        """Fills the caches; called once the model is on its device (its buffers start empty), and again with the
        engine's ``max_model_len`` as ``context`` when the frequencies depend on it."""
        self.context = context
        inv_freq = inverse_frequencies(self.config, context).to(device)
        positions = torch.arange(self.config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        scaling = self.config.rope_scaling
        attention = scaling.attention_factor if scaling is not None else 1.0   # YaRN's; 1 otherwise
        self.cos_cache = (freqs.cos() * attention).to(dtype)
        self.sin_cache = (freqs.sin() * attention).to(dtype)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, Hq, D], key [T, Hkv, D]. Returns the rotated pair (the same tensors, rotated in
        place, with the CPU kernels)."""
        return self.rotate(positions, query, key, self.cos_cache, self.sin_cache)


def _rotate_pair(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].unsqueeze(1)  # [T, 1, D/2]
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


class _InPlaceRotary:
    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.rotary_(query, positions, cos_cache, sin_cache)
        self.ops.rotary_(key, positions, cos_cache, sin_cache)
        return query, key


class _NpuRotary:
    """``npu_rotary_mul(x, r1, r2)`` = ``x * r1 + rotate_half(x) * r2`` on x [1, T, H, D] (BSND) with r1 = cos and
    r2 = sin at full width [1, T, 1, D], as vLLM-Ascend's rotary layer calls it."""

    def __init__(self, npu_ops: Any) -> None:
        self.ops = npu_ops

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos_cache[positions]
        sin = sin_cache[positions]
        r1 = torch.cat((cos, cos), dim=-1)[None, :, None, :]
        r2 = torch.cat((sin, sin), dim=-1)[None, :, None, :]
        return (self.ops.npu_rotary_mul(query[None], r1, r2)[0],
                self.ops.npu_rotary_mul(key[None], r1, r2)[0])


class _GenericRotary:
    """RoPE over the first ``dim`` dimensions of each head (the rest pass through), in halves or interleaved pairs
    (GLM: dimensions 2i and 2i+1 turn by frequency i), as transformers' ``apply_rotary_pos_emb`` of those models."""

    def __init__(self, dim: int, interleaved: bool) -> None:
        self.dim = dim
        self.interleaved = interleaved

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos_cache[positions].unsqueeze(1)  # [T, 1, dim/2]
        sin = sin_cache[positions].unsqueeze(1)
        return self._apply(query, cos, sin), self._apply(key, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.dim], x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            rot = _rotate(rot, cos, sin)
        return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equal to x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), without building the full-width tensors.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
