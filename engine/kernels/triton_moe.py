"""Fused mixture-of-experts in Triton, in the shape of vLLM's ``fused_moe``: one grouped GEMM kernel run twice.

A step's (token, slot) pairs routed to this rank's experts are sorted by expert and each expert's run padded to a
multiple of ``BLOCK_M`` (``align_pairs``, PyTorch ops on the device), so every block of ``BLOCK_M`` sorted pairs
belongs to one expert. A program of the kernel takes one such block and ``BLOCK_N`` output columns and multiplies
the block's rows by its expert's weight, accumulating in float32:

1. ``h = x[pair // top_k] @ w13[e].T`` for every pair (gate and up rows, [P, 2 * I]);
2. ``silu(gate) * up`` over the same blocks (a small kernel: float32, rounded once to the model's dtype);
3. ``y = weight[pair] * (act[pair] @ w2[e].T)`` ([P, H], float32);

then each token's ``top_k`` rows of ``y`` are summed. Pairs whose expert another rank holds (expert parallelism)
are not sorted into any block: their rows of ``y`` stay zero.

No host read anywhere: the launch covers the worst-case number of blocks (fixed by the shapes), the blocks past
the last expert's return at once, so a decode step can be captured in a CUDA graph.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernel runs on CPU tensors with numpy:
that is how it is tested without a GPU. A leaf module: imports nothing of the engine.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns of one program of the SiLU-and-mul kernel (times BLOCK_M rows), at most.
_SILU_BLOCK_I = 128


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_pairs_ptr, block_expert_ptr,
                         num_pairs, num_local, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         PAIRS_PER_A_ROW: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """C[pair, n] = (weight[pair] *) sum_k A[pair // PAIRS_PER_A_ROW, k] * B[e, n, k] for the pairs of one block
    (e: the block's expert); padding pairs (``num_pairs``) read and write nothing."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_local:   # past the last expert's blocks: the launch covers the worst case
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows).to(tl.int64)
    pair_ok = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // PAIRS_PER_A_ROW)[:, None] * stride_am + k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + n[None, :] * stride_bn + k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k + k0 < K
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=pair_ok, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & n_ok[None, :])


@triton.jit
def _silu_and_mul_kernel(h_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_local, inter,
                         stride_h, stride_o, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """out[pair] = silu(h[pair, :inter]) * h[pair, inter:] in float32, rounded once, for the pairs of one block
    (the rows of pairs held elsewhere were never written: not read)."""
    block = tl.program_id(0)
    if tl.load(block_expert_ptr + block) >= num_local:
        return
    pair = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (pair < num_pairs)[:, None] & (cols < inter)[None, :]
    h_ptrs = h_ptr + pair[:, None] * stride_h + cols[None, :]
    gate = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptrs + inter, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * stride_o + cols[None, :], (gate * tl.sigmoid(gate) * up).to(
        out_ptr.dtype.element_ty), mask=ok)


def block_sizes(num_tokens: int, num_local: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): vLLM's defaults without a tuned config, small blocks when there are fewer
    tokens than experts (most experts then get a pair or two)."""
    return (16, 32, 64) if num_tokens <= num_local else (64, 64, 32)


def align_pairs(topk_ids: torch.Tensor, block_m: int, expert_start: int, num_local: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ``topk_ids`` [T, k] (flat index ``t * k + slot``) routed to local experts ``expert_start`` ..,
    sorted by expert (stable) and each expert's run padded with ``T * k`` to a multiple of ``block_m``:
    (sorted pairs int64 [num_blocks * block_m], each block's local expert int64 [num_blocks], ``num_local`` for a
    block past the last expert's). ``num_blocks`` is the worst case of the shapes, so nothing is read on the host."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    # Each expert with pairs pads at most block_m - 1 rows.
    num_blocks = triton.cdiv(num_pairs + min(num_pairs, num_local) * (block_m - 1), block_m)
    capacity = num_blocks * block_m
    local = flat.to(torch.int64) - expert_start
    held = (local >= 0) & (local < num_local)
    key = torch.where(held, local, num_local)   # pairs held elsewhere: one bucket after the local experts
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # Where each bucket's run starts among the padded rows; the last bucket goes to a spare row dropped below.
    starts = torch.cat([ends - padded, ends.new_full((1,), capacity)])
    sorted_key, order = torch.sort(key, stable=True)
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts).index_select(0, sorted_key)
    dest = torch.where(sorted_key < num_local, starts.index_select(0, sorted_key) + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    return sorted_pairs[:capacity], block_expert


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                  sorted_pairs: torch.Tensor, block_expert: torch.Tensor, pairs_per_a_row: int, mul_weight: bool,
                  blocks: tuple[int, int, int]) -> None:
    """out[pair] = (weights[pair] *) a[pair // pairs_per_a_row] @ b[e].T for every sorted pair; a [rows, K],
    b [E_local, N, K], out [P, N]."""
    block_m, block_n, block_k = blocks
    num_local, n, k = b.shape
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, weights, sorted_pairs, block_expert, out.shape[0], num_local, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=a.dtype == torch.float32,
        # The interpreter keeps bfloat16 as uint16 bit patterns and its tl.dot multiplies them as integers.
        DOT_F32=a.dtype == torch.bfloat16 and not a.is_cuda)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """x [T, H]; w13 [E_local, 2 * I, H] (each expert's gate rows, then its up rows); w2 [E_local, H, I];
    topk_weights [T, k] (float32), topk_ids [T, k] (global expert ids). Returns [T, H] in x's dtype:
    ``sum_k weight_k * w2[e] @ (silu(gate) * up)`` over each token's experts ``expert_start`` ..
    ``expert_start + E_local - 1`` (the others add nothing), accumulated in float32."""
    num_tokens, hidden = x.shape
    num_local, two_i, _ = w13.shape
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x {x.dtype} and the experts' weights {w13.dtype} / {w2.dtype} must have one dtype")
    if w13.shape[2] != hidden or w2.shape != (num_local, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x's hidden size {hidden}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if num_pairs == 0:
        return out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights = topk_weights.reshape(-1).float()
    blocks = block_sizes(num_tokens, num_local)
    sorted_pairs, block_expert = align_pairs(topk_ids, blocks[0], expert_start, num_local)
    h = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, weights, sorted_pairs, block_expert, top_k, False, blocks)
    # The rows of pairs held elsewhere stay uninitialised in h and act: nothing reads them.
    intermediate = two_i // 2
    act = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    block_i = min(_SILU_BLOCK_I, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(block_expert.shape[0], triton.cdiv(intermediate, block_i))](
        h, act, sorted_pairs, block_expert, num_pairs, num_local, intermediate, h.stride(0), act.stride(0),
        BLOCK_M=blocks[0], BLOCK_I=block_i)
    _grouped_gemm(act, w2, out, weights, sorted_pairs, block_expert, 1, True, blocks)
    return out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
