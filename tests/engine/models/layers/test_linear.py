"""Each linear layer's method, chosen once from its weights and the device's KernelChoice."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.device.kernel_choice import BF16_QUANT_MAX_ROWS, KernelChoice, default_quant_max_rows
from engine.models.layers.linear import (
    AMX_LINEAR_MAX_ROWS,
    AmxLinearMethod,
    BlockQuantLinearMethod,
    DenseLinearMethod,
    Linear,
    OneDnnLinearMethod,
    choose_linear_method,
    linear_methods,
)
from engine.models.quant import QuantWeight


class FakeOps:
    """Stands in for the compiled kernels: records which ran, computes with dense weights."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.calls: list[tuple[str, int]] = []

    def quant_linear(self, x: torch.Tensor, codes: Any, scales: Any, mins: Any, fmt: str) -> torch.Tensor:
        self.calls.append(("quant", x.shape[0]))
        return F.linear(x.float(), self.weight.float())

    def amx_pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.clone()

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append(("amx", x.shape[0]))
        assert x.stride(-1) == 1
        return F.linear(x, packed, bias)


def _layer(dtype: torch.dtype = torch.float32, blocks: bool = False, out: int = 64, inp: int = 32) -> Linear:
    torch.manual_seed(0)
    layer = Linear(inp, out, bias=False).to(dtype)
    if blocks:
        empty = torch.empty(0)
        layer.quant = QuantWeight("u4", empty, empty, empty)
    return layer


def test_torch_choice_keeps_the_dense_weight_and_drops_blocks() -> None:
    layer = _layer(blocks=True)
    layer.use_kernels(KernelChoice.torch())
    assert isinstance(layer.method, DenseLinearMethod) and layer.quant is None and layer.weight is not None


def test_onednn_choice_packs_and_frees_the_weight() -> None:
    layer = _layer()
    weight = layer.weight.detach().clone()
    layer.use_kernels(KernelChoice(onednn=True))
    assert isinstance(layer.method, OneDnnLinearMethod) and layer.weight is None
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_blocks_without_a_row_limit_run_every_step_and_free_the_weight() -> None:
    layer = _layer(blocks=True)
    ops = FakeOps(layer.weight.detach().clone())
    layer.use_kernels(KernelChoice(ops=ops, onednn=True, quant_max_rows=None))
    assert isinstance(layer.method, BlockQuantLinearMethod) and layer.method.fallback is None
    assert layer.weight is None and layer.quant is None
    layer(torch.randn(300, 32))
    layer(torch.randn(2, 3, 32))  # any leading shape: 6 rows
    assert ops.calls == [("quant", 300), ("quant", 6)]


def test_blocks_with_a_row_limit_hand_larger_steps_to_onednn() -> None:
    layer = _layer(torch.bfloat16, blocks=True)
    ops = FakeOps(layer.weight.detach().clone())
    layer.use_kernels(KernelChoice(ops=ops, onednn=True, quant_max_rows=BF16_QUANT_MAX_ROWS))
    method = layer.method
    assert isinstance(method, BlockQuantLinearMethod) and isinstance(method.fallback, OneDnnLinearMethod)
    for rows in (1, BF16_QUANT_MAX_ROWS, BF16_QUANT_MAX_ROWS + 1):
        out = layer(torch.randn(rows, 32, dtype=torch.bfloat16))
        assert out.dtype == torch.bfloat16  # a projection's output keeps the model's dtype
    assert ops.calls == [("quant", 1), ("quant", BF16_QUANT_MAX_ROWS)]


def test_a_tied_lm_head_on_blocks_keeps_float32_logits_an_untied_one_the_models_dtype() -> None:
    for tied, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        layer = _layer(torch.bfloat16, blocks=True)
        layer.is_lm_head, layer.shares_weight = True, tied
        layer.use_kernels(KernelChoice(ops=FakeOps(layer.weight.detach().clone()), onednn=True, quant_max_rows=2))
        assert layer(torch.randn(1, 32, dtype=torch.bfloat16)).dtype == dtype


def test_amx_replaces_blocks_for_decode_sized_bfloat16_steps() -> None:
    layer = _layer(torch.bfloat16, blocks=True)
    ops = FakeOps(layer.weight.detach().clone())
    layer.use_kernels(KernelChoice(ops=ops, onednn=True, quant_max_rows=2, amx_linear=True))
    assert isinstance(layer.method, AmxLinearMethod) and isinstance(layer.method.fallback, OneDnnLinearMethod)
    assert layer.quant is None and layer.weight is None
    layer(torch.randn(AMX_LINEAR_MAX_ROWS, 32, dtype=torch.bfloat16))
    layer(torch.randn(AMX_LINEAR_MAX_ROWS + 1, 32, dtype=torch.bfloat16))  # prefill: oneDNN
    layer(torch.randn(32, 3, dtype=torch.bfloat16).T)  # strided rows reach the kernel contiguous
    assert ops.calls == [("amx", AMX_LINEAR_MAX_ROWS), ("amx", 3)]


def test_amx_skips_what_it_cannot_pack() -> None:
    odd = _layer(torch.bfloat16, out=40)  # 40 rows: not a multiple of 32
    odd.use_kernels(KernelChoice(ops=FakeOps(odd.weight.detach().clone()), onednn=True, amx_linear=True))
    assert isinstance(odd.method, OneDnnLinearMethod)
    f32 = _layer()
    f32.use_kernels(KernelChoice(ops=FakeOps(f32.weight.detach().clone()), onednn=True, amx_linear=True))
    assert isinstance(f32.method, OneDnnLinearMethod)


def test_a_shared_weight_is_never_freed() -> None:
    layer = _layer()
    layer.shares_weight = True
    layer.use_kernels(KernelChoice(onednn=True))
    assert isinstance(layer.method, OneDnnLinearMethod) and layer.weight is not None


def test_a_row_limit_needs_a_fallback() -> None:
    empty = torch.empty(0)
    with pytest.raises(ValueError, match="fallback"):
        BlockQuantLinearMethod(object(), QuantWeight("u4", empty, empty, empty), 4, None)


def test_default_row_limits_by_dtype() -> None:
    assert default_quant_max_rows(torch.float32, None) is None
    assert default_quant_max_rows(torch.bfloat16, None) == BF16_QUANT_MAX_ROWS
    assert default_quant_max_rows(torch.bfloat16, 0) == 0 and default_quant_max_rows(torch.float32, 8) == 8


def test_choose_does_not_modify_the_layer_and_methods_are_counted() -> None:
    layer = _layer(blocks=True)
    method = choose_linear_method(layer, KernelChoice.torch())
    assert isinstance(method, DenseLinearMethod) and layer.quant is not None  # only use_kernels applies it
    model = torch.nn.Sequential(_layer(), _layer())
    model[0].use_kernels(KernelChoice(onednn=True))
    assert linear_methods(model) == {"OneDnnLinearMethod": 1, "DenseLinearMethod": 1}
