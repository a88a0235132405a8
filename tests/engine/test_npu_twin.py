"""The torch-npu operator twin keeps the documented signatures, refuses what the documentation refuses and masks a band
as the documentation draws it; the layers that pick torch-npu's operators (``KernelChoice.npu_ops``) give the PyTorch
path's numbers within dtype tolerance."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.device.kernel_choice import KernelChoice
from engine.models.config import ModelConfig
from engine.models.layers.activation import SiluAndMul
from engine.models.layers.norm import NpuNorm, RMSNorm
from engine.models.layers.rotary import RotaryEmbedding
from tests.engine.models.layers.test_fused_moe_npu import DOCUMENTED as MOE_DOCUMENTED
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)
from tests.engine.npu_twin.attention import visible_keys

# Parameters as torch-npu's API reference lists them: (positional-or-keyword, keyword-only).
FIA_KEYWORDS = (
    "pse_shift atten_mask actual_seq_lengths actual_seq_lengths_kv dequant_scale1 quant_scale1 dequant_scale2 "
    "quant_scale2 quant_offset2 antiquant_scale antiquant_offset block_table query_padding_size kv_padding_size "
    "key_antiquant_scale key_antiquant_offset value_antiquant_scale value_antiquant_offset key_shared_prefix "
    "value_shared_prefix actual_shared_prefix_len query_rope key_rope key_rope_antiquant_scale num_heads scale "
    "pre_tokens next_tokens input_layout num_key_value_heads sparse_mode inner_precise block_size antiquant_mode "
    "softmax_lse_flag key_antiquant_mode value_antiquant_mode")
DOCUMENTED: dict[str, tuple[str, str]] = {
    "_npu_reshape_and_cache": ("key value key_cache value_cache slot_indices", ""),
    "_npu_paged_attention": ("query key_cache value_cache num_kv_heads num_heads scale_value block_table "
                             "context_lens out workspace", ""),
    "_npu_paged_attention_get_workspace": ("query key_cache value_cache num_kv_heads num_heads scale_value "
                                           "block_table context_lens out", ""),
    "npu_fused_infer_attention_score": ("query key value", FIA_KEYWORDS),
    "npu_rms_norm": ("self gamma epsilon", ""),
    "npu_add_rms_norm": ("x1 x2 gamma epsilon", ""),
    "npu_swiglu": ("self dim", ""),
    "npu_rotary_mul": ("self r1 r2 rotary_mode", ""),
    "npu_dynamic_quant": ("x", "smooth_scales group_index dst_type"),
    "npu_quantize": ("input scales zero_points dtype axis div_mode", ""),
    "npu_quant_matmul": ("x1 x2 scale", "offset pertoken_scale bias output_dtype"),
    "_npu_reshape_and_cache_siso": ("key key_cache slot_indices", ""),
    "_npu_paged_attention_mla": ("query key_cache num_kv_heads num_heads scale_value block_table context_lens "
                                 "mla_vheadsize out", ""),
    "npu_weight_quant_batchmatmul": ("x weight antiquant_scale antiquant_offset quant_scale quant_offset bias "
                                     "antiquant_group_size inner_precise", ""),
    "npu_convert_weight_to_int4pack": ("weight inner_k_tiles", ""),
}


def test_twin_operators_have_the_documented_signatures() -> None:
    assert set(twin.OPERATORS) == set(DOCUMENTED) | set(MOE_DOCUMENTED)   # the MoE ones are checked in their module
    for name, (positional, keyword_only) in DOCUMENTED.items():
        params = inspect.signature(twin.OPERATORS[name]).parameters.values()
        assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == positional.split(), name
        assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == keyword_only.split(), name


def _half(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).half()


def _cache() -> torch.Tensor:
    return _half(4, 128, 2, 16)


def _paged(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(query=_half(2, 4, 16), key_cache=_cache(), value_cache=_cache(), num_kv_heads=2,
                                num_heads=4, scale_value=0.25, block_table=torch.ones(2, 2, dtype=torch.int32),
                                context_lens=torch.tensor([3, 130], dtype=torch.int32), out=_half(2, 4, 16))
    args.update(change)
    return lambda: twin._npu_paged_attention(**args)


def _workspace(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(query=_half(2, 4, 16), key_cache=_cache(), value_cache=_cache(), num_kv_heads=2,
                                num_heads=4, scale_value=0.25, block_table=torch.ones(2, 2, dtype=torch.int32),
                                context_lens=torch.tensor([3, 130], dtype=torch.int32), out=_half(2, 4, 16))
    args.update(change)
    return lambda: twin._npu_paged_attention_get_workspace(**args)


def _fia(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(
        atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1), block_table=torch.ones(1, 2,
                                                                                                   dtype=torch.int32),
        input_layout="TND", block_size=128, actual_seq_lengths=[5], actual_seq_lengths_kv=[9], num_key_value_heads=2,
        num_heads=4, scale=0.25, sparse_mode=3)
    query = change.pop("query", _half(5, 4, 16))
    args.update(change)
    return lambda: twin.npu_fused_infer_attention_score(query, _half(4, 128, 32), _half(4, 128, 32), **args)


def _reshape(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(key=_half(3, 2, 16), value=_half(3, 2, 16), key_cache=_cache(), value_cache=_cache(),
                                slot_indices=torch.tensor([1, 200, 7], dtype=torch.int32))
    args.update(change)
    return lambda: twin._npu_reshape_and_cache(**args)


def _latent_cache() -> torch.Tensor:
    return _half(4, 128, 1, 40)


def _siso(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(key=_half(3, 1, 40), key_cache=_latent_cache(),
                                slot_indices=torch.tensor([1, 200, 7], dtype=torch.int32))
    args.update(change)
    return lambda: twin._npu_reshape_and_cache_siso(**args)


def _mla(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(query=_half(2, 4, 40), key_cache=_latent_cache(), num_kv_heads=1, num_heads=4,
                                scale_value=0.25, block_table=torch.ones(2, 2, dtype=torch.int32),
                                context_lens=torch.tensor([3, 130], dtype=torch.int32), mla_vheadsize=32,
                                out=_half(2, 4, 32))
    args.update(change)
    return lambda: twin._npu_paged_attention_mla(**args)


REFUSED: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "reshape int64 slots": (_reshape(slot_indices=torch.tensor([1, 2, 3])), TypeError, "slot_indices"),
    "reshape float32 key": (_reshape(key=torch.randn(3, 2, 16)), TypeError, "key must have the cache's dtype"),
    "reshape 3 heads": (_reshape(key=_half(3, 3, 16)), ValueError, r"key must be \[num_tokens, 2, 16\]"),
    "reshape slot past the cache": (_reshape(slot_indices=torch.tensor([1, 512, 7], dtype=torch.int32)), ValueError,
                                    "past the cache"),
    "paged int64 tables": (_paged(block_table=torch.ones(2, 2, dtype=torch.int64)), TypeError, "block_table"),
    "paged int64 lens": (_paged(context_lens=torch.tensor([3, 130])), TypeError, "context_lens"),
    "paged float32 query": (_paged(query=torch.randn(2, 4, 16)), TypeError, "query"),
    "paged wrong heads": (_paged(num_heads=2), ValueError, "num_heads=2"),
    "paged too long": (_paged(context_lens=torch.tensor([3, 300], dtype=torch.int32)), ValueError, "context_lens"),
    "paged list workspace": (_paged(workspace=[0]), TypeError, "workspace"),
    "workspace int64 lens": (_workspace(context_lens=torch.tensor([3, 130])), TypeError, "context_lens"),
    "workspace too long": (_workspace(context_lens=torch.tensor([3, 300], dtype=torch.int32)), ValueError,
                           "context_lens"),
    "fia float32 query": (_fia(query=torch.randn(5, 4, 16)), TypeError, "query"),
    "fia BSH layout": (_fia(input_layout="BSH"), ValueError, "TND"),
    "fia tensor lengths": (_fia(actual_seq_lengths=torch.tensor([5])), TypeError, "SymInt"),
    "fia not cumulative": (_fia(actual_seq_lengths=[4]), ValueError, "cumulative"),
    "fia block size 64": (_fia(block_size=64), ValueError, "block_size"),
    "fia int64 table": (_fia(block_table=torch.ones(1, 2, dtype=torch.int64)), TypeError, "block_table"),
    "fia mask 128": (_fia(atten_mask=torch.triu(torch.ones(128, 128, dtype=torch.bool), 1)), ValueError, "2048"),
    "fia lower mask": (_fia(atten_mask=torch.tril(torch.ones(2048, 2048, dtype=torch.bool), -1)), ValueError,
                       "above the diagonal"),
    "fia band without a mask": (_fia(sparse_mode=4, pre_tokens=3, next_tokens=0, atten_mask=None), ValueError,
                                "sparse_mode 4 takes the optimised"),
    "fia empty band": (_fia(sparse_mode=4, pre_tokens=-3, next_tokens=2), ValueError, "pre_tokens . next_tokens"),
    "fia band past the queries": (_fia(sparse_mode=4, pre_tokens=-6, next_tokens=8), ValueError,
                                  "pre_tokens >= -5"),
    "fia band float tokens": (_fia(sparse_mode=4, pre_tokens=3.0, next_tokens=0), TypeError, "pre_tokens"),
    "fia released block": (_fia(block_table=torch.tensor([[-1, 1]], dtype=torch.int32)), ValueError,
                           "outside the cache"),
    "siso int64 slots": (_siso(slot_indices=torch.tensor([1, 2, 3])), TypeError, "slot_indices"),
    "siso float32 key": (_siso(key=torch.randn(3, 1, 40)), TypeError, "key must have the cache's dtype"),
    "siso two heads": (_siso(key=_half(3, 2, 40)), ValueError, r"key must be \[num_tokens, 1, 40\]"),
    "siso repeated slot": (_siso(slot_indices=torch.tensor([7, 200, 7], dtype=torch.int32)), ValueError, "repeat"),
    "siso slot past the cache": (_siso(slot_indices=torch.tensor([1, 512, 7], dtype=torch.int32)), ValueError,
                                 "out of the cache"),
    "mla two kv heads": (_mla(key_cache=_half(4, 128, 2, 40), num_kv_heads=2), ValueError, "MQA only"),
    "mla head size 640": (_mla(query=_half(2, 4, 640), key_cache=_half(2, 128, 1, 640)), ValueError,
                          r"head_size must be in \(0, 576\]"),
    "mla block size 256 at 576": (_mla(query=_half(2, 4, 576), key_cache=_half(2, 256, 1, 576)), ValueError,
                                  "block_size"),
    "mla vheadsize past the head": (_mla(mla_vheadsize=48, out=_half(2, 4, 48)), ValueError, "mla_vheadsize"),
    "mla float32 query": (_mla(query=torch.randn(2, 4, 40)), TypeError, "query"),
    "mla int64 tables": (_mla(block_table=torch.ones(2, 2, dtype=torch.int64)), TypeError, "block_table"),
    "mla int64 lens": (_mla(context_lens=torch.tensor([3, 130])), TypeError, "context_lens"),
    "mla out of the head size": (_mla(out=_half(2, 4, 40)), ValueError, "out must be"),
    "mla too long": (_mla(context_lens=torch.tensor([3, 300], dtype=torch.int32)), ValueError, "context_lens"),
    "rms float64": (lambda: twin.npu_rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8)), TypeError, "x"),
    "rms gamma width": (lambda: twin.npu_rms_norm(_half(2, 8), _half(4)), ValueError, "gamma"),
    "add_rms shapes": (lambda: twin.npu_add_rms_norm(_half(2, 8), _half(3, 8), _half(8)), ValueError, "x1"),
    "swiglu int": (lambda: twin.npu_swiglu(torch.ones(2, 8, dtype=torch.int32)), TypeError, "x"),
    "swiglu odd": (lambda: twin.npu_swiglu(_half(2, 7)), ValueError, "even"),
    "rotary 3-D": (lambda: twin.npu_rotary_mul(_half(3, 2, 8), _half(1, 3, 1, 8), _half(1, 3, 1, 8)), ValueError,
                   "4-D"),
    "rotary r dtype": (lambda: twin.npu_rotary_mul(_half(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
                       TypeError, "r1"),
    "quant float32": (lambda: twin.npu_dynamic_quant(torch.randn(2, 8)), TypeError, "float16 or bfloat16"),
    "matmul float x1": (lambda: twin.npu_quant_matmul(torch.randn(2, 8), torch.ones(8, 4, dtype=torch.int8),
                                                      torch.ones(4)), TypeError, "x1"),
    "matmul float32 scale for float16 out with a float bias": (
        lambda: twin.npu_quant_matmul(torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 4, dtype=torch.int8),
                                      torch.ones(4), bias=torch.ones(4).half(), output_dtype=torch.float16),
        TypeError, "bias"),
    "matmul int64 scale for bfloat16 out": (
        lambda: twin.npu_quant_matmul(torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 4, dtype=torch.int8),
                                      torch.ones(4, dtype=torch.int64), output_dtype=torch.bfloat16),
        TypeError, "scale"),
    "quantize scales dtype": (lambda: twin.npu_quantize(_half(2, 8), torch.ones(8), None, torch.qint8, -1, False),
                              TypeError, "scales"),
    "quantize scales width": (lambda: twin.npu_quantize(_half(2, 8), _half(4), None, torch.qint8, -1, False),
                              ValueError, "scales"),
    "quantize division": (lambda: twin.npu_quantize(_half(2, 8), _half(8), None, torch.qint8, -1, True),
                          ValueError, "div_mode"),
    "int4pack int8 weight": (lambda: twin.npu_convert_weight_to_int4pack(torch.ones(4, 8, dtype=torch.int8)),
                             TypeError, "int32"),
    "int4pack out of range": (lambda: twin.npu_convert_weight_to_int4pack(torch.full((4, 8), 9, dtype=torch.int32)),
                              ValueError, "range"),
    "wqbmm float32 x": (lambda: twin.npu_weight_quant_batchmatmul(torch.randn(2, 8), torch.ones(8, 4, dtype=torch.int8),
                                                                  _half(4)), TypeError, "float16 or bfloat16"),
    "wqbmm scale dtype": (lambda: twin.npu_weight_quant_batchmatmul(_half(2, 8), torch.ones(8, 4, dtype=torch.int8),
                                                                    torch.ones(4)), TypeError, "antiquant_scale"),
    "wqbmm group size": (lambda: twin.npu_weight_quant_batchmatmul(_half(2, 64), torch.ones(64, 4, dtype=torch.int8),
                                                                   _half(4, 4), antiquant_group_size=16),
                         ValueError, "antiquant_group_size"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_twin_operators_refuse_what_the_documentation_refuses(case: str) -> None:
    call, error, match = REFUSED[case]
    with pytest.raises(error, match=match):
        call()


def test_every_twin_operator_has_a_refusal_case() -> None:
    prefixes = {"reshape": "_npu_reshape_and_cache", "paged": "_npu_paged_attention",
                "workspace": "_npu_paged_attention_get_workspace",
                "fia": "npu_fused_infer_attention_score", "rms": "npu_rms_norm", "add_rms": "npu_add_rms_norm",
                "swiglu": "npu_swiglu", "rotary": "npu_rotary_mul", "quant": "npu_dynamic_quant",
                "quantize": "npu_quantize",
                "matmul": "npu_quant_matmul", "siso": "_npu_reshape_and_cache_siso",
                "mla": "_npu_paged_attention_mla", "int4pack": "npu_convert_weight_to_int4pack",
                "wqbmm": "npu_weight_quant_batchmatmul"}
    assert {prefixes[case.split(" ")[0]] for case in REFUSED} == set(twin.OPERATORS) - set(MOE_DOCUMENTED)


def test_a_negative_slot_writes_nothing() -> None:
    # ATB's ReshapeAndCache kernel skips a token whose slot is negative (a captured graph's padding rows)
    key, value, key_cache, value_cache = _half(3, 2, 16), _half(3, 2, 16), _cache(), _cache()
    before = key_cache.clone()
    twin._npu_reshape_and_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                                slot_indices=torch.tensor([5, -1, 130], dtype=torch.int32))
    flat, was = key_cache.view(-1, 2, 16), before.view(-1, 2, 16)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[130], key[2])
    assert torch.equal(value_cache.view(-1, 2, 16)[130], value[2])
    untouched = [s for s in range(512) if s not in (5, 130)]
    assert torch.equal(flat[untouched], was[untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.usefixtures("torch_npu_twin")
def test_layers_on_npu_operators_match_the_torch_path(dtype: torch.dtype) -> None:
    choice = KernelChoice(npu_ops=twin)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    residual = torch.randn(7, 64, generator=gen).to(dtype)
    npu_norm, ref_norm = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)
    with torch.no_grad():
        npu_norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=gen))
        ref_norm.weight.copy_(npu_norm.weight)
    npu_norm.to(dtype).use_kernels(choice)
    ref_norm.to(dtype).use_kernels(KernelChoice.torch())
    assert isinstance(npu_norm.method, NpuNorm)
    torch.testing.assert_close(npu_norm(x), ref_norm(x))
    for got, expected in zip(npu_norm.add_and_norm(x, residual), ref_norm.add_and_norm(x, residual), strict=True):
        torch.testing.assert_close(got, expected)
    act = SiluAndMul()
    act.use_kernels(choice)
    assert act.fn is twin.npu_swiglu
    torch.testing.assert_close(act(x), SiluAndMul()(x))
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=False)
    npu_rope, ref_rope = RotaryEmbedding(config), RotaryEmbedding(config)
    for rope in (npu_rope, ref_rope):
        rope.build_cache("cpu", dtype)
    npu_rope.use_kernels(choice)
    positions = torch.tensor([0, 5, 6, 7, 30, 31, 63])
    q = torch.randn(7, 4, 16, generator=gen).to(dtype)
    k = torch.randn(7, 2, 16, generator=gen).to(dtype)
    for got, expected in zip(npu_rope(positions, q, k), ref_rope(positions, q, k), strict=True):
        torch.testing.assert_close(got, expected)
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul"} <= twin.CALLED


def test_the_refusal_cases_differ_from_an_accepted_call_in_one_argument() -> None:
    for accepted in (_reshape(), _paged(), _fia(), _fia(sparse_mode=4, pre_tokens=3, next_tokens=0), _siso(), _mla()):
        accepted()


# CANN ops-transformer docs/figures/sparsemode为4遮挡矩阵.png (the sparse_mode page's band example), cell by cell:
# 13 queries, 16 keys, pre_tokens 6, next_tokens 4, counted from the bottom-right corner; "." computed, "#" masked.
BAND_FIGURE = """
........########
.........#######
..........######
...........#####
#...........####
##...........###
###...........##
####...........#
#####...........
######..........
#######.........
########........
#########.......
"""


def test_the_twin_band_is_the_documented_figure() -> None:
    visible = visible_keys(4, 13, 16, pre_tokens=6, next_tokens=4)
    assert visible is not None
    assert ["".join("." if v else "#" for v in row) for row in visible.tolist()] == BAND_FIGURE.split()
    # the window of W positions, the query's own included: pre_tokens W - 1, next_tokens 0
    window = visible_keys(4, 3, 5, pre_tokens=1, next_tokens=0)
    assert window is not None and window.int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    causal = visible_keys(3, 3, 5, pre_tokens=1, next_tokens=0)   # mode 3 ignores both
    assert causal is not None and causal.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
