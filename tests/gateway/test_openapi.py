"""``/openapi.json`` and ``/docs``: public as /health is, the security scheme when keys are set, and
``--disable-fastapi-docs`` turns both off. (The document's content is fuzzed in test_openapi_fuzz.py.)"""

from __future__ import annotations

import pytest

from gateway.__main__ import build_parser, settings_from_args
from tests.gateway.conftest import API_KEY, GatewayFactory

pytestmark = pytest.mark.anyio


async def test_both_are_public_and_the_document_asks_for_the_key(make_gateway: GatewayFactory) -> None:
    async with make_gateway(api_keys=(API_KEY,)) as gw:
        document = (await gw.client.get("/openapi.json")).json()
        assert document["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
        assert document["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in document["paths"]["/health"]["get"]
        page = await gw.client.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert (await gw.client.get("/v1/models")).status_code == 401  # the API itself still needs the key


async def test_disable_fastapi_docs_serves_neither(make_gateway: GatewayFactory) -> None:
    ns = build_parser().parse_args(["--disable-fastapi-docs"])
    assert settings_from_args(ns, {}).enable_docs is False
    async with make_gateway(enable_docs=False) as gw:
        for path in ("/openapi.json", "/docs"):
            r = await gw.client.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
