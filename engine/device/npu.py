"""Ascend NPU backend through torch-npu (docs/npu.md).

``torch_npu`` is imported here only, and this module is imported only when ``--device npu`` is chosen, so the engine
runs and is tested without it. Streams, events and memory go through ``torch.npu`` (which mirrors torch.cuda) in
the shared :class:`AcceleratorDevice`; attention runs torch-npu's fused paged-attention operators
(:class:`~engine.attention.npu_backend.NpuAttentionBackend`, block size 128); RMSNorm, SwiGLU, rotary embedding and
W8A8 linears run torch-npu's fused operators (``KernelChoice.npu_ops``); collectives use HCCL
(engine/distributed/parallel_state.py). Decode steps of a single-rank engine are captured per batch-size bucket as
NPU graphs (``torch.npu.NPUGraph``, vLLM-Ascend's ACL graph; ``engine.worker.graphs`` and ``npu_graphs``), off with
``--enforce-eager``.

NOT RUN ON ASCEND HARDWARE: none was available. Every operator call is checked on the CPU against a test-only twin
written from torch-npu's documentation (tests/engine/npu_twin), which proves the calls, not the hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.device.accelerator import AcceleratorDevice
from engine.device.kernel_choice import KernelChoice

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend


class NpuDevice(AcceleratorDevice):
    """NPU ``index`` of the host. ``place``: where tensors live instead of ``npu:index``; only the operator twin's
    tests pass one (the CPU: torch without torch-npu has no "npu" device), production leaves it None."""

    def __init__(self, index: int = 0, *, place: torch.device | None = None) -> None:
        try:
            import torch_npu  # (registers torch.npu)
        except ImportError as e:
            raise RuntimeError("device 'npu' needs torch_npu (Ascend CANN + torch-npu) installed") from e
        npu = torch.npu  # type: ignore[attr-defined]
        if not npu.is_available():
            raise RuntimeError("device 'npu' was chosen but torch_npu sees no NPU")
        super().__init__("npu", npu, index, place)
        self.torch_npu = torch_npu

    @property
    def pin_memory(self) -> bool:
        # Tensors placed on the host need no page-locked staging (and torch without an accelerator cannot pin).
        return self.torch_device.type != "cpu"

    def new_graph(self) -> Any:
        return self._mod.NPUGraph()

    def attention_backend(self) -> AttentionBackend:
        from engine.attention.npu_backend import NpuAttentionBackend

        return NpuAttentionBackend(self.torch_npu)

    def kernel_choice(self, dtype: torch.dtype, amx_pack_bytes: int = 0, int8_layers: int = 0) -> KernelChoice:
        """torch-npu's fused operators for every layer that has one: ``npu_rms_norm`` / ``npu_add_rms_norm``,
        ``npu_swiglu``, ``npu_rotary_mul``, and ``npu_dynamic_quant`` + ``npu_quant_matmul`` for W8A8 linears."""
        return KernelChoice(npu_ops=self.torch_npu)
