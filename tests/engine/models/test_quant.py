"""Block-quantized weights (engine/models/quant.py) and the ``quant_linear`` kernel (engine/kernels/quant_linear.cpp).

gguf-py (llama.cpp's own Python package) makes the blocks and dequantizes them: the reference for what
each format means. The kernel must compute ``x @ dequantize(W).T`` to float32 precision on both of its
paths (fused, up to 8 rows of x; a GEMM over expanded weight panels above, in blocks of 6 rows with
remainders of 1-5), for any N (a tail panel) and strided rows of x.
The default model through this path is checked against transformers in test_models.py.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.device.kernel_choice import BF16_QUANT_MAX_ROWS, KernelChoice
from engine.models import llama
from engine.models.config import ModelConfig
from engine.models.layers import linear as linear_layer
from engine.models.layers.linear import BlockQuantLinearMethod, Linear, OneDnnLinearMethod
from engine.models.llama import build_model
from engine.models.quant import QuantWeight, cat_rows, from_gguf_blocks, permute_rows
from tests.engine.kernel_probe import blocks_only, model_onednn_packed, onednn_packed, prepare, uses_cpu_ops
from tests.engine.models.test_llama import _backend, _run
from tests.engine.paged_factory import PagedKV

FORMATS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    """Random weights quantized by gguf-py; returns ours and gguf-py's dequantized float32 [rows, cols]."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = quantize(w, qtype)
    reference = dequantize(raw, qtype).reshape(rows, cols)
    return from_gguf_blocks(raw, qtype), torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32))


def _linear(ops: Any, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    return ops.quant_linear(x, weight.codes, weight.scales, weight.mins, weight.format)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_blocks_dequantize_as_gguf_does(qtype: GGMLQuantizationType) -> None:
    weight, reference = _blocks(9, 96, qtype, seed=1)
    assert weight.shape == (9, 96)
    assert weight.scales.dtype == torch.float16 and weight.scales.shape == (9, 3)
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
# 13, 14 and 32 rows end in a block of x of 1, 2 and 2 rows
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 13, 14, 17, 32, 40, 100])
def test_kernel_matches_the_dequantized_matmul(ops: Any, qtype: GGMLQuantizationType, rows: int) -> None:
    weight, reference = _blocks(130, 576, qtype, seed=rows)  # 130 = 8 panels of 16 and a tail of 2
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    out = _linear(ops, x, weight)
    assert out.shape == (rows, 130) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ reference.T, rtol=1e-5, atol=1e-5)


# Packed x over 2 MB goes in chunks of rows that fit L2: K = 1536 makes that 343+ rows in chunks of 60.
# N = 130: every thread keeps its few expanded panels for the next chunk; N = 5600 on 1 or 2 threads: a
# thread's panels (8.6 or 17 MB) do not fit its 8 MB, so each chunk expands them again. Neither may change
# a result, not even in the last bit.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "n"), [(400, 130), (350, 5600)])
def test_kernel_rows_in_chunks(ops: Any, rows: int, n: int, threads: int) -> None:
    weight, reference = _blocks(n, 1536, GGMLQuantizationType.Q4_1, seed=n)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _linear(ops, x, weight)
        torch.testing.assert_close(out, x @ reference.T, rtol=1e-4, atol=1e-4)
        for start in (0, 120, rows - rows % 6 - 60):  # 60 rows: one piece, no chunks; full blocks of 6 either way
            assert torch.equal(out[start:start + 60], _linear(ops, x[start:start + 60], weight))
    finally:
        torch.set_num_threads(before)


# Below the chunking size the threads take pieces of the output columns from a shared counter (so one the OS
# preempts leaves its pieces to the others): with 3 threads, N = 1000 splits into 32 pieces whose last is
# short (8 columns in the fused path, one panel of 8 rows in the GEMM). Every column once, and each computed
# exactly as on one thread.
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [4, 32])
def test_kernel_columns_taken_in_pieces(ops: Any, rows: int, threads: int) -> None:
    weight, reference = _blocks(1000, 576, GGMLQuantizationType.Q4_1, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _linear(ops, x, weight)
        torch.set_num_threads(threads)
        for _ in range(3):
            out = _linear(ops, x, weight)
            torch.testing.assert_close(out, x @ reference.T, rtol=1e-5, atol=1e-5)
            assert torch.equal(out, alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 4, 12])
@pytest.mark.parametrize("n", [1, 3, 64])
def test_kernel_small_shapes_and_strided_rows(ops: Any, rows: int, n: int) -> None:
    weight, reference = _blocks(n, 64, GGMLQuantizationType.Q4_1, seed=n)
    wide = torch.randn(rows, 100, generator=torch.Generator().manual_seed(7))
    x = wide[:, 10:74]  # rows 100 floats apart
    assert x.stride(0) == 100
    torch.testing.assert_close(_linear(ops, x, weight), x @ reference.T, rtol=1e-5, atol=1e-5)
    assert _linear(ops, torch.zeros(0, 64), weight).shape == (0, n)


def test_kernel_rejects_bad_inputs(ops: Any) -> None:
    weight, _ = _blocks(8, 64, GGMLQuantizationType.Q4_1, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="format must be"):
        ops.quant_linear(x, weight.codes, weight.scales, weight.mins, "q3")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quant_linear(torch.randn(2, 48), weight.codes, weight.scales, weight.mins, "u4")
    with pytest.raises(RuntimeError, match="float32"):
        ops.quant_linear(x.double(), weight.codes, weight.scales, weight.mins, "u4")
    with pytest.raises(RuntimeError, match="scales must be float16"):
        ops.quant_linear(x, weight.codes, weight.scales.float(), weight.mins, "u4")
    with pytest.raises(RuntimeError, match="u4 mins"):
        ops.quant_linear(x, weight.codes, weight.scales, torch.empty(0, dtype=torch.float16), "u4")
    with pytest.raises(RuntimeError, match="s8 codes"):
        ops.quant_linear(x, weight.codes, weight.scales, weight.mins, "s8")  # uint8 [8, 32] is not int8 [8, 64]
    with pytest.raises(RuntimeError, match=r"scales must be float16 \[N, K/32\]"):
        ops.quant_linear(torch.randn(2, 128), weight.codes, weight.scales, weight.mins, "u4")


def test_fused_shards_and_row_permutation() -> None:
    q, q_ref = _blocks(8, 64, GGMLQuantizationType.Q4_1, seed=1)
    k, k_ref = _blocks(4, 64, GGMLQuantizationType.Q4_1, seed=2)
    fused = cat_rows([q, k])
    assert fused is not None and torch.equal(fused.dequantize(), torch.cat([q_ref, k_ref]))
    s8, _ = _blocks(4, 64, GGMLQuantizationType.Q8_0, seed=3)
    assert cat_rows([q, s8]) is None  # mixed formats: that projection stays float32
    order = np.array([3, 0, 2, 1, 7, 4, 6, 5])
    permuted = permute_rows(q, lambda a: a[order])
    assert torch.equal(permuted.dequantize(), q_ref[order])


def _tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=64, tie_word_embeddings=True)


def _quantized_tiny_model(qtype: GGMLQuantizationType, v_type: GGMLQuantizationType | None = None) -> llama.CausalLM:
    """A tiny model whose weights are exactly representable in ``qtype`` blocks, loaded both ways."""
    cfg = _tiny_config()
    model = build_model(cfg, torch.float32, "cpu")
    dense: list[tuple[str, torch.Tensor]] = []
    blocks: list[tuple[str, QuantWeight]] = []
    seed = 0
    for name, param in model.named_parameters():
        seed += 1
        if param.dim() == 1:
            dense.append((name, torch.ones_like(param)))
            continue
        shards = {"qkv_proj": [("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)],
                  "gate_up_proj": [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)]}
        part = next((p for p in shards if p in name), None)
        pieces = shards[part] if part else [(None, param.shape[0])]
        for i, (piece, rows) in enumerate(pieces):
            fmt = v_type if (v_type is not None and piece == "v_proj") else qtype
            weight, reference = _blocks(rows, param.shape[1], fmt, seed=100 * seed + i)
            hf = "model." + (name.replace(part, piece) if part and piece else name)
            dense.append((hf, reference))
            blocks.append((hf, weight))
    model.load_weights(dense)
    model.load_quantized(blocks)
    return model


def _counting_quant_linear(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the row count of every ``quant_linear`` call the model makes."""
    calls: list[int] = []
    real = linear_layer.quant_linear

    def counting(ops: Any, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(ops, x, weight, bias)

    monkeypatch.setattr(linear_layer, "quant_linear", counting)
    return calls


def _float32_reference() -> llama.CausalLM:
    reference = _quantized_tiny_model(GGMLQuantizationType.Q4_1)
    reference.drop_quantized()
    prepare(reference, torch.float32)
    assert reference.quantized_linears == 0 and model_onednn_packed(reference)
    return reference


def _compare(model: llama.CausalLM, reference: llama.CausalLM, prompt: list[int], decode: list[int]) -> None:
    cfg = model.config
    kv_q = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4, backend=_backend(model))
    kv_r = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4,
                   backend=_backend(reference))
    torch.testing.assert_close(_run(model, kv_q, [("a", prompt)]), _run(reference, kv_r, [("a", prompt)]),
                               rtol=1e-4, atol=1e-4)
    for token in decode:
        torch.testing.assert_close(_run(model, kv_q, [("a", [token])]), _run(reference, kv_r, [("a", [token])]),
                                   rtol=1e-4, atol=1e-4)


def test_model_runs_every_step_on_blocks_and_frees_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_QUANT_MAX_ROWS", raising=False)  # the default: no row limit
    reference = _float32_reference()
    model = _quantized_tiny_model(GGMLQuantizationType.Q4_1)
    assert model.quantized_linears == 2 * 4 + 1  # qkv, o, gate_up, down per layer + the tied lm_head
    prepare(model, torch.float32)
    assert uses_cpu_ops(model) and model.quantized_linears == 9
    for layer in (model.layers[0].mlp.gate_up_proj, model.layers[1].self_attn.qkv_proj):
        assert blocks_only(layer)
        assert layer.weight is None and onednn_packed(layer) is None  # the float32 copy is gone, not packed
    assert blocks_only(model.lm_head) and onednn_packed(model.lm_head) is None
    assert model.embed_tokens.weight is not None  # lookup keeps the table
    with pytest.raises(RuntimeError, match="only their blocks left"):
        model.drop_quantized()

    calls = _counting_quant_linear(monkeypatch)
    prompt = list(range(3, 3 + 21))  # 21 rows: the GEMM path, 3 blocks of 6 and a remainder of 3
    _compare(model, reference, prompt, decode=[5, 9, 11])
    # Per forward: 4 projections x 2 layers and the lm_head (_run takes logits for every token).
    assert calls == [21] * 9 + [1] * 9 * 3


def test_row_limit_keeps_float32_for_larger_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _float32_reference()
    model = prepare(_quantized_tiny_model(GGMLQuantizationType.Q4_1), torch.float32, quant_max_rows=8)
    layer = model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.method, BlockQuantLinearMethod) and layer.method.max_rows == 8
    assert not blocks_only(layer) and onednn_packed(layer) is not None
    assert onednn_packed(model.lm_head) is not None
    assert model.embed_tokens.weight is model.lm_head.weight  # tied: the table is never freed

    calls = _counting_quant_linear(monkeypatch)
    _compare(model, reference, list(range(3, 3 + 13)), decode=[5, 9, 11])  # prefill above the limit: float32
    assert calls == [1] * 9 * 3


def test_blocks_only_layer_takes_any_leading_shape(ops: Any) -> None:
    weight, reference = _blocks(24, 64, GGMLQuantizationType.Q8_0, seed=9)
    layer = Linear(64, 24, bias=False)
    layer.quant = weight
    layer.use_kernels(KernelChoice(ops=ops, onednn=True, quant_max_rows=None))
    assert blocks_only(layer) and layer.weight is None
    x = torch.randn(2, 7, 64)
    out = layer(x)
    assert out.shape == (2, 7, 24)
    torch.testing.assert_close(out, x @ reference.T, rtol=1e-5, atol=1e-5)


def test_mixed_formats_leave_a_projection_in_float32() -> None:
    model = _quantized_tiny_model(GGMLQuantizationType.Q4_1, v_type=GGMLQuantizationType.Q8_0)
    assert model.layers[0].self_attn.qkv_proj.quant is None  # q/k Q4_1 but v Q8_0
    assert model.layers[0].self_attn.o_proj.quant is not None
    assert model.quantized_linears == 2 * 3 + 1


def test_kernels_off_drop_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _quantized_tiny_model(GGMLQuantizationType.Q8_0)
    assert model.quantized_linears == 9
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    prepare(model, torch.float32)
    assert model.quantized_linears == 0 and not uses_cpu_ops(model) and not model_onednn_packed(model)
    x = torch.randn(1, 64)
    proj = model.layers[0].self_attn.o_proj
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight))


def test_linear_uses_blocks_only_up_to_the_threshold(ops: Any) -> None:
    limit = 48
    weight, reference = _blocks(40, 64, GGMLQuantizationType.Q4_0, seed=5)
    layer = Linear(64, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(reference)
        layer.bias.copy_(torch.randn(40))
    layer.quant = weight
    layer.use_kernels(KernelChoice(ops=ops, onednn=True, quant_max_rows=limit))
    assert isinstance(layer.method, BlockQuantLinearMethod)
    assert isinstance(layer.method.fallback, OneDnnLinearMethod) and layer.weight is None
    for rows in (1, limit, limit + 1, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, reference, layer.bias), rtol=1e-5, atol=1e-5)
    # Blocks that disagree with the float32 weight show which path ran.
    layer.method.blocks = QuantWeight("u4", weight.codes, weight.scales, torch.zeros_like(weight.mins))
    x = torch.randn(1, 64)
    assert not torch.allclose(layer(x), F.linear(x, reference, layer.bias), atol=1e-3)
    x = torch.randn(limit + 1, 64)
    torch.testing.assert_close(layer(x), F.linear(x, reference, layer.bias), rtol=1e-5, atol=1e-5)


def test_quant_max_rows_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.errors import InvalidRequestError
    from engine.config import KernelSettings

    def rows(value: str | None) -> int | None:
        env = {} if value is None else {"SLUICE_QUANT_MAX_ROWS": value}
        return KernelSettings.from_env(env).quant_max_rows

    assert rows(None) is None  # no limit
    assert rows(" ") is None
    assert rows("0") == 0
    assert rows(" 16 ") == 16
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(InvalidRequestError, match="SLUICE_QUANT_MAX_ROWS must be a non-negative integer"):
            rows(bad)


def test_bfloat16_model_reads_its_blocks_for_small_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # --dtype auto on AVX512-BF16 CPUs without amx_linear: the prompt's steps run oneDNN's bfloat16 GEMM on the
    # dense weights, steps of up to BF16_QUANT_MAX_ROWS rows read the blocks (widened to float32 for the kernel).
    # (Where amx_linear runs it replaces the blocks: tests/engine/kernels/test_amx_linear.py.)
    monkeypatch.delenv("SLUICE_QUANT_MAX_ROWS", raising=False)
    monkeypatch.setenv("SLUICE_AMX_LINEAR", "0")
    model = _quantized_tiny_model(GGMLQuantizationType.Q4_1).to(torch.bfloat16)
    prepare(model, torch.bfloat16)
    assert uses_cpu_ops(model) and model_onednn_packed(model) and model.quantized_linears == 9
    layer = model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.method, BlockQuantLinearMethod) and layer.method.max_rows == BF16_QUANT_MAX_ROWS
    assert onednn_packed(layer) is not None and onednn_packed(model.lm_head) is not None
    reference = _quantized_tiny_model(GGMLQuantizationType.Q4_1).to(torch.bfloat16)
    reference.drop_quantized()
    prepare(reference, torch.bfloat16)

    calls = _counting_quant_linear(monkeypatch)
    cfg = model.config
    kv_q, kv_r = (PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4,
                          dtype=torch.bfloat16, backend=_backend(m)) for m in (model, reference))
    prompt = list(range(3, 3 + 13))
    steps = [[("a", prompt)], [("a", [5])], [("a", [9]), ("b", [7, 8, 9])], [("a", [11]), ("b", [4])]]
    for chunks in steps:
        got, expected = _run(model, kv_q, chunks), _run(reference, kv_r, chunks)
        assert got.dtype == torch.float32
        assert float((got - expected).norm() / expected.norm()) < 0.02
    # Steps of up to the limit on the blocks (4 projections x 2 layers and the tied lm_head each), the
    # prompt's 13 rows on oneDNN.
    limit = BF16_QUANT_MAX_ROWS
    assert 1 <= limit < 13
    assert calls == [rows for rows in (13, 1, 4, 2) if rows <= limit for _ in range(9)]
