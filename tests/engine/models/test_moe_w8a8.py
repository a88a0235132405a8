"""W8A8 int8 experts: ``--quantization w8a8`` quantizes every routed expert at load, and a compressed-tensors W8A8
checkpoint of a mixture-of-experts model brings its own int8 experts; either way each active expert's two products
are W8A8 products (``w8a8_reference`` per expert), and the model stays close to its float self."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import load_model
from engine.models.layers.fused_moe import FusedMoE, Int8GroupedMoEMethod
from engine.models.layers.moe_routing import select_experts
from engine.models.w8a8 import quantize_weight, w8a8_reference
from tests.engine.kernel_probe import prepare
from tests.engine.models.moe_factory import write_checkpoint
from tests.engine.models.test_compressed_tensors import write_w8a8
from tests.engine.paged_factory import PagedKV


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe"))[1]


def _experts(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    kv = PagedKV(model.num_local_layers, model.num_local_kv_heads, model.kv_head_dim, block_size=4)
    step = kv.step([("a", tokens)])
    with torch.no_grad():
        return model.compute_logits(model(step.input_ids, step.positions, kv.kv_caches, step.meta))


def test_quantized_experts_compute_w8a8_products(float_dir: Path) -> None:
    model = prepare(load_model(str(float_dir), torch.float32, quantization="w8a8"), torch.float32)
    layers = _experts(model)
    assert layers and all(isinstance(m.method, Int8GroupedMoEMethod) for m in layers)
    assert all(m.w13.numel() == 0 and m.w2.numel() == 0 for m in layers)   # the float experts are freed
    layer = layers[0]
    assert layer.int8 is not None
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(x, logits)
    weights, ids = select_experts(logits, layer.routing)
    expected = torch.zeros(9, 64)
    for t in range(9):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = w8a8_reference(x[t:t + 1], layer.int8[0][e])
            gate, up = h.chunk(2, dim=-1)
            expected[t] += float(weights[t, slot]) * w8a8_reference(F.silu(gate) * up, layer.int8[1][e])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_w8a8_model_stays_close_to_float(float_dir: Path) -> None:
    tokens = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    exact = _logits(load_model(str(float_dir), torch.float32), tokens)
    int8 = _logits(prepare(load_model(str(float_dir), torch.float32, quantization="w8a8"), torch.float32), tokens)
    assert float((int8 - exact).norm() / exact.norm()) < 0.05


def test_a_compressed_tensors_checkpoint_brings_its_own_int8_experts(float_dir: Path, tmp_path: Path) -> None:
    ckpt = write_w8a8(float_dir, tmp_path / "w8a8")
    ours = load_model(str(ckpt), torch.float32)
    floats = _experts(load_model(str(float_dir), torch.float32))
    for layer, original in zip(_experts(ours), floats, strict=True):
        assert layer.int8 is not None
        for e in range(layer.num_local_experts):   # the checkpoint's codes, gate and up stacked as w13 is
            assert torch.equal(layer.int8[0][e].qweight, quantize_weight(original.w13[e]).qweight)
            assert torch.equal(layer.int8[1][e].qweight, quantize_weight(original.w2[e]).qweight)
    prepare(ours, torch.float32)
    assert all(isinstance(m.method, Int8GroupedMoEMethod) for m in _experts(ours))
    tokens = [5, 9, 77, 3, 41, 18]
    exact = _logits(load_model(str(float_dir), torch.float32), tokens)
    assert float((_logits(ours, tokens) - exact).norm() / exact.norm()) < 0.05
