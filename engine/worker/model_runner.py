"""The driver's model runner: each step's inputs in, sampled tokens out (the model itself runs in StageRunner).

One step = copy inputs → compute → sample → copy back, each on its own stream
(no-op streams on CPU). Inputs are prepared with numpy into (pinned, where the
device wants it) host staging buffers, so building step N+1 is cheap Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from engine.worker.input_layout import lay_out, split_rows
from engine.worker.kv_pull import RemoteKVWorker
from engine.worker.kv_transfer import KVTransferWorker
from engine.worker.lora_manager import LoRAManager
from engine.worker.mrope import GridOf, MRopeModel, step_positions
from engine.worker.multi_step import LookaheadLayout
from engine.worker.multimodal import plan_spans
from engine.worker.sampler import Sampler, SamplingRow, is_greedy, make_generator
from engine.worker.sampling_ops import compute_logprobs
from engine.worker.spec_decode import Proposer
from engine.worker.stage_runner import StageRunner
from engine.worker.step_inputs import MicroBatch, StepInputs
from engine.worker.structured_output import PendingMasks, StructuredOutputs
from engine.worker.thinking import ThinkingTracker

if TYPE_CHECKING:  # the core's step types, handed down by the executor: annotations only
    from engine.core.request import PromptLogprobsChunk, SequenceId
    from engine.core.sampling_params import SamplingParams, StructuredOutputsParams
    from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

Logprob = tuple[float, dict[int, float], int]  # (logprob, top tokens' logprobs, rank): the sampler's

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
    # KV offload: {load job id: blocks copied in intact} of the loads that ended this step (KVTransferWorker).
    kv_loads: dict[int, int] = field(default_factory=dict)
    # Pooling runner: each pooling request's output rows, float32 [rows, row_size] on the host.
    pooled: dict[SequenceId, torch.Tensor] = field(default_factory=dict)


# Flat input positions whose ids the previous step samples (async scheduling), and the sequence of each.
FedInputs = tuple[np.ndarray, list["SequenceId"]]


@dataclass
class PreparedStep:
    """A step whose host side is done (``ModelRunner.prepare``), ready for ``ModelRunner.run``."""

    out: SchedulerOutput
    inputs: StepInputs
    buffer: int                        # the staging half its flat arrays live in
    row_tokens: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)   # prompt-logprob logits calls
    draft_of: dict[int, np.ndarray] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)
    sampling: list[ScheduledRequest] = field(default_factory=list)
    sampled: list[ScheduledRequest] = field(default_factory=list)
    row_of: list[int] = field(default_factory=list)
    rows: list[SamplingRow] = field(default_factory=list)
    owners: list[SequenceId] = field(default_factory=list)
    masks: PendingMasks | None = None
    fed: FedInputs | None = None


class ModelRunner:
    """The driver's runner (rank 0): lays out each step's inputs, hands them to the other ranks (``publish``),
    runs its own stage (:class:`StageRunner`) and samples. Speculative proposals, structured outputs, beams and
    the sampler live here only."""

    def __init__(
        self,
        stage: StageRunner,
        sampler: Sampler,
        *,
        block_size: int,
        max_num_batched_tokens: int,
        structured: StructuredOutputs | None = None,
        lora: LoRAManager | None = None,
        proposer: Proposer | None = None,
        publish: Callable[[StepInputs], None] | None = None,
    ) -> None:
        self.stage = stage
        self.proposer = proposer  # None: no speculative decoding
        self.lora = lora  # None: LoRA off
        self.structured = structured  # None: the engine was given no vocabulary, requests with a grammar refused
        self.publish = publish   # sends each step's inputs to the other ranks; None: this is the only rank
        # A KV offload tier's copies, or a decode engine's pulls from prefill engines (the worker sets it).
        self.kv_transfer: KVTransferWorker | RemoteKVWorker | None = None
        self.device = device = stage.device
        self.sampler = sampler
        self.block_size = block_size
        self.num_micro_batches = stage.parallel.pp_size
        self.copy_stream = device.new_stream()
        self.compute_stream = device.new_stream()
        self.d2h_stream = device.new_stream()
        self.inputs_ready = device.new_event()   # a step's inputs are on the device (copy -> compute stream)
        self.step_done = device.new_event()      # a step's forward pass has run (compute -> next step's copies)
        self.sampled_ready = device.new_event()  # its ids are sampled (compute -> d2h stream)
        self.copied = device.new_event()         # they are on the host (d2h stream -> the runner's thread)
        self.generators: dict[SequenceId, torch.Generator] = {}  # seeded sequences' own, until they end
        self.thinking = ThinkingTracker()  # where reasoning sequences stand in their thinking
        self.last_prepare_s = 0.0  # host time spent building the last step's inputs
        # Multi-step decode's further passes move the first pass's layout on (one micro-batch: not pipelined).
        self.lookahead = LookaheadLayout(block_size) if self.num_micro_batches == 1 else None
        # An M-RoPE model's image grids, for each step's 3-D positions (None: positions are 1-D)
        self.mrope_grid: GridOf | None = (cast("MRopeModel", stage.model).mrope_grid
                                          if stage.model.config.mrope_section is not None else None)
        pin = device.pin_memory
        # Double-buffered host staging (ids, positions, slots): a step is prepared into one half while the step
        # before it, staged in the other, may still be copying to the device (async scheduling).
        self._buffers = [tuple(torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)
                               for _ in range(3)) for _ in range(2)]
        self._buffer = 0
        self._d2h_buffer = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)
        # The last step's sampled ids on the device, and each sequence's row in them.
        self._last_sampled: tuple[torch.Tensor, dict[SequenceId, int]] = (torch.empty(0, dtype=torch.int64), {})
        if device.torch_device.type != "cpu":
            sampler.to_host = self._to_host

    def release(self, seq_ids: list[SequenceId]) -> None:
        """Forget the per-sequence state (seeded generators, grammar matchers) of sequences that ended."""
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        self.thinking.release(seq_ids)
        if self.proposer is not None:
            self.proposer.forget(seq_ids)
        if self.structured is not None:
            self.structured.release(seq_ids)

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        """``child`` continues from ``parent``'s per-sequence state: its grammar matcher's, when constrained."""
        if self.structured is not None:
            self.structured.fork(parent, child)
        if self.proposer is not None:
            self.proposer.fork(parent, child)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One step, start to end: ``run(prepare(out))``."""
        return self.run(self.prepare(out))

    @torch.inference_mode()
    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """The host side of a step, on the caller's thread: proposals, the flat inputs (into the staging buffers
        the previous step is not using), the logits plan, the sampling rows and their grammar masks. A decode
        row whose token the step before samples (async scheduling: ``Request.num_pending``) gets it in ``run``,
        from that step's output on the device."""
        if self.proposer is not None:
            if out.block_copies:
                self.proposer.copy_blocks(out.block_copies)
            if out.preempted:
                self.proposer.forget(out.preempted)
        scheduled = out.scheduled  # decodes first: the scheduler's order, which the attention metadata relies on
        if not scheduled:
            none = np.empty(0, dtype=np.int64)
            return PreparedStep(out, StepInputs(none, none, none, self.block_size, [], out.block_copies), self._buffer)
        t0 = time.perf_counter()
        # Speculative decoding: each row with lookahead slots gets its proposal, verified in this forward pass.
        # (A draft model runs every step: its cache follows the target's.)
        drafts = self.proposer.propose(scheduled) if self.proposer is not None else None
        self._buffer ^= 1
        fed: FedInputs | None = None
        if out.pass_index and self.lookahead is not None:   # multi-step: a further pass of the step begun last
            input_ids, positions, slots = self._buffers[self._buffer]
            inputs, sample_idx, row_tokens = self.lookahead.prepare(out, input_ids, positions, slots)
        else:
            inputs, sample_idx, row_tokens, fed = self._prepare(scheduled, drafts, out.block_copies, self._buffer)
            if self.lookahead is not None:
                self.lookahead.begin(out)
        if self.mrope_grid is not None:
            inputs.mrope_positions = step_positions(scheduled, row_tokens, inputs.positions, self.mrope_grid)
        chunks = self._plan_logits(scheduled, row_tokens, sample_idx, inputs)
        sampling = [s for s in scheduled if s.sample]
        # Logits rows of each sampling row: its last token's, or each token's of a row verifying a proposal.
        draft_of = ({id(s): d for s, d in zip(scheduled, drafts) if len(d)} if drafts is not None else {})
        counts = [1 + len(draft_of.get(id(s), ())) for s in sampling]
        sampled = [s for s in sampling if not s.num_beam_candidates]   # beams get proposals instead
        row_of, rows, owners = self._sampling_rows(sampled, draft_of)
        # The grammar masks of this step's constrained rows depend only on tokens already sampled: they are
        # filled on the mask thread while the model runs.
        masks = (self.structured.start_masks(owners, [self._constraint(seq_id, row)
                                                      for seq_id, row in zip(owners, rows)],
                                             [self._grammar_history(row) for row in rows])
                 if self.structured is not None else None)
        self.last_prepare_s = time.perf_counter() - t0
        return PreparedStep(out, inputs, self._buffer, row_tokens, chunks, draft_of, counts, sampling, sampled,
                            row_of, rows, owners, masks, fed)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> RunnerOutput:
        """The device side of a prepared step (async scheduling: on the core's worker thread, in step order):
        adapters, inputs to the device, the forward pass, logits, sampling, the ids back to the host."""
        try:
            transfer = step.out.kv_transfer
            if transfer is None or self.kv_transfer is None:
                return self._run_step(step)
            with self.device.use_stream(self.compute_stream):   # before the step's writes, in its stream order
                kv_loads = self.kv_transfer.execute(transfer)
            out = self._run_step(step)
            out.kv_loads = kv_loads
            return out
        finally:   # the next step's copies (its fed ids, copy-on-write) wait for all of this step's work
            self.device.record_event(self.step_done, self.compute_stream)

    def _run_step(self, step: PreparedStep) -> RunnerOutput:
        scheduled = step.out.scheduled
        if not scheduled:
            if step.inputs.block_copies:   # every rank copies them in its layers
                self._run(step.inputs, step.buffer, None)
            return RunnerOutput()
        if self.lora is not None:
            self.lora.activate([(s.request.lora_request, n) for s, n in zip(scheduled, step.row_tokens)])
        inputs, sampling, sampled, rows, owners = step.inputs, step.sampling, step.sampled, step.rows, step.owners
        dev = self.device
        with dev.use_stream(self.compute_stream):
            hidden, needed = self._run(inputs, step.buffer, step.fed)
            assert hidden is not None, "the driver is on pipeline stage 0"
            # One compute_logits call per entry of inputs.logits_rows, in its order: the other tensor ranks of
            # stage 0 make the same calls to gather the vocabulary.
            prompt_logprobs = self._prompt_logprobs(scheduled, step.chunks, hidden, needed, inputs)
            if not sampling:   # prefill chunks only: every token stands
                self._observe_hidden(scheduled, step.row_tokens, step.row_tokens)
                return RunnerOutput(prompt_logprobs=prompt_logprobs)
            logits = self.stage.logits(hidden, needed, inputs.logits_rows[-1])
            runner_out = RunnerOutput(prompt_logprobs=prompt_logprobs)
            beams = [i for i, s in enumerate(sampling) if s.num_beam_candidates]
            if beams:   # their proposals, not samples; the other rows' logits stay, in order
                logits = self._propose(sampling, logits, beams, step.counts, runner_out)
                if not sampled:   # beams only: no row verifies a proposal
                    self._observe_hidden(scheduled, step.row_tokens, step.row_tokens)
                    return runner_out
            if step.row_of != list(range(logits.shape[0])):
                logits = logits.index_select(0, torch.tensor(step.row_of, device=logits.device))
            result = self.sampler(logits, rows, step.masks.result() if step.masks is not None else None)
        # The next step's pending decode inputs are these ids, on the device (only plain one-token rows are fed).
        if result.token_tensor is not None:
            self._last_sampled = (result.token_tensor, {seq_id: j for j, seq_id in enumerate(owners)})
        draft_of = step.draft_of
        j = 0
        for s in sampled:
            draft = draft_of.get(id(s))
            if draft is not None:   # the proposal's longest prefix that the target's own samples agree with
                seq_id = s.request.seq_id
                tokens, lps = self._accept(draft, result.token_ids[j:j + len(draft) + 1],
                                           result.logprobs[j:j + len(draft) + 1])
                runner_out.sampled[seq_id] = tokens
                self._rewind(rows[j], len(tokens))
                if lps is not None:
                    runner_out.logprobs[seq_id] = lps
                runner_out.num_draft_tokens[seq_id] = len(draft)
                assert self.proposer is not None
                self.proposer.accepted(seq_id, len(tokens) - 1)
                j += len(draft) + 1
                continue
            if s.num_spec_tokens:
                runner_out.num_draft_tokens[s.request.seq_id] = 0
            for _ in s.sample_seq_ids:
                runner_out.sampled[owners[j]] = [result.token_ids[j]]
                lp = result.logprobs[j]
                if lp is not None:
                    runner_out.logprobs[owners[j]] = [lp]
                j += 1
        # A verified row's tokens stand up to its last accepted one.
        self._observe_hidden(scheduled, step.row_tokens,
                             [len(runner_out.sampled[s.request.seq_id]) if id(s) in draft_of else n
                              for s, n in zip(scheduled, step.row_tokens)])
        if step.masks is not None and self.structured is not None:
            # Constrained rows never speculate: one token each, the first of its sequence's list.
            firsts = list(runner_out.sampled)
            runner_out.grammar_complete, runner_out.grammar_failed = self.structured.advance(
                firsts, [runner_out.sampled[seq_id][0] for seq_id in firsts])
        return runner_out

    def _observe_hidden(self, scheduled: list[ScheduledRequest], row_tokens: list[int], kept: list[int]) -> None:
        """A proposer that reads the target's hidden states (MTP) gets every token's that stands (``kept`` of each
        row's ``row_tokens``)."""
        if self.proposer is not None and self.proposer.wants_hidden:
            assert self.stage.last_hidden is not None
            self.proposer.observe(scheduled, row_tokens, kept, self.stage.last_hidden)

    def _run(self, inputs: StepInputs, buffer: int, fed: FedInputs | None) -> tuple[torch.Tensor | None, np.ndarray]:
        """Hand the step to the other ranks, then run this rank's part of it (``StageRunner.run``). ``fed``: the
        flat positions whose ids the previous step sampled, and where in its output they are."""
        dev = self.device
        n = inputs.num_tokens
        ids, pos, slots = self._buffers[buffer]
        src: torch.Tensor | None = None
        if fed is not None:
            last, row_of = self._last_sampled
            src = torch.tensor([row_of[seq_id] for seq_id in fed[1]], device=last.device)
            if self.publish is not None:   # the other ranks read the ids from the message: fill them on the host
                inputs.input_ids[fed[0]] = last.index_select(0, src).cpu().numpy()
        if self.publish is not None:
            self.publish(inputs)
        with dev.use_stream(self.copy_stream):
            # Ordered after the previous step's work: copy-on-write copies and the forward read what it wrote.
            dev.wait_event(self.copy_stream, self.step_done)
            tensors = self.stage.prepare(inputs, ids[:n], pos[:n], slots[:n])
            if fed is not None and src is not None and self.publish is None:
                input_ids = tensors[0]
                input_ids.index_copy_(0, torch.from_numpy(fed[0]).to(input_ids.device, non_blocking=True),
                                      self._last_sampled[0].index_select(0, src.to(input_ids.device)))
            dev.record_event(self.inputs_ready, self.copy_stream)
        dev.wait_event(self.compute_stream, self.inputs_ready)
        with dev.use_stream(self.compute_stream):
            return self.stage.run(inputs, tensors)

    def _to_host(self, ids: torch.Tensor) -> list[int]:
        """Sampled ids to the host: on an accelerator, copied on the d2h stream into pinned memory after the
        compute stream's sampling, then waited for by this (the runner's) thread alone."""
        dev = self.device
        if ids.device.type == "cpu":
            return ids.tolist()
        host = self._d2h_buffer[:len(ids)]
        dev.record_event(self.sampled_ready, self.compute_stream)
        dev.wait_event(self.d2h_stream, self.sampled_ready)
        with dev.use_stream(self.d2h_stream):
            host.copy_(ids, non_blocking=True)
            dev.record_event(self.copied, self.d2h_stream)
        dev.synchronize_event(self.copied)
        return host.tolist()

    @staticmethod
    def _rewind(row: SamplingRow, num_kept: int) -> None:
        """Leave a seeded generator as if only the kept positions had drawn: the noise of a sequence's t-th
        token is then the t-th draw of its seed's stream whatever was proposed, so a seeded request samples
        exactly what it samples without speculation. The draws of discarded positions decided nothing that
        was kept (acceptance at a position reads only that position's draw), so reusing them is sound."""
        if row.generator is not None and row.states is not None and len(row.states) >= num_kept:
            row.generator.set_state(row.states[num_kept - 1])

    @staticmethod
    def _accept(draft: np.ndarray, samples: list[int], lps: list[Logprob | None]
                ) -> tuple[list[int], list[Logprob] | None]:
        """``samples[j]``: the target's token after the row's known tokens and the first ``j`` proposed ones, each
        drawn as it would be without speculation. Proposed token j + 1 stands when the target drew it at j; the
        first disagreement, or the token after a fully accepted proposal, ends the row's tokens. With one-token
        draft distributions this is exactly Leviathan et al.'s rejection sampling (accept with probability
        p(token); a rejection's token is drawn from p without it), so outputs keep the target's distribution;
        greedy rows get the tokens non-speculative decoding gives."""
        n = 1
        while n <= len(draft) and samples[n - 1] == draft[n - 1]:
            n += 1
        kept = [lp for lp in lps[:n] if lp is not None]
        return samples[:n], kept if len(kept) == n else None

    def _propose(self, sampling: list[ScheduledRequest], logits: torch.Tensor, beams: list[int], counts: list[int],
                 runner_out: RunnerOutput) -> torch.Tensor:
        """Beam rows get their proposals instead of a sample; returns the other rows' logits (``counts[i]``: the
        logits rows of sampling row i)."""
        firsts = [0]
        for n in counts:
            firsts.append(firsts[-1] + n)
        index = torch.tensor([firsts[i] for i in beams], device=logits.device)
        rows = [SamplingRow(params=sampling[i].request.sampling_params,
                            prompt_token_ids=sampling[i].request.prompt_token_ids,
                            output_token_ids=sampling[i].request.output_token_ids, generator=None) for i in beams]
        num = max(sampling[i].num_beam_candidates for i in beams)
        proposals = self.sampler.beam_candidates(logits.index_select(0, index), rows, num)
        for i, (ids, logprobs) in zip(beams, proposals):
            k = sampling[i].num_beam_candidates
            runner_out.beam_candidates[sampling[i].request.seq_id] = (ids[:k], logprobs[:k])
        others = [r for i in range(len(sampling)) if not sampling[i].num_beam_candidates
                  for r in range(firsts[i], firsts[i + 1])]
        if others:
            logits = logits.index_select(0, torch.tensor(others, device=logits.device))
        return logits

    def _prepare(self, scheduled: list[ScheduledRequest], drafts: list[np.ndarray] | None,
                 block_copies: list[tuple[int, int]], buffer: int
                 ) -> tuple[StepInputs, list[int], list[int], FedInputs | None]:
        """The step's flat inputs: each row's known tokens, then its proposed ones (``drafts``), in up to one
        micro-batch per pipeline stage. A row verifying a proposal is laid out for attention as one single-token
        row per token, each seeing the cache up to its own position (the keys of all of them are written first),
        so it runs with the decodes. A decode row whose token is pending (async scheduling) gets a 0 there, to be
        fed from the previous step's output. Returns (the inputs, flat logits rows to sample from, tokens of each
        row, the fed positions and their sequences or None)."""
        rows = [(s.request, s.start, s.request.all_token_ids[s.start:s.start + s.num_new_tokens]
                 if drafts is None or not len(drafts[i]) else
                 np.concatenate([s.request.all_token_ids[s.start:s.start + s.num_new_tokens], drafts[i]]),
                 drafts is not None and len(drafts[i]) > 0) for i, s in enumerate(scheduled)]
        fed_at: list[int] = []
        fed_seqs: list[SequenceId] = []
        offset = 0
        for i, s in enumerate(scheduled):
            if s.start + s.num_new_tokens > s.request.num_tokens:   # its last token is the pending one
                request, start, tokens, split = rows[i]
                rows[i] = (request, start, np.append(tokens, 0).astype(tokens.dtype), split)
                fed_at.append(offset + len(tokens))
                fed_seqs.append(request.seq_id)
            offset += len(rows[i][2])
        input_ids, positions, slots = self._buffers[buffer]
        micro_batches: list[MicroBatch] = []
        num_tokens = 0
        for part in split_rows(rows, self.num_micro_batches):
            start = num_tokens
            n, layout, _ = lay_out(part, self.block_size, input_ids[start:], positions[start:], slots[start:])
            num_tokens += n
            micro_batches.append(MicroBatch(start, num_tokens, layout.query_lens, layout.seq_lens,
                                            layout.num_decodes, layout.block_tables))
        sample_idx: list[int] = []
        row_tokens: list[int] = []
        end = 0
        for i, s in enumerate(scheduled):
            n = len(rows[i][2])
            row_tokens.append(n)
            end += n
            if s.sample:  # the scheduler decided: this chunk ends the known tokens
                sample_idx += range(end - n, end) if rows[i][3] else [end - 1]
        inputs = StepInputs(input_ids[:num_tokens].numpy(), positions[:num_tokens].numpy(),
                            slots[:num_tokens].numpy(), self.block_size, micro_batches, block_copies)
        inputs.mm_spans = plan_spans(scheduled, row_tokens)
        fed = (np.asarray(fed_at, dtype=np.int64), fed_seqs) if fed_at else None
        return inputs, sample_idx, row_tokens, fed

    @staticmethod
    def _plan_logits(scheduled: list[ScheduledRequest], row_tokens: list[int], sample_idx: list[int],
                     inputs: StepInputs) -> list[tuple[int, int, int]]:
        """The step's ``compute_logits`` calls, in the order they are made, into ``inputs.logits_rows``: the
        prompt-logprob chunks (PROMPT_LOGITS_ROWS positions at a time, row by row), then the sampled rows.
        Returns each chunk as (scheduled row, first, end) positions within the row's new tokens."""
        chunks: list[tuple[int, int, int]] = []
        offset = 0
        for i, (s, num_row_tokens) in enumerate(zip(scheduled, row_tokens)):
            end = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1) - s.start
            if s.num_prompt_logprobs is not None and end > 0:
                for lo in range(0, end, PROMPT_LOGITS_ROWS):
                    hi = min(lo + PROMPT_LOGITS_ROWS, end)
                    chunks.append((i, lo, hi))
                    inputs.logits_rows.append(np.arange(offset + lo, offset + hi, dtype=np.int64))
            offset += num_row_tokens
        if sample_idx:
            inputs.logits_rows.append(np.asarray(sample_idx, dtype=np.int64))
        return chunks

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], chunks: list[tuple[int, int, int]],
                         hidden: torch.Tensor, needed: np.ndarray, inputs: StepInputs
                         ) -> dict[SequenceId, PromptLogprobsChunk]:
        """Logprobs of the prompt tokens that the positions of each chunk asking for them predict (position p
        predicts token p + 1; the prompt's last position predicts the first output, not a prompt token).

        Only these chunks pay for full-vocabulary logits, PROMPT_LOGITS_ROWS positions at a time (``chunks``:
        the first calls of ``inputs.logits_rows``), float32 (the raw model distribution, as vLLM); only the
        k + 1 numbers (and the token's rank) per position are kept."""
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for (i, lo, hi), rows in zip(chunks, inputs.logits_rows):
            s = scheduled[i]
            targets = torch.from_numpy(s.request.all_token_ids[s.start + lo + 1:s.start + hi + 1].astype(np.int64))
            logits = self.stage.logits(hidden, needed, rows).float()
            logits = logits[:, :self.sampler.vocab_size]   # never a padding column of the output layer
            assert s.num_prompt_logprobs is not None
            parts.setdefault(i, []).append(compute_logprobs(logits, targets.to(logits.device), s.num_prompt_logprobs))
        return {scheduled[i].request.seq_id: (scheduled[i].start + 1,
                                              torch.cat([p[0] for p in ps]).cpu().numpy(),
                                              torch.cat([p[2] for p in ps]).cpu().numpy(),
                                              torch.cat([p[1] for p in ps]).cpu().numpy(),
                                              torch.cat([p[3] for p in ps]).cpu().numpy())
                for i, ps in parts.items()}

    def _sampling_rows(self, sampling: list[ScheduledRequest], draft_of: dict[int, np.ndarray]
                       ) -> tuple[list[int], list[SamplingRow], list[SequenceId]]:
        """One sampler row per sequence of ``ScheduledRequest.sample_seq_ids`` (n rows at the first sample of
        a request with n > 1, all from its one row of logits), and one per token of a row verifying a proposal
        (``draft_of``, by ``id`` of the row): the row after j proposed tokens sees them as its outputs, so
        penalties and min_tokens treat it as they would the step that sampled after them. Returns (logits row
        of each, the rows, their sequences)."""
        row_of: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[SequenceId] = []
        logits_row = 0
        for s in sampling:
            req = s.request
            params = req.sampling_params
            draft = draft_of.get(id(s))
            if draft is not None:
                generator = self._generator(req.seq_id, params, 0, req.num_output_tokens)
                # A seeded row's positions draw from its generator one after another; the step rewinds it to
                # the state after the last position kept (``_rewind``).
                states: list[torch.Tensor] | None = [] if generator is not None else None
                outputs = req.output_token_ids
                extra = draft.tolist()
                for j in range(len(draft) + 1):
                    row_of.append(logits_row + j)
                    rows.append(SamplingRow(params=params, prompt_token_ids=req.prompt_token_ids,
                                            output_token_ids=outputs + extra[:j] if j else outputs,
                                            generator=generator, cumulative=req.holds_outputs, states=states))
                    owners.append(req.seq_id)
                logits_row += len(draft) + 1
                continue
            for offset, seq_id in enumerate(s.sample_seq_ids):
                row_of.append(logits_row)
                forced = (self.thinking.forced_token(seq_id, params.reasoning, req.output_token_ids)
                          if params.reasoning is not None else None)
                rows.append(SamplingRow(params=params, prompt_token_ids=req.prompt_token_ids,
                                        output_token_ids=req.output_token_ids,
                                        generator=self._generator(seq_id, params, offset, req.num_output_tokens),
                                        cumulative=req.holds_outputs, forced_token=forced))
                owners.append(seq_id)
            logits_row += 1
        return row_of, rows, owners

    def _constraint(self, seq_id: SequenceId, row: SamplingRow) -> StructuredOutputsParams | None:
        """The row's grammar, once its thinking (if it thinks) has ended: the thinking is not constrained, and the
        grammar starts from its start with the token after the thinking's end (vLLM's structured outputs with a
        reasoning parser)."""
        spec, reasoning = row.params.structured_outputs, row.params.reasoning
        if spec is None or reasoning is None or self.thinking.has_ended(seq_id, reasoning, row.output_token_ids):
            return spec
        return None

    @staticmethod
    def _grammar_history(row: SamplingRow) -> Sequence[int]:
        """The row's outputs its grammar applies to (those after the thinking's end, when it thinks): fed to a
        matcher made for a sequence that already has them (a request resumed from another engine)."""
        outputs = row.output_token_ids
        reasoning = row.params.reasoning
        if reasoning is None or not outputs:
            return outputs
        try:
            return outputs[outputs.index(reasoning.end_token_id) + 1:]
        except ValueError:
            return ()

    def _generator(self, seq_id: SequenceId, params: SamplingParams, offset: int, num_sampled: int
                   ) -> torch.Generator | None:
        """The sequence's own generator when its request is seeded: seed + its index, as the fork gives it
        (``offset`` is that index at the fork, when the first sequence's params sample for all n). Made for a
        sequence that already has ``num_sampled`` outputs (a request resumed from another engine), it starts past
        their draws: its t-th token is still the t-th draw of its seed's stream."""
        if params.seed is None:
            return None
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = self.generators[seq_id] = make_generator(params.seed + offset, self.device.torch_device)
            if num_sampled and not is_greedy(params):
                self.sampler.skip_draws(gen, num_sampled)
        return gen
