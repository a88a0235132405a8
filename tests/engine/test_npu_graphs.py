"""NPU graph mode (engine.worker.graphs with torch-npu's paged attention in task groups, engine.worker.npu_graphs) on
the operator twin's graph mode (tests/engine/npu_twin/graph.py): each decode bucket is captured once and replayed,
batches pad into their bucket, larger ones run eagerly, greedy tokens equal eager mode's on tiny Llama and Qwen2,
``enforce_eager`` captures nothing; a replayed step equals the eager step after every step's inputs changed, and
would not if a buffer were left stale or the paged attention's context lengths were not updated."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from engine.attention.backend import StepLayout
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.device import get_device
from engine.models import load_model
from engine.worker.graphs import DecodeGraphs, device_recorder, graphs_off_reason
from engine.worker.npu_graphs import NpuGraphAttention
from engine.worker.stage_runner import StageRunner
from engine.worker.worker import prepare_model
from tests.engine.executor.checkpoints import write_checkpoint
from tests.engine.npu_twin import npu_device_twin, torch_npu_twin  # noqa: F401  (fixtures)
from tests.engine.npu_twin import torch_npu as twin

npu = twin.npu
BLOCK = 128
rng = np.random.default_rng(5)
PROMPTS = [[int(t) for t in rng.integers(3, 128, n)] for n in (9, 30, 17, 40, 5)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _generate(path: Path, **kw: Any) -> tuple[list[list[int]], EngineCore]:
    """Greedy tokens of PROMPTS, request i stopping after 3 + 2i tokens: decode batches of 5 (past the largest
    bucket), 4, 3 (padded into 4), 2 and 1."""
    core = EngineCore(EngineConfig(model=str(path), dtype="float16", device="npu", block_size=BLOCK,
                                   max_num_batched_tokens=64, num_kv_blocks=16, max_model_len=256, max_num_seqs=8,
                                   cuda_graph_sizes=(1, 2, 4), **kw))
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))], core


@pytest.mark.usefixtures("npu_device_twin")
def test_buckets_captured_once_replayed_and_tokens_equal_eager(checkpoint: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[tuple[int, int | None]] = []   # (rows, bucket replayed or None) of each pure-decode step
    forward = DecodeGraphs.forward

    def noting(self: DecodeGraphs, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> Any:
        if meta.num_decodes == meta.num_seqs:
            steps.append((meta.num_seqs, self.size_for(len(input_ids), meta)))
        return forward(self, input_ids, positions, meta)

    monkeypatch.setattr(DecodeGraphs, "forward", noting)
    got, core = _generate(checkpoint)
    stage = core.executor.worker.stage   # type: ignore[attr-defined]
    assert stage.graphs is not None and stage.graphs.sizes == [1, 2, 4]
    graphs = {size: replay.__self__ for size, (replay, _) in stage.graphs.graphs.items()}
    assert npu.CAPTURED == [graphs[4], graphs[2], graphs[1]]   # once each, largest first
    assert (5, None) in steps and (3, 4) in steps and (4, 4) in steps   # too large: eager; 3 rows padded into 4
    assert {size: g.replays for size, g in graphs.items()} == {s: sum(1 for _, b in steps if b == s) for s in graphs}
    assert all(g.replays for g in graphs.values())
    core.close()

    npu.CAPTURED.clear()
    twin.CALLED.clear()
    eager, core = _generate(checkpoint, enforce_eager=True)
    assert core.executor.worker.stage.graphs is None   # type: ignore[attr-defined]
    assert npu.CAPTURED == [] and "_npu_paged_attention_get_workspace" not in twin.CALLED
    assert got == eager and [len(t) for t in got] == [3, 5, 7, 9, 11]
    core.close()


def test_the_npu_captures_unless_told_or_the_model_reads_host_values(tmp_path: Path) -> None:
    from engine.attention.npu_backend import NpuAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models.loader import read_model_config

    backend, npu_config = NpuAttentionBackend(twin), EngineConfig(device="npu")
    llama = read_model_config(str(write_checkpoint("llama", tmp_path / "llama")))
    mistral = read_model_config(str(write_checkpoint("mistral", tmp_path / "mistral")))
    assert graphs_off_reason(npu_config, "npu", 1, backend, llama) is None   # on by default
    assert graphs_off_reason(EngineConfig(device="npu", enforce_eager=True), "npu", 1, backend) == "--enforce-eager"
    assert graphs_off_reason(npu_config, "npu", 2, backend) == "2 ranks: collectives are not captured"
    assert "sliding-window" in str(graphs_off_reason(npu_config, "npu", 1, backend, mistral))
    assert "not the NPU attention backend" in str(graphs_off_reason(npu_config, "npu", 1, TorchAttentionBackend()))


def _layout(rows: list[tuple[list[int], int]], decode: bool = True) -> tuple[StepLayout, torch.Tensor]:
    """A step of ``rows`` (block table, context after the step): a decode of each, or a prefill of all of it."""
    bs = BLOCK
    spans = [range(n - 1, n) if decode else range(n) for _, n in rows]
    positions = [p for span in spans for p in span]
    slots = [table[p // bs] * bs + p % bs for (table, _), span in zip(rows, spans) for p in span]
    tables = np.zeros((len(rows), max(len(t) for t, _ in rows)), dtype=np.int64)
    for i, (table, _) in enumerate(rows):
        tables[i, :len(table)] = table
    layout = StepLayout(slot_mapping=torch.tensor(slots), block_tables=tables, query_lens=[len(s) for s in spans],
                        seq_lens=[n for _, n in rows], num_decodes=len(rows) if decode else 0, block_size=bs)
    return layout, torch.tensor(positions)


# Three sequences: a of 127 tokens in blocks [1, 2] (its second decode opens block 2), b of 5 in [3], c of 60 in [4].
PREFILL = [([1, 2], 127), ([3], 5), ([4], 60)]
STEP_A = [([1, 2], 128), ([3], 6), ([4], 61)]
STEP_B = [([4], 62), ([1, 2], 129), ([3], 7)]   # the rows reordered: each row's table, position and length change


@pytest.fixture
def decode_graphs(npu_device_twin: ModuleType, tmp_path: Path) -> tuple[DecodeGraphs, StageRunner]:  # noqa: F811
    """Tiny Llama on the twin NPU with PREFILL in its cache and decode graphs of 1 and 4 rows captured."""
    device = get_device("npu")
    model: Any = load_model(str(write_checkpoint("llama", tmp_path / "llama")), torch.float16, device.torch_device)
    prepare_model(model, device, torch.float16)
    stage = StageRunner(model, device, num_blocks=8, block_size=BLOCK, dtype=torch.float16,
                        activation_dtype=torch.float16)
    layout, positions = _layout(PREFILL, decode=False)
    ids = torch.from_numpy(rng.integers(3, 128, len(positions)))
    with torch.inference_mode():
        model(ids, positions, stage.kv_caches, stage.backend.build_metadata(layout, device.torch_device))
        graphs = DecodeGraphs(model, stage.backend, stage.kv_caches, sizes=[1, 4], max_seq_len=256, block_size=BLOCK,
                              device=device.torch_device)
        graphs.capture(device_recorder(device))   # type: ignore[arg-type]
    return graphs, stage


def _step(graphs: DecodeGraphs, stage: StageRunner, rows: list[tuple[list[int], int]]
          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The decode step of ``rows`` replayed and run eagerly from the same cache: (replayed hidden states, eager
    ones, the caches after each). The cache is left as the eager step wrote it."""
    layout, positions = _layout(rows)
    meta = stage.backend.build_metadata(layout, torch.device("cpu"))
    ids = torch.from_numpy(rng.integers(3, 128, len(rows)))
    before = [c.clone() for c in stage.kv_caches]
    with torch.inference_mode():
        replayed = graphs.forward(ids, positions, meta)
        assert replayed is not None
        replayed = replayed.clone()
        after_replay = [c.clone() for c in stage.kv_caches]
        for c, b in zip(stage.kv_caches, before):
            c.copy_(b)
        eager = stage.model(ids, positions, stage.kv_caches, meta)
    return replayed, eager, after_replay, [c.clone() for c in stage.kv_caches]


def test_each_replay_reads_the_steps_inputs(decode_graphs: tuple[DecodeGraphs, StageRunner]) -> None:
    graphs, stage = decode_graphs
    four = graphs.graphs[4][0].__self__   # type: ignore[attr-defined]
    for rows in (STEP_A, STEP_B):
        replayed, eager, replay_cache, eager_cache = _step(graphs, stage, rows)
        torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
        for r, e in zip(replay_cache, eager_cache):   # the padding row wrote nothing
            assert torch.equal(r, e)
    assert four.replays == 2


@pytest.mark.parametrize("stale", ["input_ids", "positions", "slots", "block_tables", "context lengths"])
def test_a_stale_input_gives_another_answer(decode_graphs: tuple[DecodeGraphs, StageRunner], stale: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay checks above can fail: a buffer replaced by a new tensor after capture (the graph keeps reading the
    old one, still holding step A), or events recorded without the task update (capture-time lengths)."""
    graphs, stage = decode_graphs
    _step(graphs, stage, STEP_A)
    if stale == "context lengths":
        def events_only(self: NpuGraphAttention, graphs: DecodeGraphs, size: int, meta: Any) -> None:
            for task in self.tasks[size]:
                task.event.record(self.update_stream)

        monkeypatch.setattr(NpuGraphAttention, "before_replay", events_only)
    else:
        setattr(graphs, stale, getattr(graphs, stale).clone())
    replayed, eager, _, _ = _step(graphs, stage, STEP_B)
    assert not torch.allclose(replayed, eager, atol=1e-2, rtol=1e-2)


def test_a_replay_without_the_task_update_would_hang(decode_graphs: tuple[DecodeGraphs, StageRunner],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    graphs, stage = decode_graphs
    monkeypatch.setattr(NpuGraphAttention, "before_replay", lambda *args: None)
    with pytest.raises(RuntimeError, match="wait forever"):
        _step(graphs, stage, STEP_A)
