"""Draft-model proposals: a smaller model of the same vocabulary proposes greedily, k tokens per step.

The draft keeps its own paged KV cache indexed by the target's block tables (same block ids, same slots, its own
layers and heads), so it needs no blocks of its own from the scheduler: the lookahead slots the scheduler
allocates for the proposed tokens hold the draft's keys for them too. Every step the draft runs over the tokens
the target computes (prefill chunks and decodes alike) so that its cache stays in step, then, for each row with
lookahead, over the row's pending token and k - 1 of its own proposals.

``computed[seq]``: positions below it hold draft keys computed from the sequence's actual tokens. Proposed
tokens that the target rejects leave wrong keys behind them, so after a step it is lowered to what was accepted;
the next step catches up from there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.worker.input_layout import LayoutRow, lay_out
from engine.worker.spec_decode import DraftLengths

if TYPE_CHECKING:
    from engine.core.request import SequenceId
    from engine.core.scheduler_output import ScheduledRequest
    from engine.device import Device
    from engine.models import CausalLM

_EMPTY = np.empty(0, dtype=np.int64)


class DraftModelProposer:
    wants_hidden = False

    def __init__(self, model: CausalLM, device: Device, *, num_blocks: int, block_size: int, max_num_tokens: int,
                 dtype: torch.dtype, vocab_size: int, num_speculative_tokens: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        cfg = model.config
        self.backend = device.attention_backend()
        self.kv_caches = self.backend.allocate_kv_caches(device, cfg.num_layers, num_blocks, block_size,
                                                         cfg.num_kv_heads, cfg.head_dim, dtype)
        self._buffers(max_num_tokens)
        self.computed: dict[SequenceId, int] = {}
        self._proposed: dict[SequenceId, tuple[int, int]] = {}   # (position of the pending token, tokens proposed)
        self.lengths = DraftLengths(num_speculative_tokens)

    def _buffers(self, size: int) -> None:
        pin = self.device.pin_memory
        self._ids, self._positions, self._slots = (torch.zeros(size, dtype=torch.int64, pin_memory=pin)
                                                   for _ in range(3))

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> list[np.ndarray]:
        rows: list[LayoutRow] = []
        order: list[int] = []   # the scheduled row of each layout row
        for i, s in enumerate(scheduled):
            req = s.request
            # A sequence not seen yet starts where the target does (a prefix-cache hit holds draft keys too).
            start = min(self.computed.get(req.seq_id, s.start), s.start)
            end = s.start + s.num_new_tokens
            rows.append((req, start, req.all_token_ids[start:end], s.num_new_tokens == 1))
            order.append(i)
            self.computed[req.seq_id] = end
        # Decodes (split: a lagging one catches up token by token) before prefill chunks, as the layout wants.
        ranked = sorted(range(len(rows)), key=lambda r: not rows[r][3])
        rows, order = [rows[r] for r in ranked], [order[r] for r in ranked]
        drafts = [_EMPTY] * len(scheduled)
        # Tokens to propose for each row with lookahead.
        want = {i: self.lengths.limit(s.request.seq_id, s.num_spec_tokens)
                for i, s in enumerate(scheduled) if s.num_spec_tokens}
        wanted = [(r, order[r]) for r in range(len(rows)) if order[r] in want]
        logits = self._forward(rows, [r for r, _ in wanted])
        if logits is None:
            return drafts
        proposals = {i: [t] for (_, i), t in zip(wanted, self._argmax(logits))}
        # Then one token at a time for the rows that want more.
        step = 1
        while True:
            more = [i for i in proposals if want[i] > step]
            if not more:
                break
            logits = self._forward([(scheduled[i].request, scheduled[i].start + step,
                                     np.asarray(proposals[i][-1:], dtype=np.int64), True) for i in more],
                                   list(range(len(more))))
            assert logits is not None
            for i, t in zip(more, self._argmax(logits)):
                proposals[i].append(t)
            step += 1
        for i, tokens in proposals.items():
            s = scheduled[i]
            drafts[i] = np.asarray(tokens, dtype=np.int64)
            self._proposed[s.request.seq_id] = (s.start, len(tokens))
            self.lengths.proposed(s.request.seq_id, len(tokens))
        return drafts

    def _forward(self, rows: list[LayoutRow], sample_rows: list[int]) -> torch.Tensor | None:
        """Run the draft over ``rows``; the logits of the last token of each of ``sample_rows`` (None: none)."""
        total = sum(len(r[2]) for r in rows)
        if total > len(self._ids):
            self._buffers(2 * total)
        num_tokens, layout, ends = lay_out(rows, self.block_size, self._ids, self._positions, self._slots)
        dev = self.device.torch_device
        meta = self.backend.build_metadata(layout, dev)
        hidden = self.model(self._ids[:num_tokens].to(dev, non_blocking=True),
                            self._positions[:num_tokens].to(dev, non_blocking=True), self.kv_caches, meta)
        if not sample_rows:
            return None
        idx = torch.tensor([ends[r] - 1 for r in sample_rows], dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, idx), dtype=None)

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()

    def accepted(self, seq_id: SequenceId, num_accepted: int) -> None:
        self.lengths.accepted(seq_id, num_accepted)
        proposed = self._proposed.pop(seq_id, None)
        if proposed is not None:
            start, k = proposed
            # Draft keys at start + 1 .. start + k - 1 came from proposals 1 .. k - 1: good as far as accepted.
            self.computed[seq_id] = start + 1 + min(num_accepted, k - 1)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.backend.copy_blocks(self.kv_caches, copies)

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        pass   # nothing per sequence that a fork needs

    def observe(self, scheduled: list[ScheduledRequest], row_tokens: list[int], kept: list[int],
                hidden: torch.Tensor) -> None:
        pass   # reads no hidden states (wants_hidden is False)

    def forget(self, seq_ids: list[SequenceId]) -> None:
        self.lengths.forget(seq_ids)
        for seq_id in seq_ids:
            self.computed.pop(seq_id, None)
            self._proposed.pop(seq_id, None)
