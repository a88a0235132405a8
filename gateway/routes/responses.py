"""``POST /v1/responses``: OpenAI's Responses API, run as the chat completion it converts to; ``GET`` and
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` over the stored ones.

The backend call, its metrics and its errors are the chat route's (``Run``); this route converts the request
(gateway/responses_api/request.py), builds the response or its events (gateway/responses_api/output.py) and
keeps finished responses for ``previous_response_id`` and retrieval (gateway/responses_api/store.py; per gateway
process). ``POST /v1/responses/{id}/cancel`` is refused: only background responses can be cancelled, and
``background`` is refused.
A stream, as chat's, waits up to ``first_event_wait`` before it commits to a 200; a failure after that is an
``error`` event, and the stream ends (Responses streams have no ``[DONE]``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.backend import Delta, FinishReason
from gateway.errors import ApiError, BackendError, internal_error
from gateway.responses_api.items import input_items, item_page
from gateway.responses_api.output import Event, ResponseBuilder
from gateway.responses_api.request import parse_responses, responses_param
from gateway.responses_api.store import ChatMessages, ResponseStore, StoredResponse
from gateway.routes.common import gateway_state, read_json, request_id, resolve_model
from gateway.routes.generate import Run, unless_disconnected
from gateway.schemas import parse_chat
from gateway.sse import KEEPALIVE, SSEResponse
from gateway.streams import TIMED_OUT

log = logging.getLogger("gateway")


def response_store(request: Request) -> ResponseStore:
    store = request.app.state.responses
    assert isinstance(store, ResponseStore)
    return store


async def create_response(request: Request) -> Response:
    state = gateway_state(request)
    body = await read_json(request)
    store = response_store(request)
    call = parse_responses(body, _history(store, body.get("previous_response_id")))
    try:
        req = parse_chat(call.chat_body, state.settings.max_n)
    except ApiError as err:
        err.message = err.message.replace(f"`{err.param}`", f"`{responses_param(err.param)}`")
        err.param = responses_param(err.param)
        raise
    model = await resolve_model(request, req.model)
    run = Run(state, req, model, request_id(request))
    builder = ResponseBuilder(call, f"resp_{uuid.uuid4().hex}", model.name)
    if not req.stream:
        return await _whole(request, run, builder, store)
    try:
        first = await run.stream.next(timeout=state.settings.first_event_wait)
    except BackendError as err:
        await run.close()
        raise run.api_error(err) from None
    except BaseException:
        await run.close()
        raise
    return SSEResponse(_events(run, builder, store, first), on_close=run.close)


def _history(store: ResponseStore, previous: object) -> ChatMessages:
    if previous is None:
        return ()
    if not isinstance(previous, str):
        raise ApiError(400, "`previous_response_id` must be a string.", param="previous_response_id")
    stored = store.get(previous)
    if stored is None:
        raise ApiError(404, f"Previous response with id '{previous[:100]}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return stored.conversation


def _keep(store: ResponseStore, builder: ResponseBuilder, response: dict[str, object]) -> None:
    if builder.call.store:
        store.put(builder.id, StoredResponse(builder.conversation(), response,
                                             input_items(builder.call.request.input, builder.id)))


def _stored(request: Request) -> StoredResponse:
    response_id = request.path_params["response_id"]
    stored = response_store(request).get(response_id)
    if stored is None:
        raise ApiError(404, f"Response with id '{response_id[:100]}' not found.", param="response_id")
    return stored


async def get_response(request: Request) -> Response:
    """A stored response as it was returned (``stream=true`` replays only background responses: refused)."""
    if request.query_params.get("stream", "false") != "false":
        raise ApiError(400, "`stream` is not supported: only background responses can be streamed again, and "
                            "`background` is not supported.", param="stream")
    return JSONResponse(_stored(request).response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not response_store(request).delete(response_id):
        raise ApiError(404, f"Response with id '{response_id[:100]}' not found.", param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: Request) -> Response:
    return JSONResponse(item_page(_stored(request).input_items, request.query_params))


async def cancel_response(request: Request) -> Response:
    _stored(request)  # an unknown id is a 404, as OpenAI's
    raise ApiError(400, "Only background responses can be cancelled, and `background` is not supported: this "
                        "response has already completed.", param="response_id")


async def _whole(request: Request, run: Run, builder: ResponseBuilder, store: ResponseStore) -> Response:
    async def collect() -> None:
        while (item := await run.stream.next()) is not None:
            assert isinstance(item, tuple)
            run.record(*item)
            builder.add(item[1])

    try:
        if not await unless_disconnected(request, collect()):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        if run.failed():
            raise internal_error(run.rid)
        run.finish()
        response = builder.finish(run.usage.total())
        _keep(store, builder, response)
        return JSONResponse(response)
    except BackendError as err:
        raise run.api_error(err) from None
    finally:
        await run.close()


def _sse(data: Event) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error(builder: ResponseBuilder, err: ApiError) -> str:
    return _sse(builder.event("error", code=err.code or err.type, message=err.message, param=err.param))


async def _events(run: Run, builder: ResponseBuilder, store: ResponseStore,
                  first: tuple[int, Delta] | str | None) -> AsyncIterator[str]:
    for opening in builder.opening():
        yield _sse(opening)
    item = first
    try:
        while item is not None:
            if item == TIMED_OUT:
                if run.state.settings.keepalive_interval is not None:
                    yield KEEPALIVE
            else:
                assert isinstance(item, tuple)
                run.record(*item)
                for out in builder.add(item[1]):
                    yield _sse(out)
                if item[1].finish_reason is FinishReason.ERROR:
                    yield _error(builder, internal_error(run.rid))
                    return
            item = await run.stream.next(timeout=run.state.settings.keepalive_interval)
    except BackendError as err:
        log.warning("request %s: backend failed mid-stream: %s", run.rid, err)
        yield _error(builder, run.api_error(err))
        return
    except Exception:
        log.exception("request %s: stream failed", run.rid)
        yield _error(builder, internal_error(run.rid))
        return
    run.finish()
    closing = builder.closing(run.usage.total())
    for event in closing:
        yield _sse(event)
    response = closing[-1]["response"]  # the completed (or incomplete) event's
    assert isinstance(response, dict)
    _keep(store, builder, response)
