"""Mixture-of-experts models over two tensor-parallel ranks (real processes, gloo), against the whole model: each
expert sliced over the ranks (tensor parallel), and each rank holding whole experts, its half of them
(``--enable-expert-parallel``). Tiny random Qwen3-MoE (GQA attention, q/k norm, a dense layer) and DeepSeek-V3
(latent attention with its heads split, shared experts, noaux_tc routing) checkpoints: float32 logits within 1e-4
over a prefill of three prompts and 20 greedy decode steps, greedy tokens identical.

With attention tensor-parallel every rank has every token's hidden states, so expert parallel needs no dispatch:
each rank runs its own experts over the tokens routed to them and the partial sums are added in the one all-reduce
the layer makes anyway (vLLM's combine without data-parallel attention).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.distributed.harness import run_ranks
from tests.engine.distributed.model_ranks import RankResult, reference, run_all
from tests.engine.models.moe_factory import write_checkpoint

pytestmark = pytest.mark.slow  # starts processes

TOL = 1e-4
STEPS = 20
PROMPTS = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 5, 11)]
KINDS = ["qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {kind: str(write_checkpoint(kind, Path(tmp_path_factory.mktemp(kind)))[1]) for kind in KINDS}


def _group(paths: dict[str, str], expert_parallel: bool) -> dict[str, list[RankResult]]:
    runs = [(kind, {"path": paths[kind], "prompts": PROMPTS, "steps": STEPS, "kernels": True,
                    "expert_parallel": expert_parallel}) for kind in KINDS]
    by_rank = run_ranks(run_all, 2, 1, runs)
    return {kind: [rank[kind] for rank in by_rank] for kind in KINDS}


@pytest.fixture(scope="module")
def whole(paths: dict[str, str]) -> dict[str, RankResult]:
    return {kind: reference(paths[kind], PROMPTS, STEPS, kernels=True) for kind in KINDS}


@pytest.fixture(scope="module")
def sliced(paths: dict[str, str]) -> dict[str, list[RankResult]]:
    return _group(paths, expert_parallel=False)


@pytest.fixture(scope="module")
def expert_parallel(paths: dict[str, str]) -> dict[str, list[RankResult]]:
    return _group(paths, expert_parallel=True)


def _assert_matches(ranks: list[RankResult], expected: RankResult) -> None:
    assert ranks[0].logits is not None and expected.logits is not None
    np.testing.assert_allclose(ranks[0].logits, expected.logits, atol=TOL, rtol=0)
    assert all(len(t) == STEPS + 1 for t in expected.tokens)
    for rank in ranks:
        assert rank.tokens == expected.tokens


@pytest.mark.parametrize("kind", KINDS)
def test_experts_sliced_over_tensor_ranks_match_the_whole_model(sliced: dict[str, list[RankResult]],
                                                                whole: dict[str, RankResult], kind: str) -> None:
    _assert_matches(sliced[kind], whole[kind])
    for rank in sliced[kind]:   # every expert, half of its intermediate size (32 -> 16)
        assert rank.experts and all(e == (0, 8, 16) for e in rank.experts.values())


@pytest.mark.parametrize("kind", KINDS)
def test_expert_parallel_matches_the_whole_model(expert_parallel: dict[str, list[RankResult]],
                                                 whole: dict[str, RankResult], kind: str) -> None:
    _assert_matches(expert_parallel[kind], whole[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_an_expert_parallel_rank_holds_only_its_experts(expert_parallel: dict[str, list[RankResult]],
                                                        whole: dict[str, RankResult], kind: str) -> None:
    first, second = expert_parallel[kind]
    assert first.experts and all(e == (0, 4, 32) for e in first.experts.values())
    assert second.experts and all(e == (4, 4, 32) for e in second.experts.values())
    # counted: each rank holds half the routed experts' weights, whole
    assert first.expert_params == second.expert_params == whole[kind].expert_params // 2
