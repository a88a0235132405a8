"""The NPU MoE method on the torch-npu twin gives ``moe_reference``'s numbers for every routing and under expert
parallelism, calling the MoE operators; the twin's MoE operators compute what their documentation says and refuse
what it refuses."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.models.layers.fused_moe import FusedMoE, moe_reference
from engine.models.layers.fused_moe_npu import NpuMoEMethod
from engine.models.layers.moe_routing import select_experts
from engine.models.moe_config import Routing
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

HIDDEN, INTER, TOKENS = 32, 16, 11

ROUTINGS = {
    "mixtral softmax renormalised": Routing(num_experts=8, top_k=2, renormalize=True),
    "qwen2-moe softmax": Routing(num_experts=8, top_k=3),
    "deepseek-v2 grouped softmax": Routing(num_experts=8, top_k=2, num_groups=4, topk_group=2,
                                           routed_scaling_factor=16.0),
    "deepseek-v3 noaux_tc": Routing(num_experts=16, top_k=4, scoring="sigmoid", renormalize=True, num_groups=4,
                                    topk_group=2, group_score="top2_sum", correction_bias=True,
                                    routed_scaling_factor=2.5),
}
FUSED_GATING = {"mixtral softmax renormalised", "qwen2-moe softmax"}
MOE_OPERATORS = {"npu_moe_init_routing", "npu_moe_compute_expert_tokens", "npu_grouped_matmul", "npu_swiglu",
                 "npu_moe_finalize_routing"}
# (atol, rtol) against the float32 reference, relative to the output's largest magnitude for atol.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def _experts(routing: Routing, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """All experts' weights, a correction bias when the routing has one, and a step's inputs."""
    gen = torch.Generator().manual_seed(seed)
    e = routing.num_experts
    bias = 0.1 * torch.randn(e, generator=gen) if routing.correction_bias else None
    return dict(w13=(torch.randn(e, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype),
                w2=(torch.randn(e, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype),
                bias=bias, x=torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype),
                logits=torch.randn(TOKENS, e, generator=gen).to(dtype))


def _layer(routing: Routing, experts: dict[str, Any], expert_start: int = 0,
           num_local: int | None = None) -> FusedMoE:
    """A layer holding experts ``expert_start`` .. (all by default), on the twin's NPU method."""
    held = routing.num_experts if num_local is None else num_local
    layer = FusedMoE(routing, HIDDEN, INTER, expert_start, held)
    with torch.no_grad():
        layer.w13 = torch.nn.Parameter(experts["w13"][expert_start:expert_start + held].clone(), requires_grad=False)
        layer.w2 = torch.nn.Parameter(experts["w2"][expert_start:expert_start + held].clone(), requires_grad=False)
        if layer.correction_bias is not None:
            layer.correction_bias.copy_(experts["bias"])
    layer.method = NpuMoEMethod(layer, twin)
    return layer


def _reference(routing: Routing, experts: dict[str, Any], held: range | None = None) -> torch.Tensor:
    """moe_reference over all experts, or only over those in ``held`` (the others' weights zeroed)."""
    weights, ids = select_experts(experts["logits"], routing, experts["bias"])
    if held is not None:
        weights = torch.where((ids >= held.start) & (ids < held.stop), weights, torch.zeros_like(weights))
    return moe_reference(experts["x"], experts["w13"], experts["w2"], weights, ids)


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol * float(expected.abs().max()), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_method_matches_the_reference(name: str, dtype: torch.dtype) -> None:
    routing = ROUTINGS[name]
    experts = _experts(routing, dtype)
    layer = _layer(routing, experts)
    _assert_matches(layer(experts["x"], experts["logits"]), _reference(routing, experts), dtype)
    assert MOE_OPERATORS <= twin.CALLED
    assert ("npu_moe_gating_top_k_softmax" in twin.CALLED) == (name in FUSED_GATING)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["mixtral softmax renormalised", "deepseek-v3 noaux_tc"])
@pytest.mark.usefixtures("torch_npu_twin")
def test_expert_parallel_halves_sum_to_the_whole(name: str, dtype: torch.dtype) -> None:
    routing = ROUTINGS[name]
    experts = _experts(routing, dtype, seed=3)
    half = routing.num_experts // 2
    outputs = []
    for start in (0, half):
        layer = _layer(routing, experts, expert_start=start, num_local=half)
        out = layer(experts["x"], experts["logits"])
        _assert_matches(out, _reference(routing, experts, held=range(start, start + half)), dtype)
        outputs.append(out.float())
    _assert_matches((outputs[0] + outputs[1]).to(dtype), _reference(routing, experts), dtype)
    assert MOE_OPERATORS <= twin.CALLED


@pytest.mark.usefixtures("torch_npu_twin")
def test_a_rank_holding_none_of_the_chosen_experts_returns_zeros() -> None:
    routing = Routing(num_experts=8, top_k=2, renormalize=True)
    experts = _experts(routing, torch.float32)
    experts["logits"][:, 4:] -= 100.0   # every token picks among experts 0..3
    far = _layer(routing, experts, expert_start=4, num_local=4)
    assert torch.equal(far(experts["x"], experts["logits"]), torch.zeros(TOKENS, HIDDEN))
    near = _layer(routing, experts, expert_start=0, num_local=4)
    _assert_matches(near(experts["x"], experts["logits"]), _reference(routing, experts), torch.float32)


def test_fused_gating_is_chosen_for_plain_softmax_top_k_only() -> None:
    for name, routing in ROUTINGS.items():
        method = NpuMoEMethod(_layer(routing, _experts(routing, torch.float32)), twin)
        assert method.fused_gating == (name in FUSED_GATING), name
        assert not method.expert_parallel


# The MoE operators' parameters as torch-npu's API reference lists them: (positional-or-keyword, keyword-only).
DOCUMENTED: dict[str, tuple[str, str]] = {
    "npu_moe_gating_top_k_softmax": ("x finished k", ""),
    "npu_moe_init_routing": ("x row_idx expert_idx active_num", ""),
    "npu_moe_compute_expert_tokens": ("sorted_expert_for_source_row num_expert", ""),
    "npu_grouped_matmul": ("x weight", "bias scale offset antiquant_scale antiquant_offset per_token_scale group_list "
                                       "activation_input activation_quant_scale activation_quant_offset split_item "
                                       "group_type group_list_type act_type output_dtype tuning_config"),
    "npu_moe_finalize_routing": ("expanded_permuted_rows skip1 skip2 bias scales expanded_src_to_dst_row "
                                 "export_for_source_row drop_pad_mode", ""),
}


def test_moe_operators_have_the_documented_signatures() -> None:
    for name, (positional, keyword_only) in DOCUMENTED.items():
        params = inspect.signature(twin.OPERATORS[name]).parameters.values()
        assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == positional.split(), name
        assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == keyword_only.split(), name
        assert getattr(twin, name) is twin.OPERATORS[name]


def test_gating_top_k_softmax_is_softmax_then_top_k() -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).half()
    y, expert_idx, row_idx = twin.npu_moe_gating_top_k_softmax(x, k=3)
    values, indices = torch.topk(torch.softmax(x.float(), dim=-1), 3)
    assert y.dtype == torch.float16 and expert_idx.dtype == torch.int32 and row_idx.dtype == torch.int32
    torch.testing.assert_close(y, values.half())
    assert torch.equal(expert_idx, indices.int())
    assert row_idx.tolist() == [[t, t + 5, t + 10] for t in range(5)]
    finished = torch.tensor([False, True, False, False, True])
    _, expert_idx, _ = twin.npu_moe_gating_top_k_softmax(x, finished, k=3)
    assert expert_idx[1].tolist() == [8, 8, 8] and expert_idx[4].tolist() == [8, 8, 8]
    assert torch.equal(expert_idx[~finished], indices[~finished].int())


def _documented_routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The API reference's example: 3 rows of width 4, 2 experts each."""
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    return x, row_idx, expert_idx


def test_init_routing_sorts_pairs_by_expert() -> None:
    x, row_idx, expert_idx = _documented_routing()
    expanded_x, expanded_row_idx, expanded_expert_idx = twin.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    # pairs (row, slot) by expert, stable: expert 0 <- (1,0) (2,0); 1 <- (0,0) (1,1); 2 <- (0,1) (2,1)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(expanded_x, x[[1, 2, 0, 1, 0, 2]])
    # expanded_row_idx[j * rows + i] = where (row i, slot j) went
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]
    assert expanded_row_idx.dtype == torch.int32 and expanded_expert_idx.dtype == torch.int32
    assert twin.npu_moe_init_routing(x, row_idx, expert_idx, 2)[0].shape == (4, 4)


def test_compute_expert_tokens_counts_ids_up_to_each_expert() -> None:
    ends = twin.npu_moe_compute_expert_tokens(torch.tensor([3, 3, 4, 5, 6, 7], dtype=torch.int32), 5)
    assert ends.dtype == torch.int32 and ends.tolist() == [0, 0, 0, 2, 3]
    ids = torch.tensor([0, 0, 2, 2, 2, 3], dtype=torch.int32)
    assert twin.npu_moe_compute_expert_tokens(ids, 4).tolist() == [2, 2, 5, 6]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_grouped_matmul_multiplies_each_group_by_its_weight(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 6, generator=gen).to(dtype)
    w = torch.randn(3, 5, 6, generator=gen).to(dtype).transpose(1, 2)   # [E, K, N], a transposed view
    expected = torch.cat([x[0:2].float() @ w[0].float(), x[2:2].float() @ w[1].float(), x[2:7].float() @ w[2].float()])
    for group_list, group_list_type in (([2, 2, 7], 0), ([2, 0, 5], 1)):
        (y,) = twin.npu_grouped_matmul([x], [w], group_list=torch.tensor(group_list), split_item=2, group_type=0,
                                       group_list_type=group_list_type)
        assert y.dtype == dtype
        torch.testing.assert_close(y, expected.to(dtype))


@pytest.mark.parametrize("drop_pad_mode", [0, 2])
def test_finalize_routing_sums_each_rows_experts(drop_pad_mode: int) -> None:
    gen = torch.Generator().manual_seed(4)
    rows, k, hidden, num_experts = 4, 3, 5, 6
    expanded = torch.randn(rows * k, hidden, generator=gen)
    skip1, skip2 = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    bias = torch.randn(num_experts, hidden, generator=gen)
    scales = torch.rand(rows, k, generator=gen)
    src_to_dst = torch.randperm(rows * k, generator=gen).int()
    experts = torch.randint(0, num_experts, (rows, k), generator=gen).int()
    out = twin.npu_moe_finalize_routing(expanded, skip1, skip2, bias, scales, src_to_dst, experts, drop_pad_mode)
    expected = skip1 + skip2
    for i in range(rows):
        for j in range(k):
            at = i + j * rows if drop_pad_mode == 0 else i * k + j
            expected[i] += scales[i, j] * (expanded[int(src_to_dst[at])] + bias[int(experts[i, j])])
    torch.testing.assert_close(out, expected)


def test_init_then_finalize_routing_returns_each_row_times_its_weights() -> None:
    x, row_idx, expert_idx = _documented_routing()
    expanded_x, expanded_row_idx, _ = twin.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    scales = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.0, 3.0]])
    out = twin.npu_moe_finalize_routing(expanded_x, None, None, None, scales, expanded_row_idx, None)
    torch.testing.assert_close(out, x * scales.sum(dim=1, keepdim=True))


def _gating(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(x=torch.randn(4, 8).half(), finished=None, k=2)
    args.update(change)
    return lambda: twin.npu_moe_gating_top_k_softmax(**args)


def _init(**change: Any) -> Callable[[], Any]:
    x, row_idx, expert_idx = _documented_routing()
    args: dict[str, Any] = dict(x=x, row_idx=row_idx, expert_idx=expert_idx, active_num=3)
    args.update(change)
    return lambda: twin.npu_moe_init_routing(**args)


def _tokens(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(sorted_expert_for_source_row=torch.tensor([0, 1, 1, 3], dtype=torch.int32),
                                num_expert=4)
    args.update(change)
    return lambda: twin.npu_moe_compute_expert_tokens(**args)


def _gmm(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(x=[torch.randn(6, 8).half()], weight=[torch.randn(3, 8, 4).half()],
                                group_list=torch.tensor([1, 4, 6]), split_item=2, group_type=0, group_list_type=0)
    args.update(change)
    return lambda: twin.npu_grouped_matmul(**args)


def _finalize(**change: Any) -> Callable[[], Any]:
    args: dict[str, Any] = dict(expanded_permuted_rows=torch.randn(6, 4).half(), skip1=None, skip2=None, bias=None,
                                scales=torch.rand(3, 2).half(), expanded_src_to_dst_row=torch.arange(6).int(),
                                export_for_source_row=None, drop_pad_mode=0)
    args.update(change)
    return lambda: twin.npu_moe_finalize_routing(**args)


REFUSED: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "gating int x": (_gating(x=torch.ones(4, 8, dtype=torch.int32)), TypeError, "x"),
    "gating 1-D x": (_gating(x=torch.randn(8).half()), ValueError, "2-D or 3-D"),
    "gating k too large": (_gating(k=9), ValueError, "k=9"),
    "gating k zero": (_gating(k=0), ValueError, "k=0"),
    "gating int finished": (_gating(finished=torch.zeros(4, dtype=torch.int32)), TypeError, "finished"),
    "gating finished shape": (_gating(finished=torch.zeros(4, 8, dtype=torch.bool)), ValueError, "finished"),
    "init int64 expert_idx": (_init(expert_idx=torch.tensor([[1, 2], [0, 1], [0, 2]])), TypeError, "expert_idx"),
    "init int64 row_idx": (_init(row_idx=torch.tensor([[0, 3], [1, 4], [2, 5]])), TypeError, "row_idx"),
    "init int x": (_init(x=torch.ones(3, 4, dtype=torch.int32)), TypeError, "x"),
    "init 3-D x": (_init(x=torch.randn(3, 1, 4)), ValueError, "x must be 2-D"),
    "init rows differ": (_init(x=torch.randn(4, 4)), ValueError, "rows"),
    "init row_idx shape": (_init(row_idx=torch.arange(6, dtype=torch.int32).view(2, 3)), ValueError, "row_idx"),
    "init row_idx repeats": (_init(row_idx=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "once"),
    "init negative active_num": (_init(active_num=-1), ValueError, "active_num"),
    "tokens int64": (_tokens(sorted_expert_for_source_row=torch.tensor([0, 1, 1, 3])), TypeError, "sorted_expert"),
    "tokens 2-D": (_tokens(sorted_expert_for_source_row=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "1-D"),
    "tokens unsorted": (_tokens(sorted_expert_for_source_row=torch.tensor([1, 0], dtype=torch.int32)), ValueError,
                        "sorted"),
    "tokens no experts": (_tokens(num_expert=0), ValueError, "positive"),
    "gmm tensor x": (_gmm(x=torch.randn(6, 8).half()), TypeError, "list of Tensors"),
    "gmm weight dtype": (_gmm(weight=[torch.randn(3, 8, 4)]), TypeError, "weight must have x's dtype"),
    "gmm int x": (_gmm(x=[torch.ones(6, 8, dtype=torch.int32)]), TypeError, "x"),
    "gmm 2-D weight": (_gmm(weight=[torch.randn(8, 4).half()]), ValueError, "3-D"),
    "gmm K differs": (_gmm(weight=[torch.randn(3, 7, 4).half()]), ValueError, "K"),
    "gmm int32 group_list": (_gmm(group_list=torch.tensor([1, 4, 6], dtype=torch.int32)), TypeError, "group_list"),
    "gmm list group_list": (_gmm(group_list=[1, 4, 6]), TypeError, "group_list"),
    "gmm group_list short": (_gmm(group_list=torch.tensor([1, 4, 5])), ValueError, "last value"),
    "gmm group_list decreasing": (_gmm(group_list=torch.tensor([4, 1, 6])), ValueError, "non-decreasing"),
    "gmm group_list length": (_gmm(group_list=torch.tensor([1, 6])), ValueError, "one value per group"),
    "gmm counts sum": (_gmm(group_list=torch.tensor([1, 3, 3]), group_list_type=1), ValueError, "sum"),
    "gmm split_item 0": (_gmm(split_item=0), ValueError, "split_item"),
    "gmm group_type -1": (_gmm(group_type=-1), ValueError, "group_type"),
    "gmm output dtype": (_gmm(output_dtype=torch.float32), TypeError, "output_dtype"),
    "gmm transposed x": (_gmm(x=[torch.randn(8, 6).half().t()]), ValueError, "contiguous"),
    "finalize scales dtype": (_finalize(scales=torch.rand(3, 2)), TypeError, "scales"),
    "finalize int64 src": (_finalize(expanded_src_to_dst_row=torch.arange(6)), TypeError, "expanded_src_to_dst_row"),
    "finalize int rows": (_finalize(expanded_permuted_rows=torch.ones(6, 4, dtype=torch.int32)), TypeError,
                          "expanded_permuted_rows"),
    "finalize src range": (_finalize(expanded_src_to_dst_row=torch.arange(1, 7).int()), ValueError, r"\[0, 5\]"),
    "finalize rows count": (_finalize(expanded_permuted_rows=torch.randn(5, 4).half()), ValueError, "rows \\* K"),
    "finalize skip2 alone": (_finalize(skip2=torch.randn(3, 4).half()), ValueError, "skip2"),
    "finalize skip1 shape": (_finalize(skip1=torch.randn(3, 5).half()), ValueError, "skip1"),
    "finalize bias without ids": (_finalize(bias=torch.randn(2, 4).half()), ValueError, "export_for_source_row"),
    "finalize expert ids range": (_finalize(bias=torch.randn(2, 4).half(),
                                            export_for_source_row=torch.full((3, 2), 2, dtype=torch.int32)),
                                  ValueError, r"\[0, 1\]"),
    "finalize drop_pad_mode 4": (_finalize(drop_pad_mode=4), ValueError, "drop_pad_mode"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_moe_operators_refuse_what_the_documentation_refuses(case: str) -> None:
    call, error, match = REFUSED[case]
    with pytest.raises(error, match=match):
        call()


def test_every_moe_operator_has_a_refusal_case() -> None:
    prefixes = {"gating": "npu_moe_gating_top_k_softmax", "init": "npu_moe_init_routing",
                "tokens": "npu_moe_compute_expert_tokens", "gmm": "npu_grouped_matmul",
                "finalize": "npu_moe_finalize_routing"}
    assert {prefixes[case.split(" ")[0]] for case in REFUSED} == set(DOCUMENTED)


def test_the_refusal_cases_differ_from_an_accepted_call_in_one_argument() -> None:
    for accepted in (_gating(), _init(), _tokens(), _gmm(), _finalize()):
        accepted()
