"""A tiny OpenAI-style SSE server with deterministic delays, run in-process on 127.0.0.1 for the tests."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeBehaviour:
    first_token_delay_s: float = 0.05
    token_delay_s: float = 0.005
    send_usage: bool = True
    fail_marker: str = "FAIL"  # prompts containing it get HTTP 500
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every request body received


def _stream(body: dict[str, Any], b: FakeBehaviour) -> AsyncIterator[str]:
    chat = "messages" in body
    n = int(body["max_tokens"])

    def chunk(text: str) -> str:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"

    async def gen() -> AsyncIterator[str]:
        yield ": keep-alive\n\n"
        if chat:  # the role-only first chunk of OpenAI chat streams: not a content token
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
        await asyncio.sleep(b.first_token_delay_s)
        for i in range(n):
            if i:
                await asyncio.sleep(b.token_delay_s)
            yield chunk(f" tok{i}")
        finish: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            finish["delta"] = {}
        else:
            finish["text"] = ""
        yield f"data: {json.dumps({'choices': [finish]})}\n\n"
        if b.send_usage:
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return gen()


def make_app(b: FakeBehaviour) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        b.bodies.append(body)
        text = body.get("prompt") or body["messages"][-1]["content"]
        if b.fail_marker in text:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        return StreamingResponse(_stream(body, b), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def ready(_: Request) -> Response:
        return JSONResponse({"status": "ready"})

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/models", models), Route("/ready", ready)])


class FakeServer:
    """Context manager: serves ``make_app(behaviour)`` on a free 127.0.0.1 port in a thread."""

    def __init__(self, behaviour: FakeBehaviour) -> None:
        self.behaviour = behaviour
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(make_app(behaviour), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeServer:
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            threading.Event().wait(0.01)
        raise RuntimeError("fake server did not start")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


if __name__ == "__main__":  # as a process, for the compare tests: python -m tests.benchmarks.fake_server --port N
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(make_app(FakeBehaviour()), host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
