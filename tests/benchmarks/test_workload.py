from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from benchmarks.workload import (
    RequestSpec,
    TokenCounter,
    approx_token_count,
    load_dataset,
    parse_range,
    poisson_arrivals,
    split_warmup,
    synthetic_requests,
    tokenizer_counter,
)


def common_prefix_len(a: list[int] | str, b: list[int] | str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_approx_token_count() -> None:
    assert approx_token_count("12 the quick fox") == 5  # digits one each
    assert approx_token_count("") == 0


def test_synthetic_exact_lengths_and_unique_index_first_prompts() -> None:
    specs = synthetic_requests(20, (50, 50), (16, 16), seed=1, first_index=100)
    assert [s.index for s in specs] == list(range(100, 120))
    for s in specs:
        assert s.prompt.startswith(f"{s.index} ")
        assert s.prompt_len == 50 == approx_token_count(s.prompt)
        assert s.output_len == 16
    assert len({s.prompt for s in specs}) == 20
    # Index first: no two prompts share even their first word.
    assert len({s.prompt.split()[0] for s in specs}) == 20


def test_synthetic_is_seeded() -> None:
    a = synthetic_requests(5, (10, 30), (1, 8), seed=7)
    assert a == synthetic_requests(5, (10, 30), (1, 8), seed=7)
    assert a != synthetic_requests(5, (10, 30), (1, 8), seed=8)


def test_length_ranges() -> None:
    specs = synthetic_requests(200, (10, 30), (1, 8), seed=3)
    ins = {s.prompt_len for s in specs}
    outs = {s.output_len for s in specs}
    assert min(ins) >= 10 and max(ins) <= 30 and len(ins) > 10
    assert outs == set(range(1, 9))
    assert parse_range("100:200") == (100, 200) and parse_range("64") == (64, 64)
    for bad in ("0:5", "9:3", "x"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_shared_prefix_groups_share_their_prefix() -> None:
    specs = synthetic_requests(9, (20, 20), (4, 4), seed=0, shared_prefix_groups=3, shared_prefix_len=40)
    for s in specs:
        assert s.prompt_len == 60
    groups = {g: [s.prompt for s in specs if s.index % 3 == g] for g in range(3)}
    for g, prompts in groups.items():
        assert len(prompts) == 3 and all(p.startswith(f"group {g} of batch 0:") for p in prompts)
        shared = min(common_prefix_len(prompts[0], p) for p in prompts[1:])
        assert approx_token_count(prompts[0][:shared]) >= 40
        # After the prefix each prompt goes on with its own index.
        for p, s in zip(prompts, [s for s in specs if s.index % 3 == g]):
            assert p[shared:].split()[0].startswith(str(s.index)[0])
    # Across groups nothing beyond "group " is shared.
    assert common_prefix_len(groups[0][0], groups[1][0]) == len("group ")
    # A later sweep step (another batch) shares no prefix with this one.
    later = synthetic_requests(3, (20, 20), (4, 4), seed=0, first_index=9, shared_prefix_groups=3,
                               shared_prefix_len=40)
    assert common_prefix_len(later[0].prompt, groups[0][0]) == len("group 0 of batch ")


@pytest.fixture(scope="module")
def default_counter() -> TokenCounter:
    try:
        return tokenizer_counter("default")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"default model tokenizer unavailable: {e}")


def test_exact_lengths_with_the_default_tokenizer(default_counter: TokenCounter) -> None:
    specs = synthetic_requests(10, (5, 200), (1, 1), seed=0, count=default_counter, first_index=995)
    # The word estimate is exact by construction, so with the same seed it gives the drawn targets.
    targets = [t.prompt_len for t in synthetic_requests(10, (5, 200), (1, 1), seed=0, first_index=995)]
    assert len(set(targets)) > 5
    assert [default_counter(s.prompt) for s in specs] == [s.prompt_len for s in specs] == targets


def test_shared_prefix_tokens_with_the_default_tokenizer(default_counter: TokenCounter) -> None:
    from engine.config import default_model_path
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_path())
    specs = synthetic_requests(4, (30, 30), (4, 4), count=default_counter, shared_prefix_groups=2,
                               shared_prefix_len=64)
    ids = [tok.encode(s.prompt, add_special_tokens=False) for s in specs]
    assert [len(i) for i in ids] == [94] * 4
    assert common_prefix_len(ids[0], ids[2]) >= 64 and common_prefix_len(ids[1], ids[3]) >= 64
    assert common_prefix_len(ids[0], ids[1]) < 64


def test_poisson_arrivals() -> None:
    t = poisson_arrivals(4001, 20.0, seed=5)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.05) < 0.05 * 0.05  # within 5 % of 1/rate
    assert abs(gaps.std() - 0.05) < 0.05 * 0.1  # exponential: std == mean
    assert t == poisson_arrivals(4001, 20.0, seed=5) and t != poisson_arrivals(4001, 20.0, seed=6)
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(0, 1.0) == []
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_load_dataset(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "hello there world", "output_len": 5}, {"prompt": "a b", "output_len": 7, "prompt_len": 11},
            {"prompt": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_dataset(path, 2) == [RequestSpec(0, "hello there world", 3, 5), RequestSpec(1, "a b", 11, 7)]
    assert load_dataset(path, None, default_output_len=9)[2] == RequestSpec(2, "x", 1, 9)
    with pytest.raises(ValueError, match="fewer"):
        load_dataset(path, 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt"}) + os.linesep, encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_dataset(bad, 1)


def test_split_warmup() -> None:
    specs = synthetic_requests(5, (8, 8), (2, 2))
    warm, measured = split_warmup(specs, 2)
    assert [s.index for s in warm] == [0, 1] and [s.index for s in measured] == [2, 3, 4]
