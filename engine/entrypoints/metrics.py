"""The engine's Prometheus metrics under vLLM's names (``vllm:*``), served at ``/metrics`` on ``--metrics-port``.

The engine owns every ``vllm:`` series: queue, KV usage, preemptions and prefix-cache state exist only here, and
a request observed once here is never counted twice when several gateways and tokenizer services front this
engine (``sluice serve``'s gateways append this page to theirs: ``--metrics-federate``). Names, types, label sets
(``model_name``, ``engine``) and buckets are those of vLLM v1 (``vllm/v1/metrics/loggers.py``), so its dashboards
and autoscalers work unchanged; docs/metrics.md lists every series and where it comes from.

The engine thread only writes plain Python numbers (``record_*``, one call per step, a few dict operations per
output); the scrape thread reads them, and the core's own counters and gauges, when Prometheus asks. No lock is
taken on the step's path: each number has one writer, and a scrape that lands mid-step sees it one step early
or late.
"""

from __future__ import annotations

import argparse
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common.procs import port_number
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.request import RequestTimes
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:   # the engine CLI imports this module before torch may load (engine.entrypoints.process)
    from engine.core.engine_core import EngineCore

# vLLM's finished_reason strings: an end-of-sequence token and a stop token id are both "stop".
FINISHED_REASON = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                   FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
# One request's KV pull: milliseconds on one host, up to the transfer timeout across hosts.
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, sized by max_model_len)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    """One label set's bucket counts and sum, written by the engine thread alone (cheaper than
    prometheus_client's, which takes a lock per observation) and turned into a family at scrape time."""

    __slots__ = ("name", "documentation", "bounds", "counts", "sum")

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last one: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1   # le: a value equal to a bound is in its bucket
        self.sum += value

    def family(self, labels: Sequence[str]) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip((*self.bounds, float("inf")), counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.documentation, labels=LABELS)
        family.add_metric(list(labels), buckets, sum_value=total)
        return family


class EngineMetrics(Collector):
    """The ``vllm:`` series of one engine core: a Collector to register with a registry (``serve_metrics``'s).

    Made once the core is built and warmed up: counters count from there, so the warm-up request is not in
    them."""

    def __init__(self, core: EngineCore, engine_index: int = 0) -> None:
        self._core = core
        self._labels = [core.config.model_name, str(engine_index)]
        self._base = core.scheduler_stats()
        if core.scheduler.kv_transfer is not None:   # pulls before now (the warm-up) are not observed either
            core.scheduler.kv_transfer.counters.latencies.clear()
        self._base_accepted_per_pos = [] if core.spec_stats is None else list(core.spec_stats.accepted_per_pos)
        self._request_success = dict.fromkeys(FINISHED_REASON.values(), 0)
        self._prompt_tokens = 0
        # (request id, sequence index) -> when its last tokens were handed back; dropped when the sequence ends.
        self._last_output: dict[tuple[str, int], float] = {}
        h = Histogram
        token_counts = build_1_2_5_buckets(core.max_model_len)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                     TOKEN_LATENCY_BUCKETS)
        self.tpot = h("vllm:time_per_output_token_seconds",
                      "Histogram of time per output token in seconds (vLLM's older name of "
                      "vllm:inter_token_latency_seconds).", TOKEN_LATENCY_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                       REQUEST_LATENCY_BUCKETS)
        self.inference = h("vllm:request_inference_time_seconds",
                           "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds",
                         "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = h("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                        REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_counts)
        self.request_generation_tokens = h("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", token_counts)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKEN_BUCKETS)
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = h("vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.", token_counts)
        self.kv_transfer_seconds = h("sluice:kv_transfer_seconds", "Histogram of the time a decode engine's pull "
                                     "of one request's KV blocks took, from admission to their arrival.",
                                     KV_TRANSFER_BUCKETS)
        self._histograms = [self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.inference, self.prefill,
                            self.decode, self.request_prompt_tokens, self.request_generation_tokens,
                            self.iteration_tokens, self.params_n, self.params_max_tokens]

    # -- the engine thread ------------------------------------------------------------------------------------
    def record_admitted(self, params: SamplingParams) -> None:
        """A request the core accepted: its ``n`` and ``max_tokens``."""
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)

    def record_step(self, num_batched_tokens: int) -> None:
        self.iteration_tokens.observe(num_batched_tokens)

    def record_outputs(self, outputs: Iterable[EngineCoreOutput], now: float | None = None) -> None:
        """One step's outputs as they are handed back: the latency between a sequence's deltas (per token),
        prompt tokens when a request's first tokens come (a pooling request's with its pooled output), and the
        finished ones."""
        now = time.monotonic() if now is None else now
        last = self._last_output
        for out in outputs:
            key = (out.request_id, out.index)
            if num_new := len(out.new_token_ids):
                before = last.get(key)
                if before is None:
                    if out.index == 0:   # a request's prompt counts once, whatever its n
                        self._prompt_tokens += out.num_prompt_tokens
                else:
                    latency = (now - before) / num_new
                    self.itl.observe(latency)
                    self.tpot.observe(latency)
                last[key] = now
            elif out.pooled is not None:   # a pooling request: its one output, after its one forward
                self._prompt_tokens += out.num_prompt_tokens
            if out.finish_reason is not None:
                last.pop(key, None)
                self._request_success[FINISHED_REASON[out.finish_reason]] += 1
            if out.times is not None:
                self.record_finished(out.times, out.num_prompt_tokens)

    def record_finished(self, times: RequestTimes, num_prompt_tokens: int) -> None:
        """A whole request ended: its stage latencies (those it reached) and token counts."""
        self.e2e.observe(times.finished - times.arrival)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generation_tokens)
        if times.first_scheduled is not None:
            self.queue.observe(times.first_scheduled - times.arrival)
            self.inference.observe(times.finished - times.first_scheduled)
        if times.first_token is not None:
            self.ttft.observe(times.first_token - times.arrival)
            self.decode.observe(times.finished - times.first_token)
            if times.first_scheduled is not None:
                self.prefill.observe(times.first_token - times.first_scheduled)

    def forget_requests(self) -> None:
        """Every request ended at once (the engine failed them): drop their per-sequence state."""
        self._last_output.clear()

    # -- the scrape ---------------------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        core, labels = self._core, self._labels
        sched = core.scheduler
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                     sched.num_running)
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                     sched.num_waiting)
        usage = sched.block_manager.usage()
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, usage)
        # vLLM's older name of the same gauge: the Gateway API Inference Extension's model-server protocol named it
        # until 2025-11-26, and endpoint pickers released before then read it by default.
        yield _gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", labels, usage)
        stats, base = core.scheduler_stats(), self._base
        for key, name, doc in (
                ("prefix_cache_queries", "vllm:prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens."),
                ("prefix_cache_hits", "vllm:prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens."),
                ("external_prefix_cache_queries", "vllm:external_prefix_cache_queries",
                 "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number "
                 "of queried tokens (here: the KV offload tier)."),
                ("external_prefix_cache_hits", "vllm:external_prefix_cache_hits",
                 "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
                 "cached tokens (here: the KV offload tier)."),
                ("num_preemptions", "vllm:num_preemptions", "Cumulative number of preemption from the engine."),
                ("generation_tokens", "vllm:generation_tokens", "Number of generation tokens processed.")):
            yield _counter(name, doc, labels, stats[key] - base[key])
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, self._prompt_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, count in self._request_success.items():
            success.add_metric([*labels, reason], count)
        yield success
        refused = CounterMetricFamily("sluice:requests_refused", "Requests the engine refused at admission, by "
                                      "reason: queue_full (--max-queued-requests), first_token_wait "
                                      "(--max-expected-ttft-ms).", labels=[*LABELS, "reason"])
        for reason, count in sched.admission.refused.items():
            refused.add_metric([*labels, reason], count)
        yield refused
        for histogram in self._histograms:
            yield histogram.family(labels)
        yield self._cache_config_info(core, labels)
        lora = core.config.lora_config
        if lora is not None:
            yield _lora_requests_info(core, lora.max_loras)
        if core.spec_stats is not None:
            yield from self._spec_decode(stats, list(core.spec_stats.accepted_per_pos), labels)
        if sched.kv_transfer is not None:
            yield from self._kv_transfer(core, stats, labels)
        if "encoder_cache_hits" in stats:   # a vision-language model: its images' vision tower outputs reused
            for key, doc in (("encoder_cache_queries", "Encoder cache lookups, in images looked up by a step."),
                             ("encoder_cache_hits", "Encoder cache hits, in images whose embeddings were cached.")):
                yield _counter(f"sluice:{key}", doc, labels, stats[key] - base[key])

    def _kv_transfer(self, core: EngineCore, stats: dict[str, int], labels: list[str]) -> Iterator[Metric]:
        """Prefill/decode disaggregation (engine.core.disagg): the engine's role, what crossed by direction, pulls
        that fell back to computing the prompt, holds nobody took, and how long each pull took."""
        config = core.config.kv_transfer_config
        assert config is not None and core.scheduler.kv_transfer is not None
        info = GaugeMetricFamily("sluice:kv_transfer_info", "The engine's part in prefill/decode disaggregation "
                                 "(--kv-transfer-config): its kv_role and connector.",
                                 labels=[*LABELS, "kv_role", "kv_connector"])
        info.add_metric([*labels, config.kv_role, config.kv_connector], 1)
        yield info
        base = self._base
        for unit, doc in (("blocks", "KV blocks"), ("bytes", "Bytes of KV blocks")):
            family = CounterMetricFamily(f"sluice:kv_transfer_{unit}", f"{doc} transferred between prefill and "
                                         "decode engines: sent (a prefill engine's blocks a decode engine took) and "
                                         "received (pulled by a decode engine).", labels=[*LABELS, "direction"])
            for direction in ("sent", "received"):
                key = f"kv_transfer_{unit}_{direction}"
                family.add_metric([*labels, direction], stats[key] - base.get(key, 0))
            yield family
        yield _counter("sluice:kv_transfer_fallbacks", "Pulls of a prefill engine's blocks that failed, timed out or "
                       "were refused, whose prompt the decode engine computed itself.", labels,
                       stats["kv_transfer_fallbacks"] - base.get("kv_transfer_fallbacks", 0))
        yield _counter("sluice:kv_transfer_holds_expired", "Prompts whose blocks a prefill engine held for a decode "
                       "engine that did not take them within hold_timeout_s.", labels,
                       stats["kv_transfer_holds_expired"] - base.get("kv_transfer_holds_expired", 0))
        counters = core.scheduler.kv_transfer.counters
        latencies, counters.latencies = counters.latencies, []
        for seconds in latencies:
            self.kv_transfer_seconds.observe(seconds)
        yield self.kv_transfer_seconds.family(labels)

    def _spec_decode(self, stats: dict[str, int], accepted_per_pos: list[int], labels: list[str]
                     ) -> Iterator[Metric]:
        """vLLM's speculative decoding counters (``SpecDecodingProm``). Its docs: acceptance rate =
        rate(accepted) / rate(draft tokens); mean acceptance length = 1 + rate(accepted) / rate(drafts); the
        acceptance rate at each position = accepted_per_pos / drafts."""
        base = self._base
        for key, doc in (("spec_decode_num_drafts", "Number of spec decoding drafts."),
                         ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                         ("spec_decode_num_accepted_tokens", "Number of accepted tokens.")):
            yield _counter(f"vllm:{key}", doc, labels, stats[key] - base[key])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        for position, (count, before) in enumerate(zip(accepted_per_pos, self._base_accepted_per_pos)):
            per_pos.add_metric([*labels, str(position)], count - before)
        yield per_pos

    @staticmethod
    def _cache_config_info(core: EngineCore, labels: list[str]) -> GaugeMetricFamily:
        config = core.config
        info = {"block_size": str(config.block_size), "cache_dtype": core.executor.kv_cache_dtype_name,
                "enable_prefix_caching": str(config.enable_prefix_caching),
                "gpu_memory_utilization": str(config.device_memory_utilization),
                "num_gpu_blocks": str(core.num_blocks), "num_cpu_blocks": "None"}
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=[*LABELS, *info])
        family.add_metric([*labels, *info.values()], 1)
        return family


def _lora_requests_info(core: EngineCore, max_loras: int) -> GaugeMetricFamily:
    """vLLM's LoRA gauge: the adapters of the running and the waiting sequences (comma-separated names), set to
    the time of the scrape."""
    sched = core.scheduler
    # list() copies in one C call under the GIL: a step on the engine thread cannot change it halfway.
    running = {r.lora_request.lora_name for r in list(sched.running) if r.lora_request is not None}
    waiting = {r.lora_request.lora_name for r in list(sched.waiting) if r.lora_request is not None}
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    family.add_metric([str(max_loras), ",".join(sorted(waiting)), ",".join(sorted(running))], time.time())
    return family


def _gauge(name: str, documentation: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _counter(name: str, documentation: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=LABELS)   # exposed as ``name``_total
    family.add_metric(labels, value)
    return family


# -- the HTTP endpoint ----------------------------------------------------------------------------------------
def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("metrics")
    g.add_argument("--metrics-port", type=port_number, default=0,
                   help="serve the engine's vllm:* Prometheus metrics at http://HOST:PORT/metrics (0: off; "
                        "`sluice serve` picks a free port and has its gateways append them to theirs)")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint binds to (0.0.0.0 in containers, for Prometheus)")


def serve_metrics(host: str, port: int) -> tuple[CollectorRegistry, WSGIServer]:
    """``/metrics`` of a new registry on a thread of its own (prometheus_client's server), bound now so that a
    port in use stops the engine before it loads a model; register the EngineMetrics once the core exists.
    ``shutdown()`` the server to stop it."""
    registry = CollectorRegistry()
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"--metrics-port {port}: cannot listen on {host}:{port}: {e}") from e
    return registry, server
