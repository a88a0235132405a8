"""Sluice's typed errors: raised by the engine, mapped to gRPC status codes (common.grpc_errors) and to
OpenAI error bodies."""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error Sluice raises on purpose."""


class InvalidRequestError(SluiceError, ValueError):
    """A request argument is invalid. ``field`` names it (e.g. ``"temperature"``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFoundError(SluiceError):
    """What a request names does not exist: a model, a LoRA adapter (gRPC NOT_FOUND, REST 404)."""


class AlreadyExistsError(SluiceError):
    """What a request would create exists already, e.g. a LoRA adapter's name (gRPC ALREADY_EXISTS)."""


class FailedPreconditionError(SluiceError):
    """The server was not started to allow this, e.g. runtime LoRA loading (gRPC FAILED_PRECONDITION)."""


class QueueFullError(SluiceError):
    """The bounded waiting queue is full, or the engine is overloaded; the request was not accepted.
    ``retry_after_s``: when the engine expects to have room (None: unsaid)."""

    def __init__(self, message: str = "", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(SluiceError):
    """The engine loop has stopped; no request can be served."""
