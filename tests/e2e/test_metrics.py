"""Issue 25's metrics end to end: a real `sluice serve` (default model) whose :8000/metrics carries the engine's
vllm:* series (federated from the engine's --metrics-port), read with prometheus_client's parser and checked
against what the official openai client received; and the Grafana dashboard's every query names one of them."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.e2e.conftest import SHARED_SERVED
from tests.engine.entrypoints.test_inference_gateway_protocol import PROTOCOL, PROTOCOL_BEFORE_2025_11_26
from tests.procs import ROOT, ServeStack

pytestmark = pytest.mark.slow

SERVED = SHARED_SERVED
DASHBOARD = ROOT / "deploy" / "grafana" / "sluice.json"

# Issue 25's names, as vLLM exports them (counters with their _total).
VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total",
    "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:request_success_total", "vllm:cache_config_info",
]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def stack(shared_stack: ServeStack) -> ServeStack:
    """``sluice serve --max-num-seqs 2`` (n-gram speculation on: tests/e2e/conftest.py)."""
    return shared_stack


@pytest.fixture(scope="module")
def client(stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(stack: ServeStack) -> list[Sample]:
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples of this model whose labels include ``labels``."""
    return sum(s.value for s in samples
               if s.name == name and s.labels.get("model_name") == SERVED and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def after_three_requests(stack: ServeStack, client: openai.OpenAI) -> tuple[list[Sample], list[Sample], int]:
    """(scrape before, scrape after, completion tokens the client was told of) around three requests: a
    completion, a chat and a stream."""
    before = scrape(stack)
    received = 0
    r = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert r.usage is not None
    received += r.usage.completion_tokens
    c = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=16, temperature=0)
    assert c.usage is not None
    received += c.usage.completion_tokens
    stream = client.completions.create(model=SERVED, prompt="One, two, three,", max_tokens=9, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    received += usage[-1].completion_tokens
    return before, scrape(stack), received


def test_every_vllm_name_is_on_the_gateway_page_with_model_name(
        after_three_requests: tuple[list[Sample], list[Sample], int]) -> None:
    _, samples, _ = after_three_requests
    for name in VLLM_NAMES:
        found = [s for s in samples if s.name == name or (s.name.startswith(name)
                                                           and s.name[len(name):] in HISTOGRAM_SUFFIXES)]
        assert found, f"{name} is not exported"
        assert all(s.labels.get("model_name") == SERVED and s.labels.get("engine") == "0" for s in found), name
    # The gateway's own series are still there, and it got the engine's page.
    assert any(s.name == "sluice:http_requests_total" for s in samples)
    # The engine's page and the tokenizer service's (its own port, `sluice serve`'s default), both fetched.
    ups = [s for s in samples if s.name == "sluice:metrics_federate_up"]
    assert len(ups) == 2 and all(up.value == 1 for up in ups)
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", up.labels["target"]) for up in ups)
    # The tokenizer service's series, labelled as a tokenizer service, not as an engine: nothing moved here.
    (moved,) = [s for s in samples if s.name == "sluice:requests_migrated_total"]
    assert moved.labels == {"tokenizer": "0"} and moved.value == 0


def test_counters_agree_with_what_the_client_received(
        after_three_requests: tuple[list[Sample], list[Sample], int]) -> None:
    before, after, received = after_three_requests

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert received > 0
    assert grew("vllm:generation_tokens_total") == received
    assert grew("vllm:request_success_total") == 3
    assert grew("vllm:e2e_request_latency_seconds_count") == 3
    assert grew("vllm:time_to_first_token_seconds_count") == 3
    assert grew("vllm:request_generation_tokens_sum") == received
    assert grew("vllm:prompt_tokens_total") > 0 and grew("vllm:iteration_tokens_total_count") > 0
    assert total(after, "vllm:num_requests_running") == 0


def test_waiting_requests_show_while_a_burst_waits(stack: ServeStack, client: openai.OpenAI) -> None:
    """Eight long requests on two seats (--max-num-seqs 2): six wait; once all are done none does."""
    def one(i: int) -> Any:
        return client.completions.create(model=SERVED, prompt=f"Story number {i}:", max_tokens=48, temperature=0,
                                         extra_body={"ignore_eos": True})

    most_waiting = 0.0
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        while not all(f.done() for f in futures):
            samples = scrape(stack)
            most_waiting = max(most_waiting, total(samples, "vllm:num_requests_waiting"))
            assert total(samples, "vllm:num_requests_running") <= 2
            time.sleep(0.1)
        results = [f.result() for f in futures]
    assert all(r.usage.completion_tokens == 48 for r in results)
    assert most_waiting > 0
    samples = scrape(stack)
    assert total(samples, "vllm:num_requests_waiting") == 0 and total(samples, "vllm:num_requests_running") == 0
    assert total(samples, "vllm:request_queue_time_seconds_count") >= 8


def test_the_inference_gateway_protocols_metrics_are_on_the_page(
        after_three_requests: tuple[list[Sample], list[Sample], int]) -> None:
    """What the Gateway API Inference Extension reads (its list and commit: test_inference_gateway_protocol.py),
    with its labels, on the federated page; the LoRA gauge needs --enable-lora (tests/e2e/test_lora.py)."""
    _, samples, _ = after_three_requests
    for name, required in {**PROTOCOL, **PROTOCOL_BEFORE_2025_11_26}.items():
        if name != "vllm:lora_requests_info":
            found = [s for s in samples if s.name == name]
            assert found and all(required.labels <= s.labels.keys() for s in found), name


# ---------------------------------------------------------------- the Grafana dashboard

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are neither functions, keywords, label
    names (inside {} or by/without ()), durations ([]), nor numbers."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)                      # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                     # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = m.group(0)
        if expr[m.end():].lstrip().startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        if m.start() > 0 and (expr[m.start() - 1].isdigit() or expr[m.start() - 1] == "."):
            continue   # an exponent or a unit glued to a number (1e-9)
        names.add(word)
    return names


def test_metric_names_extracts_selectors_only() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket'
            '{model_name="$model_name"}[$__rate_interval]))) / clamp_min(rate(vllm:x_total[5m]), 1e-9)')
    assert metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket", "vllm:x_total"}


def dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"].removeprefix("label_values(").rsplit(",", 1)[0]   # a variable's query
            else:
                yield from dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item)


def test_every_dashboard_query_names_an_exported_metric(
        after_three_requests: tuple[list[Sample], list[Sample], int]) -> None:
    _, samples, _ = after_three_requests
    exported = {s.name for s in samples}
    dashboard = json.loads(Path(DASHBOARD).read_text())
    exprs = list(dashboard_exprs(dashboard))
    assert len(exprs) >= 20
    named: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} names {sorted(names - exported)}, not exported"
        named |= names
    # The panels vLLM's dashboard has: latencies by quantile, throughput, queue, KV, prefix cache, preemptions.
    for needed in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total",
                   "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                   "vllm:num_preemptions_total", "vllm:request_success_total"):
        assert needed in named, needed
