"""Pooling of a flat batch's hidden states into each request's output, as vLLM's poolers do: CLS (first token),
MEAN (every token, specials included, as sentence-transformers' mean pooling over the attention mask), LAST (the
prompt's last token), ALL (one row per token); then an embedding's Matryoshka truncation and normalisation, or a
classifier's activation (softmax over labels, sigmoid for one)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_states(hidden: torch.Tensor, seq_lens: list[int], pooling_types: list[str]) -> list[torch.Tensor]:
    """``hidden`` [T, H], sequence by sequence (``seq_lens``); one [H] row per sequence (ALL: [n, H])."""
    rows: list[torch.Tensor] = []
    start = 0
    for n, kind in zip(seq_lens, pooling_types, strict=True):
        states = hidden[start:start + n]
        start += n
        if kind == "CLS":
            rows.append(states[0])
        elif kind == "LAST":
            rows.append(states[-1])
        elif kind == "MEAN":
            rows.append(states.float().mean(dim=0).to(states.dtype))
        elif kind == "ALL":
            rows.append(states)
        else:
            raise ValueError(f"unknown pooling type {kind!r}")
    return rows


def finish_embedding(row: torch.Tensor, *, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """An embedding (or per-token rows, [n, H]) in float32: its first ``dimensions`` values, then unit length when
    ``normalize`` (vLLM's order, so a truncated Matryoshka vector is renormalised)."""
    out = row.float()
    if dimensions is not None:
        out = out[..., :dimensions]
    if normalize:
        out = F.normalize(out, p=2, dim=-1)
    return out


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """A classifier's scores in float32: ``activation`` is "softmax" (over labels), "sigmoid", "tanh" or
    "identity"."""
    out = logits.float()
    if activation == "softmax":
        return torch.softmax(out, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(out)
    if activation == "tanh":
        return torch.tanh(out)
    if activation == "identity":
        return out
    raise ValueError(f"unknown activation {activation!r}")
