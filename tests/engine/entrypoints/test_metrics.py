"""The engine's vllm:* metrics (engine/entrypoints/metrics.py): what each series observes, read back from the
exposition text with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common.procs import free_port
from engine.config import EngineConfig, LoRAConfig, SpeculativeConfig
from engine.core.admission import AdmissionControl
from engine.core.finish_reason import FinishReason
from engine.core.lora_request import LoRARequest
from engine.core.outputs import EngineCoreOutput
from engine.core.request import RequestTimes
from engine.core.sampling_params import SamplingParams
from engine.core.spec_stats import SpecDecodingStats
from engine.entrypoints.metrics import EngineMetrics, build_1_2_5_buckets, serve_metrics

LABELS = {"model_name": "m", "engine": "0"}


class FakeCore:
    """What EngineMetrics reads of a core, set by hand."""

    def __init__(self, *, lora: bool = False, num_spec_tokens: int = 0) -> None:
        spec = SpeculativeConfig(num_speculative_tokens=num_spec_tokens) if num_spec_tokens else None
        self.config = EngineConfig(served_model_name="m", block_size=16,
                                   lora_config=LoRAConfig(max_loras=2) if lora else None, speculative_config=spec)
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.max_model_len = 100
        self.num_blocks = 40
        self.executor = SimpleNamespace(kv_cache_dtype_name="float32")
        self.stats = {"prefix_cache_queries": 100, "prefix_cache_hits": 50, "num_preemptions": 1,
                      "external_prefix_cache_queries": 40, "external_prefix_cache_hits": 8,
                      "prompt_tokens": 30, "generation_tokens": 2, "steps": 3}   # the warm-up's, left out
        self.usage = 0.25
        self.scheduler = SimpleNamespace(num_running=3, num_waiting=2, running=[], waiting=[],
                                         block_manager=SimpleNamespace(usage=lambda: self.usage),
                                         admission=AdmissionControl(None, 2048), kv_transfer=None)

    def scheduler_stats(self) -> dict[str, int]:
        spec = self.spec_stats
        return dict(self.stats) if spec is None else {
            **self.stats, "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens}


def scrape(metrics: EngineMetrics) -> dict[str, list[Sample]]:
    """Every sample of the exposition text, by family name."""
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    (found,) = [s.value for s in samples if s.name == name and s.labels == {**LABELS, **labels}]
    return found


def histogram(samples: list[Sample], name: str) -> tuple[dict[str, float], float, float]:
    """(cumulative count by le, sum, count) of one labelled histogram."""
    buckets = {s.labels["le"]: s.value for s in samples if s.name == f"{name}_bucket"}
    return buckets, value(samples, f"{name}_sum"), value(samples, f"{name}_count")


def times(arrival: float, scheduled: float | None, first: float | None, finished: float,
          generated: int = 0) -> RequestTimes:
    return RequestTimes(arrival, scheduled, first, finished, num_preemptions=0, num_generation_tokens=generated)


def test_stage_histograms_observe_the_request_times() -> None:
    metrics = EngineMetrics(FakeCore())   # type: ignore[arg-type]
    metrics.record_outputs([EngineCoreOutput("a", [7], finish_reason=FinishReason.LENGTH, num_prompt_tokens=12,
                                             request_finished=True,
                                             times=times(100.0, 100.5, 101.5, 104.0, generated=5))])
    # Aborted while waiting: only its end-to-end latency and token counts; no stage it never reached.
    metrics.record_outputs([EngineCoreOutput("b", [], finish_reason=FinishReason.ABORT, num_prompt_tokens=3,
                                             request_finished=True, times=times(200.0, None, None, 200.75))])
    got = scrape(metrics)
    expected = {"vllm:e2e_request_latency_seconds": (4.0 + 0.75, 2),
                "vllm:request_queue_time_seconds": (0.5, 1),
                "vllm:request_prefill_time_seconds": (1.0, 1),
                "vllm:request_decode_time_seconds": (2.5, 1),
                "vllm:request_inference_time_seconds": (3.5, 1),
                "vllm:time_to_first_token_seconds": (1.5, 1),
                "vllm:request_prompt_tokens": (15, 2),
                "vllm:request_generation_tokens": (5, 2)}
    for name, (total, count) in expected.items():
        _, got_sum, got_count = histogram(got[name], name)
        assert (got_sum, got_count) == pytest.approx((total, count)), name
    # Buckets are vLLM's and cumulative; a value equal to a bound is in that bound's bucket (le).
    buckets, _, _ = histogram(got["vllm:e2e_request_latency_seconds"], "vllm:e2e_request_latency_seconds")
    assert list(buckets)[:6] == ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0"] and list(buckets)[-1] == "+Inf"
    assert (buckets["0.5"], buckets["0.8"], buckets["2.5"], buckets["5.0"], buckets["+Inf"]) == (0, 1, 1, 2, 2)
    buckets, _, _ = histogram(got["vllm:request_queue_time_seconds"], "vllm:request_queue_time_seconds")
    assert (buckets["0.3"], buckets["0.5"]) == (0, 1)
    tokens, _, _ = histogram(got["vllm:request_prompt_tokens"], "vllm:request_prompt_tokens")
    assert list(tokens) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]   # up to max_model_len
    assert (tokens["2.0"], tokens["5.0"], tokens["10.0"], tokens["20.0"]) == (0, 1, 1, 2)
    success = got["vllm:request_success"]
    assert value(success, "vllm:request_success_total", finished_reason="length") == 1
    assert value(success, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(success, "vllm:request_success_total", finished_reason="stop") == 0


def test_token_latency_per_delta_prompt_once_per_request_and_finish_reasons() -> None:
    metrics = EngineMetrics(FakeCore())   # type: ignore[arg-type]
    # A request with n=2: each sequence's first tokens start its clock; the prompt counts once.
    metrics.record_outputs([EngineCoreOutput("r", [1], num_prompt_tokens=8, index=0),
                            EngineCoreOutput("r", [2], num_prompt_tokens=8, index=1)], now=10.0)
    metrics.record_outputs([EngineCoreOutput("r", [3], num_prompt_tokens=8, index=0)], now=10.5)
    # Two tokens in one delta (a stream interval): the interval per token.
    metrics.record_outputs([EngineCoreOutput("r", [4, 5], num_prompt_tokens=8, index=1,
                                             finish_reason=FinishReason.EOS)], now=11.5)
    metrics.record_outputs([EngineCoreOutput("r", [6], num_prompt_tokens=8, index=0, finish_reason=FinishReason.STOP,
                                             request_finished=True, times=times(9.0, 9.5, 10.0, 12.0, 6))],
                           now=12.0)
    got = scrape(metrics)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        buckets, total, count = histogram(got[name], name)
        assert (total, count) == pytest.approx((0.5 + 0.75 + 1.5, 3))
        assert (buckets["0.4"], buckets["0.5"], buckets["0.75"], buckets["1.0"], buckets["2.5"]) == (0, 1, 2, 2, 3)
    assert value(got["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == 8
    assert value(got["vllm:request_success"], "vllm:request_success_total", finished_reason="stop") == 2
    assert metrics._last_output == {}   # noqa: SLF001 — ended sequences leave nothing behind


def test_gauges_and_counters_read_from_the_core_at_scrape_time() -> None:
    core = FakeCore()
    metrics = EngineMetrics(core)   # type: ignore[arg-type]
    core.stats.update(prefix_cache_queries=164, prefix_cache_hits=82, num_preemptions=4, generation_tokens=42)
    metrics.record_step(33)
    metrics.record_step(1)
    metrics.record_admitted(SamplingParams(n=2, max_tokens=20))
    got = scrape(metrics)
    assert value(got["vllm:num_requests_running"], "vllm:num_requests_running") == 3
    assert value(got["vllm:num_requests_waiting"], "vllm:num_requests_waiting") == 2
    assert value(got["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == 0.25
    # Counted from when the metrics were made: the warm-up before is not in them.
    assert value(got["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total") == 64
    assert value(got["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") == 32
    assert value(got["vllm:num_preemptions"], "vllm:num_preemptions_total") == 3
    assert value(got["vllm:generation_tokens"], "vllm:generation_tokens_total") == 40
    buckets, total, count = histogram(got["vllm:iteration_tokens_total"], "vllm:iteration_tokens_total")
    assert (buckets["1.0"], buckets["32.0"], buckets["64.0"], total, count) == (1, 1, 2, 34, 2)
    assert histogram(got["vllm:request_params_n"], "vllm:request_params_n")[1:] == (2, 1)
    assert histogram(got["vllm:request_params_max_tokens"], "vllm:request_params_max_tokens")[1:] == (20, 1)
    (info,) = got["vllm:cache_config_info"]
    assert info.value == 1 and {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "cache_dtype")} == {
        "block_size": "16", "num_gpu_blocks": "40", "cache_dtype": "float32"}
    assert "vllm:lora_requests_info" not in got   # LoRA off
    core.usage = 0.5   # a gauge is read at each scrape
    assert value(scrape(metrics)["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == 0.5


def test_lora_requests_info_names_the_running_and_waiting_adapters() -> None:
    core = FakeCore(lora=True)

    def seq(name: str | None) -> Any:
        return SimpleNamespace(lora_request=None if name is None else LoRARequest(name, 1, "/x"))

    core.scheduler.running = [seq("b"), seq("a"), seq(None), seq("a")]
    core.scheduler.waiting = [seq("c")]
    (info,) = scrape(EngineMetrics(core))["vllm:lora_requests_info"]   # type: ignore[arg-type]
    assert info.labels == {"max_lora": "2", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert info.value > 1e9   # the scrape's time, as vLLM sets it


def test_spec_decode_counters_count_the_drafts_after_warm_up() -> None:
    core = FakeCore(num_spec_tokens=3)
    assert core.spec_stats is not None
    core.spec_stats.observe(3, 3)   # the warm-up's, left out
    metrics = EngineMetrics(core)   # type: ignore[arg-type]
    for drafted, accepted in ((3, 2), (3, 0), (2, 2), (1, 1)):
        core.spec_stats.observe(drafted, accepted)
    got = scrape(metrics)
    assert value(got["vllm:spec_decode_num_drafts"], "vllm:spec_decode_num_drafts_total") == 4
    assert value(got["vllm:spec_decode_num_draft_tokens"], "vllm:spec_decode_num_draft_tokens_total") == 9
    assert value(got["vllm:spec_decode_num_accepted_tokens"], "vllm:spec_decode_num_accepted_tokens_total") == 5
    per_pos = got["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert [value(per_pos, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(3)] == [3, 2, 0]


def test_no_spec_decode_series_when_speculation_is_off() -> None:
    assert not any(name.startswith("vllm:spec_decode") for name in scrape(EngineMetrics(FakeCore())))  # type: ignore[arg-type]


def test_build_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_metrics_endpoint_serves_the_registry_and_refuses_a_port_in_use() -> None:
    port = free_port()
    registry, server = serve_metrics("127.0.0.1", port)
    try:
        registry.register(EngineMetrics(FakeCore()))   # type: ignore[arg-type]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            names = {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert {"vllm:num_requests_waiting", "vllm:e2e_request_latency_seconds"} <= names
        with pytest.raises(OSError, match=f"--metrics-port {port}: cannot listen"):
            serve_metrics("127.0.0.1", port)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_async_engine_counts_what_its_requests_generated() -> None:
    """A real core behind AsyncEngine: the counters agree with the outputs the callers got."""
    from engine.core.engine_core import EngineCore
    from engine.entrypoints.async_engine import AsyncEngine
    from engine.entrypoints.grpc_servicer import warm_up

    def build() -> EngineCore:
        core = EngineCore(EngineConfig(dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1))
        warm_up(core)
        return core

    async def run() -> tuple[AsyncEngine, list[list[EngineCoreOutput]]]:
        engine = await AsyncEngine.launch(build, collect_metrics=True)

        async def one(rid: str, params: SamplingParams) -> list[EngineCoreOutput]:
            return [out async for out in engine.generate(rid, [1, 2, 3, 4, 5], params)]

        got = await asyncio.gather(one("a", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
                                   one("b", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2)))
        return engine, list(got)

    engine, results = asyncio.run(run())
    try:
        assert engine.metrics is not None
        got = scrape(engine.metrics)
    finally:
        engine.shutdown()
    generated = sum(len(out.new_token_ids) for outs in results for out in outs)
    assert generated == 6 + 2 * 3
    labels = {"model_name": EngineConfig().model_name, "engine": "0"}

    def val(family: str, name: str, **extra: str) -> float:
        (found,) = [s.value for s in got[family] if s.name == name and s.labels == {**labels, **extra}]
        return found

    assert val("vllm:generation_tokens", "vllm:generation_tokens_total") == generated   # warm-up left out
    assert val("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 2 * 5
    assert val("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    assert val("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    assert val("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
    assert val("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == generated
    # Every delta after a sequence's first is one inter-token observation.
    deltas = sum(1 for outs in results for out in outs if out.new_token_ids)
    assert val("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == deltas - 3
    assert val("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") >= 6
    assert val("vllm:num_requests_running", "vllm:num_requests_running") == 0


def test_the_engine_cli_still_loads_no_torch_before_main() -> None:
    """The metrics flags' module is imported by the engine CLI, which sets OpenMP's defaults before torch loads."""
    import subprocess
    import sys

    from tests.procs import ROOT

    out = subprocess.run([sys.executable, "-c", "import sys, engine.entrypoints.cli; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_pooling_request_counts_its_prompt_tokens_once() -> None:
    metrics = EngineMetrics(FakeCore())   # type: ignore[arg-type]
    metrics.record_outputs([EngineCoreOutput("e", [], finish_reason=FinishReason.STOP, num_prompt_tokens=9,
                                             request_finished=True, pooled=torch.ones(4),
                                             times=times(1.0, 1.5, None, 2.0))])
    # Aborted before its forward: no pooled output, nothing processed.
    metrics.record_outputs([EngineCoreOutput("f", [], finish_reason=FinishReason.ABORT, num_prompt_tokens=5,
                                             request_finished=True, times=times(3.0, None, None, 3.5))])
    got = scrape(metrics)
    assert value(got["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == 9


def test_refusals_are_counted_by_reason() -> None:
    core = FakeCore()
    core.scheduler.admission.refused.update(queue_full=2, first_token_wait=5)
    samples = scrape(EngineMetrics(core))["sluice:requests_refused"]   # type: ignore[arg-type]
    assert value(samples, "sluice:requests_refused_total", reason="queue_full") == 2
    assert value(samples, "sluice:requests_refused_total", reason="first_token_wait") == 5
