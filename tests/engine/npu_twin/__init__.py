"""A test-only twin of the torch-npu operators Sluice calls and of ``torch.npu``, on the CPU (``torch_npu.py`` and the
modules it gathers): written from torch-npu's documentation, it proves our calls (names, keyword-only arguments,
dtypes, shapes, layouts, masks), not the hardware.

Fixtures, each only for the test that asks:

* ``torch_npu_twin``: the twin importable as ``torch_npu``, its call record and its record of captured graphs
  cleared;
* ``npu_device_twin``: that, plus ``torch.npu`` as the twin, and ``--device npu`` building an ``NpuDevice`` whose
  tensors live on the CPU (its documented ``place`` argument: torch without torch-npu has no "npu" device), so the
  whole engine runs "on the NPU" through the twin operators.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.engine.npu_twin import torch_npu as twin


@pytest.fixture
def torch_npu_twin(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The twin, importable as ``torch_npu`` for the test's duration."""
    monkeypatch.setitem(sys.modules, "torch_npu", twin)
    twin.CALLED.clear()
    twin.npu.CAPTURED.clear()
    yield twin


@pytest.fixture
def npu_device_twin(monkeypatch: pytest.MonkeyPatch, torch_npu_twin: ModuleType) -> Iterator[ModuleType]:
    """``torch_npu_twin`` plus ``torch.npu`` and an NPU device placed on the CPU (see the module's docstring)."""
    import engine.device.npu as npu_device

    monkeypatch.setattr(torch, "npu", twin.npu, raising=False)
    monkeypatch.setattr(npu_device, "NpuDevice", functools.partial(npu_device.NpuDevice, place=torch.device("cpu")))
    yield torch_npu_twin
