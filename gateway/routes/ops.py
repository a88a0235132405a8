"""Operational routes: liveness, readiness, the model list, Prometheus metrics."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, BackendError
from gateway.routes.common import gateway_state


async def health(request: Request) -> Response:
    """Liveness: this process answers. Says nothing about the backend (see /ready)."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: a backend is reachable and serving, asked with a short deadline."""
    state = gateway_state(request)
    if await state.backend.check_ready(timeout=state.settings.ready_timeout):
        return JSONResponse({"status": "ready"})
    err = ApiError(503, "The model backend is not ready.", type="service_unavailable_error",
                   code="backend_unavailable", headers={"Retry-After": str(state.settings.retry_after_seconds)})
    return err.response()


async def list_models(request: Request) -> Response:
    """The served model(s), then each LoRA adapter with the model it was fine-tuned from as its ``parent``
    (vLLM's listing)."""
    state = gateway_state(request)
    try:
        names = await state.models.names()
        # vLLM lists max_model_len with each model; clients size their prompts from it.
        info = await state.models.info(state.settings.unary_timeout)
    except BackendError as err:
        raise state.api_error(err) from None
    created = int(time.time())
    entries = [(name, None) for name in names] + [(a.name, a.base_model_name) for a in info.lora_adapters]
    data = [{"id": name, "object": "model", "created": created, "owned_by": "sluice", "root": name,
             "parent": parent, "max_model_len": info.max_model_len} for name, parent in entries]
    return JSONResponse({"object": "list", "data": data})


async def metrics(request: Request) -> Response:
    body, content_type = await gateway_state(request).metrics.render()
    return Response(body, media_type=content_type)
