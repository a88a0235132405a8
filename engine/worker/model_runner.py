"""The model runner: the only module that touches the model's tensors.

One step = copy inputs → compute → sample → copy back, each on its own stream
(no-op streams on CPU). Inputs are prepared with numpy into (pinned, where the
device wants it) host staging buffers, so building step N+1 is cheap Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.torch_backend import AttentionMetadata, kv_cache_shape
from engine.device import Device
from engine.models import CausalLM
from engine.core.request import Request
from engine.worker.sampler import Sampler, SamplingRow, make_generator
from engine.core.scheduler import ScheduledRequest, SchedulerOutput

Logprob = tuple[float, dict[int, float]]


@dataclass
class RunnerOutput:
    """Sampled token ids (and logprobs, when asked) per request id."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)


def child_request_id(parent_id: str, index: int) -> str:
    """The id of the ``index``-th sequence of an ``n > 1`` request (index 0 keeps the parent id)."""
    return parent_id if index == 0 else f"{parent_id}#{index}"


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
    ) -> None:
        self.model = model
        self.device = device
        self.sampler = sampler
        self.block_size = block_size
        self.num_blocks = num_blocks
        cfg = model.config
        shape = kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [device.allocate_kv_cache(shape, dtype) for _ in range(cfg.num_layers)]
        self.backend = device.attention_backend()
        self.copy_stream = device.new_stream()
        self.compute_stream = device.new_stream()
        self.d2h_stream = device.new_stream()
        self.inputs_ready = device.new_event()
        self.generators: dict[str, torch.Generator] = {}
        self.last_prepare_s = 0.0  # host time spent building the last step's inputs
        pin = device.pin_memory
        self._input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)
        self._positions = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)
        self._slots = torch.zeros(max_num_batched_tokens, dtype=torch.int64, pin_memory=pin)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_caches[0][:, 0].numel() * self.kv_caches[0].element_size() * len(self.kv_caches)

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators) of requests that ended."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        scheduled = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first, stable
        if not scheduled:
            return RunnerOutput()
        dev = self.device
        t0 = time.perf_counter()
        with dev.use_stream(self.copy_stream):
            input_ids, positions, meta, sample_idx = self._prepare(scheduled)
            self.last_prepare_s = time.perf_counter() - t0
            dev.record_event(self.inputs_ready, self.copy_stream)
        dev.wait_event(self.compute_stream, self.inputs_ready)
        with dev.use_stream(self.compute_stream):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            sampling = [s for s in scheduled if s.start + s.num_new_tokens == s.request.num_tokens]
            if not sampling:
                return RunnerOutput()
            idx = torch.tensor(sample_idx, dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx), dtype=None)
            row_of, rows, owners = self._sampling_rows(sampling)
            if len(row_of) != len(sampling):
                logits = logits.index_select(0, torch.tensor(row_of, device=logits.device))
            result = self.sampler(logits, rows)
        # The sampler hands back host lists; on accelerators that read is the copy back.
        runner_out = RunnerOutput()
        for (rid, _child), token, lp in zip(owners, result.token_ids, result.logprobs):
            runner_out.sampled.setdefault(rid, []).append(token)
            if lp is not None:
                runner_out.logprobs.setdefault(rid, []).append(lp)
        return runner_out

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
            if end == req.num_tokens:
                sample_idx.append(offset - 1)
        torch_dev = self.device.torch_device
        input_ids = self._input_ids[:num_tokens].to(torch_dev, non_blocking=True)
        positions = self._positions[:num_tokens].to(torch_dev, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=self._slots[:num_tokens].to(torch_dev, non_blocking=True),
            block_tables=torch.from_numpy(block_tables).to(torch_dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(torch_dev, non_blocking=True),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
            block_size=bs,
            backend=self.backend,
        )
        return input_ids, positions, meta, sample_idx

    def _sampling_rows(self, sampling: list[ScheduledRequest]
                       ) -> tuple[list[int], list[SamplingRow], list[tuple[str, int]]]:
        """One sampler row per sequence; a first sample of an ``n > 1`` request fans out to n rows."""
        row_of: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[tuple[str, int]] = []
        for i, s in enumerate(sampling):
            req = s.request
            params = req.sampling_params
            fan_out = params.n if (params.n > 1 and req.parent_id is None and not req.output_token_ids) else 1
            for child in range(fan_out):
                rid = child_request_id(req.request_id, child)
                row_of.append(i)
                rows.append(SamplingRow(params=params, prompt_token_ids=req.prompt_token_ids,
                                        output_token_ids=req.output_token_ids,
                                        generator=self._generator(rid, req, child)))
                owners.append((req.request_id, child))
        return row_of, rows, owners

    def _generator(self, rid: str, req: Request, child: int) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(rid)
        if gen is None:
            gen = self.generators[rid] = make_generator(seed + child, self.device.torch_device)
        return gen

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        dev = self.device.torch_device
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=dev)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=dev)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]
