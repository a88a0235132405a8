"""API keys: where a process gets them, how they are compared, and the gRPC interceptor that asks for them.

One key source for every process that takes keys (the gateway, the tokenizer service, ``sluice serve``):
``--api-key`` (repeatable) and ``--api-key-file`` (one key per line; the key stays out of ``ps``), else
``SLUICE_API_KEY`` / ``VLLM_API_KEY`` (common.settings). A key is printable ASCII without spaces, because
it travels as ``authorization: Bearer <key>`` in an HTTP header or in gRPC metadata, which carries
nothing else.

On the public gRPC API every call carries the key in its ``authorization`` metadata, checked once per call
(a ``GenerateStream`` once, however many requests it carries); health and reflection stay open, as
``/health`` is on REST: probes carry no key, and reflection describes only what the .proto files publish.
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from common.settings import api_key

# Methods under these prefixes need no key.
OPEN_GRPC_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                      "/grpc.reflection.v1.ServerReflection/")
MISSING_KEY = "missing API key: send `authorization: Bearer <key>` metadata"
INVALID_KEY = "invalid API key"


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="accepted bearer key (repeatable; it shows in `ps`: prefer --api-key-file); default: "
                             "$SLUICE_API_KEY, else $VLLM_API_KEY; none: no key asked for")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="a file of accepted bearer keys, one per line (blank lines ignored), taken with any "
                             "--api-key")


def api_keys(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys of ``--api-key`` and ``--api-key-file`` together, else the environment's; () when none.
    Raises ValueError naming the flag or file at fault."""
    keys = [*(ns.api_key or ()), *(read_key_file(ns.api_key_file) if ns.api_key_file is not None else ())]
    if not keys and (env_key := api_key(environ)) is not None:
        keys = [env_key]
    for key in keys:
        if not is_valid_key(key):
            raise ValueError("an API key must be printable ASCII without spaces (it travels as "
                             "`authorization: Bearer <key>`)")
    return tuple(dict.fromkeys(keys))


def read_key_file(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: {getattr(e, 'strerror', None) or e}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip()]
    if not keys:
        raise ValueError(f"--api-key-file {path}: the file has no keys")
    return keys


def is_valid_key(key: str) -> bool:
    return bool(key) and all("!" <= c <= "~" for c in key)


def key_matches(presented: bytes, keys: Sequence[bytes]) -> bool:
    """Whether ``presented`` is one of ``keys``, in time that tells neither which one nor how much matched."""
    matched = False
    for key in keys:  # compare with every key
        matched |= hmac.compare_digest(presented, key)
    return matched


def bearer_metadata(key: str) -> tuple[str, str]:
    """The metadata entry a gRPC client sends ``key`` in."""
    return ("authorization", f"Bearer {key}")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without one of ``keys`` in its ``authorization: Bearer`` metadata, before its
    request is read; health and reflection calls pass. Install it first, ahead of every other interceptor."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = tuple(k.encode("ascii") for k in keys)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        if details.method.startswith(OPEN_GRPC_SERVICES):
            return await continuation(details)
        token = _bearer_token(details.invocation_metadata or ())
        if token is not None and key_matches(token, self._keys):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else _refusal(handler, MISSING_KEY if token is None else INVALID_KEY)


def _bearer_token(metadata: Sequence[tuple[str, str | bytes]]) -> bytes | None:
    for key, value in metadata:
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            return token.strip().encode("utf-8", "replace") if scheme.lower() == "bearer" else None
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call UNAUTHENTICATED without reading its request
    (no deserializer: the bytes are never parsed)."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover — abort raises; this only makes the function a generator

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(streaming, response_serializer=handler.response_serializer)
