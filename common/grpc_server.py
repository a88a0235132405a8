"""What every Sluice gRPC server shares: the error interceptor, message limits, health, reflection,
and a stop signal (STYLE: gRPC servers look alike)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.grpc_errors import ErrorMappingInterceptor
from common.grpc_utf8 import DecodeErrorInterceptor
from common.tls import GrpcTls, bind_port

# What a client receives (our own answers: prompt logprobs of 128k tokens) and sends (prompts of 128k ids
# inline when shared memory is not available). A server's receive limit is sized from its model instead.
MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
# Room in a server's receive limit for a request's fields besides its prompt: sampling, stop strings, a guided
# decoding schema, a logit bias or allowed ids over a whole vocabulary (150k ids × 5 bytes is 0.75 MiB).
MESSAGE_HEADROOM_BYTES = 4 * 2**20


class Health:
    """The standard grpc.health.v1 service, for one named service and the whole server ("")."""

    def __init__(self, server: grpc.aio.Server, service_name: str) -> None:
        self._servicer = health.aio.HealthServicer()
        self._names = (service_name, "")
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._names:
            await self._servicer.set(name, status)


def new_server(service_name: str, *, max_receive_bytes: int,
               interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> tuple[grpc.aio.Server, Health]:
    """A grpc.aio server with the error interceptor (after ``interceptors``), reflection, and health starting
    NOT_SERVING. A request over ``max_receive_bytes`` is refused by gRPC (RESOURCE_EXHAUSTED) unread; one that
    does not parse (invalid UTF-8 in a string field) is INVALID_ARGUMENT naming the field."""
    server = grpc.aio.server(interceptors=[*interceptors, ErrorMappingInterceptor(), DecodeErrorInterceptor()],
                             # Two servers must never share a port silently.
                             options=[("grpc.max_receive_message_length", max_receive_bytes),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)])
    health_service = Health(server, service_name)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, health_service


def bind(server: grpc.aio.Server, host: str, port: int, tls: GrpcTls | None = None) -> int:
    """Listens on ``host:port``, with TLS when ``tls`` is given; returns the port bound."""
    bound = bind_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (drain, then exit)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    return stop
