"""Test-wide settings, applied before torch is imported anywhere (also inherited by spawned processes), and the
transformers references for the default model, loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# The suite runs several processes (tests, engine, tokenizer services, gateways) on 2 cores. OpenMP threads
# that spin while waiting for each other then starve everyone: sleep instead (measured 3-5x faster steps).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Without a GPU, the Triton kernels (the CUDA attention backend's) are tested under Triton's interpreter, which is
# read when triton is imported, and torch imports it (torch._dynamo) wherever it is installed: chosen here.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _default_gguf() -> Path:
    from engine.config import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def default_hf_tokenizer() -> Any:
    """transformers' own tokenizer for the default GGUF: a reference no one here wrote. Shared by every module
    that needs it (~4 s a load); a test that changes it works on a copy."""
    transformers = pytest.importorskip("transformers")
    path = _default_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def default_hf_model() -> Any:
    """transformers' float32 model of the default GGUF (the file's blocks dequantized by transformers), in eval
    mode. Shared (~13 s a load, ~0.5 GiB): tests only run it forward."""
    transformers = pytest.importorskip("transformers")
    path = _default_gguf()
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()
