"""M-RoPE positions (Qwen2-VL): each token's (temporal, height, width) position, from its 1-D position in the
sequence and the request's images, as transformers' ``get_rope_index`` lays them out.

A text token's three components are equal: its 1-D position shifted by every image before it, each of which
occupies ``max(h, w)`` positions (its merged patch grid's larger side) in place of its ``t * h * w`` tokens. An
image's placeholder k takes (start + k // (h w), start + k // w % h, start + k % w), ``start`` being the shifted
position of its first placeholder. The positions depend only on the request's tokens and images, which key its
prefix-cache blocks, so cached blocks stay valid; a decode token's shift is the sum over all images (transformers'
``rope_deltas``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.core.multimodal import MultiModalItem
    from engine.core.scheduler_output import ScheduledRequest

# An image's tensors -> its placeholders' (t, h, w) grid (the model's ``mrope_grid``).
GridOf = Callable[[Mapping[str, "torch.Tensor"]], tuple[int, int, int]]


class MRopeModel(Protocol):
    def mrope_grid(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int, int]: ...


def request_positions(items: Sequence[MultiModalItem], positions: np.ndarray, grid_of: GridOf) -> np.ndarray:
    """int64 [3, n]: the M-RoPE positions of a request's tokens at 1-D ``positions`` [n]."""
    out = np.repeat(positions[None, :].astype(np.int64), 3, axis=0)
    shift = 0
    for item in sorted(items, key=lambda it: it.offset):
        t, h, w = grid_of(item.tensors)
        inside = (positions >= item.offset) & (positions < item.end)
        if inside.any():
            k = positions[inside] - item.offset
            start = item.offset + shift
            out[:, inside] = np.stack((start + k // (h * w), start + k // w % h, start + k % w))
        shift += max(h, w) - item.length
        out[:, positions >= item.end] += max(h, w) - item.length
    return out


def step_positions(scheduled: Sequence[ScheduledRequest], row_tokens: Sequence[int], positions: np.ndarray,
                   grid_of: GridOf) -> np.ndarray:
    """int64 [3, N]: the M-RoPE positions of a step's flat ``positions`` [N], whose rows (``scheduled``, one after
    another, ``row_tokens`` each) are laid out in order."""
    out = np.repeat(positions[None, :].astype(np.int64), 3, axis=0)
    offset = 0
    for s, n in zip(scheduled, row_tokens):
        items = s.request.mm_items
        if items:
            out[:, offset:offset + n] = request_positions(items, positions[offset:offset + n], grid_of)
        offset += n
    return out
