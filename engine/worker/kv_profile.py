"""KV cache sizing on accelerators by profiling a max-size step (DESIGN.md §4, vLLM's ``profile_run``).

At start, before the cache exists, the worker runs one dummy step as large as the scheduler can ever make:
``max_num_batched_tokens`` prompt tokens over ``max_num_seqs`` sequences (fresh prompts, the widest attention),
then ``compute_logits`` over one row per sequence and a float32 softmax like the sampler's. The device's peak
allocation during that step, less what was allocated before it, is the activation memory every later step
fits in. The cache then gets ``device_memory_utilization`` of the device, less the weights, that peak, and what
other processes (and the CUDA context) already hold::

    cache = utilization * total - weights - activations - others
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import StepLayout

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend
    from engine.device import Device
    from engine.models import CausalLM


@dataclass(frozen=True)
class MemoryProfile:
    """What the profile step measured, in bytes."""

    total: int          # the device's memory
    used_before: int    # in use on the device before the step (total - free): ours, the context's, others'
    torch_before: int   # allocated by this process's torch before the step: weights and the profile's cache
    profile_cache: int  # the minimal cache the step wrote into (freed before the real one is made)
    peak: int           # torch's peak allocation during the step

    @property
    def weights(self) -> int:
        return self.torch_before - self.profile_cache

    @property
    def activations(self) -> int:
        return max(0, self.peak - self.torch_before)

    @property
    def others(self) -> int:
        """Held outside this process's tensors: the CUDA context, other processes, the allocator's free cache."""
        return max(0, self.used_before - self.torch_before)


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for the KV cache: ``utilization`` of the device less weights, activation peak and others."""
    return int(profile.total * utilization) - profile.weights - profile.activations - profile.others


def dummy_layout(max_num_batched_tokens: int, max_num_seqs: int, block_size: int
                 ) -> tuple[StepLayout, np.ndarray, np.ndarray]:
    """The profile step: ``max_num_batched_tokens`` tokens as fresh prompts of ``max_num_seqs`` sequences (as
    even as they divide, the shorter first). Every sequence writes into the same blocks ``0..n-1``: the step
    needs somewhere to write, not room for everyone. Returns (the layout, the positions, each sequence's last
    token's flat row)."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    lens = [base] * (num_seqs - extra) + [base + 1] * extra
    num_blocks = -(-max(lens) // block_size)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    layout = StepLayout(slot_mapping=torch.from_numpy(positions.copy()),   # block i of each table is block i
                        block_tables=np.tile(np.arange(num_blocks, dtype=np.int64), (num_seqs, 1)),
                        query_lens=lens, seq_lens=lens,
                        num_decodes=next((i for i, n in enumerate(lens) if n != 1), num_seqs), block_size=block_size)
    return layout, positions, np.cumsum(lens) - 1


def profile_step(model: CausalLM, device: Device, backend: AttentionBackend, *, max_num_batched_tokens: int,
                 max_num_seqs: int, block_size: int, dtype: torch.dtype) -> MemoryProfile:
    """Runs the dummy step on ``device`` with a minimal cache and returns what it measured (single rank: the
    step's collectives would wait for ranks that are not running it)."""
    layout, positions, last_rows = dummy_layout(max_num_batched_tokens, max_num_seqs, block_size)
    dev = device.torch_device
    num_blocks = layout.block_tables.shape[1]
    caches = backend.allocate_kv_caches(device, model.num_local_layers, num_blocks, block_size,
                                        model.num_local_kv_heads, model.kv_head_dim, dtype, model.kv_planes)
    profile_cache = sum(c.numel() * c.element_size() for c in caches)
    device.synchronize()
    free, total = device.memory_info()
    device.reset_peak_memory()
    torch_before = device.peak_memory_allocated()   # a fresh peak starts at what is allocated now
    with torch.inference_mode():
        meta = backend.build_metadata(layout, dev)
        ids = torch.zeros(len(positions), dtype=torch.int64, device=dev)
        hidden = model(ids, torch.from_numpy(positions).to(dev), caches, meta)
        assert isinstance(hidden, torch.Tensor)
        logits = model.compute_logits(hidden[torch.from_numpy(last_rows).to(dev)], dtype=None)
        logits.float().softmax(-1)   # the sampler's float32 copy of the logits
    device.synchronize()
    peak = device.peak_memory_allocated()
    del caches, meta, hidden, logits
    return MemoryProfile(total=total, used_before=total - free, torch_before=torch_before,
                         profile_cache=profile_cache, peak=peak)
