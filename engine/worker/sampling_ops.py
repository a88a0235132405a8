"""Pure tensor operations over a batch of logits ``[B, V]``: one row per sequence.

Each function takes per-row parameters as 1-D tensors, so a batch with mixed
settings is processed in a few kernels. Every operation is row-local: a row's
result never depends on the other rows of the batch, which is what lets a
seeded request sample the same tokens alone or inside any batch.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    seen: tuple[torch.Tensor, torch.Tensor],
    generated: tuple[torch.Tensor, torch.Tensor],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties, in place: repetition over prompt + output tokens, then frequency and presence over output.

    ``seen`` and ``generated`` are (row index, token id) pairs, one per token occurrence:
    prompt and output tokens, and output tokens alone. A repeated token's positive logit
    is divided by the repetition penalty and a negative one multiplied, so the penalty
    always makes it less likely (CTRL, Keskar et al. 2019); then
    ``logit -= frequency * count + presence``.

    Only the touched entries are computed (O(tokens), not O(batch x vocab)); a token
    occurring twice is written twice with the same value, so duplicates are harmless.
    """
    rows, ids = seen
    x = logits[rows, ids]
    penalty = repetition[rows]
    logits[rows, ids] = torch.where(x > 0, x / penalty, x * penalty)
    rows, ids = generated
    counts = torch.zeros_like(logits)
    counts.index_put_((rows, ids), torch.ones(rows.shape, dtype=logits.dtype, device=logits.device), accumulate=True)
    logits[rows, ids] = logits[rows, ids] - frequency[rows] * counts[rows, ids] - presence[rows]
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, num_candidates: int = 1024
) -> torch.Tensor:
    """Mask (to -inf) all but each row's ``top_k`` best tokens, then all but its top-p nucleus.

    ``top_k`` is int64 ``[B]`` clamped to ``[1, V]`` (V = disabled); ``top_p`` is float
    ``[B]`` in ``(0, 1]`` (1 = disabled). The nucleus is the smallest set of most likely
    tokens whose probability, renormalized after top-k, reaches ``top_p``.

    Both are applied as a value threshold (keep ``logit >= cutoff``), as vLLM does, so
    tokens tied at the cutoff are all kept and the result never depends on how a sort
    orders ties. A full sort of a large vocabulary is slow (on CPU ~5 ms a row for 49k
    tokens), so cutoffs are first sought among the ``num_candidates`` best tokens; only
    rows whose cutoff may lie beyond them are sorted in full. Which way a row goes
    depends on that row alone, so a row's result is the same in any batch.
    """
    vocab = logits.shape[-1]
    cutoffs, exact = _cutoffs(logits, top_k, top_p, min(num_candidates, vocab))
    if not bool(exact.all()):
        rows = torch.nonzero(~exact).flatten()
        full, _ = _cutoffs(logits.index_select(0, rows), top_k.index_select(0, rows), top_p.index_select(0, rows),
                           vocab)
        cutoffs = cutoffs.index_copy(0, rows, full)
    return logits.masked_fill(logits < cutoffs.unsqueeze(1), _NEG_INF)


def _cutoffs(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's lowest kept logit, from its ``num`` best tokens, and whether ``num`` was enough to know it."""
    vocab = logits.shape[-1]
    values, ids = logits.topk(num, dim=-1)  # descending
    has_k = top_k < vocab
    kth = values.gather(-1, (top_k.clamp(max=num) - 1).unsqueeze(1)).squeeze(1)
    cut_k = torch.where(has_k, kth, _NEG_INF)
    # Probabilities renormalized over the top-k set; without top-k, over the whole vocabulary.
    in_top_k = values.masked_fill(values < cut_k.unsqueeze(1), _NEG_INF)
    probs = torch.where(has_k.unsqueeze(1), in_top_k.softmax(dim=-1), logits.softmax(dim=-1).gather(-1, ids))
    cumulative = probs.cumsum(dim=-1)
    # A token is kept while the mass ranked above it is below top_p; that is a prefix of the ranks.
    num_kept = ((cumulative - probs) < top_p.unsqueeze(1)).sum(dim=-1)
    last_kept = values.gather(-1, (num_kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    # top_p == 1 keeps everything: float rounding of the cumulative sum must not cut the tail.
    cut_p = torch.where(top_p < 1, last_kept, _NEG_INF)
    if num == vocab:
        exact = torch.ones_like(has_k)
    else:
        # Known when top-k lies among the candidates, or (no top-k) the nucleus closes inside them.
        exact = (top_k <= num) | (~has_k & (top_p < 1) & (cumulative[:, -1] >= top_p))
        exact |= ~has_k & (top_p >= 1)  # nothing to cut
    return torch.maximum(cut_k, cut_p), exact


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: ``argmax(p_i / E_i)`` with ``E_i ~ Exponential(1)`` is distributed as ``p``.

    Unlike ``torch.multinomial`` the randomness is an explicit tensor, so each row's
    noise can come from that row's own generator. The clamp keeps a zero draw from
    turning a masked token's ``0 / 0`` into NaN, which argmax would pick.
    """
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``token_ids`` ``[B]`` and the ``num_top`` most likely tokens of each row.

    Returns ``(sampled [B], top_logprobs [B, num_top], top_ids [B, num_top], ranks [B])``, top entries in
    descending order; a token's rank is the number of tokens at least as likely, itself included (vLLM's
    ``batched_count_greater_than``: 1 for the most likely).
    """
    logprobs = logits.float().log_softmax(dim=-1)
    sampled = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    ranks = (logprobs >= sampled.unsqueeze(-1)).sum(dim=-1)
    return sampled, top_logprobs, top_ids, ranks
