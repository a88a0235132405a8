"""A test-only twin of the torch-npu operators Sluice calls, on the CPU (``torch_npu.py``): written from torch-npu's
documentation, it proves our calls (names, keyword-only arguments, dtypes, shapes, layouts), not the hardware.
Tests install it as ``torch_npu`` with the ``torch_npu_twin`` fixture, only for themselves. Other operators (the
attention ones) are added to ``torch_npu.py`` in the same form: documented signature, argument checks, CPU math."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.engine.npu_twin import torch_npu as twin


@pytest.fixture
def torch_npu_twin(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The twin, importable as ``torch_npu`` for the test's duration."""
    monkeypatch.setitem(sys.modules, "torch_npu", twin)
    yield twin
