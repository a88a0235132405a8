"""Fixtures shared by the engine's tests: the compiled kernels, and one parsed reader per GGUF file."""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from gguf import GGUFReader

from engine.kernels import cpu_ops, portable_cpu_ops
from engine.models import gguf_loader


@pytest.fixture(scope="module", params=["native", "portable"])
def ops(request: pytest.FixtureRequest) -> Any:
    """The compiled CPU kernels, as built for this CPU and as built without AVX2/FMA."""
    if request.param == "portable":  # built without AVX2/FMA: the loops other CPUs run
        return portable_cpu_ops()
    module = cpu_ops()
    assert module is not None, "engine/kernels/cpu_ops.cpp did not build (see the warning logged)"
    return module


@pytest.fixture(scope="session", autouse=True)
def one_gguf_reader_per_file() -> Iterator[None]:
    """These tests load the default model in process ~25 times; the session keeps one parsed reader per file (path,
    inode, size, mtime). A reader is a read-only memory map and its parsed fields; every load still runs the
    engine's whole loader (config, dequantization, shards, blocks) over it."""
    parse = gguf_loader.ModelReader
    readers: dict[tuple[str, int, int, int], GGUFReader] = {}

    def reader(path: str) -> GGUFReader:
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = parse(path)
        return readers[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(gguf_loader, "ModelReader", reader)
    yield
    patch.undo()
