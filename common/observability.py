"""The tracing and logging flags every process of the stack takes (vLLM's names), parsed into one settings
object, set up once per process, and passed on by ``sluice serve`` to its children."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from common.logs import LOG_FORMATS, configure_logging
from common.tracing import Tracing, init_tracing, traces_endpoint


@dataclass(frozen=True)
class ObservabilitySettings:
    # OTLP/gRPC endpoint spans go to; None: no tracing (opentelemetry is never imported).
    otlp_traces_endpoint: str | None = None
    log_format: str = "text"
    # One INFO line per request received and per request finished (vLLM's --enable-log-requests).
    log_requests: bool = False

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tracing and logs (vLLM's flag names)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317 "
                        "(plaintext unless https://); default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing")
    g.add_argument("--collect-detailed-traces", default=None, metavar="{all,model,worker}",
                   help="refused: Sluice has no model or worker sub-spans; the engine's span carries the queue, "
                        "prefill and decode timings as events and attributes")
    g.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="json: one JSON object per line (time, level, logger, message, process, request_id)")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log one INFO line per request received and per request finished (default: off)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no per-request log lines (the default; vLLM's older flag)")


def observability_settings(ns: argparse.Namespace, environ: Mapping[str, str] | None = None
                           ) -> ObservabilitySettings:
    """The settings from :func:`add_observability_args`' flags; ValueError naming a flag Sluice refuses."""
    if ns.collect_detailed_traces is not None:
        raise ValueError("--collect-detailed-traces: Sluice has no model or worker sub-spans to collect; the "
                         "engine's request span already carries queue, prefill and decode timings")
    endpoint = traces_endpoint(ns.otlp_traces_endpoint, os.environ if environ is None else environ)
    return ObservabilitySettings(otlp_traces_endpoint=endpoint, log_format=ns.log_format,
                                 log_requests=ns.log_requests)


def observability_flags(settings: ObservabilitySettings) -> list[str]:
    """The command-line flags that give a child process ``settings``."""
    flags = ["--log-format", settings.log_format]
    if settings.otlp_traces_endpoint is not None:
        flags += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
    if settings.log_requests:
        flags.append("--enable-log-requests")
    return flags


def set_up(settings: ObservabilitySettings, *, log_level: str, process: str) -> Tracing | None:
    """Configure this process's logging and, with an endpoint, tracing under the service name ``sluice-<process>``;
    the caller shuts the returned :class:`Tracing` down on exit."""
    configure_logging(log_level, settings.log_format, process)
    return init_tracing(settings.otlp_traces_endpoint, f"sluice-{process}")
