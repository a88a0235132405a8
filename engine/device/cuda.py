"""CUDA backend: real streams and events; paged attention through the Triton kernels when triton imports
(``TritonAttentionBackend``: decodes and prefill chunks over the cache in place, CUDA-graph capturable), else
the portable PyTorch path (SDPA over a block-table gather), with the reason logged once; mixture-of-experts layers
likewise on the Triton fused-MoE kernels (``KernelChoice.triton_moe``) when they import.

Decode steps of a single-rank engine are captured as CUDA graphs at start (``engine.worker.graphs``, off
with ``--enforce-eager``) and the KV cache is sized by profiling a max-size step (``engine.worker.kv_profile``).
See docs/cuda.md, which also says what has and has not been run on a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.device.accelerator import AcceleratorDevice
from engine.device.kernel_choice import KernelChoice

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)


class CudaDevice(AcceleratorDevice):
    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was chosen but torch sees no CUDA device")
        super().__init__("cuda", torch.cuda, index)
        self._backend: AttentionBackend | None = None

    def attention_backend(self) -> AttentionBackend:
        """Chosen once per device: every runner of this rank (target and draft model) shares the choice."""
        if self._backend is None:
            self._backend = cuda_attention_backend()
        return self._backend

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def kernel_choice(self, dtype: torch.dtype, amx_pack_bytes: int = 0, int8_layers: int = 0) -> KernelChoice:
        """Mixture-of-experts layers on the Triton fused-MoE kernels when they import (as attention: without
        triton, PyTorch's path); PyTorch ops for the other layers."""
        return KernelChoice(triton_moe=triton_moe_imports())


def triton_moe_imports() -> bool:
    """Whether the Triton fused-MoE kernels import (triton installed, and a version that has what they use)."""
    try:
        import engine.kernels.triton_moe  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_attention_backend() -> AttentionBackend:
    """The Triton backend when triton imports, else the PyTorch one (and why, in the log)."""
    try:
        from engine.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        from engine.attention.torch_backend import TorchAttentionBackend

        logger.warning("triton is not importable (%s): CUDA attention runs the PyTorch path (block gather + SDPA), "
                       "and decode steps are not captured as CUDA graphs", e)
        return TorchAttentionBackend()
    logger.info("CUDA attention: Triton paged kernels")
    return TritonAttentionBackend()
