"""Attention within each sequence of a flat batch (no KV cache): one SDPA call per sequence, unpadded, on 4-D views
so that SDPA takes its fused CPU kernel. Measured on CPU (32 sequences of 10-42 tokens, 12 heads of 64, one thread,
CPU time): 4.8 ms per layer as 32 calls against 16 ms as one call over a padded, masked block (the copies in and out
and the masked kernel cost more than the calls); at 32 x 66 tokens 12 ms as 32 calls (21 ms on 3-D views, which
SDPA ran on its math path) against 10 ms as one unmasked call — ~4 % of a BERT-base layer's ~300 ms either way."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class VarlenLayout:
    """A flat batch's sequences (``seq_lens``), shared by every layer of one forward; the window masks are built
    once per sequence length."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        self.seq_lens = seq_lens
        self.device = device
        self._masks: dict[tuple[int, bool, int], torch.Tensor] = {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               window: int | None = None, scale: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (Hq a multiple of Hkv) -> [T, Hq, D]; ``window``: keys at most that many
        positions away, on either side (bidirectional) or behind (causal)."""
        groups = q.shape[1] // k.shape[1]
        outs = []
        start = 0
        for n in self.seq_lens:
            # [1, H, n, D]: SDPA's fused CPU kernel takes 4-D inputs only (3-D falls back to the math path)
            qs = q[start:start + n].transpose(0, 1)[None]
            ks = k[start:start + n].transpose(0, 1)[None]
            vs = v[start:start + n].transpose(0, 1)[None]
            if groups > 1:
                ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
            mask = self._mask(n, causal, window) if window is not None and n > window + 1 else None
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None,
                                                 scale=scale)
            outs.append(out[0].transpose(0, 1))
            start += n
        return torch.cat(outs)

    def _mask(self, n: int, causal: bool, window: int) -> torch.Tensor:
        key = (n, causal, window)
        if key not in self._masks:
            idx = torch.arange(n, device=self.device)
            distance = idx[:, None] - idx[None, :]
            self._masks[key] = (distance >= 0) & (distance <= window) if causal else distance.abs() <= window
        return self._masks[key]
