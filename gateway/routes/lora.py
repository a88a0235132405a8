"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Success is vLLM's plain-text sentence; refusals are OpenAI error bodies. The backend
decides whether runtime updating is on (``--allow-runtime-lora-updating``): when it is
off the routes answer 404, as vLLM does by not mounting them.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.errors import ApiError, BackendError, BackendErrorKind, bad_request
from gateway.fields import validate
from gateway.models import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from gateway.routes.common import GatewayState, gateway_state, read_json

_RUNTIME_OFF = ("Loading and unloading LoRA adapters at runtime is off: start the engine with "
                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true).")


async def load_lora_adapter(request: Request) -> Response:
    state = gateway_state(request)
    req = validate(LoadLoraAdapterRequest, await read_json(request))
    name, path = _required("lora_name", req.lora_name), _required("lora_path", req.lora_path)
    base = req.base_model_name or ""
    try:
        if name in await state.models.names():  # requests naming it would never reach the adapter
            raise bad_request("lora_name", f"`lora_name` {name!r} is the served model's name.")
        await state.backend.load_lora_adapter(name, path, base, timeout=state.settings.unary_timeout)
    except BackendError as err:
        if err.kind is BackendErrorKind.ALREADY_EXISTS:
            raise bad_request("lora_name", f"The lora adapter '{name}' has already been loaded.") from None
        raise _refusal(state, err) from None
    finally:
        state.models.adapters_changed()
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = gateway_state(request)
    name = _required("lora_name", validate(UnloadLoraAdapterRequest, await read_json(request)).lora_name)
    try:
        await state.backend.unload_lora_adapter(name, timeout=state.settings.unary_timeout)
    except BackendError as err:
        if err.kind is BackendErrorKind.NOT_FOUND:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", type="not_found_error",
                           param="lora_name", code="lora_adapter_not_found") from None
        raise _refusal(state, err) from None
    finally:
        state.models.adapters_changed()
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _refusal(state: GatewayState, err: BackendError) -> ApiError:
    if err.kind is BackendErrorKind.FAILED_PRECONDITION:
        return ApiError(404, _RUNTIME_OFF, type="not_found_error", code="runtime_lora_updating_disabled")
    return state.api_error(err)  # INVALID_ARGUMENT: a 400 with the backend's message naming the file and field


def _required(name: str, value: str) -> str:
    if not value:
        raise bad_request(name, f"`{name}` is required.")
    return value
