"""Multi-token prediction (MTP) proposals: the checkpoint's own next-token-prediction layers (``engine.models.mtp``)
propose greedily from the target's hidden states, k tokens per step (vLLM's ``deepseek_mtp`` / ``mtp`` methods).

MTP's entry for position p reads the target's final hidden state at p and the token at p + 1, and predicts the token
at p + 2, so it follows the target one step behind: after each forward pass the runner hands over (``observe``) the
hidden states of every token the step computed and kept (a verified row's up to its last accepted token); at the next
step's ``propose`` the MTP layer runs over those positions — all of them, to fill its own KV cache under the target's
block tables (the same slots, as a draft model's) — and its output at the position before the row's pending token
is the first proposal. Entries sit at their hidden state's position, with that rotary position (vLLM's layout;
transformers numbers them one later, which leaves every attention score the same), so position 0 has one too.
Further proposals chain the layer on its own output (the last MTP layer again when k exceeds the checkpoint's
layers, as vLLM does). Keys that rejected proposals leave behind are rewritten by the next catch-up, which always
covers every position before the pending token.

The sequences a prompt forks into (``n`` > 1) all get its hidden states. A sequence that reaches a prefix-cache hit
reads MTP keys the sequence that computed those blocks wrote, as a draft model's does; where that sequence ended
before its last hidden states were used, those keys are missing, which costs acceptance, never exactness.
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
    from engine.models.mtp import MtpModel

_EMPTY = np.empty(0, dtype=np.int64)
# Hidden states of positions p0, p0 + 1, ... of a sequence that the MTP layer has not read yet.
Pending = list[tuple[int, torch.Tensor]]


class MtpProposer:
    wants_hidden = True

    def __init__(self, mtp: MtpModel, target: CausalLM, device: Device, *, num_blocks: int, block_size: int,
                 max_num_tokens: int, dtype: torch.dtype, num_speculative_tokens: int) -> None:
        self.mtp = mtp
        self.target = target
        self.device = device
        self.block_size = block_size
        self.vocab_size = target.config.vocab_size
        cfg = target.config
        self.backend = device.attention_backend()
        if cfg.mla is not None:
            heads, width, planes = 1, cfg.mla.latent_dim, 1
        else:
            heads, width, planes = cfg.num_kv_heads, cfg.head_dim, 2
        self.kv_caches = self.backend.allocate_kv_caches(device, mtp.num_layers, num_blocks, block_size, heads,
                                                         width, dtype, planes)
        pin = device.pin_memory
        self._ids, self._positions, self._slots = (torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin)
                                                   for _ in range(3))
        self.pending: dict[SequenceId, Pending] = {}
        self.lengths = DraftLengths(num_speculative_tokens)

    # -- what the target computed ------------------------------------------------------------------------------
    def observe(self, scheduled: list[ScheduledRequest], row_tokens: list[int], kept: list[int],
                hidden: torch.Tensor) -> None:
        """``hidden``: the step's final hidden states, every flat token (rows in ``scheduled`` order, ``row_tokens``
        each); ``kept[i]``: how many of row i's first tokens stand (a verified row's pending token and the proposals
        accepted after it)."""
        offset = 0
        for s, n, k in zip(scheduled, row_tokens, kept, strict=True):
            if k:
                states = hidden[offset:offset + k].clone()
                # a row sampling for several sequences (n > 1 forks after the prompt) hands them all its states
                for seq_id in {s.request.seq_id, *s.sample_seq_ids}:
                    self.pending.setdefault(seq_id, []).append((s.start, states))
            offset += n

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        if parent in self.pending:
            self.pending[child] = list(self.pending[parent])

    # -- proposals -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> list[np.ndarray]:
        drafts = [_EMPTY] * len(scheduled)
        want = {i: self.lengths.limit(s.request.seq_id, s.num_spec_tokens)
                for i, s in enumerate(scheduled) if s.num_spec_tokens}
        rows: list[LayoutRow] = []
        hiddens: list[torch.Tensor] = []
        owner: list[int] = []   # the scheduled row of each layout row
        for i, s in enumerate(scheduled):
            req = s.request
            for p0, h in self._ready(req.seq_id, req.num_tokens):
                rows.append((req, p0, req.all_token_ids[p0 + 1:p0 + 1 + len(h)], False))
                hiddens.append(h)
                owner.append(i)
        if not rows:
            return drafts
        ranked = sorted(range(len(rows)), key=lambda r: len(rows[r][2]) != 1)   # single tokens first
        rows, hiddens, owner = [rows[r] for r in ranked], [hiddens[r] for r in ranked], [owner[r] for r in ranked]
        # The row ending just before a wanting sequence's pending token (its first new position) gives its first
        # proposal.
        firsts = {owner[r]: r for r in range(len(rows))
                  if owner[r] in want and rows[r][1] + len(rows[r][2]) == scheduled[owner[r]].start}
        out, ends = self._forward(rows, torch.cat(hiddens), 0)
        if not firsts:
            return drafts
        chosen = list(firsts)
        last = out.index_select(0, torch.tensor([ends[firsts[i]] - 1 for i in chosen], device=out.device))
        tokens = self._argmax(last)
        proposals = {i: [t] for i, t in zip(chosen, tokens)}
        step = 1
        while True:
            more = [j for j, i in enumerate(chosen) if want[i] > step]
            if not more:
                break
            chain: list[LayoutRow] = [(scheduled[chosen[j]].request, scheduled[chosen[j]].start + step - 1,
                                       np.asarray(proposals[chosen[j]][-1:], dtype=np.int64), True) for j in more]
            last, _ = self._forward(chain, last.index_select(0, torch.tensor(more, device=last.device)), step)
            chosen = [chosen[j] for j in more]
            for i, t in zip(chosen, self._argmax(last)):
                proposals[i].append(t)
            step += 1
        for i, proposal in proposals.items():
            drafts[i] = np.asarray(proposal, dtype=np.int64)
            self.lengths.proposed(scheduled[i].request.seq_id, len(proposal))
        return drafts

    def _ready(self, seq_id: SequenceId, num_tokens: int) -> list[tuple[int, torch.Tensor]]:
        """The sequence's pending hidden states whose next token is known, as (first position, states) runs of
        consecutive positions; the rest stays pending."""
        runs: list[tuple[int, torch.Tensor]] = []
        for p0, h in self.pending.pop(seq_id, []):
            known = max(0, min(len(h), num_tokens - (p0 + 1)))
            if known < len(h):
                self.pending.setdefault(seq_id, []).append((p0 + known, h[known:]))
            if known == 0:
                continue
            if runs and runs[-1][0] + len(runs[-1][1]) == p0:
                runs[-1] = (runs[-1][0], torch.cat((runs[-1][1], h[:known])))
            else:
                runs.append((p0, h[:known]))
        return runs

    def _forward(self, rows: list[LayoutRow], previous: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        """MTP layer ``step`` (mod the checkpoint's) over ``rows``, reading ``previous`` (one hidden state per token,
        in layout order); its output [tokens, hidden] and the flat end of each row."""
        total = sum(len(r[2]) for r in rows)
        if total > len(self._ids):
            pin = self.device.pin_memory
            self._ids, self._positions, self._slots = (torch.zeros(2 * total, dtype=torch.int64, pin_memory=pin)
                                                       for _ in range(3))
        num_tokens, layout, ends = lay_out(rows, self.block_size, self._ids, self._positions, self._slots)
        dev = self.device.torch_device
        meta = self.backend.build_metadata(layout, dev)
        ids = self._ids[:num_tokens].to(dev, non_blocking=True)
        positions = self._positions[:num_tokens].to(dev, non_blocking=True)
        k = step % self.mtp.num_layers
        embed = self.mtp.embed_tokens if self.mtp.embed_tokens is not None else self.target.embed_tokens
        assert embed is not None
        out = self.mtp.layers[k](embed(ids), previous.to(embed.weight.dtype), positions, self.kv_caches[k], meta)
        return out, ends

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits: torch.Tensor = (self.mtp.head(hidden) if self.mtp.head is not None
                                else self.target.compute_logits(hidden, dtype=None))
        tokens: list[int] = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        return tokens

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def accepted(self, seq_id: SequenceId, num_accepted: int) -> None:
        self.lengths.accepted(seq_id, num_accepted)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.backend.copy_blocks(self.kv_caches, copies)

    def forget(self, seq_ids: list[SequenceId]) -> None:
        self.lengths.forget(seq_ids)
        for seq_id in seq_ids:
            self.pending.pop(seq_id, None)
