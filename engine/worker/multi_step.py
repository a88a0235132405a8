"""Multi-step decode on the runner: the inputs of a step's further decode passes, moved on from its first pass.

With ``--num-scheduler-steps N`` a decode row of a step may run up to N - 1 further passes in the same step
(``ScheduledRequest.num_lookahead_steps``), one token each; the scheduler allocated every slot they write when it
scheduled the first pass. So pass j's inputs are the first pass's rows (those still running) j positions on: the
position + j, the slot read from the block table kept from the first pass, the sequence length + 1 per pass. No
scheduling and no per-row layout happen between passes; the token ids are those the pass before sampled, which
the core has on the host anyway (each pass's tokens are stop-checked and can be streamed as it ends).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.worker.step_inputs import MicroBatch, StepInputs

if TYPE_CHECKING:
    from engine.core.request import SequenceId
    from engine.core.scheduler_output import SchedulerOutput


class LookaheadLayout:
    """The block tables and first positions of one multi-step step's decode rows, kept from its first pass."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._row_of: dict[SequenceId, int] = {}
        self._starts = np.zeros(0, dtype=np.int64)
        self._tables = np.zeros((0, 0), dtype=np.int64)

    def begin(self, first: SchedulerOutput) -> None:
        """Keep the rows of a step's first pass that have further passes (none: nothing is kept)."""
        rows = [s for s in first.scheduled if s.num_lookahead_steps]
        self._row_of = {s.request.seq_id: i for i, s in enumerate(rows)}
        if not rows:
            return
        self._starts = np.fromiter((s.start for s in rows), dtype=np.int64, count=len(rows))
        self._tables = np.zeros((len(rows), max(len(s.request.block_ids) for s in rows)), dtype=np.int64)
        for i, s in enumerate(rows):
            self._tables[i, :len(s.request.block_ids)] = s.request.block_ids

    def prepare(self, out: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor) -> tuple[StepInputs, list[int], list[int]]:
        """Pass ``out.pass_index`` of the step begun last, into the runner's host buffers: (its inputs, the flat
        rows to sample from, tokens per row), as ``ModelRunner._prepare`` returns them."""
        j = out.pass_index
        scheduled = out.scheduled
        n = len(scheduled)
        try:
            index = np.fromiter((self._row_of[s.request.seq_id] for s in scheduled), dtype=np.int64, count=n)
        except KeyError as e:
            raise ValueError(f"pass {j} of a multi-step step has a row its first pass did not have: {e}") from None
        pos = self._starts[index] + j
        bs = self.block_size
        # Each row's table up to the block of its position, zero-padded: the layout a plain decode step has.
        num_blocks = pos // bs + 1
        width = int(num_blocks.max())
        tables = self._tables[index, :width]
        tables = np.where(np.arange(width) < num_blocks[:, None], tables, 0)
        ids_np, pos_np, slot_np = input_ids.numpy(), positions.numpy(), slots.numpy()
        ids_np[:n] = [s.request.output_token_ids[-1] for s in scheduled]
        pos_np[:n] = pos
        slot_np[:n] = tables[np.arange(n), pos // bs] * bs + pos % bs
        seq_lens = (pos + 1).tolist()
        batch = MicroBatch(0, n, [1] * n, seq_lens, n, tables)
        inputs = StepInputs(ids_np[:n], pos_np[:n], slot_np[:n], bs, [batch], list(out.block_copies))
        return inputs, list(range(n)), [1] * n
