"""W8A8 linear layers: the method each gets from the device's KernelChoice (oneDNN's int8 GEMM, the portable path,
the NPU hook), what each frees, and that every path gives w8a8_reference's result, bit for bit."""
from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from common.settings import kernel_switches
from engine.config import KernelSettings
from engine.device.cpu import CpuDevice
from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.kernels import cpu_ops
from engine.models.layers.linear import (
    AmxLinearMethod,
    Linear,
    PortableW8A8LinearMethod,
    RowParallelLinear,
    W8A8LinearMethod,
    choose_linear_method,
)
from engine.models.layers.lora import LoRALinearMethod, LoRAStepPlan, LoRAStepState
from engine.models.quant import QuantWeight
from engine.models.w8a8 import Int8Weight, quantize_weight, w8a8_reference


@pytest.fixture(scope="module")
def native_ops() -> Any:
    module = cpu_ops()
    assert module is not None, "engine/kernels/cpu_ops.cpp did not build (see the warning logged)"
    return module


class NoVnniOps:
    """The compiled kernels on a CPU that reports no int8 dot-product instructions."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def int8_isa(self) -> str:
        return ""


def _layer(dtype: torch.dtype, inp: int = 96, out: int = 40, bias: bool = True, smooth: bool = False,
           cls: type[Linear] = Linear) -> Linear:
    torch.manual_seed(0)
    layer = Linear(inp, out, bias=bias) if cls is Linear else RowParallelLinear(inp, out, bias, ParallelContext())
    layer = layer.to(dtype)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    layer.int8 = quantize_weight(layer.weight, torch.rand(inp) + 0.5 if smooth else None)
    return layer


def _x(rows: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    x = (torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    x[0] = 0
    return x


def _needs_vnni(ops: Any) -> None:
    """oneDNN's int8 GEMM is exact only with int8 dot products (the device picks the portable path without them)."""
    if not ops.int8_isa():
        pytest.skip("needs a CPU with AVX512-VNNI, AVX-VNNI or AMX-INT8")


def _choices(ops: Any) -> dict[str, KernelChoice]:
    return {"onednn": KernelChoice(ops=ops, onednn=True, int8="onednn"),
            "portable with kernels": KernelChoice(ops=ops, onednn=True, int8="portable"),
            "torch": KernelChoice.torch()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["onednn", "portable with kernels", "torch"])
def test_every_path_equals_the_reference_and_frees_the_dense_weight(native_ops: Any, dtype: torch.dtype,
                                                                    path: str) -> None:
    if path == "onednn":
        _needs_vnni(native_ops)
    layer = _layer(dtype, smooth=dtype == torch.float32)
    int8 = layer.int8
    assert int8 is not None
    layer.use_kernels(_choices(native_ops)[path])
    assert isinstance(layer.method, W8A8LinearMethod if path == "onednn" else PortableW8A8LinearMethod)
    assert layer.weight is None and layer.int8 is None
    for rows in (1, 2, 33, 2048):
        x = _x(rows, 96, dtype)
        assert torch.equal(layer(x), w8a8_reference(x, int8, layer.bias)), rows
    x3 = _x(6, 96, dtype).reshape(2, 3, 96)  # [batch, seq, hidden] in, same shape out
    assert torch.equal(layer(x3), w8a8_reference(x3.reshape(6, 96), int8, layer.bias).reshape(2, 3, 40))
    strided = _x(5, 192, dtype)[:, ::2]  # a view whose rows are not contiguous
    assert torch.equal(layer(strided), w8a8_reference(strided, int8, layer.bias))


def test_int8_wins_over_gguf_blocks_and_amx(native_ops: Any) -> None:
    layer = _layer(torch.bfloat16, inp=64, out=64)  # AMX-packable sides
    empty = torch.empty(0)
    layer.quant = QuantWeight("u4", empty, empty, empty)
    choice = KernelChoice(ops=native_ops, onednn=True, quant_max_rows=2, amx_linear=True, int8="onednn")
    assert isinstance(choose_linear_method(layer, choice), W8A8LinearMethod)
    layer.int8 = None
    assert isinstance(choose_linear_method(layer, choice), AmxLinearMethod)


def test_a_shared_weight_is_kept(native_ops: Any) -> None:
    layer = _layer(torch.float32)
    layer.shares_weight = True
    layer.use_kernels(_choices(native_ops)["onednn"])
    assert isinstance(layer.method, W8A8LinearMethod) and layer.weight is not None


@pytest.mark.parametrize("path", ["onednn", "torch"])
def test_row_parallel_adds_its_bias_after_the_sum(native_ops: Any, path: str) -> None:
    if path == "onednn":
        _needs_vnni(native_ops)
    layer = _layer(torch.bfloat16, cls=RowParallelLinear)
    int8 = layer.int8
    assert int8 is not None and layer.method_bias is None
    layer.use_kernels(_choices(native_ops)[path])
    x = _x(9, 96, torch.bfloat16)
    assert torch.equal(layer(x), w8a8_reference(x, int8).add_(layer.bias))


def test_lora_wraps_the_int8_method(native_ops: Any) -> None:
    _needs_vnni(native_ops)
    layer = _layer(torch.float32, bias=False)
    int8 = layer.int8
    assert int8 is not None
    layer.use_kernels(_choices(native_ops)["onednn"])
    state = LoRAStepState()
    lora = LoRALinearMethod(layer.method, state, slices=(40,), in_features=96, max_loras=1, max_rank=2,
                            dtype=torch.float32, device=torch.device("cpu"))
    layer.method = lora
    a, b = torch.randn(2, 96), torch.randn(40, 2)
    lora.set_slot(0, [(a, b)])
    x = _x(3, 96, torch.float32)
    state.set(LoRAStepPlan(torch.tensor([0, -1, 0]), 1))
    expected = w8a8_reference(x, int8)
    expected[[0, 2]] += (x[[0, 2]] @ a.T) @ b.T
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    assert not torch.equal(layer(x), w8a8_reference(x, int8))


def test_the_int8_switch_is_read_from_its_variable() -> None:
    assert kernel_switches({"SLUICE_INT8_VNNI": "0"})["int8_vnni"] is False
    assert not KernelSettings.from_env({"SLUICE_INT8_VNNI": "0"}).int8_vnni
    assert KernelSettings.from_env({}).int8_vnni


@pytest.mark.parametrize("case", ["vnni", "no vnni", "switched off", "no kernels"])
def test_the_device_falls_back_with_one_warning(native_ops: Any, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture, case: str) -> None:
    if case == "vnni":
        _needs_vnni(native_ops)
    settings = KernelSettings(int8_vnni=case != "switched off", cpu_kernels=case != "no kernels")
    device = CpuDevice(kernels=settings)
    ops = NoVnniOps(native_ops) if case == "no vnni" else native_ops
    monkeypatch.setattr(device, "ops", lambda: ops)
    with caplog.at_level(logging.WARNING, logger="engine.device.cpu"):
        assert device.kernel_choice(torch.bfloat16).int8 == "portable"   # a model without W8A8 layers: no check
        choices = [device.kernel_choice(torch.bfloat16, int8_layers=3) for _ in range(2)]
    warnings = [r.getMessage() for r in caplog.records if "W8A8" in r.getMessage()]
    if case == "vnni":
        assert choices[0].int8 == "onednn" and warnings == []
    elif case == "no kernels":  # everything off by request: the portable path, nothing to warn about
        assert choices[0].int8 == "portable" and choices[0].ops is None and warnings == []
    else:
        assert choices[0].int8 == "portable" and len(warnings) == 1
        assert ("no AVX512-VNNI, AVX-VNNI or AMX-INT8" if case == "no vnni" else "SLUICE_INT8_VNNI=0") in warnings[0]
        assert "portable path" in warnings[0]
    layer = _layer(torch.bfloat16)
    int8 = layer.int8
    assert int8 is not None
    layer.use_kernels(choices[0])
    x = _x(17, 96, torch.bfloat16)
    assert torch.equal(layer(x), w8a8_reference(x, int8, layer.bias))


def _worst_case(k: int) -> tuple[torch.Tensor, Int8Weight]:
    """Codes of +-127 everywhere: sums of up to k * 16129, past 2^24 for k > 1040, and u8 x s8 pairs of 255 x 127
    (with zero point 128), which overflow int16."""
    weight = Int8Weight(torch.full((8, k), 127, dtype=torch.int8), torch.rand(8) + 0.1)
    weight.qweight[1] = -127
    weight.qweight[2, 1::2] = -127
    x = torch.full((4, k), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0
    return x, weight


@pytest.mark.parametrize("k", [1040, 1041, 3001])
def test_the_portable_sums_are_exact_past_float32s_integers(k: int) -> None:
    x, weight = _worst_case(k)
    method = PortableW8A8LinearMethod(None, weight)
    layer = Linear(k, 8, bias=False)
    out = method.apply(layer, x)
    assert out.abs().max() > 2**24 * 0.1
    assert torch.equal(out, w8a8_reference(x, weight))


_NO_VNNI_CHECK = """
import torch
from engine.models.layers.linear import Linear, PortableW8A8LinearMethod
from engine.models.w8a8 import w8a8_reference
from tests.engine.models.layers.test_w8a8_linear import _worst_case
x, weight = _worst_case(576)
codes = torch.round(x / (x.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
exact = codes.long() @ weight.qweight.long().t()
print("int_mm", torch.equal(torch._int_mm(codes, weight.qweight.t()).long(), exact))
out = PortableW8A8LinearMethod(None, weight).apply(Linear(576, 8, bias=False), x)
print("portable", torch.equal(out, w8a8_reference(x, weight)))
"""


def test_without_vnni_onednn_int8_saturates_and_the_portable_path_does_not() -> None:
    """Why a CPU without VNNI runs the portable path: oneDNN limited to AVX-512 without VNNI (as on such a CPU)
    gets int8 products wrong (torch._int_mm runs it), while the portable path's float32 sums stay exact."""
    root = str(Path(__file__).resolve().parents[4])
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", _NO_VNNI_CHECK], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "portable True" in out
    if torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64"):
        assert "int_mm False" in out
