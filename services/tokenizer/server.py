"""Process wiring of the tokenizer service: grpc.aio server, health, reflection, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence

import grpc

from common.auth import ApiKeyInterceptor
from common.grpc_server import CHANNEL_OPTIONS, Health, bind, new_server, stop_event
from common.tls import GrpcTls, aio_channel
from common.tracing import Tracing
from engine.config import DEFAULT_SERVED_NAME, default_model_path
from engine.entrypoints.model_limits import model_context_length
from engine.text import Tokenizer
from proto.sluice.v1 import generation_pb2_grpc
from services.tokenizer.engines import Engine
from services.tokenizer.limits import InputLimits, max_message_bytes
from services.tokenizer.migration import MigrationMetrics, MigrationSettings
from services.tokenizer.multimodal import ChatImages, MediaSettings
from services.tokenizer.reasoning import Reasoning
from services.tokenizer.routing import RoutingSettings
from services.tokenizer.service import GenerationServicer
from services.tokenizer.tools import ToolSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Generation"


async def serve(*, engine_addrs: Sequence[str], host: str, port: int, model: str | None, tokenizer: str | None,
                served_model_name: str | None, shm_tokens: int, shutdown_grace: float = 10.0,
                chat_template: str | None = None, tools: ToolSettings | None = None,
                limits: InputLimits | None = None, tracing: Tracing | None = None, log_requests: bool = False,
                tls: GrpcTls | None = None, api_keys: Sequence[str] = (), reasoning_parser: str | None = None,
                routing: RoutingSettings | None = None, migration: MigrationSettings | None = None,
                migration_metrics: MigrationMetrics | None = None, media: MediaSettings | None = None) -> None:
    """``engine_addrs``: the engines this service sends requests to (several: the replicas of ``sluice serve -dp``,
    chosen per request by ``routing``); ``tls``: TLS on this service's port and on its channels to the engines
    (None: plaintext);
    ``chat_template``: the template text (``--chat-template``, already read), used instead of the model's;
    ``tracing``: a span per generation (None: off); ``log_requests``: a line per request received and finished;
    ``api_keys``: the keys every call but health and reflection must carry (none: no key asked for);
    ``reasoning_parser``: splits chat outputs into thinking and answer (``--reasoning-parser``); exits 2 when the
    model's vocabulary lacks its tags; ``migration``: how requests move off an engine that died
    (services/tokenizer/migration.py), counted in ``migration_metrics``; ``media``: image inputs' limits (a
    vision-language model's processor is loaded from ``model``'s directory)."""
    model_path = model or default_model_path()
    tok = Tokenizer.from_pretrained(tokenizer or model_path)
    if chat_template is not None:
        tok.chat_template = chat_template
    try:
        reasoning = Reasoning.load(reasoning_parser, tok) if reasoning_parser is not None else None
    except ValueError as e:
        logger.error("%s", e)
        raise SystemExit(2) from e
    engines = [Engine(aio_channel(addr, tls, options=CHANNEL_OPTIONS), addr) for addr in engine_addrs]
    name = served_model_name or (DEFAULT_SERVED_NAME if model is None else None)
    if name is None:
        from engine.config import EngineConfig

        name = EngineConfig(model=model).model_name
    images = ChatImages.load(model_path, media or MediaSettings(), name, chat_template)
    server, health_service = public_server(tok, model_context_length(model_path), api_keys, images.message_bytes())
    servicer = GenerationServicer(tok, engines, served_model_name=name,
                                  shm_tokens=shm_tokens, tools=tools, limits=limits, tracing=tracing,
                                  log_requests=log_requests, reasoning=reasoning, routing=routing,
                                  migration=migration, migration_metrics=migration_metrics,
                                  images=images)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    await health_service.set_serving(False)
    bind_port = bind(server, host, port, tls)
    await server.start()
    stop = stop_event()
    watcher = asyncio.create_task(track_engines(servicer, health_service, stop))
    if len(engines) == 1:
        logger.info("tokenizer service on %s:%d, engine at %s", host, bind_port, engine_addrs[0])
    else:
        policy = servicer.router.settings.policy_for(len(engines))
        logger.info("tokenizer service on %s:%d, engines at %s, routing %s", host, bind_port, ", ".join(engine_addrs),
                    policy)
        if policy == "kv_aware" and "PYTHONHASHSEED" not in os.environ:
            logger.warning("kv_aware routing without PYTHONHASHSEED: prompt block hashes here can never match the "
                           "engines' (run this service with the engines' PYTHONHASHSEED); routing by load alone")
    await stop.wait()
    watcher.cancel()
    servicer.drain()  # before NOT_SERVING: whoever sees that finds new stream requests refused
    await health_service.set_serving(False)
    await server.stop(shutdown_grace)
    servicer.close()
    for engine in engines:
        await engine.channel.close()


def public_server(tokenizer: Tokenizer, context_length: int, api_keys: Sequence[str], image_bytes: int = 0
                  ) -> tuple[grpc.aio.Server, Health]:
    """The public API's server: it asks for ``api_keys`` when there are any, and receives no message larger
    than the longest prompt the model can take (``context_length`` tokens, the model's: its engine may take
    fewer) with room for the other fields, and ``image_bytes`` for a vision-language model's images."""
    limit = max_message_bytes(context_length, tokenizer.max_token_bytes,
                              normalized=tokenizer.backend.normalizer is not None) + image_bytes
    return new_server(SERVICE_NAME, max_receive_bytes=limit,
                      interceptors=[ApiKeyInterceptor(api_keys)] if api_keys else [])


async def track_engines(servicer: GenerationServicer, health_service: Health, stop: asyncio.Event) -> None:
    """SERVING while any of the servicer's engines is up (:func:`track_engine`, one per engine): requests go only
    to engines that are up, so a replica that is down or restarting is routed around."""
    serving: bool | None = None
    lock = asyncio.Lock()

    async def changed() -> None:
        nonlocal serving
        async with lock:
            ok = any(e.up for e in servicer.engines)
            if ok != serving:
                await health_service.set_serving(ok)
                serving = ok

    await asyncio.gather(*(track_engine(servicer, engine, changed, stop) for engine in servicer.engines))


async def track_engine(servicer: GenerationServicer, engine: Engine, changed: Callable[[], Awaitable[None]],
                       stop: asyncio.Event) -> None:
    """``engine.up`` while connected to an engine that answered GetInfo on this connection; not from the moment
    the connection is lost (``changed`` is awaited after each change). Which engine answered is told by its
    instance id, not by the connection: the servicer hands our shared memory over again when the id changes
    (``engine_info``), and a reconnect to the same engine (a dropped connection, a proxy restarted) keeps
    everything.

    Liveness follows the connection, never a call's latency: a stalled or overloaded engine (SIGSTOP, a step
    of minutes) keeps its connection, so GetInfo is sent with no deadline and waited for as long as it takes,
    and nothing here ever ends a request. Requests on a connection that is really gone fail by themselves:
    gRPC ends every call on it with UNAVAILABLE (within milliseconds of a SIGKILL).
    """
    channel = engine.channel

    async def set_up(ok: bool) -> None:
        if ok != engine.up:
            engine.up = ok
            await changed()

    await changed()
    while not stop.is_set():
        state = channel.get_state(try_to_connect=True)
        if state is not grpc.ChannelConnectivity.READY:
            await set_up(False)
            await _state_change(channel, state, 0.25)
            continue
        try:
            await servicer.engine_info(refresh=True, timeout=None, engine=engine)
        except grpc.aio.AioRpcError as error:
            # The connection went (it ended the call), or the engine answered with an error: not ready
            # until it answers.
            if error.code() is not grpc.StatusCode.UNAVAILABLE:
                logger.warning("%s: GetInfo failed: %s %s", engine.name, error.code().name, error.details())
            await set_up(False)
            await _state_change(channel, grpc.ChannelConnectivity.READY, 0.25)
            continue
        await set_up(True)
        # At once when the connection changes (a dying engine drops it): readiness follows within
        # milliseconds; else the info is refreshed every second (the LoRA adapters loaded, the load, the id).
        await _state_change(channel, grpc.ChannelConnectivity.READY, 1.0)


async def _state_change(channel: grpc.aio.Channel, state: grpc.ChannelConnectivity, timeout: float) -> bool:
    """Whether ``channel`` left ``state`` within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(channel.wait_for_state_change(state), timeout)
    except TimeoutError:
        return False
    return True
