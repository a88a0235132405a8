"""The model runner: the only module that touches the model's tensors.

One step = copy inputs → compute → sample → copy back, each on its own stream
(no-op streams on CPU). Inputs are prepared with numpy into (pinned, where the
device wants it) host staging buffers, so building step N+1 is cheap Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata, StepLayout
from engine.device import Device
from engine.models import CausalLM
from engine.worker.lora_manager import LoRAManager
from engine.worker.sampler import Sampler, SamplingRow, make_generator
from engine.worker.sampling_ops import compute_logprobs
from engine.worker.structured_output import StructuredOutputs

if TYPE_CHECKING:  # the core's step types, handed down by the executor: annotations only
    from engine.core.request import PromptLogprobsChunk, SequenceId
    from engine.core.sampling_params import SamplingParams
    from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

Logprob = tuple[float, dict[int, float]]

# Prompt positions whose full-vocabulary logits exist at once when computing prompt logprobs: bounds that
# memory (512 x a 150k vocabulary x 4 bytes = 300 MB) whatever the chunk's length.
PROMPT_LOGITS_ROWS = 512


@dataclass
class RunnerOutput:
    """Sampled token ids (and logprobs, when asked) per sequence; a beam's proposals instead of a sample."""

    sampled: dict[SequenceId, list[int]] = field(default_factory=dict)
    logprobs: dict[SequenceId, list[Logprob]] = field(default_factory=dict)
    # Beam search: (token ids, logprobs) of each beam's most likely next tokens, most likely first.
    beam_candidates: dict[SequenceId, tuple[list[int], list[float]]] = field(default_factory=dict)
    # Prompt logprobs of this step's chunks, for the sequences whose chunk asked (ScheduledRequest).
    prompt_logprobs: dict[SequenceId, PromptLogprobsChunk] = field(default_factory=dict)
    # Constrained sequences whose grammar is complete with this step's token (they end now), and those whose
    # matcher failed (a step over llguidance's limits).
    grammar_complete: set[SequenceId] = field(default_factory=set)
    grammar_failed: set[SequenceId] = field(default_factory=set)
    # Speculative decoding: the proposed tokens verified for each row that had lookahead slots (0: nothing was
    # proposed); ``sampled`` holds the accepted ones followed by the token the target sampled after them.
    num_draft_tokens: dict[SequenceId, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: Device,
        sampler: Sampler,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        dtype: torch.dtype,
        structured: StructuredOutputs | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # None: LoRA off
        self.structured = structured  # None: the engine was given no vocabulary, requests with a grammar refused
        self.device = device
        self.sampler = sampler
        self.block_size = block_size
        self.num_blocks = num_blocks
        cfg = model.config
        self.backend = device.attention_backend()  # owns the cache's layout, allocation and step metadata
        self.kv_caches = self.backend.allocate_kv_caches(device, cfg.num_layers, num_blocks, block_size,
                                                         cfg.num_kv_heads, cfg.head_dim, dtype)
        self.copy_stream = device.new_stream()
        self.compute_stream = device.new_stream()
        self.d2h_stream = device.new_stream()
        self.inputs_ready = device.new_event()
        self.generators: dict[SequenceId, torch.Generator] = {}  # seeded sequences' own, until they end
        self.last_prepare_s = 0.0  # host time spent building the last step's inputs
        pin = device.pin_memory
        self._input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)
        self._positions = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)
        self._slots = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_caches[0][:, 0].numel() * self.kv_caches[0].element_size() * len(self.kv_caches)

    def release(self, seq_ids: list[SequenceId]) -> None:
        """Forget the per-sequence state (seeded generators, grammar matchers) of sequences that ended."""
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        if self.structured is not None:
            self.structured.release(seq_ids)

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        """``child`` continues from ``parent``'s per-sequence state: its grammar matcher's, when constrained."""
        if self.structured is not None:
            self.structured.fork(parent, child)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        scheduled = out.scheduled  # decodes first: the scheduler's order, which the attention metadata relies on
        if not scheduled:
            return RunnerOutput()
        dev = self.device
        t0 = time.perf_counter()
        with dev.use_stream(self.copy_stream):
            input_ids, positions, meta, sample_idx = self._prepare(scheduled)
            if self.lora is not None:
                self.lora.prepare_step(scheduled)
            self.last_prepare_s = time.perf_counter() - t0
            dev.record_event(self.inputs_ready, self.copy_stream)
        sampling = [s for s in scheduled if s.sample]
        sampled = [s for s in sampling if not s.num_beam_candidates]   # beams get proposals instead
        row_of, rows, owners = self._sampling_rows(sampled)
        # The grammar masks of this step's constrained rows depend only on tokens already sampled: they are
        # filled on the mask thread while the model runs.
        pending = (self.structured.start_masks(owners, [row.params.structured_outputs for row in rows])
                   if self.structured is not None else None)
        dev.wait_event(self.compute_stream, self.inputs_ready)
        with dev.use_stream(self.compute_stream):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            prompt_logprobs = self._prompt_logprobs(scheduled, hidden)
            if not sampling:
                return RunnerOutput(prompt_logprobs=prompt_logprobs)
            idx = torch.tensor(sample_idx, dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx), dtype=None)
            runner_out = RunnerOutput(prompt_logprobs=prompt_logprobs)
            beams = [i for i, s in enumerate(sampling) if s.num_beam_candidates]
            if beams:   # their proposals, not samples; the other rows' logits stay, in order
                _, logits = self._propose(sampling, logits, beams, runner_out)
                if not sampled:
                    return runner_out
            if len(row_of) != len(sampled):
                logits = logits.index_select(0, torch.tensor(row_of, device=logits.device))
            result = self.sampler(logits, rows, pending.result() if pending is not None else None)
        # The sampler hands back host lists; on accelerators that read is the copy back.
        for seq_id, token, lp in zip(owners, result.token_ids, result.logprobs):
            runner_out.sampled[seq_id] = [token]
            if lp is not None:
                runner_out.logprobs[seq_id] = [lp]
        if pending is not None and self.structured is not None:
            runner_out.grammar_complete, runner_out.grammar_failed = self.structured.advance(owners,
                                                                                              result.token_ids)
        return runner_out

    def _propose(self, sampling: list[ScheduledRequest], logits: torch.Tensor, beams: list[int],
                 runner_out: RunnerOutput) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Beam rows get their proposals instead of a sample; returns the other rows and their logits."""
        index = torch.tensor(beams, device=logits.device)
        rows = [SamplingRow(params=sampling[i].request.sampling_params,
                            prompt_token_ids=sampling[i].request.prompt_token_ids,
                            output_token_ids=sampling[i].request.output_token_ids, generator=None) for i in beams]
        num = max(sampling[i].num_beam_candidates for i in beams)
        proposals = self.sampler.beam_candidates(logits.index_select(0, index), rows, num)
        for i, (ids, logprobs) in zip(beams, proposals):
            k = sampling[i].num_beam_candidates
            runner_out.beam_candidates[sampling[i].request.seq_id] = (ids[:k], logprobs[:k])
        others = [i for i in range(len(sampling)) if not sampling[i].num_beam_candidates]
        if others:
            logits = logits.index_select(0, torch.tensor(others, device=logits.device))
        return [sampling[i] for i in others], logits

    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor,
                                                                    AttentionMetadata, list[int]]:
        bs = self.block_size
        query_lens = [s.num_new_tokens for s in scheduled]
        seq_lens = [s.start + s.num_new_tokens for s in scheduled]
        num_tokens = sum(query_lens)
        ids_np = self._input_ids.numpy()
        pos_np = self._positions.numpy()
        slot_np = self._slots.numpy()
        max_blocks = max((n + bs - 1) // bs for n in seq_lens)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
        sample_idx: list[int] = []
        offset = 0
        for row, s in enumerate(scheduled):
            req = s.request
            n = s.num_new_tokens
            end = s.start + n
            table = np.asarray(req.block_ids[: (end + bs - 1) // bs], dtype=np.int64)
            block_tables[row, : len(table)] = table
            if n == 1:
                ids_np[offset] = req.all_token_ids[s.start]
                pos_np[offset] = s.start
                slot_np[offset] = table[s.start // bs] * bs + s.start % bs
            else:
                pos = np.arange(s.start, end, dtype=np.int64)
                ids_np[offset:offset + n] = req.all_token_ids[s.start:end]
                pos_np[offset:offset + n] = pos
                slot_np[offset:offset + n] = table[pos // bs] * bs + pos % bs
            offset += n
            if s.sample:  # the scheduler decided: this chunk ends the known tokens
                sample_idx.append(offset - 1)
        torch_dev = self.device.torch_device
        input_ids = self._input_ids[:num_tokens].to(torch_dev, non_blocking=True)
        positions = self._positions[:num_tokens].to(torch_dev, non_blocking=True)
        layout = StepLayout(slot_mapping=self._slots, block_tables=block_tables, query_lens=query_lens,
                            seq_lens=seq_lens,
                            num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
                            block_size=bs)
        meta = self.backend.build_metadata(layout, torch_dev)
        return input_ids, positions, meta, sample_idx

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor
                         ) -> dict[SequenceId, PromptLogprobsChunk]:
        """Logprobs of the prompt tokens that the positions of each chunk asking for them predict (position p
        predicts token p + 1; the prompt's last position predicts the first output, not a prompt token).

        Only these chunks pay for full-vocabulary logits, PROMPT_LOGITS_ROWS positions at a time, float32 (the
        raw model distribution, as vLLM); only the k + 1 numbers per position are kept."""
        result: dict[SequenceId, PromptLogprobsChunk] = {}
        offset = 0
        for s in scheduled:
            k = s.num_prompt_logprobs
            req = s.request
            end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if k is not None and end > s.start:
                targets = torch.from_numpy(req.all_token_ids[s.start + 1:end + 1].astype(np.int64))
                targets = targets.to(hidden.device)
                parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
                for lo in range(0, end - s.start, PROMPT_LOGITS_ROWS):
                    hi = min(lo + PROMPT_LOGITS_ROWS, end - s.start)
                    logits = self.model.compute_logits(hidden[offset + lo:offset + hi], dtype=torch.float32)
                    logits = logits[:, :self.sampler.vocab_size]   # never a padding column of the output layer
                    parts.append(compute_logprobs(logits, targets[lo:hi], k))
                result[req.seq_id] = (s.start + 1,
                                      torch.cat([p[0] for p in parts]).cpu().numpy(),
                                      torch.cat([p[2] for p in parts]).cpu().numpy(),
                                      torch.cat([p[1] for p in parts]).cpu().numpy())
            offset += s.num_new_tokens
        return result

    def _sampling_rows(self, sampling: list[ScheduledRequest]
                       ) -> tuple[list[int], list[SamplingRow], list[SequenceId]]:
        """One sampler row per sequence of ``ScheduledRequest.sample_seq_ids`` (n rows at the first sample of
        a request with n > 1, all from its one row of logits): (logits row of each, the rows, their sequences)."""
        row_of: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[SequenceId] = []
        for i, s in enumerate(sampling):
            req = s.request
            params = req.sampling_params
            for offset, seq_id in enumerate(s.sample_seq_ids):
                row_of.append(i)
                rows.append(SamplingRow(params=params, prompt_token_ids=req.prompt_token_ids,
                                        output_token_ids=req.output_token_ids,
                                        generator=self._generator(seq_id, params, offset),
                                        cumulative=req.holds_outputs))
                owners.append(seq_id)
        return row_of, rows, owners

    def _generator(self, seq_id: SequenceId, params: SamplingParams, offset: int) -> torch.Generator | None:
        """The sequence's own generator when its request is seeded: seed + its index, as the fork gives it
        (``offset`` is that index at the fork, when the first sequence's params sample for all n)."""
        if params.seed is None:
            return None
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = self.generators[seq_id] = make_generator(params.seed + offset, self.device.torch_device)
        return gen

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.backend.copy_blocks(self.kv_caches, copies)
