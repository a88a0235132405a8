"""TEST-ONLY TWIN of torch-npu's mixture-of-experts operators, on the CPU, from the Ascend Extension for PyTorch API
reference (op-plugin ``docs/context/torch_npu-npu_moe_*.md`` and ``torch_npu-npu_grouped_matmul.md``) and the checks
of op-plugin's front end (``MoeInitRoutingKernelNpuOpApi.cpp``): the chain vLLM-Ascend's all-gather path ran before
it moved to ``npu_moe_init_routing_v2`` / ``npu_moe_token_unpermute`` (``vllm_ascend/ops/moe_dispatcher/
token_dispatcher.py`` and ``ops/layers/moe_mlp.py`` at f86596a^): ``npu_moe_gating_top_k_softmax`` ->
``npu_moe_init_routing`` -> ``npu_moe_compute_expert_tokens`` -> ``npu_grouped_matmul`` -> ``npu_swiglu`` ->
``npu_grouped_matmul`` -> ``npu_moe_finalize_routing``.

Products are taken in float32 and written in the inputs' dtype; the hardware's accumulation order is not modelled."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tests.engine.npu_twin._ops import operator, require, require_contiguous, require_dtype

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# The grouped matmul's inner-axis limit (InnerLimit) on Atlas A2 / A3.
INNER_LIMIT = 65536
# The most groups one grouped matmul takes when x, weight and y are single tensors.
MAX_GROUPS = 1024


@operator
def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None,
                                 k: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over the last axis of ``x`` (2-D or 3-D, float16/bfloat16/float32), then its top ``k`` (0 < k <= the
    last axis, k <= 1024). Returns (y: the top-k probabilities in x's dtype; expert_idx int32; row_idx int32 with
    ``row_idx[i, j] = j * rows + i``). A row whose ``finished`` (bool, x's shape without its last axis) is True gets
    expert id ``num_experts`` in every slot. A 3-D x counts its rows over both leading axes."""
    op = "npu_moe_gating_top_k_softmax"
    require_dtype("x", op, x, FLOATS)
    require(x.dim() in (2, 3), f"{op}: x must be 2-D or 3-D, got {tuple(x.shape)}")
    num_experts = x.shape[-1]
    require(isinstance(k, int) and not isinstance(k, bool), f"{op}: k must be an int, got {k!r}", TypeError)
    require(0 < k <= num_experts and k <= 1024, f"{op}: k={k} must be in (0, {min(num_experts, 1024)}]")
    if finished is not None:
        require_dtype("finished", op, finished, (torch.bool,))
        require(tuple(finished.shape) == tuple(x.shape[:-1]),
                f"{op}: finished must have x's shape without its last axis {tuple(x.shape[:-1])}, got "
                f"{tuple(finished.shape)}")
    scores = x.float().softmax(dim=-1)
    y, expert_idx = torch.topk(scores, k, dim=-1)
    expert_idx = expert_idx.to(torch.int32)
    if finished is not None:
        expert_idx = expert_idx.masked_fill(finished.unsqueeze(-1), num_experts)
    rows = scores.numel() // num_experts
    row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().reshape(expert_idx.shape)
    return y.to(x.dtype), expert_idx, row_idx


@operator
def npu_moe_init_routing(x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor,
                         active_num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the (row, slot) pairs by expert: ``expert_idx`` [rows, K] (int32) and ``row_idx`` (its shape, int32, a
    permutation of 0 .. rows * K - 1, as ``npu_moe_gating_top_k_softmax`` writes it) sorted together by expert id
    (stable); ``expanded_row_idx[sorted_row_idx[i]] = i`` and ``expanded_x[i] = x[sorted_row_idx[i] % rows]``.
    Ids are not bounded: the gating operator's finished rows carry ``num_experts`` and sort after every expert.
    Returns (expanded_x [min(rows, active_num) * K, H] in x's dtype; expanded_row_idx int32 [rows * K];
    expanded_expert_idx int32 [rows * K], the sorted ids)."""
    op = "npu_moe_init_routing"
    require(x.dim() == 2, f"{op}: x must be 2-D (rows, H), got {tuple(x.shape)}")
    require_dtype("x", op, x, FLOATS)
    require(x.numel() < 2 ** 24, f"{op}: x must have fewer than 2^24 elements, got {x.numel()}")
    require(expert_idx.dim() == 2, f"{op}: expert_idx must be 2-D (rows, K), got {tuple(expert_idx.shape)}")
    require_dtype("expert_idx", op, expert_idx, (torch.int32,))
    require(row_idx.dim() == 2, f"{op}: row_idx must be 2-D, got {tuple(row_idx.shape)}")
    require_dtype("row_idx", op, row_idx, (torch.int32,))
    require(isinstance(active_num, int) and not isinstance(active_num, bool),
            f"{op}: active_num must be an int, got {active_num!r}", TypeError)
    require(active_num >= 0, f"{op}: active_num must be non-negative, got {active_num}")
    rows, k = expert_idx.shape
    require(x.shape[0] == rows, f"{op}: x has {x.shape[0]} rows, expert_idx {rows}")
    require(row_idx.shape == expert_idx.shape,
            f"{op}: row_idx {tuple(row_idx.shape)} must have expert_idx's shape {tuple(expert_idx.shape)}")
    flat_rows = row_idx.reshape(-1).long()
    require(torch.equal(flat_rows.sort().values, torch.arange(rows * k)),
            f"{op}: row_idx must hold each position 0 .. {rows * k - 1} once")
    order = torch.sort(expert_idx.reshape(-1), stable=True).indices
    sorted_row_idx = flat_rows.index_select(0, order)
    expanded_row_idx = torch.empty(rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_row_idx] = torch.arange(rows * k, dtype=torch.int32)
    expanded_x = x.index_select(0, sorted_row_idx % max(rows, 1))[: min(rows, active_num) * k]
    return expanded_x, expanded_row_idx, expert_idx.reshape(-1).index_select(0, order)


@operator
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: torch.Tensor, num_expert: int) -> torch.Tensor:
    """For each expert e < ``num_expert``, the end of its rows in the sorted ids (1-D int32): by binary search, how
    many ids are <= e. Ids past ``num_expert - 1`` are allowed (the documented example passes 3..7 with 5 experts);
    they count in no expert. Returns int32 [num_expert]."""
    op = "npu_moe_compute_expert_tokens"
    ids = sorted_expert_for_source_row
    require(ids.dim() == 1, f"{op}: sorted_expert_for_source_row must be 1-D, got {tuple(ids.shape)}")
    require_dtype("sorted_expert_for_source_row", op, ids, (torch.int32,))
    require(ids.numel() < 2147483647, f"{op}: sorted_expert_for_source_row is too long ({ids.numel()})")
    require(isinstance(num_expert, int) and not isinstance(num_expert, bool),
            f"{op}: num_expert must be an int, got {num_expert!r}", TypeError)
    require(num_expert > 0, f"{op}: num_expert must be positive, got {num_expert}")
    require(bool((ids[1:] >= ids[:-1]).all()), f"{op}: sorted_expert_for_source_row must be sorted ascending")
    ends = torch.searchsorted(ids, torch.arange(num_expert, dtype=torch.int32), right=True)
    return ends.to(torch.int32)


def _group_sizes(op: str, group_list: Any, group_list_type: int, groups: int, rows: int) -> list[int]:
    require(isinstance(group_list, torch.Tensor),
            f"{op} twin: group_list must be a Tensor (the List[int] form is not modelled), got "
            f"{type(group_list).__name__}", TypeError)
    require_dtype("group_list", op, group_list, (torch.int64,))
    require(group_list.dim() == 1 and group_list.shape[0] == groups,
            f"{op}: group_list must be 1-D with one value per group ({groups}), got {tuple(group_list.shape)}")
    values = [int(v) for v in group_list.tolist()]
    require(all(v >= 0 for v in values), f"{op}: group_list must be non-negative, got {values}")
    if group_list_type == 0:
        require(all(b >= a for a, b in zip(values, values[1:])),
                f"{op}: group_list (group_list_type 0, cumulative) must be non-decreasing, got {values}")
        require(values[-1] == rows, f"{op}: group_list's last value {values[-1]} must equal x's {rows} rows")
        return [b - a for a, b in zip([0, *values], values)]
    require(group_list_type == 1, f"{op} twin: group_list_type {group_list_type} is not modelled (0 or 1)")
    require(groups != 1, f"{op}: group_list (group_list_type 1, counts) must not have length 1")
    require(sum(values) == rows, f"{op}: group_list's counts sum to {sum(values)}, x has {rows} rows")
    return values


@operator
def npu_grouped_matmul(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *,
                       bias: Sequence[torch.Tensor] | None = None, scale: Sequence[torch.Tensor] | None = None,
                       offset: Sequence[torch.Tensor] | None = None,
                       antiquant_scale: Sequence[torch.Tensor] | None = None,
                       antiquant_offset: Sequence[torch.Tensor] | None = None,
                       per_token_scale: Sequence[torch.Tensor] | None = None, group_list: Any = None,
                       activation_input: Sequence[torch.Tensor] | None = None,
                       activation_quant_scale: Sequence[torch.Tensor] | None = None,
                       activation_quant_offset: Sequence[torch.Tensor] | None = None, split_item: int = 0,
                       group_type: int | None = None, group_list_type: int = 0, act_type: int = 0,
                       output_dtype: torch.dtype | None = None,
                       tuning_config: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Grouped matmul, modelled in the form vLLM-Ascend's MoE MLP calls it: x, weight and y single tensors (``x=[x]``
    [M, K], ``weight=[w]`` [E, K, N], split_item 2 or 3, group_type 0: groups along M), ``group_list`` an int64
    Tensor with one value per expert, cumulative ends (group_list_type 0) or counts (1), covering all M rows; not
    quantized (x and weight float16, bfloat16 or float32, one dtype; output that dtype). Rows of group e are multiplied
    by ``w[e]``. ``w`` may be the transpose of a contiguous [E, N, K] tensor (the documented weight transpose); x must
    be contiguous. Returns [y [M, N]]."""
    op = "npu_grouped_matmul"
    for name, value in (("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
                        ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale),
                        ("activation_input", activation_input), ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset), ("bias", bias),
                        ("tuning_config", tuning_config)):
        require(value is None, f"{op} twin: {name} is not modelled (the float form without bias)")
    require(act_type == 0, f"{op} twin: act_type {act_type} is not modelled (0, no activation)")
    for name, tensors in (("x", x), ("weight", weight)):
        require(isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in tensors),
                f"{op}: {name} must be a list of Tensors, got {type(tensors).__name__}", TypeError)
        require(1 <= len(tensors) <= 128, f"{op}: {name} must hold 1 to 128 tensors, got {len(tensors)}")
    require(len(x) == 1 and len(weight) == 1,
            f"{op} twin: only single x and single weight are modelled, got {len(x)} and {len(weight)}")
    require(group_type == 0, f"{op} twin: group_type {group_type!r} is not modelled (0: groups along M)")
    require(split_item in (2, 3), f"{op}: single x, weight and y need split_item 2 or 3, got {split_item!r}")
    a, w = x[0], weight[0]
    require_dtype("x", op, a, FLOATS)
    require(w.dtype == a.dtype, f"{op}: weight must have x's dtype {a.dtype} (not quantized), got {w.dtype}",
            TypeError)
    require(output_dtype in (None, a.dtype), f"{op}: output_dtype must be None or x's {a.dtype}, got {output_dtype}",
            TypeError)
    require(a.dim() == 2, f"{op}: x must be 2-D [M, K], got {tuple(a.shape)}")
    require(w.dim() == 3, f"{op}: a single weight must be 3-D [E, K, N], got {tuple(w.shape)}")
    require_contiguous("x", op, a)
    require(w.is_contiguous() or w.transpose(1, 2).is_contiguous(),
            f"{op}: weight must be contiguous [E, K, N] or the transpose of a contiguous [E, N, K]")
    groups, k, n = w.shape
    require(groups <= MAX_GROUPS, f"{op}: at most {MAX_GROUPS} groups, got {groups}")
    require(a.shape[1] == k, f"{op}: x's K {a.shape[1]} != weight's K {k} (weight is [E, K, N])")
    require(k < INNER_LIMIT and n < INNER_LIMIT, f"{op}: K {k} and N {n} must be below {INNER_LIMIT}")
    sizes = _group_sizes(op, group_list, group_list_type, groups, a.shape[0])
    y = torch.empty(a.shape[0], n, dtype=a.dtype)
    start = 0
    for e, size in enumerate(sizes):
        y[start:start + size] = (a[start:start + size].float() @ w[e].float()).to(a.dtype)
        start += size
    return [y]


@operator
def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1: torch.Tensor | None,
                             skip2: torch.Tensor | None, bias: torch.Tensor | None, scales: torch.Tensor | None,
                             expanded_src_to_dst_row: torch.Tensor, export_for_source_row: torch.Tensor | None,
                             drop_pad_mode: int = 0) -> torch.Tensor:
    """Sums each row's experts back (drop-less modes): ``out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] *
    (expanded_permuted_rows[expanded_src_to_dst_row[p(i, k)]] + bias[export_for_source_row[i, k]])`` with
    ``p(i, k) = i + k * rows`` (drop_pad_mode 0, column order, as ``npu_moe_init_routing``'s expanded_row_idx is
    laid out) or ``i * K + k`` (2, row order). ``expanded_permuted_rows`` [rows * K, H] float16/bfloat16/float32;
    skip1 / skip2 / bias (E, H) / scales (rows, K) optional and of its dtype; ``expanded_src_to_dst_row`` int32
    [rows * K] in [0, rows * K - 1]; ``export_for_source_row`` int32 (rows, K) in [0, E - 1]. Returns [rows, H] in
    the rows' dtype (sums in float32)."""
    op = "npu_moe_finalize_routing"
    rows_in = expanded_permuted_rows
    require_dtype("expanded_permuted_rows", op, rows_in, FLOATS)
    require(isinstance(drop_pad_mode, int) and not isinstance(drop_pad_mode, bool),
            f"{op}: drop_pad_mode must be an int, got {drop_pad_mode!r}", TypeError)
    require(0 <= drop_pad_mode <= 3, f"{op}: drop_pad_mode must be in [0, 3], got {drop_pad_mode}")
    require(drop_pad_mode in (0, 2), f"{op} twin: drop_pad_mode {drop_pad_mode} (drop-pad, [E, C, H]) is not modelled")
    require(rows_in.dim() == 2, f"{op}: expanded_permuted_rows must be 2-D [rows * K, H], got {tuple(rows_in.shape)}")
    require(scales is not None or export_for_source_row is not None,
            f"{op} twin: K is read from scales or export_for_source_row; give one")
    shaped = scales if scales is not None else export_for_source_row
    assert shaped is not None
    require(shaped.dim() == 2, f"{op}: scales / export_for_source_row must be 2-D (rows, K), got {tuple(shaped.shape)}")
    rows, k = shaped.shape
    hidden = rows_in.shape[1]
    require(rows_in.shape[0] == rows * k,
            f"{op}: expanded_permuted_rows has {rows_in.shape[0]} rows, expected rows * K = {rows * k}")
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias), ("scales", scales)):
        if t is not None:
            require(t.dtype == rows_in.dtype, f"{op}: {name} must have expanded_permuted_rows' dtype {rows_in.dtype}, "
                                              f"got {t.dtype}", TypeError)
    require(not (skip1 is None and skip2 is not None), f"{op}: skip2 must be None when skip1 is None")
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None:
            require(tuple(t.shape) == (rows, hidden), f"{op}: {name} must be the output's shape {(rows, hidden)}, got "
                                                      f"{tuple(t.shape)}")
    if scales is not None and export_for_source_row is not None:
        require(export_for_source_row.shape == scales.shape,
                f"{op}: export_for_source_row {tuple(export_for_source_row.shape)} must have scales' shape "
                f"{tuple(scales.shape)}")
    src = expanded_src_to_dst_row
    require_dtype("expanded_src_to_dst_row", op, src, (torch.int32,))
    require(src.dim() == 1 and src.shape[0] == rows * k,
            f"{op}: expanded_src_to_dst_row must be 1-D of rows * K = {rows * k}, got {tuple(src.shape)}")
    require(src.numel() == 0 or (int(src.min()) >= 0 and int(src.max()) < rows * k),
            f"{op}: expanded_src_to_dst_row must be in [0, {rows * k - 1}]")
    if export_for_source_row is not None:
        require_dtype("export_for_source_row", op, export_for_source_row, (torch.int32,))
    if bias is not None:
        require(bias.dim() == 2 and bias.shape[1] == hidden, f"{op}: bias must be (E, {hidden}), got "
                                                             f"{tuple(bias.shape)}")
        require(export_for_source_row is not None, f"{op}: bias needs export_for_source_row")
        assert export_for_source_row is not None
        require(export_for_source_row.numel() == 0 or (int(export_for_source_row.min()) >= 0 and
                                                         int(export_for_source_row.max()) < bias.shape[0]),
                f"{op}: export_for_source_row must be in [0, {bias.shape[0] - 1}]")
    slots = torch.arange(k).unsqueeze(0)
    tokens = torch.arange(rows).unsqueeze(1)
    position = tokens + slots * rows if drop_pad_mode == 0 else tokens * k + slots
    gathered = rows_in.float()[src.long()[position]]              # [rows, K, H]
    if bias is not None and export_for_source_row is not None:
        gathered = gathered + bias.float()[export_for_source_row.long()]
    if scales is not None:
        gathered = gathered * scales.float().unsqueeze(-1)
    out = gathered.sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows_in.dtype)
