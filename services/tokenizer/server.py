"""Process wiring of the tokenizer service: grpc.aio server, health, reflection, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.grpc_server import CHANNEL_OPTIONS, Health, bind, new_server, stop_event
from engine.config import DEFAULT_SERVED_NAME, default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import generation_pb2_grpc
from services.tokenizer.service import GenerationServicer
from services.tokenizer.tools import ToolSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Generation"


async def serve(*, engine_addr: str, host: str, port: int, model: str | None, tokenizer: str | None,
                served_model_name: str | None, shm_tokens: int, shutdown_grace: float = 10.0,
                chat_template: str | None = None, tools: ToolSettings | None = None) -> None:
    """``chat_template``: the template text (``--chat-template``, already read), used instead of the model's."""
    model_path = model or default_model_path()
    tok = Tokenizer.from_pretrained(tokenizer or model_path)
    if chat_template is not None:
        tok.chat_template = chat_template
    channel = grpc.aio.insecure_channel(engine_addr, options=CHANNEL_OPTIONS)
    server, health_service = new_server(SERVICE_NAME)
    name = served_model_name or (DEFAULT_SERVED_NAME if model is None else None)
    if name is None:
        from engine.config import EngineConfig

        name = EngineConfig(model=model).model_name
    servicer = GenerationServicer(tok, channel, served_model_name=name, model_path=model_path,
                                  shm_tokens=shm_tokens, tools=tools)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    await health_service.set_serving(False)
    bind_port = bind(server, host, port)
    await server.start()
    stop = stop_event()
    watcher = asyncio.create_task(_track_engine(servicer, channel, health_service, stop))
    logger.info("tokenizer service on %s:%d, engine at %s", host, bind_port, engine_addr)
    await stop.wait()
    watcher.cancel()
    servicer.drain()  # before NOT_SERVING: whoever sees that finds new stream requests refused
    await health_service.set_serving(False)
    await server.stop(shutdown_grace)
    servicer.close()
    await channel.close()


async def _track_engine(servicer: GenerationServicer, channel: grpc.aio.Channel,
                        health_service: Health, stop: asyncio.Event) -> None:
    """SERVING while the engine answers GetInfo; re-registers shared memory after an engine restart.

    Probes every second, and at once when the engine connection changes state (an engine that dies
    drops the connection, so readiness follows within milliseconds, not a polling period).
    """
    serving: bool | None = None
    while not stop.is_set():
        try:
            await servicer.engine_info(refresh=True)
            ok = True
        except grpc.aio.AioRpcError:
            ok = False
        if ok and serving is False:
            servicer.engine_restarted()
        if ok != serving:
            await health_service.set_serving(ok)
            serving = ok
        state = channel.get_state(try_to_connect=True)
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), 1.0 if ok else 0.25)
        except TimeoutError:
            pass
