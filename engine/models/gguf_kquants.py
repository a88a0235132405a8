"""GGUF K-quants (Q4_K, Q5_K, Q6_K: what llama.cpp's Q4_K_M and Q5_K_M files hold) and how they run.

Every K-quant stores super-blocks of 256 weights along a row (ggml's ``block_q4_K``, ``block_q5_K``,
``block_q6_K``):

* Q4_K, 144 bytes: float16 ``d`` and ``dmin``, 12 bytes packing a 6-bit scale ``sc`` and a 6-bit minimum ``m`` for
  each of 8 sub-blocks of 32, then 128 bytes of 4-bit codes (byte ``i`` of 32-byte chunk ``c``: sub-block ``2c`` in
  its low nibble, ``2c + 1`` in its high one). ``w = d * sc * q - dmin * m``.
* Q5_K, 176 bytes: Q4_K's header, 32 bytes of fifth bits (bit ``j`` of byte ``i``: element ``i`` of sub-block ``j``),
  Q4_K's 128 bytes of low nibbles. The same ``w`` with ``q`` in 0..31.
* Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per sub-block of 16) and a
  float16 ``d``. ``w = d * scale * (q - 32)``.

How they run on the CPU (docs/models.md, "GGUF quantized types"): a Q4_K matrix is exactly a group-32 asymmetric
4-bit weight, ``scale = d * sc`` and an additive ``offset = -dmin * m`` per sub-block (``Int4Weight.offsets``,
computed in float32 as gguf-py computes them, so ``Int4Weight.dequantize`` is gguf-py's dequantization bit for bit),
and runs on the int4 ``LinearMethod`` (torch's ``_weight_int4pack_mm_for_cpu``) with no float copy kept. Q5_K and
Q6_K are dequantized at load to the model's dtype (as transformers does) and run on the dense methods: no kernel
here takes them as they are (Q6_K's scales cover 16 weights, the int4 kernel's groups at least 32; Q5_K's codes
have 5 bits), and Q5_K's exact split into two int4 planes held nearly as much memory as bfloat16 and was faster at
one row only (benchmarks/gguf_kquants.py, docs/benchmarks.md).

A projection gets its 4-bit weight only when the kernel takes it (output rows a multiple of 16) and, for a fused one
(q/k/v, gate/up), when all its parts are Q4_K: a Q4_K_M file's Q6_K ``attn_v`` leaves that layer's q/k/v dense.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.models.int4 import Int4Weight
from engine.models.layers.int4_linear import kernel_group_size
from engine.models.llama import CausalLM
from engine.models.weight_names import num_parts

Q4_K = GGMLQuantizationType.Q4_K
KQUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
SUPER_BLOCK = 256
SUB_BLOCK = 32          # Q4_K's (and Q5_K's) sub-block: the int4 weight's group
_Q4_K_BYTES = 144


def scale_min_codes(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums [..., 8] of Q4_K / Q5_K's 12 packed bytes [..., 12] (ggml's
    ``get_scale_min_k4``): bytes 0-3 hold scales 0-3 and the top bits of scales 4-7, bytes 4-7 the same for the
    minimums, bytes 8-11 the low nibbles of scales 4-7 (low) and minimums 4-7 (high)."""
    s = packed.reshape(*packed.shape[:-1], 3, 4)
    lo, hi, nib = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    scales = np.concatenate([lo & 0x3F, (nib & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (nib >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return scales, mins


def q4_k_weight(raw: np.ndarray) -> Int4Weight:
    """A Q4_K matrix (``raw``: its bytes as uint8 [rows, bytes per row], ``ReaderTensor.data``) as a group-32 4-bit
    weight with additive offsets: ``codes * (d * sc) + (-(dmin * m))``, gguf-py's float32 arithmetic."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, _Q4_K_BYTES)
    n = blocks.shape[1]
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)        # [rows, n, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = scale_min_codes(blocks[..., 4:16])                             # [rows, n, 8]
    scales = (d * sc.astype(np.float32)).reshape(rows, n * 8)
    offsets = -(dmin * m.astype(np.float32)).reshape(rows, n * 8)
    qs = blocks[..., 16:].reshape(rows, n, 4, 1, SUB_BLOCK)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n * SUPER_BLOCK)
    groups = torch.from_numpy(scales)
    return Int4Weight(torch.from_numpy(codes), groups, torch.zeros_like(groups), SUB_BLOCK,
                      offsets=torch.from_numpy(np.ascontiguousarray(offsets)))


def permute_rows(weight: Int4Weight, permute: Callable[[np.ndarray], np.ndarray]) -> Int4Weight:
    """``weight`` with a numpy row permutation (``gguf_loader.unpermute_qk``) applied to its codes, scales and
    offsets."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(permute(t.numpy())))

    assert weight.offsets is not None and weight.perm is None
    return Int4Weight(rows(weight.codes), rows(weight.scales), torch.zeros_like(weight.zeros), weight.group_size,
                      offsets=rows(weight.offsets))


def attach(model: CausalLM, weights: Iterable[tuple[str, Int4Weight]]) -> int:
    """Gives linears their Q4_K weights as ``Linear.int4`` (named and sharded as ``load_weights`` had them, which
    loaded the same values dequantized), stacking a fused projection's parts, and frees the float weights they
    replace. A projection is left dense when only some of its parts are Q4_K or the kernel does not take its shape.
    The embedding table stays dense; a tied lm_head runs on the table's Q4_K codes and shares the table. Returns how
    many linears got one."""
    from engine.models.layers.linear import Linear

    shards: dict[str, dict[int, Int4Weight]] = {}
    for hf_name, weight in weights:
        target = model._target(hf_name)
        if target is not None:
            shards.setdefault(target[0], {})[target[1]] = weight
    count = 0
    module: torch.nn.Module | None
    for name, parts in shards.items():
        if len(parts) != num_parts(name, model.plan):
            continue
        if name == "embed_tokens.weight":
            module = model.lm_head if model.config.tie_word_embeddings else None
        else:
            module = model.get_submodule(name.removesuffix(".weight"))
        if not isinstance(module, Linear) or module.weight is None or module.weight.device.type != "cpu":
            continue
        fused = Int4Weight.cat([parts[i] for i in range(len(parts))], name)
        if module.is_lm_head and fused.shape[0] < module.out_features:   # the vocabulary shard's padding rows
            fused = fused.pad_rows(module.out_features)
        if fused.shape != (module.out_features, module.in_features) or kernel_group_size(fused) is None:
            continue
        module.int4 = replace(fused, dtype=module.weight.dtype)
        module.quant = None
        if not module.shares_weight:
            module.weight = None  # type: ignore[assignment]
        count += 1
    return count
