"""The CUDA device's attention backend: Triton's when triton imports, else the PyTorch fallback (checked on CPU by
hiding triton), and on a GPU the device hands out the Triton backend once."""
from __future__ import annotations

import sys

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.device.cuda import cuda_attention_backend
from tests.engine.triton_interpreter import triton_backend_module


def test_triton_backend_when_triton_imports() -> None:
    module = triton_backend_module()
    assert isinstance(cuda_attention_backend(), module.TritonAttentionBackend)


def test_pytorch_fallback_without_triton(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("triton", "engine.kernels.triton_paged", "engine.attention.triton_backend"):
        monkeypatch.setitem(sys.modules, name, None)   # import of a None entry raises ImportError
    backend = cuda_attention_backend()
    assert type(backend) is TorchAttentionBackend
    assert "triton is not importable" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_hands_out_one_triton_backend() -> None:
    from engine.device import get_device

    module = triton_backend_module()
    dev = get_device("cuda")
    assert isinstance(dev.attention_backend(), module.TritonAttentionBackend)
    assert dev.attention_backend() is dev.attention_backend()
