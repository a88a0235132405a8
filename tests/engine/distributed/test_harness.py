"""The multi-process harness the model-parallel tests stand on: results by rank, and a failing rank fails the run
at once instead of leaving its peers hung on a collective."""
from __future__ import annotations

import time

import pytest
import torch

from engine.distributed import ParallelContext
from tests.engine.distributed.harness import run_ranks


def ranks_and_sum(parallel: ParallelContext) -> tuple[int, int, int, float]:
    x = torch.tensor([float(parallel.rank + 1)])
    return parallel.rank, parallel.tp_rank, parallel.pp_rank, float(parallel.all_reduce(x))


def rank_1_fails(parallel: ParallelContext) -> None:
    if parallel.rank == 1:
        raise ValueError("rank 1 gives up")
    parallel.all_reduce(torch.ones(1))  # never completes: its peer is gone


def test_results_come_back_by_rank() -> None:
    # 2 x 2: each stage's two tensor ranks sum within their own group (1 + 2, 3 + 4).
    assert run_ranks(ranks_and_sum, 2, 2) == [(0, 0, 0, 3.0), (1, 1, 0, 3.0), (2, 0, 1, 7.0), (3, 1, 1, 7.0)]


def test_a_failing_rank_fails_the_run_without_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed:[\s\S]*ValueError: rank 1 gives up"):
        run_ranks(rank_1_fails, 2, 1, timeout_s=60)
    assert time.monotonic() - start < 30
