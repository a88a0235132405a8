"""A step's tokens laid out flat for the model, and for attention row by row (the runner's and the draft's); cut
into pipeline micro-batches."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import StepLayout

if TYPE_CHECKING:
    from engine.core.request import Request

# (sequence, position of its first token this step, the token ids, split): a split row's tokens are each their
# own single-token attention row (a verified proposal: every token sees the cache up to its own position).
LayoutRow = tuple["Request", int, np.ndarray, bool]


def lay_out(rows: list[LayoutRow], block_size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor) -> tuple[int, StepLayout, list[int]]:
    """Write the rows' ids, positions and cache slots into the (host) buffers, one row after another. Rows with
    one token or split must come first (the decodes of ``StepLayout``). Returns (number of tokens, the layout,
    the flat offset where each row ends)."""
    bs = block_size
    ids_np, pos_np, slot_np = input_ids.numpy(), positions.numpy(), slots.numpy()
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[np.ndarray] = []
    ends: list[int] = []
    offset = 0
    for request, start, tokens, split in rows:
        n = len(tokens)
        end = start + n
        table = np.asarray(request.block_ids[: (end + bs - 1) // bs], dtype=np.int64)
        if n == 1:
            ids_np[offset] = tokens[0]
            pos_np[offset] = start
            slot_np[offset] = table[start // bs] * bs + start % bs
        else:
            pos = np.arange(start, end, dtype=np.int64)
            ids_np[offset:offset + n] = tokens
            pos_np[offset:offset + n] = pos
            slot_np[offset:offset + n] = table[pos // bs] * bs + pos % bs
        if split:
            query_lens += [1] * n
            seq_lens += range(start + 1, end + 1)
            tables += [table] * n
        else:
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
        offset += n
        ends.append(offset)
    block_tables = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = table
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    layout = StepLayout(slot_mapping=slots, block_tables=block_tables, query_lens=query_lens, seq_lens=seq_lens,
                        num_decodes=num_decodes, block_size=bs)
    return offset, layout, ends


def split_rows(rows: list[LayoutRow], parts: int) -> list[list[LayoutRow]]:
    """The rows in up to ``parts`` contiguous micro-batches of about equal tokens, in order. A row that straddles
    a boundary is cut in two: its second piece starts at the position where the first ended, and a pipeline
    stage runs its micro-batches in order, so the first piece's keys are in the cache when the second attends
    to them (one long prompt is pipelined like many short ones). Each micro-batch keeps the rows' order, so
    its single-token rows still come first."""
    total = sum(len(tokens) for _, _, tokens, _ in rows)
    parts = min(parts, total)
    if parts <= 1:
        return [rows]
    cuts = [round(k * total / parts) for k in range(1, parts)]   # flat token offsets, strictly increasing
    batches: list[list[LayoutRow]] = [[]]
    offset = 0
    for request, start, tokens, split in rows:
        n, done = len(tokens), 0
        while cuts and cuts[0] < offset + n:   # a boundary inside the row (those at its start were taken)
            cut = cuts.pop(0) - offset
            batches[-1].append((request, start + done, tokens[done:cut], split))
            batches.append([])
            done = cut
        batches[-1].append((request, start + done, tokens[done:], split))
        offset += n
        if cuts and cuts[0] == offset:
            cuts.pop(0)
            batches.append([])
    return batches
