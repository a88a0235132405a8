"""Pipeline micro-batches: a step's rows cut into runs of about equal tokens, in order, rows cut where needed."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from engine.worker.input_layout import LayoutRow, lay_out, split_rows


def _row(name: str, start: int, n: int, split: bool = False) -> LayoutRow:
    request: Any = SimpleNamespace(request_id=name, block_ids=list(range(100)))
    return (request, start, np.arange(start, start + n, dtype=np.int64), split)


def _shape(batches: list[list[LayoutRow]]) -> list[list[tuple[str, int, int, bool]]]:
    return [[(r.request_id, start, len(tokens), split) for r, start, tokens, split in b] for b in batches]


def test_one_micro_batch_is_the_rows_as_they_are() -> None:
    rows = [_row("a", 5, 1), _row("b", 0, 7)]
    assert split_rows(rows, 1) == [rows]


def test_decodes_split_at_row_boundaries_and_keep_their_order() -> None:
    rows = [_row(c, 9, 1) for c in "abcdef"]
    assert [[r[0] for r in b] for b in _shape(split_rows(rows, 4))] == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert len(split_rows(rows[:2], 4)) == 2   # never more micro-batches than tokens


def test_a_long_prompt_is_cut_and_its_second_piece_continues_where_the_first_ended() -> None:
    rows = [_row("d", 30, 1), _row("p", 0, 9), _row("v", 12, 2, split=True)]
    assert _shape(split_rows(rows, 3)) == [[("d", 30, 1, False), ("p", 0, 3, False)], [("p", 3, 4, False)],
                                           [("p", 7, 2, False), ("v", 12, 2, True)]]
    pieces = split_rows([_row("p", 0, 9)], 2)
    assert np.concatenate([t for b in pieces for _, _, t, _ in b]).tolist() == list(range(9))


def test_micro_batches_laid_out_one_after_another_give_the_flat_layout() -> None:
    rows = [_row("d", 6, 1), _row("p", 0, 10)]
    size = 16
    whole = [torch.zeros(size, dtype=torch.int64) for _ in range(3)]
    n, _, _ = lay_out(rows, 4, *whole)
    parts = [torch.zeros(size, dtype=torch.int64) for _ in range(3)]
    offset, layouts = 0, []
    for batch in split_rows(rows, 2):
        m, layout, _ = lay_out(batch, 4, *(t[offset:] for t in parts))
        layouts.append(layout)
        offset += m
    assert offset == n == 11
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
    assert [(lo.query_lens, lo.seq_lens, lo.num_decodes) for lo in layouts] == [([1, 5], [7, 5], 1), ([5], [10], 0)]
