"""benchmarks/runner.py's event loop choice (the load shapes are driven end to end in test_bench.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from benchmarks.runner import run_async


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_async_runs_on_uvloop_when_installed() -> None:
    assert run_async(loop_module()).startswith("uvloop")


def test_run_async_falls_back_to_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert run_async(loop_module()).startswith("asyncio")
