"""What every rank of a replica needs to run one step's forward pass: the driver lays it out, the others follow.

The driver (rank 0, in the engine process) holds the requests, prepares the flat inputs from the scheduler's
output, proposes speculative tokens and samples; the other ranks hold no request state. Each step they receive a
:class:`StepInputs` (``engine.executor.message`` is its wire schema), run their shard or stage of the model over
it, and take part in the same collectives in the same order: one tensor-parallel logits gather per entry of
``logits_rows``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.worker.multimodal import MultiModalSpan


@dataclass
class MicroBatch:
    """A contiguous run of the step's sequences, ``[token_start, token_end)`` of the flat arrays, with its own
    attention layout (``StepLayout`` without the slots, which are the flat arrays' slice). One per step without
    pipeline parallelism; pipeline stages pass micro-batches on while they compute the next."""

    token_start: int
    token_end: int
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    block_tables: np.ndarray   # int64 [num_seqs, max_blocks], padded with 0


@dataclass
class StepInputs:
    """One step's forward pass, for every rank."""

    input_ids: np.ndarray      # int64 [num_tokens]
    positions: np.ndarray      # int64 [num_tokens]
    slot_mapping: np.ndarray   # int64 [num_tokens]
    block_size: int
    micro_batches: list[MicroBatch]
    # Copy-on-write block copies (src, dst) to do before the forward pass, in every layer this rank holds.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Flat hidden-state rows of each ``compute_logits`` call the driver makes, in order (prompt-logprob chunks,
    # then the sampled rows): the tensor ranks of stage 0 gather the vocab-parallel logits with it.
    logits_rows: list[np.ndarray] = field(default_factory=list)
    # The image placeholder rows this step covers and their images (the driver's only: vision-language models run
    # on one rank); the stage runner's encoder turns them into the rows' embeddings.
    mm_spans: list[MultiModalSpan] = field(default_factory=list)
    # An M-RoPE model's positions, int64 [3, num_tokens] (``engine.worker.mrope``), given to it in place of
    # ``positions`` (the cache slots still follow ``positions``); None for every other model.
    mrope_positions: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def hidden_rows(self) -> np.ndarray:
        """The flat rows whose final hidden states stage 0 needs (every row of ``logits_rows``), sorted: the last
        pipeline stage sends back only these."""
        if not self.logits_rows:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(self.logits_rows))
