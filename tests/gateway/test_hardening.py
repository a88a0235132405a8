"""Hostile input at the gateway: text that is not UTF-8, bodies without a JSON content type, bodies
past the model-sized limit, and clients that send their request too slowly."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.backend import ModelInfo
from gateway.drain import Drain
from gateway.errors import BackendError, BackendErrorKind
from gateway.routes.common import FALLBACK_MAX_BODY_BYTES, GatewayState, ServedModels, body_limit_for
from gateway.server import DrainingServer, build_server
from gateway.settings import GatewaySettings
from tests.gateway.conftest import SERVED, Gateway, GatewayFactory
from tests.gateway.fakes import FakeServer
from tests.gateway.test_error_matrix import check_error_body

pytestmark = pytest.mark.anyio

LONE = "\ud800"
JSON = {"Content-Type": "application/json"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "enum": ["x"]}}}
# Every string of these bodies is a text field that reaches the backend (or names one).
CHAT_BODY: dict[str, Any] = {
    "model": SERVED, "user": "u", "stop": ["END"], "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"flag": "on"},
    "messages": [
        {"role": "system", "content": "be brief", "name": "boss"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "description": "weather", "parameters": SCHEMA}}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
}
COMPLETION_BODY: dict[str, Any] = {"model": SERVED, "prompt": ["one", "two"], "stop": "END", "guided_regex": "a+"}
GUIDED: list[dict[str, Any]] = [{"guided_json": json.dumps(SCHEMA)}, {"guided_choice": ["yes", "no"]},
                                {"guided_grammar": "root ::= \"a\""}]


def string_leaves(value: object, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(field path, container, key) of every string in ``value``."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip(".")
        if isinstance(item, str):
            assert isinstance(value, (list, dict))
            yield name, value, key
        else:
            yield from string_leaves(item, name)


def with_lone_surrogates() -> Iterator[tuple[str, str, bytes]]:
    """(route, field, body) with "\\ud800" appended to one string field, for every field of every body."""
    bodies = [("/v1/chat/completions", CHAT_BODY), ("/v1/completions", COMPLETION_BODY),
              *(("/v1/completions", {**COMPLETION_BODY, **g}) for g in GUIDED),
              ("/tokenize", {"model": SERVED, "prompt": "hi"}),
              ("/tokenize", {"model": SERVED, "messages": CHAT_BODY["messages"], "chat_template": "{{ x }}"}),
              ("/detokenize", {"model": SERVED, "tokens": [1]})]
    for route, body in bodies:
        for name, _, _ in string_leaves(body):
            copy = json.loads(json.dumps(body))
            for leaf, container, key in string_leaves(copy):
                if leaf == name:
                    container[key] += LONE
            # ensure_ascii: the body carries the escape "\ud800", as a JSON client would send it
            yield route, name, json.dumps(copy).encode()


SURROGATE_CASES = list(with_lone_surrogates())


def test_the_cases_cover_every_named_field() -> None:
    fields = {(route, name) for route, name, _ in SURROGATE_CASES}
    for expected in [("/v1/completions", "prompt[1]"), ("/v1/completions", "stop"), ("/v1/completions", "model"),
                     ("/v1/completions", "guided_regex"), ("/v1/completions", "guided_json"),
                     ("/v1/completions", "guided_choice[0]"), ("/v1/completions", "guided_grammar"),
                     ("/v1/chat/completions", "messages[0].content"), ("/v1/chat/completions", "messages[0].name"),
                     ("/v1/chat/completions", "messages[1].content[1].text"),
                     ("/v1/chat/completions", "messages[2].tool_calls[0].function.arguments"),
                     ("/v1/chat/completions", "stop[0]"), ("/v1/chat/completions", "chat_template"),
                     ("/v1/chat/completions", "response_format.json_schema.schema.properties.a.enum[0]"),
                     ("/v1/chat/completions", "tools[0].function.description"),
                     ("/tokenize", "prompt"), ("/tokenize", "messages[3].content"), ("/detokenize", "model")]:
        assert expected in fields


@pytest.mark.parametrize("route,name,body", SURROGATE_CASES, ids=[f"{r}:{n}" for r, n, _ in SURROGATE_CASES])
async def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(gateway: Gateway, route: str, name: str,
                                                                 body: bytes) -> None:
    r = await gateway.client.post(route, content=body, headers=JSON)
    err = check_error_body(r, 400, name)
    assert err["message"] == f"`{name}` is not valid UTF-8 text: it holds a lone UTF-16 surrogate (such as \\ud800)."
    assert gateway.backend_calls.generate_requests == []
    assert [m for m in gateway.backend_calls.unary_requests if type(m).__name__ != "GetModelInfoRequest"] == []


async def test_raw_surrogate_bytes_and_surrogate_names_are_refused(gateway: Gateway) -> None:
    # json.loads lets the UTF-8-like bytes of a surrogate through as one.
    raw = b'{"model": "' + SERVED.encode() + b'", "prompt": "a\xed\xa0\x80b"}'
    check_error_body(await gateway.client.post("/v1/completions", content=raw, headers=JSON), 400, "prompt")
    body = json.dumps({"prompt": "x", "logit_bias": {LONE: 1}}).encode()
    err = check_error_body(await gateway.client.post("/v1/completions", content=body, headers=JSON), 400,
                           "logit_bias")
    assert err["message"].startswith("`logit_bias` has a field name that is not valid UTF-8 text")
    body = json.dumps({"prompt": "x", LONE: 1}).encode()
    check_error_body(await gateway.client.post("/v1/completions", content=body, headers=JSON), 400, None)
    assert gateway.backend_calls.generate_requests == []


async def test_a_paired_surrogate_is_text(gateway: Gateway) -> None:
    body = json.dumps({"model": SERVED, "prompt": "smile \U0001f600"}).encode()  # sent as "\ud83d\ude00"
    r = await gateway.client.post("/v1/completions", content=body, headers=JSON)
    assert r.status_code == 200, r.text
    assert gateway.backend_calls.generate_requests[0].text == "smile \U0001f600"


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonp", "json"])
async def test_a_body_without_a_json_content_type_is_a_415(gateway: Gateway, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = json.dumps({"model": SERVED, "prompt": "hello"}).encode()
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter"):
        r = await gateway.client.post(route, content=body, headers=headers)
        err = check_error_body(r, 415)
        assert err["code"] == "unsupported_media_type"
        got = "none" if content_type is None else repr(content_type)
        assert err["message"] == ("The request body must be JSON, sent with `Content-Type: application/json` "
                                  f"(got {got}).")
    assert gateway.backend_calls.generate_requests == []


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON ; charset=UTF-8"])
async def test_a_json_content_type_with_or_without_charset_is_read(gateway: Gateway, content_type: str) -> None:
    body = json.dumps({"model": SERVED, "prompt": "hello"}).encode()
    r = await gateway.client.post("/v1/completions", content=body, headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello world"


async def test_the_body_limit_is_sized_from_the_models_context_length(make_gateway: GatewayFactory) -> None:
    limit = body_limit_for(2048)  # the fake backend's max_model_len
    assert limit == 2048 * 16 + 1024 * 1024
    async with make_gateway() as gw:
        prefix = json.dumps({"model": SERVED, "prompt": ""}).encode()[:-2]
        fits = prefix + b"x" * (limit - len(prefix) - 2) + b'"}'
        assert len(fits) == limit
        r = await gw.client.post("/v1/completions", content=fits, headers=JSON)
        assert r.status_code == 200, r.text
        r = await gw.client.post("/v1/completions", content=fits[:-2] + b'x"}', headers=JSON)
        err = check_error_body(r, 413)
        assert err["message"] == f"The request body is larger than {limit} bytes, this server's limit."
        assert err["code"] == "request_too_large"
        assert len(gw.backend_calls.generate_requests) == 1


class _Models:
    """A backend that answers model info only when told to."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0

    async def model_info(self, *, timeout: float | None) -> ModelInfo:
        self.calls += 1
        if not self.up:
            raise BackendError(BackendErrorKind.UNAVAILABLE, "starting")
        return ModelInfo("m", 4096)


async def test_the_fixed_limit_holds_until_the_backend_gives_its_context_length() -> None:
    backend = _Models()
    settings = GatewaySettings()
    models = ServedModels(("m",), backend, 1.0)  # type: ignore[arg-type]
    state = GatewayState(settings, backend, None, models)  # type: ignore[arg-type]
    assert await state.body_limit() == FALLBACK_MAX_BODY_BYTES == 32 * 1024 * 1024
    backend.up = True
    assert await state.body_limit() == 4096 * 16 + 1024 * 1024
    assert await state.body_limit() == 4096 * 16 + 1024 * 1024
    assert backend.calls == 2  # asked again after the failure, then kept
    fixed = GatewayState(GatewaySettings(max_body_bytes=100), backend, None, models)  # type: ignore[arg-type]
    assert await fixed.body_limit() == 100
    assert backend.calls == 2


@dataclasses.dataclass
class Served:
    port: int
    server: DrainingServer
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def served(fake: FakeServer, **overrides: Any) -> AsyncIterator[Served]:
    """The gateway as ``python -m gateway`` serves it (its protocol and server), on a free port."""
    settings = GatewaySettings(tokenizer_addresses=(fake.address,), served_model_names=(SERVED,), port=0,
                               **overrides)
    drain = Drain()
    server = build_server(create_app(settings, drain=drain), settings, drain, log_level="warning", loop="none")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    try:
        yield Served(sock.getsockname()[1], server, task)
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _closed_after(port: int, data: bytes) -> tuple[float, bytes]:
    """Send ``data`` on a new connection and read until the server closes it: (seconds, bytes read)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = loop.time()
    writer.write(data)
    received = await asyncio.wait_for(reader.read(), 5)  # to EOF
    writer.close()
    return loop.time() - started, received


async def test_a_half_sent_request_is_dropped_within_the_header_timeout(fake_server: FakeServer) -> None:
    async with served(fake_server, header_read_timeout=0.3) as gw:
        port = gw.port
        for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"):
            elapsed, received = await _closed_after(port, partial)
            assert received == b""
            assert 0.25 < elapsed < 1.5


async def test_the_header_timeout_spares_a_kept_alive_connection(fake_server: FakeServer) -> None:
    async with served(fake_server, header_read_timeout=0.3) as gw:
        port = gw.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            await asyncio.sleep(0.5)  # idle past the header timeout, within uvicorn's keep-alive (5 s)
        writer.close()


async def test_a_body_that_trickles_is_a_408(fake_server: FakeServer) -> None:
    async with served(fake_server, body_read_timeout=0.3) as gw:
        port = gw.port
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        elapsed, received = await _closed_after(port, head)
        assert received.startswith(b"HTTP/1.1 408 ")
        assert b"connection: close" in received.lower()
        body = json.loads(received.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"
        assert 0.25 < elapsed < 1.5
    assert fake_server.servicer.generate_requests == []


async def test_python_client_json_is_accepted_by_the_served_gateway(fake_server: FakeServer) -> None:
    async with served(fake_server) as gw, httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as client:
        r = await client.post("/v1/completions", json={"model": SERVED, "prompt": "hello"})
        assert r.status_code == 200, r.text
