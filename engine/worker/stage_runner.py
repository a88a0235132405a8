"""One rank's part of a step's forward pass, the same code on the driver and on every follower rank.

Given a step's :class:`~engine.worker.step_inputs.StepInputs`, a rank copies the step's blocks in the layers it
holds, runs its pipeline stage over each micro-batch in order (stage 0 embeds; a later stage receives the
previous stage's ``(x, residual)``; each stage sends on without waiting, so stage 0 computes micro-batch k + 1
while stage 1 computes k), and the last stage sends the final hidden states of the rows that need logits back to
stage 0. Stage 0's tensor ranks then make one ``compute_logits`` call (a vocab-parallel gather) per entry of
``logits_rows``, in order. Because every rank derives its collectives from the same inputs, they pair up.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata, CacheMemory, StepLayout
from engine.worker.multimodal import EncoderRunner
from engine.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.device import Device
    from engine.models import CausalLM
    from engine.worker.graphs import DecodeGraphs

# A step's device inputs: token ids, positions, one attention metadata per micro-batch.
StepTensors = tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]


class StageRunner:
    """The model's shard or stage on this rank, with its KV cache (its layers, its KV heads)."""

    def __init__(self, model: CausalLM, device: Device, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, activation_dtype: torch.dtype, cache_memory: CacheMemory | None = None) -> None:
        """``cache_memory``: where the KV cache is allocated (default: ``device``; a KV transport's own memory for
        a prefill engine whose decode engines read it)."""
        self.model = model
        self.parallel = model.parallel
        self.device = device
        self.activation_dtype = activation_dtype   # of the hidden states passed between stages
        self.backend = device.attention_backend()  # owns the cache's layout, allocation and step metadata
        self.kv_caches = self.backend.allocate_kv_caches(cache_memory or device, model.num_local_layers, num_blocks,
                                                         block_size, model.num_local_kv_heads, model.kv_head_dim,
                                                         dtype, model.kv_planes)
        self.graphs: DecodeGraphs | None = None   # decode steps' CUDA / NPU graphs (the worker captures them)
        # Every token's final hidden states of the last step, kept for a proposer that reads them (MTP; one stage)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # A vision-language model's vision tower and encoder cache (None: a text-only model)
        self.encoder = EncoderRunner(model) if model.config.image_token_id is not None else None  # type: ignore[arg-type]

    def prepare(self, inputs: StepInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor) -> StepTensors:
        """The step's host tensors (the flat arrays of ``inputs``) on the device, and each micro-batch's metadata."""
        dev = self.device.torch_device
        metas = [self.backend.build_metadata(
            StepLayout(slot_mapping=slots[mb.token_start:mb.token_end], block_tables=mb.block_tables,
                       query_lens=mb.query_lens, seq_lens=mb.seq_lens, num_decodes=mb.num_decodes,
                       block_size=inputs.block_size), dev) for mb in inputs.micro_batches]
        if inputs.mrope_positions is not None:
            positions = torch.from_numpy(inputs.mrope_positions)
        return input_ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True), metas

    def run(self, inputs: StepInputs, tensors: StepTensors) -> tuple[torch.Tensor | None, np.ndarray]:
        """Block copies, then this stage over every micro-batch. Returns, on stage 0, the final hidden states of
        the rows ``inputs.hidden_rows()`` (which it also returns), in that order; None on other stages."""
        if inputs.block_copies:
            self.backend.copy_blocks(self.kv_caches, inputs.block_copies)
        needed = inputs.hidden_rows()
        if not inputs.micro_batches:
            return None, needed
        input_ids, positions, metas = tensors
        if self.parallel.pp_size == 1:
            hidden = None
            if inputs.mm_spans and self.encoder is not None:   # images: their rows' embeddings replace the ids'
                hidden = self.model(input_ids, positions, self.kv_caches, metas[0],
                                    mm_embeds=self.encoder.embeddings(inputs.mm_spans, input_ids.device))
            elif self.graphs is not None:
                # M-RoPE positions [3, T]: a graph-captured step has text tokens only, whose three are equal
                hidden = self.graphs.forward(input_ids, positions[0] if positions.dim() == 2 else positions, metas[0])
            if hidden is None:   # not a captured decode step
                hidden = self.model(input_ids, positions, self.kv_caches, metas[0])
            if self.keep_hidden:
                self.last_hidden = hidden
            if len(needed) < len(hidden):
                hidden = hidden.index_select(0, torch.from_numpy(needed).to(hidden.device))
            return hidden, needed
        return self._run_stages(inputs, input_ids, positions, metas, needed), needed

    def _run_stages(self, inputs: StepInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                    metas: list[AttentionMetadata], needed: np.ndarray) -> torch.Tensor | None:
        par = self.parallel
        dev = input_ids.device
        width = self.model.config.hidden_size
        last = par.pp_size - 1
        pending: list[tuple[list[Any], list[torch.Tensor]]] = []   # sends in flight, their tensors kept alive
        returned: list[int] = []   # rows of each micro-batch that the last stage sends back to stage 0
        for mb, meta in zip(inputs.micro_batches, metas, strict=True):
            lo, hi = mb.token_start, mb.token_end
            rows = needed[(needed >= lo) & (needed < hi)] - lo
            returned.append(len(rows))
            if par.is_first_stage:
                out = self.model(input_ids[lo:hi], positions[lo:hi], self.kv_caches, meta)
                sent = list(out)
                to = 1
            else:
                x, residual = par.recv([(hi - lo, width)] * 2, self.activation_dtype, dev, par.pp_rank - 1)
                out = self.model(input_ids[lo:hi], positions[lo:hi], self.kv_caches, meta, intermediate=(x, residual))
                if par.is_last_stage:
                    sent = [out.index_select(0, torch.from_numpy(rows).to(dev))] if len(rows) else []
                    to = 0
                else:
                    sent = list(out)
                    to = par.pp_rank + 1
            if sent:
                pending.append((par.send(sent, to), sent))
        hidden: torch.Tensor | None = None
        if par.is_first_stage:
            parts = [par.recv([(n, width)], self.activation_dtype, dev, last)[0] for n in returned if n]
            hidden = torch.cat(parts) if parts else torch.empty(0, width, dtype=self.activation_dtype, device=dev)
        for works, _ in pending:
            for work in works:
                work.wait()
        return hidden

    def logits(self, hidden: torch.Tensor, needed: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """``compute_logits`` over the flat ``rows`` (a subset of ``needed``, the rows ``hidden`` holds), in the
        lm_head's dtype: on stage 0, every tensor rank calls it with the same rows (it gathers the vocabulary)."""
        if not np.array_equal(rows, needed):
            hidden = hidden.index_select(0, torch.from_numpy(np.searchsorted(needed, rows)).to(hidden.device))
        return self.model.compute_logits(hidden, dtype=None)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs) -> None:
        """A follower rank's step: the forward pass and, on stage 0, the logits gathers the driver makes."""
        tensors = self.prepare(inputs, torch.from_numpy(inputs.input_ids), torch.from_numpy(inputs.positions),
                               torch.from_numpy(inputs.slot_mapping))
        hidden, needed = self.run(inputs, tensors)
        if hidden is not None:
            for rows in inputs.logits_rows:
                self.logits(hidden, needed, rows)
