"""Device backends behind one interface; each accelerator backend is imported only when chosen."""

from __future__ import annotations

from engine.config import KernelSettings
from engine.device.base import Device
from engine.device.cpu import CpuDevice


def get_device(name: str, *, num_threads: int | None = None, kernels: KernelSettings | None = None,
               index: int = 0) -> Device:
    """``index``: which accelerator of the host (each rank of a replica has its own); the CPU has one."""
    if name == "cpu":
        return CpuDevice(num_threads, kernels)
    if name == "cuda":
        from engine.device.cuda import CudaDevice

        return CudaDevice(index)
    if name == "npu":
        from engine.device.npu import NpuDevice  # imports torch_npu, and only here

        return NpuDevice(index)
    raise ValueError(f"unknown device {name!r} (cpu, cuda or npu)")


__all__ = ["Device", "CpuDevice", "get_device"]
