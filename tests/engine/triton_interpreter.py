"""Importing the Triton backend in tests: without a GPU its kernels must run under Triton's interpreter
(``TRITON_INTERPRET=1``: numpy over CPU tensors), which is read when the kernels are defined, so every test
imports them through here. Skips the test when triton is not installed."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch


def choose_interpreter() -> None:
    """Before anything (the engine's own lazy imports included) defines the kernels: no GPU, the interpreter."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def triton_backend_module() -> ModuleType:
    """``engine.attention.triton_backend`` (the interpreter chosen first where there is no GPU)."""
    choose_interpreter()
    pytest.importorskip("triton")
    return importlib.import_module("engine.attention.triton_backend")
