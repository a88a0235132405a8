"""vLLM's development route ``POST /reset_prefix_cache``, mounted only when ``VLLM_SERVER_DEV_MODE=1``.

As vLLM's: no body, 200 with an empty body once every engine behind the gateway forgot its prefix cache. Unlike
vLLM's, which answers 200 without checking, an engine whose running requests hold cached blocks refuses and the
answer is a 409 (nothing changed there; retry when it is idle). vLLM's ``reset_running_requests`` (preempt the
running requests first) and ``reset_external`` (a KV connector's cache) are refused when true.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import ApiError, BackendError, bad_request
from gateway.routes.common import gateway_state

# What FastAPI reads as a bool query parameter (vLLM's route takes them so).
_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})
_NOT_SUPPORTED = {"reset_running_requests": "running requests are never preempted to reset the cache",
                  "reset_external": "Sluice's engines reset no external (KV connector) cache"}


def dev_routes() -> list[Route]:
    return [Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]


async def reset_prefix_cache(request: Request) -> Response:
    for name, why in _NOT_SUPPORTED.items():
        if _query_bool(request, name):
            raise bad_request(name, f"`{name}=true` is not supported: {why}.")
    state = gateway_state(request)
    try:
        ok = await state.backend.reset_prefix_cache(timeout=state.settings.unary_timeout)
    except BackendError as err:
        raise state.api_error(err) from None
    if not ok:
        raise ApiError(409, "The prefix cache was not reset: requests in progress hold cached blocks on an engine "
                            "(or one could not be reached). Retry when the server is idle.",
                       type="conflict_error", code="prefix_cache_in_use")
    return Response(status_code=200)


def _query_bool(request: Request, name: str) -> bool:
    value = request.query_params.get(name)
    if value is None or value.lower() in _FALSE:
        return False
    if value.lower() in _TRUE:
        return True
    raise bad_request(name, f"`{name}` must be a boolean, got {value[:50]!r}.")
