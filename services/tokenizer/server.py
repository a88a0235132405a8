"""Process wiring of the tokenizer service: grpc.aio server, health, reflection, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.grpc_server import CHANNEL_OPTIONS, Health, bind, new_server, stop_event
from common.tls import GrpcTls, aio_channel
from common.tracing import Tracing
from engine.config import DEFAULT_SERVED_NAME, default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import generation_pb2_grpc
from services.tokenizer.limits import InputLimits
from services.tokenizer.service import GenerationServicer
from services.tokenizer.tools import ToolSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Generation"


async def serve(*, engine_addr: str, host: str, port: int, model: str | None, tokenizer: str | None,
                served_model_name: str | None, shm_tokens: int, shutdown_grace: float = 10.0,
                chat_template: str | None = None, tools: ToolSettings | None = None,
                limits: InputLimits | None = None, tracing: Tracing | None = None, log_requests: bool = False,
                tls: GrpcTls | None = None) -> None:
    """``tls``: TLS on this service's port and on its channel to the engine (None: plaintext);
    ``chat_template``: the template text (``--chat-template``, already read), used instead of the model's;
    ``tracing``: a span per generation (None: off); ``log_requests``: a line per request received and finished."""
    model_path = model or default_model_path()
    tok = Tokenizer.from_pretrained(tokenizer or model_path)
    if chat_template is not None:
        tok.chat_template = chat_template
    channel = aio_channel(engine_addr, tls, options=CHANNEL_OPTIONS)
    server, health_service = new_server(SERVICE_NAME)
    name = served_model_name or (DEFAULT_SERVED_NAME if model is None else None)
    if name is None:
        from engine.config import EngineConfig

        name = EngineConfig(model=model).model_name
    servicer = GenerationServicer(tok, channel, served_model_name=name, model_path=model_path,
                                  shm_tokens=shm_tokens, tools=tools, limits=limits, tracing=tracing,
                                  log_requests=log_requests)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    await health_service.set_serving(False)
    bind_port = bind(server, host, port, tls)
    await server.start()
    stop = stop_event()
    watcher = asyncio.create_task(track_engine(servicer, channel, health_service, stop))
    logger.info("tokenizer service on %s:%d, engine at %s", host, bind_port, engine_addr)
    await stop.wait()
    watcher.cancel()
    servicer.drain()  # before NOT_SERVING: whoever sees that finds new stream requests refused
    await health_service.set_serving(False)
    await server.stop(shutdown_grace)
    servicer.close()
    await channel.close()


async def track_engine(servicer: GenerationServicer, channel: grpc.aio.Channel,
                        health_service: Health, stop: asyncio.Event) -> None:
    """SERVING while connected to an engine that answered GetInfo on this connection; NOT_SERVING from the
    moment the connection is lost. A new connection is a new engine as far as we can tell (a process that
    dies closes its sockets; the restarted one is reached over a new connection): its first answer hands our
    shared memory and info over again.

    Liveness follows the connection, never a call's latency: a stalled or overloaded engine (SIGSTOP, a step
    of minutes) keeps its connection, so GetInfo is sent with no deadline and waited for as long as it takes,
    and nothing here ever ends a request. Requests on a connection that is really gone fail by themselves:
    gRPC ends every call on it with UNAVAILABLE (within milliseconds of a SIGKILL).
    """
    serving: bool | None = None
    answered = False  # the engine answered on the current connection
    ever_answered = False

    async def set_serving(ok: bool) -> None:
        nonlocal serving
        if ok != serving:
            await health_service.set_serving(ok)
            serving = ok

    while not stop.is_set():
        state = channel.get_state(try_to_connect=True)
        if state is not grpc.ChannelConnectivity.READY:
            answered = False
            await set_serving(False)
            await _state_change(channel, state, 0.25)
            continue
        if not answered and ever_answered:
            servicer.engine_restarted()
        try:
            await servicer.engine_info(refresh=True, timeout=None)
        except grpc.aio.AioRpcError as error:
            # The connection went (it ended the call), or the engine answered with an error: not ready
            # until it answers, and that answer is handled as a new engine's.
            answered = False
            if error.code() is not grpc.StatusCode.UNAVAILABLE:
                logger.warning("engine GetInfo failed: %s %s", error.code().name, error.details())
            await set_serving(False)
            await _state_change(channel, grpc.ChannelConnectivity.READY, 0.25)
            continue
        answered = ever_answered = True
        await set_serving(True)
        # At once when the connection changes (a dying engine drops it): readiness follows within
        # milliseconds; else the info is refreshed every second (the LoRA adapters loaded, the load).
        if await _state_change(channel, grpc.ChannelConnectivity.READY, 1.0):
            answered = False  # lost, even if it is READY again by the time we look


async def _state_change(channel: grpc.aio.Channel, state: grpc.ChannelConnectivity, timeout: float) -> bool:
    """Whether ``channel`` left ``state`` within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(channel.wait_for_state_change(state), timeout)
    except TimeoutError:
        return False
    return True
