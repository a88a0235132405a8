"""CUDA backend: real streams and events; attention through PyTorch (SDPA + block-table gather)."""

from __future__ import annotations

import torch

from engine.device.accelerator import AcceleratorDevice


class CudaDevice(AcceleratorDevice):
    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was chosen but torch sees no CUDA device")
        super().__init__("cuda", torch.cuda, index)
