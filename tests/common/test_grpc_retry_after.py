"""A refusal's retry hint on the wire (common.grpc_errors): an overloaded engine's QueueFullError puts its
``retry_after_s`` in the ``retry-after`` trailer the gateway reads (gateway.client.to_backend_error), and a
service passes a downstream call's trailer on."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from common.errors import QueueFullError
from common.grpc_errors import RETRY_AFTER_KEY, _abort_with, retry_after_s
from gateway.client import to_backend_error


class Context:
    def __init__(self) -> None:
        self.trailing: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*self.trailing), details)


def abort(exc: Exception) -> grpc.aio.AioRpcError:
    context: Any = Context()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_abort_with(exc, context))
    return err.value


def test_an_overloaded_engines_hint_reaches_the_gateway() -> None:
    err = abort(QueueFullError("overloaded", retry_after_s=3))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert tuple(err.trailing_metadata()) == ((RETRY_AFTER_KEY, "3"),)
    backend = to_backend_error(err)
    assert backend.retry_after == 3 and backend.message == "overloaded"


def test_a_full_queue_says_nothing_and_a_downstream_hint_is_passed_on() -> None:
    assert tuple(abort(QueueFullError("full")).trailing_metadata()) == ()
    downstream = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                      grpc.aio.Metadata((RETRY_AFTER_KEY, "7")), "overloaded")
    assert retry_after_s(downstream) == 7
    assert tuple(abort(downstream).trailing_metadata()) == ((RETRY_AFTER_KEY, "7"),)
