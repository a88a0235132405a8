"""vLLM's ``cache_salt`` on /v1/completions, /v1/chat/completions and /v1/responses: validated as vLLM validates it
(a non-empty string), carried to the tokenizer service (GenerateRequest.cache_salt) and from there to the engine
(EngineGenerateRequest.cache_salt). What the salt does to the cache: tests/engine/core/test_cache_salt.py."""

from __future__ import annotations

from typing import Any

import pytest

from proto.sluice.v1 import generation_pb2
from services.tokenizer.engine_request import engine_options
from tests.gateway.conftest import SERVED, Gateway

pytestmark = pytest.mark.anyio

ROUTES = {"completions": ("/v1/completions", {"prompt": "hello there"}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}),
          "responses": ("/v1/responses", {"input": "hello there"})}


async def post(gw: Gateway, route: str, **fields: Any) -> Any:
    path, body = ROUTES[route]
    limit = "max_output_tokens" if route == "responses" else "max_tokens"
    return await gw.client.post(path, json={"model": SERVED, limit: 2, **body, **fields})


@pytest.mark.parametrize("route", list(ROUTES))
async def test_the_salt_reaches_the_tokenizer_service(gateway: Gateway, route: str) -> None:
    assert (await post(gateway, route, cache_salt="tenant-7")).status_code == 200
    assert (await post(gateway, route)).status_code == 200
    assert [r.cache_salt for r in gateway.backend_calls.generate_requests] == ["tenant-7", ""]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
async def test_anything_but_a_non_empty_string_is_a_400_naming_it(gateway: Gateway, route: str, salt: Any) -> None:
    r = await post(gateway, route, cache_salt=salt)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert gateway.backend_calls.generate_requests == []


def test_the_tokenizer_service_passes_it_to_the_engine() -> None:
    req = generation_pb2.GenerateRequest(text="x", cache_salt="tenant-7")
    assert engine_options(req, "k", 1, None).cache_salt == "tenant-7"
    assert engine_options(generation_pb2.GenerateRequest(text="x"), "k", 1, None).cache_salt == ""
