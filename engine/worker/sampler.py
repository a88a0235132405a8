"""The batched sampler: one step's logits ``[B, V]`` in, one token id (and logprobs) per row out.

Order of operations, as vLLM: logits → float32 → allowed_token_ids mask → bad words → logit bias → min_tokens mask →
repetition penalty → frequency / presence penalties → structured-output token
masks → a forced token (a spent thinking budget) → greedy rows take the argmax;
sampled rows: temperature → top-k → top-p → min-p → sample. Logprobs
are those of the raw model distribution (vLLM's default ``raw_logprobs``).

Sampling is an exponential race (``argmax(p / E)``) so every row's noise comes
from its own generator: a seeded request samples the same tokens whatever batch
it is in and wherever it sits in it. Rows without a seed share one generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.worker.sampling_ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
    exponential_race,
)

if TYPE_CHECKING:
    from engine.core.sampling_params import SamplingParams
    from engine.worker.structured_output import TokenMasks

# vLLM's _SAMPLING_EPS: a smaller temperature is greedy (dividing by it would overflow).
_GREEDY_TEMPERATURE = 1e-5

# (logprob of the sampled token, {token id: logprob} of the top tokens, most likely first, the sampled token's rank:
# 1 + the tokens more likely than it)
Logprobs = tuple[float, dict[int, float], int]


@dataclass
class SamplingRow:
    """One sequence of the batch: its parameters and the tokens penalties and min_tokens look at."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] | np.ndarray   # the request's int32 buffer, as the core keeps it
    output_token_ids: list[int]
    generator: torch.Generator | None  # the request's seeded generator; None = the sampler's shared one
    # The sampled token's logprob is wanted even without ``params.logprobs`` (best_of ranks by their sum).
    cumulative: bool = False
    # When set, the generator's state after this row's draw is appended (a speculative row rewinds its seeded
    # generator to the last position it keeps).
    states: list[torch.Tensor] | None = None
    # The only token this row may take (the end of a thinking whose budget is spent); None: any.
    forced_token: int | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]               # one per row
    logprobs: list[Logprobs | None]    # per row; None where params.logprobs is None and not row.cumulative
    # The same ids on the device (int64 [rows]): async scheduling feeds them to the next step's inputs there.
    token_tensor: torch.Tensor | None = None


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device the sampler runs on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)  # torch takes [0, 2**64); users send any integer, negatives included
    return generator


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE


def _needs_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _is_plain_greedy(row: SamplingRow) -> bool:
    """True when the row's token is the argmax of the raw logits and nothing else is asked."""
    p = row.params
    return (is_greedy(p) and p.logprobs is None and not row.cumulative and not p.logit_bias
            and p.allowed_token_ids is None and p.bad_words_token_ids is None and not _needs_penalties(p)
            and len(row.output_token_ids) >= p.min_tokens
            and row.forced_token is None)


class Sampler:
    """Turns a step's logits into tokens; holds only the shared generator(s) between steps."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int = 0,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 to_host: Callable[[torch.Tensor], list[int]] | None = None) -> None:
        """``to_host``: how the sampled ids reach the host (the runner's copy on its d2h stream); default
        ``tolist``."""
        self.to_host = to_host if to_host is not None else torch.Tensor.tolist
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        # The device's argmax over float32 or bfloat16 rows (Device.row_argmax), when it has one faster than torch's.
        self._row_argmax = argmax

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        if (self._row_argmax is not None and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
                and x.stride(-1) == 1):
            return self._row_argmax(x)
        return x.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 masks: TokenMasks | None = None) -> SamplerOutput:
        """``masks``: the structured-output masks of the constrained rows (None: no row is constrained)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
        logits = self._trim(logits)
        if masks is None and all(_is_plain_greedy(row) for row in rows):
            ids = self._argmax(logits)
            return SamplerOutput(self.to_host(ids), [None] * len(rows), ids)

        processed = self.process_logits(logits, rows, masks)
        sampled = [i for i, row in enumerate(rows) if not is_greedy(row.params)]
        if len(sampled) == len(rows):
            token_ids = self._sample(processed, rows)
        else:
            token_ids = self._argmax(processed)
            if sampled:
                index = torch.tensor(sampled, device=logits.device)
                chosen = self._sample(processed.index_select(0, index), [rows[i] for i in sampled])
                token_ids.index_copy_(0, index, chosen)
        return SamplerOutput(self.to_host(token_ids), self._logprobs(logits, token_ids, rows), token_ids)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                       masks: TokenMasks | None = None) -> torch.Tensor:
        """Float32 logits after logit bias, min_tokens, penalties, grammar masks and forced tokens: what greedy
        rows take the argmax of.

        Returns a new tensor; the caller's logits are never modified.
        """
        x = self._trim(logits).to(torch.float32, copy=True)
        self._apply_allowed_token_ids(x, rows)
        self._apply_bad_words(x, rows)
        self._apply_logit_bias(x, rows)
        self._apply_min_tokens(x, rows, masks)
        x = self._apply_penalties(x, rows)
        if masks is not None:
            masks.apply_(x)
        forced = [(i, row.forced_token) for i, row in enumerate(rows) if row.forced_token is not None]
        if forced:
            index = torch.tensor([i for i, _ in forced], device=x.device)
            tokens = torch.tensor([t for _, t in forced], device=x.device)
            x[index] = float("-inf")
            x[index, tokens] = 0.0
        return x

    def beam_candidates(self, logits: torch.Tensor, rows: list[SamplingRow], num: int
                        ) -> list[tuple[list[int], list[float]]]:
        """Each beam row's ``num`` most likely next tokens and their logprobs, most likely first.

        As transformers' beam search: log_softmax of the float32 logits, then min_tokens masks the stop
        tokens (after the softmax: the other tokens' logprobs are not renormalised).
        """
        x = torch.log_softmax(self._trim(logits).to(torch.float32), dim=-1)
        self._apply_min_tokens(x, rows, None)
        values, ids = torch.topk(x, min(num, x.shape[1]), dim=-1)
        return list(zip(ids.tolist(), values.tolist()))

    def _trim(self, logits: torch.Tensor) -> torch.Tensor:
        # Some models pad their output layer past the tokenizer's vocabulary: never sample a padding column.
        return logits[:, : self.vocab_size] if logits.shape[1] > self.vocab_size else logits

    @staticmethod
    def _apply_allowed_token_ids(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """A row with ``allowed_token_ids`` keeps only those logits (vLLM masks them before the bias too)."""
        vocab = x.shape[1]
        for i, row in enumerate(rows):
            allowed = row.params.allowed_token_ids
            if allowed is None:
                continue
            keep = torch.tensor([t for t in allowed if 0 <= t < vocab], dtype=torch.long, device=x.device)
            masked = torch.full_like(x[i], float("-inf"))
            masked[keep] = x[i, keep]
            x[i] = masked

    @staticmethod
    def _apply_bad_words(x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Ban the last token of each bad-word sequence whose other tokens are the row's latest output tokens
        (vLLM's ``apply_bad_words``): one scatter for the whole batch."""
        vocab = x.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, row in enumerate(rows):
            outputs = row.output_token_ids
            for ids in row.params.bad_words_token_ids or ():
                prefix = len(ids) - 1
                if prefix <= len(outputs) and (prefix == 0 or outputs[-prefix:] == ids[:-1]) and 0 <= ids[-1] < vocab:
                    row_ids.append(i)
                    token_ids.append(ids[-1])
        if row_ids:
            x[torch.tensor(row_ids, device=x.device), torch.tensor(token_ids, device=x.device)] = float("-inf")

    def _apply_logit_bias(self, x: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = x.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for i, row in enumerate(rows):
            for token, bias in (row.params.logit_bias or {}).items():
                if 0 <= token < vocab:  # validate(vocab_size) rejects the rest; never index out of range
                    row_ids.append(i)
                    token_ids.append(token)
                    biases.append(bias)
        if row_ids:
            index = (torch.tensor(row_ids, device=x.device), torch.tensor(token_ids, device=x.device))
            x.index_put_(index, torch.tensor(biases, dtype=x.dtype, device=x.device), accumulate=True)

    def _apply_min_tokens(self, x: torch.Tensor, rows: list[SamplingRow], masks: TokenMasks | None) -> None:
        # EOS is masked even with ignore_eos (vLLM does too): ignore_eos only stops EOS from
        # finishing the sequence, and before min_tokens nothing may finish it. A grammar that allows
        # nothing but ending wins over min_tokens: masking both would leave the row no token at all.
        vocab = x.shape[1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, row in enumerate(rows):
            if len(row.output_token_ids) < row.params.min_tokens:
                stops = self.eos_token_ids.union(row.params.stop_token_ids)
                if masks is not None and masks.allows_only(i, stops, vocab, x.device):
                    continue
                for token in stops:
                    if 0 <= token < vocab:
                        row_ids.append(i)
                        token_ids.append(token)
        if row_ids:
            x[torch.tensor(row_ids, device=x.device), torch.tensor(token_ids, device=x.device)] = float("-inf")

    def _apply_penalties(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        if not any(_needs_penalties(p) for p in params):
            return x
        # Rows without penalties contribute no tokens; their neutral values are never read.
        prompts = [row.prompt_token_ids if p.repetition_penalty != 1.0 else [] for row, p in zip(rows, params)]
        outputs = [row.output_token_ids if _needs_penalties(p) else [] for row, p in zip(rows, params)]
        generated = self._pairs(outputs, x)
        prompt_rows, prompt_ids = self._pairs(prompts, x)
        seen = (torch.cat([prompt_rows, generated[0]]), torch.cat([prompt_ids, generated[1]]))

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=x.dtype, device=x.device)

        return apply_penalties(x, seen, generated,
                               column([p.repetition_penalty for p in params]),
                               column([p.frequency_penalty for p in params]),
                               column([p.presence_penalty for p in params]))

    @staticmethod
    def _pairs(token_lists: Sequence[Sequence[int] | np.ndarray], like: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) of every token in every row's list, ids outside the vocabulary dropped."""
        lengths = torch.tensor([len(ids) for ids in token_lists], device=like.device)
        # Prompts are int32 arrays (Request's buffer), outputs lists: one C-level concatenation.
        flat: np.ndarray | list[int] = (np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_lists])
                                        if token_lists else [])
        ids = torch.as_tensor(flat, dtype=torch.long).to(like.device)
        rows = torch.repeat_interleave(torch.arange(len(token_lists), device=like.device), lengths)
        keep = (ids >= 0) & (ids < like.shape[1])
        return rows[keep], ids[keep]

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per (non-greedy) row of the processed logits ``x`` (modified in place)."""
        params = [row.params for row in rows]
        vocab = x.shape[1]
        device = x.device
        x.div_(torch.tensor([p.temperature for p in params], dtype=x.dtype, device=device).unsqueeze(1))
        top_k = [vocab if p.top_k is None else min(p.top_k, vocab) for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            x = apply_top_k_top_p(x, torch.tensor(top_k, device=device),
                                  torch.tensor(top_p, dtype=x.dtype, device=device))
        if any(p.min_p > 0.0 for p in params):
            x = apply_min_p(x, torch.tensor([p.min_p for p in params], dtype=x.dtype, device=device))
        return exponential_race(x.softmax(dim=-1), self._noise(rows, x))

    def _noise(self, rows: list[SamplingRow], like: torch.Tensor) -> torch.Tensor:
        """Exponential(1) noise ``[B, V]``: seeded rows from their own generator, the rest from the shared one.

        Drawn as ``-log(U)``, U uniform: the same distribution as ``exponential_``, four
        times faster on CPU. A seeded row draws exactly V numbers per sampled step,
        whatever else is in the batch.
        """
        noise = torch.empty_like(like)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        shared = self._shared_generator(like.device) if unseeded else None
        if len(unseeded) == len(rows):
            noise.uniform_(generator=shared)
        elif unseeded:
            block = torch.empty((len(unseeded), like.shape[1]), dtype=like.dtype, device=like.device)
            noise[torch.tensor(unseeded, device=like.device)] = block.uniform_(generator=shared)
        for i, row in enumerate(rows):
            generator = row.generator
            if generator is None:
                continue
            if generator.device == noise.device:
                noise[i].uniform_(generator=generator)
            else:  # a generator made for another device: draw there, same numbers
                draw = torch.empty(like.shape[1], dtype=like.dtype, device=generator.device)
                noise[i].copy_(draw.uniform_(generator=generator))
            if row.states is not None:
                row.states.append(generator.get_state())
        return noise.log_().neg_()

    def skip_draws(self, generator: torch.Generator, num_steps: int) -> None:
        """Advance a seeded generator past ``num_steps`` sampled steps, as :meth:`_noise` draws them (V float32
        numbers each): a request resumed after that many outputs (request migration) then draws what it would have
        drawn had it sampled them here."""
        draw = torch.empty(self.vocab_size, dtype=torch.float32, device=generator.device)
        for _ in range(num_steps):
            draw.uniform_(generator=generator)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = self._shared_generators[device] = make_generator(self.seed, device)
        return generator

    def _logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                  rows: list[SamplingRow]) -> list[Logprobs | None]:
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None or row.cumulative]
        result: list[Logprobs | None] = [None] * len(rows)
        if not wanted:
            return result
        index = torch.tensor(wanted, device=logits.device)
        num_top = max(rows[i].params.logprobs or 0 for i in wanted)
        sampled, top_logprobs, top_ids, ranks = compute_logprobs(
            logits.index_select(0, index), token_ids.index_select(0, index), num_top)
        sampled_list, top_lp_list, top_id_list = sampled.tolist(), top_logprobs.tolist(), top_ids.tolist()
        rank_list = ranks.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs or 0
            result[i] = (sampled_list[j], dict(zip(top_id_list[j][:n], top_lp_list[j][:n])), rank_list[j])
        return result
