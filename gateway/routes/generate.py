"""``POST /v1/completions`` and ``POST /v1/chat/completions``, whole or streamed.

One HTTP request is one backend call per prompt (one for chat). A stream
waits up to ``first_event_wait`` for its first event before it commits to
a 200, so requests that fail fast (a full queue, a bad argument, a backend that
is down) still get their exact status; after that, failures arrive as an SSE
error event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.backend import Delta, FinishReason, GenerateCall
from gateway.errors import ApiError, BackendError, internal_error
from gateway.metrics import GenerationTracker
from gateway.responses import ResponseBuilder, UsageSum, usage_json
from gateway.routes.common import GatewayState, ModelChoice, gateway_state, read_json, request_id, resolve_model
from gateway.schemas import GenerationRequest, parse_chat, parse_completion
from gateway.sse import DONE, KEEPALIVE, SSEResponse, event
from gateway.streams import TIMED_OUT, DeltaStream

log = logging.getLogger("gateway")


async def completions(request: Request) -> Response:
    return await _generate(request, is_chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, is_chat=True)


class Run:
    """One request in flight: its merged calls, the response being built, usage, metrics."""

    def __init__(self, state: GatewayState, req: GenerationRequest, model: ModelChoice, rid: str,
                 timeout: float | None = None) -> None:
        """``timeout``: the request's own deadline in seconds (MindIE's ``timeout``), within --request-timeout."""
        self.state = state
        self.req = req
        self.model = model
        self.rid = rid
        num_prompts = len(req.prompts)
        calls: list[GenerateCall] = []
        try:
            for i, prompt in enumerate(req.prompts):
                calls.append(state.backend.generate(prompt, req.params,
                                                    request_id=rid if num_prompts == 1 else f"{rid}-{i}",
                                                    timeout=_within(timeout, state.settings.request_timeout),
                                                    adapter=model.adapter))
        except BaseException:
            for call in calls:  # started already: abort them
                call.cancel()
            raise
        self.stream = DeltaStream(calls, req.params.n)
        self.builder = ResponseBuilder(is_chat=req.is_chat, request_id=rid, created=int(time.time()),
                                       model=model.name,
                                       num_choices=num_prompts * req.params.n, logprobs=req.params.logprobs,
                                       prompt_logprobs=req.params.prompt_logprobs is not None,
                                       echo=req.params.echo, echo_prefix=req.echo_prefix,
                                       include_reasoning=req.include_reasoning)
        self.usage = UsageSum(num_prompts)
        self.tracker: GenerationTracker = state.metrics.track(model.name)

    def api_error(self, err: BackendError) -> ApiError:
        """The client's error for a backend failure; a refused constraint (the backend names the wire field,
        ``guided.regex``) names the request field it came from (``guided_regex``, ``response_format``...)."""
        error = self.state.api_error(err, self.model)
        guided = self.req.params.guided
        if guided is not None and guided.source and error.param is not None and error.param.startswith("guided"):
            if error.message.startswith(f"{error.param}: "):
                error.message = f"{guided.source}: {error.message[len(error.param) + 2:]}"
            error.param = guided.source
        return error

    def record(self, prompt_index: int, delta: Delta) -> tuple[int, int]:
        """Account for a delta; return its choice index and text offset."""
        index = self.stream.choice_index(prompt_index, delta)
        self.usage.update(prompt_index, delta.usage)
        if delta.token_ids or delta.text or delta.tool_calls:
            self.tracker.token()
        if delta.finish_reason is FinishReason.ERROR:
            log.error("request %s: choice %d failed in the backend: %s", self.rid, index, delta.error_message)
        return index, self.builder.add(index, delta)

    def failed(self) -> bool:
        return any(c.finish_reason is FinishReason.ERROR for c in self.builder.choices)

    def finish(self) -> None:
        reasons = [c.finish_reason.openai for c in self.builder.choices if c.finish_reason is not None]
        self.tracker.finish(reasons, self.usage.total())

    async def close(self) -> None:
        await self.stream.aclose()
        self.tracker.close()


def _within(timeout: float | None, limit: float | None) -> float | None:
    return limit if timeout is None else timeout if limit is None else min(timeout, limit)


async def _generate(request: Request, *, is_chat: bool) -> Response:
    state = gateway_state(request)
    body = await read_json(request)
    max_n = state.settings.max_n
    req = parse_chat(body, max_n) if is_chat else parse_completion(body, max_n)
    model = await resolve_model(request, req.model)
    run = Run(state, req, model, request_id(request))
    if not req.stream:
        return await _whole(request, run)
    try:
        first = await run.stream.next(timeout=state.settings.first_event_wait)
    except BackendError as err:
        await run.close()
        raise run.api_error(err) from None
    except BaseException:
        await run.close()
        raise
    return SSEResponse(_events(run, first), on_close=run.close)


async def _whole(request: Request, run: Run) -> Response:
    async def collect() -> None:
        while (item := await run.stream.next()) is not None:
            assert isinstance(item, tuple)
            run.record(*item)

    try:
        if not await unless_disconnected(request, collect()):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        if run.failed():
            raise internal_error(run.rid)
        run.finish()
        return JSONResponse(run.builder.full(run.usage.total()))
    except BackendError as err:
        raise run.api_error(err) from None
    finally:
        await run.close()


async def _events(run: Run, first: tuple[int, Delta] | str | None) -> AsyncIterator[str]:
    builder = run.builder
    for role_chunk in builder.role_chunks():
        yield event(role_chunk)
    item = first
    try:
        while item is not None:
            if item == TIMED_OUT:
                if run.state.settings.keepalive_interval is not None:  # else the first wait ran out: no comment
                    yield KEEPALIVE
            else:
                assert isinstance(item, tuple)
                prompt_index, delta = item
                index, offset = run.record(prompt_index, delta)
                chunk = builder.delta_chunk(index, delta, offset)
                if chunk is not None:
                    if run.req.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
                        chunk["usage"] = usage_json(run.usage.total())
                    yield event(chunk)
                if delta.finish_reason is FinishReason.ERROR:
                    yield event(internal_error(run.rid).body())
                    yield DONE
                    return
            item = await run.stream.next(timeout=run.state.settings.keepalive_interval)
    except BackendError as err:
        log.warning("request %s: backend failed mid-stream: %s", run.rid, err)
        yield event(run.api_error(err).body())
        yield DONE
        return
    except Exception:
        log.exception("request %s: stream failed", run.rid)
        yield event(internal_error(run.rid).body())
        yield DONE
        return
    if run.req.include_usage:
        yield event(builder.usage_chunk(run.usage.total()))
    run.finish()
    yield DONE


async def unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run ``work`` unless the client disconnects first (then cancel it): False if it did."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # re-raise the work's own error
    return True


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
