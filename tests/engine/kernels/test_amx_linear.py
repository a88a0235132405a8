"""``cpu_ops.amx_linear``: bfloat16 linears of decode-sized steps on AMX tiles, and the model's use of it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.device import CpuDevice
from engine.kernels import cpu_ops, portable_cpu_ops
from engine.models import llama, load_model
from engine.models.layers import linear as linear_layer
from tests.engine.kernel_probe import amx_packed, linears, model_onednn_packed, onednn_packed, prepare

ENV_AMX_LINEAR = "SLUICE_AMX_LINEAR"


def _amx_ops() -> Any:
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning logged)"
    if not ops.has_amx_linear():
        pytest.skip("needs a CPU with AMX-BF16 (and Linux granting the tile state)")
    return ops


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return out if bias is None else out + bias.float()


def _assert_rounded_from(got: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 sums rounded once to bfloat16: within half a bfloat16 step (2^-9 relative) of the float32 result,
    # plus what a different summation order moves it. A dropped K step, row or bias is far outside this.
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    err = (got.float() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + 1e-4 * ref.abs().max()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("n,k", [(32, 32), (64, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 48, 64, 70])
def test_amx_linear_matches_float32_products_rounded_once(n: int, k: int, rows: int) -> None:
    ops = _amx_ops()
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    packed = ops.amx_pack_linear(w)
    assert packed.shape == (n // 32, k // 32, 2, 16, 32)
    _assert_rounded_from(ops.amx_linear(x, packed), _reference(x, w, None))
    for bias in (torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()):
        _assert_rounded_from(ops.amx_linear(x, packed, bias), _reference(x, w, bias))


def test_amx_linear_reads_strided_rows_and_no_rows() -> None:
    ops = _amx_ops()
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(21, 200, generator=gen).bfloat16()
    x = wide[:, 8:136]  # rows 200 apart, each 128 contiguous
    w = (torch.randn(64, 128, generator=gen) * 0.05).bfloat16()
    packed = ops.amx_pack_linear(w)
    _assert_rounded_from(ops.amx_linear(x, packed), _reference(x, w, None))
    assert ops.amx_linear(x[:0], packed).shape == (0, 64)


def test_amx_linear_rejects_what_it_cannot_run() -> None:
    ops = _amx_ops()
    w = torch.randn(64, 64).bfloat16()
    packed = ops.amx_pack_linear(w)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.amx_pack_linear(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_pack_linear(w.float())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(x.float(), packed)
    with pytest.raises(RuntimeError, match="features"):
        ops.amx_linear(torch.randn(4, 96).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.amx_linear(torch.randn(64, 4).bfloat16().T, packed)
    with pytest.raises(RuntimeError, match="amx_pack_linear"):
        ops.amx_linear(x, w)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(x, packed, torch.randn(32))


def test_portable_build_has_no_amx_linear() -> None:
    ops = portable_cpu_ops()
    assert not ops.has_amx_linear()
    with pytest.raises(RuntimeError, match="without AMX"):
        ops.amx_linear(torch.randn(2, 32).bfloat16(), torch.zeros(1, 1, 2, 16, 32, dtype=torch.bfloat16))


def _tiny_bf16_model(tmp_path: Path, tied: bool) -> llama.CausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return prepare(load_model(str(tmp_path), torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("tied", [True, False])
def test_bfloat16_model_runs_decode_sized_steps_on_amx_and_larger_ones_on_onednn(
        tmp_path: Path, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _amx_ops()
    model = _tiny_bf16_model(tmp_path, tied)
    layers = linears(model)  # the lm_head among them, tied or not
    assert layers and all(amx_packed(m) is not None and onednn_packed(m) is not None for m in layers)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    calls: list[int] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(ops, name)

        def amx_linear(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
            calls.append(x.shape[0])
            return ops.amx_linear(x, *args)

    for m in layers:
        m.method.ops = Spy()
    projections = [m for m in layers if m is not model.lm_head]
    limit = linear_layer.AMX_LINEAR_MAX_ROWS
    for rows in (3, limit, limit + 1):
        calls.clear()
        x = torch.randn(rows, 64).bfloat16()
        with torch.no_grad():
            out = [m(x if m.in_features == 64 else torch.randn(rows, m.in_features).bfloat16())
                   for m in projections]
            model.compute_logits(x, dtype=None)
        expected = len(projections) + 1 if rows <= limit else 0  # every projection and the lm_head, or none
        assert len(calls) == expected and set(calls) <= {rows}, (rows, calls)
        assert all(o.dtype == torch.bfloat16 and o.shape == (rows, m.out_features) for o, m in zip(out, projections))


def test_linear_hands_the_kernel_whole_rows(tmp_path: Path) -> None:
    _amx_ops()
    model = _tiny_bf16_model(tmp_path, tied=False)
    proj = model.layers[0].mlp.gate_up_proj
    x = torch.randn(64, 5).bfloat16().T  # 5 rows whose elements lie 5 apart
    with torch.no_grad():
        got = proj(x)
    packed = onednn_packed(proj)
    assert packed is not None
    ref = x.float() @ packed.to_dense().float().T
    _assert_rounded_from(got, ref)


def test_amx_copies_replace_the_quantized_blocks_of_a_bfloat16_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GGUF-style model with block-quantized weights in bfloat16: on AMX CPUs even 1-row steps run amx_linear
    # (faster than the blocks), so the blocks are dropped and no step reads them.
    from gguf import GGMLQuantizationType

    from tests.engine.models.test_llama import _backend, _run
    from tests.engine.models.test_quant import _counting_quant_linear, _quantized_tiny_model
    from tests.engine.paged_factory import PagedKV

    ops = _amx_ops()
    monkeypatch.delenv("SLUICE_QUANT_MAX_ROWS", raising=False)
    model = _quantized_tiny_model(GGMLQuantizationType.Q4_1).to(torch.bfloat16)
    assert model.quantized_linears == 9
    prepare(model, torch.bfloat16)
    assert model.quantized_linears == 0 and amx_packed(model.lm_head) is not None
    assert all(amx_packed(m) is not None and m.quant is None for m in linears(model))
    reference = _quantized_tiny_model(GGMLQuantizationType.Q4_1).to(torch.bfloat16)
    reference.drop_quantized()
    prepare(reference, torch.bfloat16, amx_linear=False)
    quant_calls = _counting_quant_linear(monkeypatch)
    amx_rows: list[int] = []
    real = ops.amx_linear

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(ops, name)

        def amx_linear(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
            amx_rows.append(x.shape[0])
            return real(x, *args)

    for m in linears(model):
        m.method.ops = Spy()
    cfg = model.config
    kv_a, kv_r = (PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16, block_size=4,
                          dtype=torch.bfloat16, backend=_backend(m)) for m in (model, reference))
    for chunks in ([("a", list(range(3, 16)))], [("a", [5])], [("a", [9]), ("b", [7, 8])]):
        got, expected = _run(model, kv_a, chunks), _run(reference, kv_r, chunks)
        assert float((got - expected).norm() / expected.norm()) < 0.02
    assert quant_calls == []
    assert amx_rows == [rows for rows in (13, 1, 3) for _ in range(9)]  # 4 projections x 2 layers + the lm_head


def test_amx_linear_switched_off_keeps_onednn_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _amx_ops()
    monkeypatch.setenv(ENV_AMX_LINEAR, "0")
    model = _tiny_bf16_model(tmp_path, tied=True)
    assert model_onednn_packed(model) and amx_packed(model.lm_head) is None
    assert all(amx_packed(m) is None for m in linears(model))


def test_amx_copies_count_their_bytes_and_are_skipped_when_memory_is_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _amx_ops()
    model = _tiny_bf16_model(tmp_path / "a", tied=True)
    copies = [amx_packed(m) for m in linears(model)]
    assert all(c is not None for c in copies)
    bytes_needed = sum(c.numel() * c.element_size() for c in copies if c is not None)
    fresh = load_model(str(tmp_path / "a"), torch.bfloat16)  # before use_kernels: what the copies would cost
    assert fresh.amx_pack_bytes() == bytes_needed
    # Copies over a quarter of the memory available at load: none are made, oneDNN runs every step.
    monkeypatch.setattr(CpuDevice, "memory_info", lambda self: (3 * bytes_needed, 2**34))
    short = _tiny_bf16_model(tmp_path / "b", tied=True)
    assert model_onednn_packed(short) and amx_packed(short.lm_head) is None
    assert all(amx_packed(m) is None for m in linears(short))
    monkeypatch.setattr(CpuDevice, "memory_info", lambda self: (4 * bytes_needed, 2**34))
    assert amx_packed(_tiny_bf16_model(tmp_path / "c", tied=True).lm_head) is not None


def test_amx_and_onednn_steps_agree_on_a_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same 20-row step through the tiny model's layers on both paths: each linear's output is the float32
    # product rounded once either way, so the final hidden states agree to a few bfloat16 steps.
    _amx_ops()
    on = _tiny_bf16_model(tmp_path / "on", tied=True)
    monkeypatch.setenv(ENV_AMX_LINEAR, "0")
    off = _tiny_bf16_model(tmp_path / "off", tied=True)
    x = torch.randn(20, 64).bfloat16()
    with torch.no_grad():
        a = on.compute_logits(on.layers[0].mlp(x), dtype=torch.float32)
        b = off.compute_logits(off.layers[0].mlp(x), dtype=torch.float32)
    assert amx_packed(on.layers[0].mlp.gate_up_proj) is not None and amx_packed(off.layers[0].mlp.gate_up_proj) is None
    assert torch.allclose(a, b, rtol=2 ** -6, atol=2 ** -6 * float(b.abs().max())), float((a - b).abs().max())
