"""Decode steps replayed from device graphs: one graph per batch-size bucket, captured at start — CUDA graphs on
CUDA, NPU graphs (``torch.npu.NPUGraph``, vLLM-Ascend's "ACL graph") on Ascend NPUs, one implementation for both.

A decode step of a small batch is bound by kernel launches, not arithmetic: dozens of small kernels per layer,
each a few microseconds of host time. Replaying a captured graph launches them all at once. Each bucket's graph
runs the model's forward over fixed device buffers (token ids, positions, slots, block tables as wide as
``--max-seq-len-to-capture`` allows, sequence lengths); a step copies its inputs into the first rows, the rows
past its batch are padding (slot -1: nothing written; their outputs are dropped), and the step takes the first rows
of the graph's output.

What differs between devices is behind two seams: the device's graph class, capture context, memory pool and
streams (``AcceleratorDevice.new_graph`` / ``capture`` / ``graph_pool``), and the attention backend's part
(:class:`GraphAttention`): the dtype of its slot and block-table buffers, the fixed metadata a captured step reads,
and what must be refreshed before each replay — nothing for the Triton kernels (``engine.worker.cuda_graphs``),
the context lengths of torch-npu's paged attention, which it reads on the host (``engine.worker.npu_graphs``).

Only a pure-decode step (one token per row) whose batch fits a bucket and whose longest sequence is at most
``max_seq_len_to_capture`` is replayed; any other step runs eagerly. Graphs are captured on CUDA (with the Triton
attention backend) and on the NPU, on a single-rank engine (no tensor or pipeline parallel collectives inside a
graph), without LoRA (its per-step adapter indices are host state) and for models without mixture-of-experts,
latent-attention, sliding-window or soft-capped layers (each picks its path from host values every step).
``--enforce-eager`` turns them off.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.device.accelerator import AcceleratorDevice

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.device import Device
    from engine.models import CausalLM, ModelConfig

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 up to 512.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))
# The devices that capture decode graphs.
GRAPH_DEVICES = ("cuda", "npu")

# Runs a forward over the fixed buffers once and returns (a replay of it, the output tensor a replay refills).
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


class GraphAttention(Protocol):
    """An attention backend's part in a decode graph."""

    # dtype of the slot and block-table buffers the backend's kernels read
    index_dtype: torch.dtype

    def metadata(self, graphs: DecodeGraphs, size: int) -> AttentionMetadata:
        """The metadata of a ``size``-row decode step that the captured forward reads: views of ``graphs``'
        buffers, which each step rewrites."""

    def before_replay(self, graphs: DecodeGraphs, size: int, meta: AttentionMetadata) -> None:
        """Refreshes what the captured step of ``size`` rows reads that the buffers do not hold, for the step of
        ``meta`` (its inputs already copied into the buffers)."""


def capture_sizes(sizes: tuple[int, ...] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending: ``sizes`` (None: ``DEFAULT_CAPTURE_SIZES``), each capped at
    ``max_num_seqs`` (a larger batch never comes; the cap itself becomes the largest bucket)."""
    return sorted({min(n, max_num_seqs) for n in (DEFAULT_CAPTURE_SIZES if sizes is None else sizes)})


def bucket(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows, or None (larger than every bucket)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graphs_off_reason(config: EngineConfig, device_name: str, world_size: int,
                      backend: AttentionBackend, model: ModelConfig | None = None) -> str | None:
    """Why decode steps must run eagerly on this rank, or None: capture them."""
    if device_name not in GRAPH_DEVICES:
        return f"decode graphs are captured on CUDA and NPU devices, this is {device_name}"
    if config.enforce_eager:
        return "--enforce-eager"
    if model is not None and (model.moe is not None or model.mla is not None):
        return ("the mixture-of-experts and latent-attention layers read host counts each step (expert groups, "
                "context lengths)")
    if model is not None and (model.sliding_window is not None or model.attn_logit_softcapping is not None):
        return "sliding-window layers pick their path from host context lengths each step"
    if world_size > 1:
        return f"{world_size} ranks: collectives are not captured"
    if config.lora_config is not None:
        return "LoRA selects adapters per step on the host"
    if device_name == "cuda":
        from engine.worker.cuda_graphs import triton_off_reason

        return triton_off_reason(backend)
    from engine.worker.npu_graphs import npu_off_reason

    return npu_off_reason(backend)


def graph_attention(backend: AttentionBackend, rows: int, device: torch.device) -> GraphAttention:
    """The part of ``backend`` in graphs of up to ``rows`` rows (one of the backends ``graphs_off_reason`` lets
    through)."""
    from engine.attention.npu_backend import NpuAttentionBackend

    if isinstance(backend, NpuAttentionBackend):
        from engine.worker.npu_graphs import NpuGraphAttention

        return NpuGraphAttention(backend)
    from engine.worker.cuda_graphs import TritonGraphAttention

    return TritonGraphAttention(backend, rows, device)


def device_recorder(device: AcceleratorDevice) -> Recorder:
    """Captures on ``device``, every graph in one memory pool (largest batch first, so smaller ones reuse it)."""
    pool = device.graph_pool()

    def record(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # A first run on a side stream, as PyTorch asks before capture: kernels compile, lazy state settles.
        side = device.new_stream()
        side.wait_stream(device.current_stream())
        with device.use_stream(side):
            forward()
        device.current_stream().wait_stream(side)
        graph = device.new_graph()
        with device.capture(graph, pool):
            out = forward()
        replay: Callable[[], None] = graph.replay
        return replay, out

    return record


class DecodeGraphs:
    """The captured decode graphs of one model and its caches, and the fixed buffers they read."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, kv_caches: list[torch.Tensor], *,
                 sizes: list[int], max_seq_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        rows = sizes[-1]
        self.width = -(-max_seq_len // block_size)   # block-table columns
        self.attention = graph_attention(backend, rows, device)
        i64, index = torch.int64, self.attention.index_dtype
        self.input_ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.slots = torch.full((rows,), -1, dtype=index, device=device)
        self.seq_lens = torch.zeros(rows, dtype=i64, device=device)
        self.block_tables = torch.zeros(rows, self.width, dtype=index, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def metadata(self, size: int) -> AttentionMetadata:
        """The fixed metadata of a ``size``-row decode step (views of the buffers)."""
        return self.attention.metadata(self, size)

    def capture(self, record: Recorder) -> None:
        """One graph per size, largest first; the buffers stay padding while capturing (nothing is written)."""
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        for size in reversed(self.sizes):
            meta = self.metadata(size)

            def forward(size: int = size, meta: AttentionMetadata = meta) -> torch.Tensor:
                out = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
                assert isinstance(out, torch.Tensor)
                return out

            self.graphs[size] = record(forward)

    def size_for(self, num_tokens: int, meta: AttentionMetadata) -> int | None:
        """The bucket that replays this step, or None: run it eagerly (not a pure decode, a batch larger than
        every bucket, or a sequence longer than ``max_seq_len``)."""
        if meta.num_decodes != meta.num_seqs or num_tokens != meta.num_seqs:
            return None
        if max(meta.seq_lens_host) > self.max_seq_len or meta.block_tables.shape[1] > self.width:
            return None
        return bucket(meta.num_seqs, self.sizes)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | None:
        """The step's final hidden states from the bucket's graph ([num_seqs, hidden], a view of the graph's
        output, valid until the next replay), or None when the step runs eagerly."""
        size = self.size_for(len(input_ids), meta)
        if size is None:
            return None
        n = meta.num_seqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].zero_()
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.attention.before_replay(self, size, meta)
        replay, out = self.graphs[size]
        replay()
        return out[:n]


def capture_decode_graphs(model: CausalLM, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                          config: EngineConfig, device: Device) -> DecodeGraphs:
    """Captures the graphs on ``device`` (the caller checked ``graphs_off_reason``)."""
    assert isinstance(device, AcceleratorDevice), f"{device.name} captures no graphs"
    max_seq_len = min(config.max_seq_len_to_capture, model.config.max_position_embeddings)
    graphs = DecodeGraphs(model, backend, kv_caches, sizes=capture_sizes(config.cuda_graph_sizes, config.max_num_seqs),
                          max_seq_len=max_seq_len, block_size=config.block_size, device=device.torch_device)
    with torch.inference_mode():
        graphs.capture(device_recorder(device))
    device.synchronize()
    logger.info("%s graphs: decode batches of %s rows captured, contexts up to %d tokens", device.name.upper(),
                ", ".join(map(str, graphs.sizes)), max_seq_len)
    return graphs
