"""Fixtures shared by the engine's kernel tests."""
from __future__ import annotations

from typing import Any

import pytest

from engine.kernels import cpu_ops, portable_cpu_ops


@pytest.fixture(scope="module", params=["native", "portable"])
def ops(request: pytest.FixtureRequest) -> Any:
    """The compiled CPU kernels, as built for this CPU and as built without AVX2/FMA."""
    if request.param == "portable":  # built without AVX2/FMA: the loops other CPUs run
        return portable_cpu_ops()
    module = cpu_ops()
    assert module is not None, "engine/kernels/cpu_ops.cpp did not build (see the warning logged)"
    return module
