"""Prometheus metrics of one gateway app, on its own registry (never the global one,
so that several apps in one process, as in tests, do not collide).

The gateway's own series are ``sluice:*``: what this gateway saw of its HTTP requests and of the latency its
clients got (network and tokenizer service included). vLLM's names (``vllm:*``), which vLLM dashboards and
autoscalers read, come from the engine, the one place that knows its queue, KV cache and per-request stages
and where a request is counted once however many gateways front it (engine/entrypoints/metrics.py). With
``--metrics-federate URL`` (``sluice serve`` passes its engine's) this gateway's ``/metrics`` appends each URL's
page after its own, so one scrape of ``:8000/metrics`` shows everything; in Kubernetes each process is scraped
on its own instead and the gateways are not told to federate (docs/metrics.md). With several targets (the
engines of ``sluice serve --data-parallel-size`` replicas, in replica order) their pages are merged, each family
once, and the i-th target's ``engine`` label reads i, as vLLM labels its data-parallel engines. The tokenizer
services' pages (``--metrics-federate-tokenizer URL``; ``sluice serve`` passes each service's) are merged alike,
the i-th labelled ``tokenizer="i"``: their series (``sluice:requests_migrated_total``) are counted where the event
happens, once, and every gateway relays the same values, never a count of its own. With prefill/decode
disaggregation (``--metrics-federate-kv-role``, one per engine target) each engine's series also carry its
``kv_role`` ("kv_producer", "kv_consumer").
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import logging
import time
import urllib.request
from collections.abc import Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.backend import Usage

logger = logging.getLogger(__name__)

# A federated target that does not answer within this is left out of the page (a Prometheus scrape times out
# after 10 s by default; the gateway's own series must still get there).
FEDERATE_TIMEOUT_S = 3.0

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class GatewayMetrics:
    """``federate``: the engines' metrics pages (URLs) appended to this one's, fetched at each scrape;
    ``federate_tokenizers``: the tokenizer services' pages, appended the same way; ``federate_kv_roles``: the KV
    role of each engine page (none: no ``kv_role`` label)."""

    def __init__(self, registry: CollectorRegistry | None = None, federate: Sequence[str] = (),
                 federate_timeout: float = FEDERATE_TIMEOUT_S, federate_tokenizers: Sequence[str] = (),
                 federate_kv_roles: Sequence[str] = ()) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.federate = tuple(federate)
        self.federate_kv_roles = tuple(federate_kv_roles)
        self.federate_tokenizers = tuple(federate_tokenizers)
        self.federate_timeout = federate_timeout
        r = self.registry
        self.http_requests = Counter("sluice:http_requests_total", "HTTP requests by route, method and status.",
                                     ["route", "method", "status"], registry=r)
        self.http_latency = Histogram("sluice:http_request_duration_seconds", "HTTP request duration by route.",
                                      ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("sluice:e2e_request_latency_seconds",
                                     "Generation requests: arrival to last token.", ["model_name"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("sluice:time_to_first_token_seconds", "Generation requests: arrival to first token.",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=r)
        self.request_success = Counter("sluice:request_success_total", "Finished sequences by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("sluice:prompt_tokens_total", "Prompt tokens of finished requests.",
                                     ["model_name"], registry=r)
        self.generation_tokens = Counter("sluice:generation_tokens_total", "Generated tokens of finished requests.",
                                         ["model_name"], registry=r)
        self.running = Gauge("sluice:num_requests_running", "Generation requests in flight in this gateway.",
                             ["model_name"], registry=r)
        self.federate_up = Gauge("sluice:metrics_federate_up",
                                 "1 when the last scrape got the federated target's metrics, else 0.", ["target"],
                                 registry=r)

    async def render(self) -> tuple[bytes, str]:
        """This gateway's page, then the federated targets' (fetched concurrently) as one; a target that fails
        adds nothing and reads 0 in ``sluice:metrics_federate_up``."""
        urls = (*self.federate, *self.federate_tokenizers)
        pages = await asyncio.gather(*(asyncio.to_thread(self._fetch, url) for url in urls))
        for url, page in zip(urls, pages):
            self.federate_up.labels(url).set(page is not None)
        body = generate_latest(self.registry)
        if any(page is not None for page in pages):
            engines, tokenizers = pages[:len(self.federate)], pages[len(self.federate):]
            try:
                merged = _Merged(engines, tokenizers, self.federate_kv_roles)
                body += generate_latest(merged)   # type: ignore[arg-type]  # has collect()
            except ValueError as e:   # targets whose families disagree (one mid-restart): this page stays whole
                logger.warning("federated metrics left out of this scrape: %s", e)
        return body, CONTENT_TYPE_LATEST

    def _fetch(self, url: str) -> list[Metric] | None:
        """One target's families (from the plain text format: no Accept header asks for OpenMetrics)."""
        try:
            with urllib.request.urlopen(url, timeout=self.federate_timeout) as response:
                return list(text_string_to_metric_families(response.read().decode()))
        except (OSError, ValueError, http.client.HTTPException) as e:
            # refused, timed out, HTTP error status, malformed or cut-off answer (a restarting engine's)
            logger.warning("metrics of %s not fetched: %s", url, e)
            return None

    def track(self, model: str) -> GenerationTracker:
        return GenerationTracker(self, model)


class _Merged:
    """The federated targets' families, each once with the samples of every target; the i-th engine target's
    ``engine`` label set to i (two replicas' engines would otherwise give the same series). With several engine
    targets, a series that has no ``engine`` label of its own (``vllm:lora_requests_info``,
    ``vllm:cache_config_info``) gets one too: else the replicas' series would be one, and a reader would see only
    the last. The i-th tokenizer service's series get ``tokenizer="i"`` (they have no label telling them apart).
    ``kv_roles``: the i-th engine's series get ``kv_role`` = its i-th."""

    def __init__(self, engines: Iterable[list[Metric] | None], tokenizers: Iterable[list[Metric] | None] = (),
                 kv_roles: Sequence[str] = ()) -> None:
        self._engines = list(engines)
        self._tokenizers = list(tokenizers)
        self._kv_roles = tuple(kv_roles)

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        several = len(self._engines) > 1
        targets = [("engine", i, page, several) for i, page in enumerate(self._engines)]
        targets += [("tokenizer", i, page, True) for i, page in enumerate(self._tokenizers)]
        for label, index, page, always in targets:
            for family in page or ():
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                for sample in family.samples:
                    if always or label in sample.labels:
                        sample = sample._replace(labels={**sample.labels, label: str(index)})
                    if label == "engine" and self._kv_roles:
                        sample = sample._replace(labels={**sample.labels, "kv_role": self._kv_roles[index]})
                    into.samples.append(sample)
        return merged.values()


class GenerationTracker:
    """Times one generation request: TTFT on the first token, the rest when it ends."""

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self._m = metrics
        self._model = model
        self._start = time.monotonic()
        self._first_seen = False
        self._done = False
        metrics.running.labels(model).inc()

    def token(self) -> None:
        if not self._first_seen:
            self._first_seen = True
            self._m.ttft.labels(self._model).observe(time.monotonic() - self._start)

    def finish(self, finish_reasons: list[str], usage: Usage) -> None:
        """The request completed: count its sequences and tokens."""
        if self._done:
            return
        self._m.e2e_latency.labels(self._model).observe(time.monotonic() - self._start)
        for reason in finish_reasons:
            self._m.request_success.labels(self._model, reason).inc()
        self._m.prompt_tokens.labels(self._model).inc(usage.prompt_tokens)
        self._m.generation_tokens.labels(self._model).inc(usage.completion_tokens)
        self.close()

    def close(self) -> None:
        """The request is over, finished or not; idempotent."""
        if not self._done:
            self._done = True
            self._m.running.labels(self._model).dec()


class MetricsMiddleware:
    """Counts and times every HTTP request. Routes are labelled by their path when
    it is a known route, else "other", so that scanners cannot blow up cardinality."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, known_paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.known_paths else "other"
        status = 500
        start = time.monotonic()

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            method = scope["method"] if scope["method"] in ("GET", "POST", "OPTIONS", "HEAD") else "other"
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_latency.labels(route).observe(time.monotonic() - start)


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-federate", action="append", default=None, metavar="URL",
                        help="a Prometheus metrics page (e.g. the engine's http://HOST:PORT/metrics) appended to "
                             "this gateway's /metrics (repeatable; `sluice serve` passes its engine's)")
    parser.add_argument("--metrics-federate-tokenizer", action="append", default=None, metavar="URL",
                        help="a tokenizer service's metrics page appended to this gateway's /metrics, its series "
                             "labelled tokenizer=\"i\" for the i-th (repeatable; `sluice serve` passes each service's)")
    parser.add_argument("--metrics-federate-kv-role", action="append", default=None, metavar="ROLE",
                        help="the KV role of the i-th --metrics-federate engine (prefill/decode disaggregation), "
                             "its series labelled kv_role=\"ROLE\" (one per --metrics-federate; `sluice serve "
                             "--prefill-replicas` passes them)")


def federate_targets(urls: Sequence[str] | None, flag: str = "--metrics-federate") -> tuple[str, ...]:
    """``flag``'s URLs (``--metrics-federate``, ``--metrics-federate-tokenizer``), checked: http(s) only."""
    for url in urls or ():
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag}: {url!r} is not an http:// or https:// URL")
    return tuple(urls or ())
