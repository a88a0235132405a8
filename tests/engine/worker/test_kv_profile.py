"""KV cache sizing by profiling (engine.worker.kv_profile and Worker.num_kv_blocks on accelerators): the arithmetic,
the dummy step's shape, and the profiling path on CPU through a fake accelerator whose memory figures are
scripted and whose peak grows only when the model runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.device.cpu import CpuDevice
from engine.worker.kv_profile import MemoryProfile, dummy_layout, kv_cache_budget
from engine.worker.worker import Worker
from tests.engine.core.tiny_llama import save_tiny_llama

GIB = 2**30


def test_budget_is_the_share_less_weights_activations_and_others() -> None:
    profile = MemoryProfile(total=80 * GIB, used_before=20 * GIB, torch_before=16 * GIB, profile_cache=GIB,
                            peak=19 * GIB)
    assert (profile.weights, profile.activations, profile.others) == (15 * GIB, 3 * GIB, 4 * GIB)
    # 0.9 * 80 = 72, less 15 of weights, 3 of activations, 4 held by others
    assert kv_cache_budget(profile, 0.9) == 50 * GIB
    assert kv_cache_budget(profile, 0.5) == 18 * GIB


def test_dummy_step_is_max_tokens_over_max_seqs_in_shared_blocks() -> None:
    layout, positions, last_rows = dummy_layout(100, 8, 16)
    assert sum(layout.query_lens) == 100 and len(layout.query_lens) == 8
    assert layout.query_lens == [12, 12, 12, 12, 13, 13, 13, 13] and layout.seq_lens == layout.query_lens
    assert layout.block_tables.tolist() == [[0]] * 8 and layout.num_decodes == 0
    assert last_rows.tolist() == [11, 23, 35, 47, 60, 73, 86, 99]
    assert positions[last_rows].tolist() == [11] * 4 + [12] * 4
    assert layout.slot_mapping.tolist() == positions.tolist()   # slot = position within block 0
    layout, _, last_rows = dummy_layout(4, 8, 16)   # fewer tokens than sequences: one token each
    assert layout.query_lens == [1, 1, 1, 1] and layout.num_decodes == 4 and last_rows.tolist() == [0, 1, 2, 3]


class FakeAccelerator(CpuDevice):
    """An accelerator as the worker sees it (not named cpu), with CPU tensors: ``free`` and ``total`` scripted,
    and an allocation peak of ``allocated`` plus ``activation`` bytes once the model has run since the reset."""

    def __init__(self, *, free: int, total: int, allocated: int, activation: int) -> None:
        super().__init__()
        self.name = "fake"
        self.free, self.total, self.allocated, self.activation = free, total, allocated, activation
        self.calls: list[str] = []
        self.ran = False

    def memory_info(self) -> tuple[int, int]:
        self.calls.append("memory_info")
        return self.free, self.total

    def reset_peak_memory(self) -> None:
        self.calls.append("reset")
        self.ran = False

    def peak_memory_allocated(self) -> int:
        self.calls.append("peak")
        return self.allocated + (self.activation if self.ran else 0)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return Worker(EngineConfig(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=96,
                               max_num_seqs=6, device_memory_utilization=0.5))


def _blocks(worker: Worker, fake: FakeAccelerator, seen: list[tuple[str, tuple[int, ...]]]) -> int:
    worker.device = fake
    model: Any = worker.model

    def ran(module: Any, args: tuple[torch.Tensor, ...], out: Any) -> None:
        fake.ran = True
        seen.append(("forward", tuple(args[0].shape)))

    hooks = [model.register_forward_hook(ran)]
    original = model.compute_logits

    def compute_logits(hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        seen.append(("logits", tuple(hidden.shape)))
        return original(hidden, dtype=dtype)

    model.compute_logits = compute_logits
    try:
        return worker.num_kv_blocks()
    finally:
        for h in hooks:
            h.remove()
        del model.compute_logits


def test_accelerator_blocks_come_from_the_profiled_peak(worker: Worker) -> None:
    mc = worker.model.config
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4   # float32
    # The profile's cache: 96 tokens over 6 sequences of 16 -> one block of 16 tokens in each layer.
    profile_cache = per_block
    total, allocated = 1000 * per_block, 100 * per_block + profile_cache
    results = []
    for activation_blocks in (10, 30):
        seen: list[tuple[str, tuple[int, ...]]] = []
        fake = FakeAccelerator(free=total - allocated - 50 * per_block, total=total, allocated=allocated,
                               activation=activation_blocks * per_block)
        results.append(_blocks(worker, fake, seen))
        # one max-size step: every token through the model, one logits row per sequence
        assert seen == [("forward", (96,)), ("logits", (6, mc.hidden_size))]
        assert fake.calls[-4:] == ["memory_info", "reset", "peak", "peak"]
    # 0.5 * 1000 blocks, less weights (100), activations and others (50)
    assert results == [500 - 100 - 10 - 50, 500 - 100 - 30 - 50]


def test_cpu_keeps_its_configured_memory(worker: Worker) -> None:
    worker.device = CpuDevice()
    mc = worker.model.config
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    assert worker.num_kv_blocks() == 2 * GIB // per_block


def test_too_little_memory_names_the_flag(worker: Worker) -> None:
    from common.errors import InvalidRequestError

    fake = FakeAccelerator(free=GIB, total=2 * GIB, allocated=GIB, activation=GIB)
    with pytest.raises(InvalidRequestError, match="no room for one KV block") as err:
        _blocks(worker, fake, [])
    assert err.value.field == "device_memory_utilization"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiling_on_cuda_measures_weights_and_a_peak(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    w = Worker(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", max_num_batched_tokens=512,
                            max_num_seqs=32, device_memory_utilization=0.5))
    from engine.worker.kv_profile import profile_step

    profile = profile_step(w.model, w.device, w.device.attention_backend(), max_num_batched_tokens=512,
                           max_num_seqs=32, block_size=16, dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in w.model.parameters())
    assert profile.weights >= weights and profile.activations > 0 and profile.total > 0
    free, total = w.device.memory_info()
    blocks = w.num_kv_blocks()
    mc = w.model.config
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 2
    assert 0 < blocks * per_block <= 0.5 * total
    assert np.isclose(blocks * per_block, kv_cache_budget(profile, 0.5), rtol=0.05)
