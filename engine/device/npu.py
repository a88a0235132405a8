"""Ascend NPU backend through torch-npu.

``torch_npu`` is imported here only, and this module is imported only when
``--device npu`` is chosen, so the engine runs and is tested without it.
NOT RUN ON REAL HARDWARE: no Ascend device was available while writing it;
it follows torch-npu's documented stream/event/memory API, which mirrors
torch.cuda. Attention uses the same PyTorch paged-attention code as CUDA/CPU;
torch-npu's fused operators (npu_fused_infer_attention_score,
_npu_reshape_and_cache, _npu_paged_attention) are the next step.
"""

from __future__ import annotations

import torch

from engine.device.accelerator import AcceleratorDevice
from engine.device.kernel_choice import KernelChoice


class NpuDevice(AcceleratorDevice):
    def __init__(self, index: int = 0) -> None:
        try:
            import torch_npu  # (registers torch.npu)
        except ImportError as e:
            raise RuntimeError("device 'npu' needs torch_npu (Ascend CANN + torch-npu) installed") from e
        npu = torch.npu  # type: ignore[attr-defined]
        if not npu.is_available():
            raise RuntimeError("device 'npu' was chosen but torch_npu sees no NPU")
        super().__init__("npu", npu, index)
        self.torch_npu = torch_npu

    def kernel_choice(self, dtype: torch.dtype, amx_pack_bytes: int = 0, int8_layers: int = 0) -> KernelChoice:
        """PyTorch ops, except W8A8 layers: ``npu_dynamic_quant`` + ``npu_quant_matmul`` (NpuW8A8LinearMethod)."""
        return KernelChoice(npu_ops=self.torch_npu)
