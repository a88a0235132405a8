"""Decode graphs on CUDA (engine.worker.graphs with the Triton backend's part, engine.worker.cuda_graphs): buckets,
when a step is replayed or run eagerly, and the replay path itself on CPU — the recorder there runs the forward over
the fixed buffers instead of capturing it, with the Triton backend under its interpreter — so the padding, copies
and slicing are checked without a GPU. The ``gpu`` tests run the engine with graphs on and off on CUDA against the
CPU's float32 greedy tokens. The NPU's graphs: tests/engine/test_npu_graphs.py."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.attention.backend import StepLayout
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.models import load_model
from engine.worker.graphs import DEFAULT_CAPTURE_SIZES, DecodeGraphs, bucket, capture_sizes, graphs_off_reason
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.engine.triton_interpreter import choose_interpreter, triton_backend_module

ON_GPU = torch.cuda.is_available()


def test_default_sizes_are_vllms_capped_at_max_num_seqs() -> None:
    assert DEFAULT_CAPTURE_SIZES[:6] == (1, 2, 4, 8, 16, 24) and DEFAULT_CAPTURE_SIZES[-1] == 512
    assert capture_sizes(None, 512) == list(DEFAULT_CAPTURE_SIZES)
    assert capture_sizes(None, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes((4, 1, 64, 4), 32) == [1, 4, 32]


def test_bucket_is_the_smallest_that_holds_the_batch() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [bucket(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, None]


def test_graphs_only_on_single_rank_cuda_with_the_triton_backend() -> None:
    choose_interpreter()   # the decision imports the Triton backend when triton is there
    torch_backend = TorchAttentionBackend()
    cfg = EngineConfig()
    assert graphs_off_reason(cfg, "cpu", 1, torch_backend) == ("decode graphs are captured on CUDA and NPU devices, "
                                                               "this is cpu")
    assert graphs_off_reason(EngineConfig(enforce_eager=True), "cuda", 1, torch_backend) == "--enforce-eager"
    assert graphs_off_reason(cfg, "cuda", 2, torch_backend) == "2 ranks: collectives are not captured"
    reason = graphs_off_reason(cfg, "cuda", 1, torch_backend)
    assert reason is not None and ("TorchAttentionBackend" in reason or "triton is not importable" in reason)
    TritonAttentionBackend = triton_backend_module().TritonAttentionBackend

    assert graphs_off_reason(cfg, "cuda", 1, TritonAttentionBackend()) is None
    assert graphs_off_reason(EngineConfig(enforce_eager=True), "cuda", 1, TritonAttentionBackend()) is not None


def eager_recorder(calls: list[int]) -> Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]:
    """A 'capture' that runs the forward again at each replay, into the output tensor it first returned."""

    def record(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = forward()
        calls.append(len(out))
        return lambda: out.copy_(forward()), out

    return record


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return path


def test_replay_pads_copies_and_slices_like_an_eager_decode(tiny: Path) -> None:
    TritonAttentionBackend = triton_backend_module().TritonAttentionBackend
    from engine.device import get_device

    device = get_device("cuda" if ON_GPU else "cpu")
    dev = device.torch_device
    model: Any = load_model(str(tiny), torch.float32, dev)
    backend = TritonAttentionBackend()
    bs = 4
    mc = model.config
    caches = backend.allocate_kv_caches(device, mc.num_layers, 16, bs, mc.num_kv_heads, mc.head_dim, torch.float32)
    # three sequences of 5, 3 and 6 prompt tokens in blocks [1, 2], [3], [4, 5]
    tables = np.array([[1, 2], [3, 0], [4, 5]], dtype=np.int64)
    lens = [5, 3, 6]

    def layout(query_lens: list[int], seq_lens: list[int], slots: list[int]) -> StepLayout:
        return StepLayout(slot_mapping=torch.tensor(slots), block_tables=tables, query_lens=query_lens,
                          seq_lens=seq_lens, num_decodes=sum(1 for q in query_lens if q == 1), block_size=bs)

    def slot(row: int, pos: int) -> int:
        return int(tables[row, pos // bs]) * bs + pos % bs

    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(3, 128, sum(lens))).to(dev)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    prefill = backend.build_metadata(layout(lens, lens, [slot(r, p) for r, n in enumerate(lens) for p in range(n)]),
                                     dev)
    with torch.inference_mode():
        model(ids, positions, caches, prefill)
        calls: list[int] = []
        before = [c.clone() for c in caches]
        graphs = DecodeGraphs(model, backend, caches, sizes=[1, 4], max_seq_len=8, block_size=bs, device=dev)
        assert graphs.width == 2
        graphs.capture(eager_recorder(calls))
        assert calls == [4, 1]   # largest first
        assert all(torch.equal(c, b) for c, b in zip(caches, before))   # capturing wrote nothing
        decode = backend.build_metadata(layout([1, 1, 1], [6, 4, 7], [slot(r, n) for r, n in enumerate(lens)]), dev)
        step_ids, step_pos = torch.tensor([7, 8, 9], device=dev), torch.tensor(lens, device=dev)
        assert graphs.size_for(3, prefill) is None   # not a decode step
        assert graphs.size_for(3, decode) == 4
        hidden = graphs.forward(step_ids, step_pos, decode)
        assert hidden is not None and hidden.shape == (3, mc.hidden_size)
        graph_caches = [c.clone() for c in caches]
        for c, b in zip(caches, before):
            c.copy_(b)
        eager = model(step_ids, step_pos, caches, decode)
    torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=1e-5)
    # the real rows' keys landed where the eager step put them; the padding row wrote nothing
    written = decode.slot_mapping.tolist()
    others = [s for s in range(16 * bs) if s not in written]
    for g, c, b in zip(graph_caches, caches, before):
        torch.testing.assert_close(g, c, atol=1e-6, rtol=1e-6)
        assert torch.equal(g.view(2, 16 * bs, -1)[:, others], b.view(2, 16 * bs, -1)[:, others])
    assert graphs.slots[3].item() == -1 and graphs.seq_lens[3].item() == 0
    longer = backend.build_metadata(layout([1, 1, 1], [9, 4, 7], [slot(r, n) for r, n in enumerate(lens)]), dev)
    assert graphs.size_for(3, longer) is None   # past max_seq_len: eager


def test_stage_runner_takes_the_graphs_output_or_runs_eagerly(tiny: Path) -> None:
    from engine.device import get_device
    from engine.worker.stage_runner import StageRunner
    from engine.worker.step_inputs import MicroBatch, StepInputs

    device = get_device("cpu")
    model: Any = load_model(str(tiny), torch.float32, "cpu")
    stage = StageRunner(model, device, num_blocks=8, block_size=4, dtype=torch.float32,
                        activation_dtype=torch.float32)
    one = np.array([1], dtype=np.int64)
    inputs = StepInputs(one * 5, one * 0, one * 4, 4, [MicroBatch(0, 1, [1], [1], 1, np.array([[1]]))],
                        logits_rows=[np.array([0])])
    tensors = stage.prepare(inputs, torch.from_numpy(inputs.input_ids), torch.from_numpy(inputs.positions),
                            torch.from_numpy(inputs.slot_mapping))

    class Stub:
        def __init__(self, out: torch.Tensor | None) -> None:
            self.out, self.calls = out, 0

        def forward(self, *args: Any) -> torch.Tensor | None:
            self.calls += 1
            return self.out

    marker = torch.full((1, model.config.hidden_size), 7.0)
    with torch.inference_mode():
        stage.graphs = Stub(marker)  # type: ignore[assignment]
        assert torch.equal(stage.run(inputs, tensors)[0], marker)
        stage.graphs = Stub(None)  # type: ignore[assignment]   # the step does not fit: eager
        hidden = stage.run(inputs, tensors)[0]
    assert hidden is not None and not torch.equal(hidden, marker) and stage.graphs.calls == 1  # type: ignore[union-attr]


def _greedy(path: Path, **kw: Any) -> list[list[int]]:
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=64,
                                   max_num_seqs=8, num_kv_blocks=64, seed=0, **kw))
    rng = np.random.default_rng(3)
    for i in range(5):   # 5 decodes: the bucket of 8, three padding rows
        prompt = [int(t) for t in rng.integers(3, 128, 7 + 5 * i)]
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(5)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_cuda_graphs_on_and_off_match_cpu_float32_greedy(tiny: Path) -> None:
    cpu = _greedy(tiny)
    graphs = _greedy(tiny, device="cuda")
    eager = _greedy(tiny, device="cuda", enforce_eager=True)
    assert graphs == eager == cpu
