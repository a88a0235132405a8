"""What the benchmark sends: synthetic or JSONL prompts with their lengths, and Poisson arrival times."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TokenCounter = Callable[[str], int]

# Common English words that are each exactly one token (with and without a leading space) for the
# default model's tokenizer (SmolLM2), so the word estimate is exact for it and close for most BPEs.
WORDS: tuple[str, ...] = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but have an
they you were had her she there one been all their has would when if more will so no what up can about
out who into them do some could time only than other then its also two may first any like new after
these people see way most made over did many where just well should through work year because each very
back years even much good our those day life how great long own state such still last part world use
make same little under around right place while since before never between three high both another old
small found set few house end thing large point every general early number group form case order home
public give line water system body city family hand side far fact night eye room school week mind power
question service area country local help level view kind light game face food sense story start job short
free true study change open move left word plan name page model paper market program course field test
top care""".split())


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    index: int
    prompt: str
    prompt_len: int  # tokens: exact with a tokenizer, else the word estimate
    output_len: int  # max_tokens (exact when the server is told to ignore EOS)


def approx_token_count(text: str) -> int:
    """~1 token per word; digits count one each, as Llama-family and SmolLM2 tokenizers split them."""
    return sum(len(w) if w.isdigit() else 1 for w in text.split())


def tokenizer_counter(path: str) -> TokenCounter:
    """Exact counts with Sluice's tokenizer of a model (GGUF file or HF dir; "default" = default model)."""
    from engine.text.tokenizer import Tokenizer  # optional: the benchmark also runs without the engine

    if path == "default":
        from engine.config import default_model_path
        path = default_model_path()
    tok = Tokenizer.from_pretrained(path)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def parse_range(text: str) -> tuple[int, int]:
    """``"100:200"`` -> (100, 200) inclusive; ``"128"`` -> (128, 128)."""
    lo, sep, hi = text.partition(":")
    bounds = (int(lo), int(hi) if sep else int(lo))
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"bad length range {text!r}: expected LO:HI with 1 <= LO <= HI")
    return bounds


def _fill(head: str, target: int, rng: random.Random, count: TokenCounter) -> str:
    """``head`` followed by random words so that ``count(text) == target`` where the tokenizer allows."""
    # Draw the words once, then only vary how many are used: a few rounds settle boundary merges.
    pool = [rng.choice(WORDS) for _ in range(max(target, 0) + 16)]
    k = max(target - count(head), 0)
    text = head
    for _ in range(8):
        k = min(max(k, 0), len(pool))
        text = " ".join([head, *pool[:k]]) if k else head
        diff = target - count(text)
        if diff == 0 or (diff > 0 and k == len(pool)) or (diff < 0 and k == 0):
            break
        k += diff
    return text


def synthetic_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], *, seed: int = 0,
                       count: TokenCounter = approx_token_count, first_index: int = 0,
                       shared_prefix_groups: int = 0, shared_prefix_len: int = 0) -> list[RequestSpec]:
    """``num`` prompts, each starting with its index so no two share a prefix by accident.

    With shared-prefix groups, request i belongs to group ``i % groups`` and its prompt is that group's
    prefix (``shared_prefix_len`` tokens, itself starting with the group number) followed by the
    request's own ``input_len`` tokens: this exercises prefix caching.
    """
    if shared_prefix_groups < 0 or shared_prefix_len < 0:
        raise ValueError("shared-prefix groups and length must be >= 0")
    rng = random.Random(seed)
    # The batch number keeps the groups of one sweep step from reusing the cache of an earlier step.
    prefixes = [_fill(f"group {g} of batch {first_index}:", shared_prefix_len, rng, count)
                for g in range(shared_prefix_groups)]
    prefix_lens = [count(p) for p in prefixes]
    specs = []
    for i in range(first_index, first_index + num):
        in_len = rng.randint(*input_len)
        out_len = rng.randint(*output_len)
        if prefixes:
            g = i % shared_prefix_groups
            prompt = _fill(f"{prefixes[g]} {i}", prefix_lens[g] + in_len, rng, count)
        else:
            prompt = _fill(str(i), in_len, rng, count)
        specs.append(RequestSpec(index=i, prompt=prompt, prompt_len=count(prompt), output_len=out_len))
    return specs


def load_dataset(path: str | Path, num: int | None, *, count: TokenCounter = approx_token_count,
                 default_output_len: int = 128) -> list[RequestSpec]:
    """Rows of ``{"prompt": str, "output_len": int}`` (optional ``prompt_len``), the first ``num`` of them."""
    specs: list[RequestSpec] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{line_no}: expected an object with a string 'prompt'")
            prompt = row["prompt"]
            out_len = int(row.get("output_len", default_output_len))
            prompt_len = int(row["prompt_len"]) if "prompt_len" in row else count(prompt)
            specs.append(RequestSpec(index=len(specs), prompt=prompt, prompt_len=prompt_len, output_len=out_len))
            if num is not None and len(specs) == num:
                break
    if num is not None and len(specs) < num:
        raise ValueError(f"{path} has {len(specs)} prompts, fewer than the {num} asked for")
    return specs


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean 1/rate.
    ``rate = inf`` sends everything at once."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if num <= 0:
        return []
    if np.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def split_warmup(specs: Sequence[RequestSpec], warmup: int) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """The first ``warmup`` specs warm the server up; the rest are measured."""
    return list(specs[:warmup]), list(specs[warmup:])
