"""What kernel each layer of a model picked (``use_kernels``), for the model and kernel tests."""
from __future__ import annotations

from typing import Any

import torch

from engine.config import KernelSettings
from engine.device import CpuDevice
from engine.models import CausalLM
from engine.models.layers.activation import SiluAndMul, silu_and_mul
from engine.models.layers.fused_moe import FusedMoE, GroupedMoEMethod
from engine.models.layers.linear import (
    AmxLinearMethod,
    BlockQuantLinearMethod,
    DenseLinearMethod,
    Linear,
    LinearMethod,
    OneDnnLinearMethod,
)
from engine.models.layers.norm import KernelNorm
from engine.worker.worker import prepare_model


def prepare(model: CausalLM, dtype: torch.dtype, **settings: Any) -> CausalLM:
    """What the engine's worker does at load, on the CPU device, with ``KernelSettings`` from the environment
    and ``settings`` on top."""
    kernels = KernelSettings.from_env()
    prepare_model(model, CpuDevice(kernels=KernelSettings(**{**kernels.__dict__, **settings})), dtype)
    return model


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _chain(method: LinearMethod | None) -> list[LinearMethod]:
    out: list[LinearMethod] = []
    while method is not None:
        out.append(method)
        method = getattr(method, "fallback", None)
    return out


def onednn_packed(layer: Linear) -> torch.Tensor | None:
    """The layer's oneDNN-packed weight, when its method (or the one it falls back to) holds one."""
    return next((m.packed for m in _chain(layer.method) if isinstance(m, OneDnnLinearMethod)), None)


def amx_packed(layer: Linear) -> torch.Tensor | None:
    return layer.method.packed if isinstance(layer.method, AmxLinearMethod) else None


def blocks_only(layer: Linear) -> bool:
    """Every step runs on the layer's GGUF blocks (its dense weight is not kept)."""
    return isinstance(layer.method, BlockQuantLinearMethod) and layer.method.max_rows is None


def model_onednn_packed(model: CausalLM) -> bool:
    return any(onednn_packed(m) is not None for m in linears(model))


def kernels_chosen(model: CausalLM) -> bool:
    """Every linear layer runs a kernel of the CPU device's choice (oneDNN, GGUF blocks, AMX), none F.linear."""
    return all(not isinstance(m.method, DenseLinearMethod) for m in linears(model))


def uses_cpu_ops(model: CausalLM) -> bool:
    acts = [m.fn for m in model.modules() if isinstance(m, SiluAndMul)]
    acts += [m.method.act for m in model.modules()
             if isinstance(m, FusedMoE) and isinstance(m.method, GroupedMoEMethod)]
    # (a model of GeGLU MLPs, Gemma's, has no SiLU to run on the kernels: its norms tell)
    return isinstance(model.norm.method, KernelNorm) and all(fn is not silu_and_mul for fn in acts)


def dense_weight(layer: Linear) -> torch.Tensor:
    """The [out, in] weight a layer computes with: its own, or unpacked from its oneDNN copy."""
    if layer.weight is not None:
        return layer.weight
    packed = onednn_packed(layer)
    assert packed is not None, "the layer keeps neither its weight nor a oneDNN copy"
    return packed.to_dense()
