"""CUDA backend: real streams and events; paged attention through the Triton kernels when triton imports
(``TritonAttentionBackend``: decodes and prefill chunks over the cache in place, CUDA-graph capturable), else
the portable PyTorch path (SDPA over a block-table gather), with the reason logged once.

Decode steps of a single-rank engine are captured as CUDA graphs at start (``engine.worker.cuda_graphs``, off
with ``--enforce-eager``) and the KV cache is sized by profiling a max-size step (``engine.worker.kv_profile``).
See docs/cuda.md, which also says what has and has not been run on a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.device.accelerator import AcceleratorDevice

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
