"""The engine's on/off environment switches (``SLUICE_CPU_KERNELS``, ``SLUICE_KV_HUGE_PAGES``, …)."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")


def switched_on(name: str) -> bool:
    """False when the variable ``name`` is 0 / false / no / off (any case, spaces ignored); True when it is
    unset or anything else: every switch defaults to on."""
    return os.environ.get(name, "1").strip().lower() not in _OFF
