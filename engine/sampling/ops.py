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
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output tokens, then frequency and presence over output tokens.

    ``prompt_mask`` is bool ``[B, V]`` (token occurs in the prompt), ``output_counts``
    float ``[B, V]`` (occurrences in the output). A repeated token's positive logit is
    divided by the repetition penalty and a negative one multiplied, so the penalty
    always makes it less likely (CTRL, Keskar et al. 2019).
    """
    in_output = output_counts > 0
    rep = torch.where(prompt_mask | in_output, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * in_output


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) all but each row's ``top_k`` highest logits, then all but its top-p nucleus.

    ``top_k`` is int64 ``[B]`` already clamped to ``[1, V]`` (V = disabled); ``top_p``
    is float ``[B]`` in ``(0, 1]`` (1 = disabled). The nucleus is the smallest set of
    most likely tokens whose probability, renormalized after top-k, reaches ``top_p``:
    a token is kept when the mass of the tokens ranked above it is still below ``top_p``.
    Top-k is by rank, not by value, so exactly k tokens survive even with ties.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks.unsqueeze(0) >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A row with top_p == 1 keeps everything: float rounding of the cumulative sum
        # must not cut its tail of tiny probabilities.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``token_ids`` ``[B]`` and the ``num_top`` most likely tokens of each row.

    Returns ``(sampled [B], top_logprobs [B, num_top], top_ids [B, num_top])``, top
    entries in descending order.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    sampled = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return sampled, top_logprobs, top_ids
