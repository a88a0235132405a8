"""What the engine's servicer reports per request besides its outputs: a span (tracing on) and vLLM's
"Added request" / "Finished request" lines (``--enable-log-requests``).

Both run on the event loop, when a request is added and when its last output arrives, never per token and never
on the core's thread: the span is made whole at the end, its start and events placed at the times the core
recorded (:class:`engine.core.request.RequestTimes`, monotonic seconds). Span and attribute names are vLLM's
(``llm_request``, ``gen_ai.*``), so queries written for vLLM's traces find them. The servicer holds no observer
when both are off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from common.tracing import Tracing, epoch_ns
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"


class RequestObserver:
    def __init__(self, model_name: str, *, tracing: Tracing | None, log_requests: bool) -> None:
        self._model_name = model_name
        self._tracing = tracing
        self._log_requests = log_requests

    def added(self, key: str, label: str, num_prompt_tokens: int, params: SamplingParams) -> None:
        """``key``: the engine's id of the request; ``label``: the caller's (``client_request_id``, else the key),
        which its lines and span carry."""
        if self._log_requests:
            logger.info("Added request %s%s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%g, top_p=%g",
                        label, _key_note(key, label), num_prompt_tokens, params.n, params.max_tokens,
                        params.temperature, params.top_p, extra={"request_id": label})

    def finished(self, out: EngineCoreOutput, label: str, trace_headers: Mapping[str, str], num_prompt_tokens: int,
                 params: SamplingParams) -> None:
        """``out``: the request's last output (``request_finished``); ``label``: the caller's id of it;
        ``trace_headers``: its parent's context."""
        if self._log_requests:
            logger.info("Finished request %s%s: %s, %d prompt tokens, %d generated tokens", label,
                        _key_note(out.request_id, label), out.finish_reason.value if out.finish_reason else "none",
                        num_prompt_tokens, out.times.num_generation_tokens if out.times else 0,
                        extra={"request_id": label})
        if self._tracing is not None:
            self._span(self._tracing, out, label, trace_headers, num_prompt_tokens, params)

    def _span(self, tracing: Tracing, out: EngineCoreOutput, label: str, trace_headers: Mapping[str, str],
              num_prompt_tokens: int, params: SamplingParams) -> None:
        attributes: dict[str, str | int | float] = {
            "gen_ai.response.model": self._model_name,
            "gen_ai.request.id": label,
            "sluice.engine.request_key": out.request_id,
            "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.prompt_tokens": num_prompt_tokens,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if out.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = out.finish_reason.value
        times = out.times
        if times is None:  # the engine failed every request at once: no times were kept
            now = time.time_ns()
            span = tracing.start_span(SPAN_NAME, parent=trace_headers, start_time_ns=now, attributes=attributes)
            span.set_status(tracing.error_status)
            span.end(end_time=now)
            return
        offset = epoch_ns(0.0)  # one clock reading for the whole span: its events keep their order and gaps

        def at(monotonic_s: float) -> int:
            return offset + int(monotonic_s * 1e9)

        arrival = times.arrival
        attributes["gen_ai.usage.completion_tokens"] = times.num_generation_tokens
        attributes["gen_ai.latency.e2e"] = times.finished - arrival
        attributes["sluice.num_preemptions"] = times.num_preemptions
        if times.first_scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = times.first_scheduled - arrival
            attributes["gen_ai.latency.time_in_model_inference"] = times.finished - times.first_scheduled
        if times.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = times.first_token - arrival
            attributes["gen_ai.latency.time_in_model_decode"] = times.finished - times.first_token
            if times.first_scheduled is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = times.first_token - times.first_scheduled
        span = tracing.start_span(SPAN_NAME, parent=trace_headers, start_time_ns=at(arrival), attributes=attributes)
        span.add_event("queued", timestamp=at(arrival))
        if times.first_scheduled is not None:
            span.add_event("scheduled", timestamp=at(times.first_scheduled))
        if times.first_token is not None:
            span.add_event("first_token", timestamp=at(times.first_token))
        span.add_event("finished", timestamp=at(times.finished))
        if out.finish_reason is FinishReason.ERROR:
            span.set_status(tracing.error_status)
        span.end(end_time=at(times.finished))


def _key_note(key: str, label: str) -> str:
    return "" if key == label else f" (engine key {key})"
