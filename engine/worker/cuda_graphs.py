"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start.

A decode step of a small batch is bound by kernel launches, not arithmetic: dozens of small kernels per layer,
each a few microseconds of host time. Replaying a captured graph launches them all at once. Each bucket's graph
runs the model's forward over fixed device buffers (token ids, positions, slots, block tables as wide as
``--max-seq-len-to-capture`` allows, sequence lengths); a step copies its inputs into the first rows, the rows
past its batch are padding (slot -1: nothing written; length 0: nothing read, zeros out), and the step takes the
first rows of the graph's output.

Only a pure-decode step (one token per row) whose batch fits a bucket and whose longest sequence is at most
``max_seq_len_to_capture`` is replayed; any other step runs eagerly. Graphs are captured only on CUDA, with the
Triton attention backend (its decode launch depends on no host value), on a single-rank engine (no tensor or
pipeline parallel collectives inside a graph) and without LoRA (its per-step adapter indices are host state).
``--enforce-eager`` turns them off.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models import CausalLM, ModelConfig

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 up to 512.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))

# Runs a forward over the fixed buffers once and returns (a replay of it, the output tensor a replay refills).
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


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
    if device_name != "cuda":
        return f"CUDA graphs are for CUDA devices, this is {device_name}"
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
    try:   # imported here: without triton the engine still runs (eagerly)
        from engine.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        return f"triton is not importable ({e})"
    if not isinstance(backend, TritonAttentionBackend):
        return f"{type(backend).__name__} reads host lengths each step (only the Triton backend is captured)"
    return None


def cuda_recorder(pool: Any) -> Recorder:
    """Captures on CUDA, every graph in one memory ``pool`` (largest batch first, so smaller ones reuse it)."""

    def record(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # A first run on a side stream, as PyTorch asks before capture: kernels compile, lazy state settles.
        stream: Any = torch.cuda.Stream   # untyped in torch's stubs
        side = stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph.replay, out

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
        i64 = torch.int64
        self.input_ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.slots = torch.full((rows,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=i64, device=device)
        self.block_tables = torch.zeros(rows, self.width, dtype=i64, device=device)
        self.query_start = torch.arange(rows + 1, dtype=i64, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def metadata(self, size: int) -> AttentionMetadata:
        """The fixed metadata of a ``size``-row decode step: views of the buffers (host lengths are not read)."""
        from engine.attention.triton_backend import decode_metadata

        meta = AttentionMetadata(slot_mapping=self.slots[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_lens=[1] * size, seq_lens_host=[0] * size,
                                 num_decodes=size, block_size=self.block_size, backend=self.backend)
        decode_metadata(meta, self.query_start[:size + 1])
        return meta

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
        replay, out = self.graphs[size]
        replay()
        return out[:n]


def capture_decode_graphs(model: CausalLM, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                          config: EngineConfig, device: torch.device) -> DecodeGraphs:
    """Captures the graphs on CUDA (the caller checked ``graphs_off_reason``)."""
    max_seq_len = min(config.max_seq_len_to_capture, model.config.max_position_embeddings)
    graphs = DecodeGraphs(model, backend, kv_caches, sizes=capture_sizes(config.cuda_graph_sizes, config.max_num_seqs),
                          max_seq_len=max_seq_len, block_size=config.block_size, device=device)
    with torch.inference_mode():
        graphs.capture(cuda_recorder(torch.cuda.graph_pool_handle()))
    torch.cuda.synchronize(device)
    logger.info("CUDA graphs: decode batches of %s rows captured, contexts up to %d tokens",
                ", ".join(map(str, graphs.sizes)), max_seq_len)
    return graphs
