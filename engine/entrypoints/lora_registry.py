"""The engine's LoRA adapters by name: what a request's adapter name means, and the runtime loads and unloads.

Requests name an adapter (REST ``model``, ``EngineGenerateRequest.lora_adapter``); the core knows adapters by
``lora_int_id`` only. The registry gives each adapter it loads a fresh id, never reused within the process: a name
loaded again after an unload gets a new id, so it never hits the prefix-cache blocks computed with the weights the
name had before. A name is listed only once its adapter is loaded, and unlisted at once when unloaded (the core
frees the weights when the adapter's last running request ends).
"""

from __future__ import annotations

from itertools import count
from typing import Protocol

from common.errors import AlreadyExistsError, FailedPreconditionError, InvalidRequestError, NotFoundError
from engine.config import EngineConfig
from engine.core.lora_request import LoRARequest


class LoRANotFoundError(NotFoundError):
    """A request names no adapter this engine serves (gRPC NOT_FOUND; REST 404 ``model_not_found``)."""


class LoRAAdapterNotFoundError(NotFoundError):
    """An unload names an adapter that is not loaded (gRPC NOT_FOUND; REST 404)."""


class LoRAAdapterExistsError(AlreadyExistsError):
    """A load names an adapter that is loaded, or being loaded (gRPC ALREADY_EXISTS; REST 400, as vLLM)."""


class LoRAUpdatesDisabledError(FailedPreconditionError):
    """Runtime loads and unloads are off (gRPC FAILED_PRECONDITION)."""


class AdapterLoader(Protocol):
    """What loads and forgets adapters' weights: the ``EngineCore`` (``add_lora`` validates the folder)."""

    def add_lora(self, lora: LoRARequest) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...


class LoRARegistry:
    """Adapter names → LoRARequest, in the order they were loaded. Used from one event loop (not thread-safe);
    the loading itself runs where the core runs (see ``engine.entrypoints.grpc_lora``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.served_model_name = config.model_name
        self.lora_config = config.lora_config
        self._adapters: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()   # names reserved by a load in progress
        self._ids = count(1)

    @property
    def enabled(self) -> bool:
        return self.lora_config is not None

    def adapters(self) -> list[LoRARequest]:
        """The adapters loaded, in load order."""
        return list(self._adapters.values())

    def parent(self, lora: LoRARequest) -> str:
        """The model the adapter was fine-tuned from, for listings: as given, else the served model."""
        return lora.base_model_name or self.served_model_name

    def resolve(self, name: str) -> LoRARequest | None:
        """The adapter a request names: None for the base model (no name, or the served model's); raises
        LoRANotFoundError (vLLM's message) for any other name, LoRA on or off."""
        if not name or name == self.served_model_name:
            return None
        lora = self._adapters.get(name)
        if lora is None:
            raise LoRANotFoundError(f"The model `{name}` does not exist.")
        return lora

    def check_runtime_updates(self) -> None:
        """Raise LoRAUpdatesDisabledError unless clients may load and unload adapters."""
        if self.lora_config is None:
            raise LoRAUpdatesDisabledError("LoRA is not enabled: start the engine with --enable-lora and "
                                           "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) "
                                           "to load adapters at runtime")
        if not self.lora_config.allow_runtime_lora_updating:
            raise LoRAUpdatesDisabledError("loading and unloading LoRA adapters at runtime is off: start the engine "
                                           "with --allow-runtime-lora-updating (or "
                                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")

    # -- loading: reserve → (the core loads it) → commit, or release on failure ------------------------------
    def reserve(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A new adapter under ``name`` with a fresh id, the name held until ``commit`` or ``release``.

        Raises InvalidRequestError (an empty name or path, the served model's name) or LoRAAdapterExistsError."""
        if not name:
            raise InvalidRequestError("lora_name", "is required")
        if not path:
            raise InvalidRequestError("lora_path", "is required")
        if name == self.served_model_name:
            raise InvalidRequestError("lora_name", f"{name!r} is the served model's name")
        if name in self._adapters or name in self._loading:
            raise LoRAAdapterExistsError(f"The lora adapter '{name}' has already been loaded.")
        self._loading.add(name)
        return LoRARequest(name, next(self._ids), path, base_model_name or None)

    def commit(self, lora: LoRARequest) -> None:
        """List a reserved adapter that the core has loaded: requests may use it from now on."""
        self._loading.remove(lora.lora_name)
        self._adapters[lora.lora_name] = lora

    def release(self, lora: LoRARequest) -> None:
        """Give up a reserved name (its load failed)."""
        self._loading.discard(lora.lora_name)

    def remove(self, name: str) -> LoRARequest:
        """Unlist an adapter now (requests naming it are NOT_FOUND from here on); returns it, for the core to
        free. Raises LoRAAdapterNotFoundError (vLLM's message) when no adapter has that name."""
        lora = self._adapters.pop(name, None)
        if lora is None:
            raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
        return lora

    def load_startup_modules(self, loader: AdapterLoader) -> None:
        """Load and validate every ``--lora-modules`` adapter (on the core's thread, before serving). A bad one
        raises InvalidRequestError naming the adapter, its file and the field: start-up stops."""
        if self.lora_config is None:
            return
        for module in self.lora_config.lora_modules:
            lora = self.reserve(module.name, module.path, module.base_model_name)
            try:
                loader.add_lora(lora)
            except InvalidRequestError as e:
                self.release(lora)
                raise InvalidRequestError(e.field, f"--lora-modules {module.name}={module.path}: {e.message}") from e
            except BaseException:
                self.release(lora)
                raise
            self.commit(lora)
