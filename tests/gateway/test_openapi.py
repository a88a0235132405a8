"""``/openapi.json`` and ``/docs``: public as /health is, the security scheme when keys are set, and
``--disable-fastapi-docs`` turns both off. (The document's content is fuzzed in test_openapi_fuzz.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.__main__ import build_parser, settings_from_args
from gateway.app import create_app
from gateway.settings import GatewaySettings
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


# Other servers' dialects (TGI, KServe v2, MindIE, Triton), documented in docs/serving.md, and the two document
# routes themselves: everything else the app serves is OpenAI's or vLLM's, and listed.
DIALECT_PATHS = {"/", "/generate", "/generate_stream", "/info", "/infer", "/v2/models/{model}/generate",
                 "/v2/models/{model}/generate_stream", "/v2/models/{model}/ready", "/v2/health/live",
                 "/v2/health/ready", "/openapi.json", "/docs"}


def served_routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for route in routes:
        if getattr(route, "routes", None):
            yield from served_routes(route.routes, prefix + getattr(route, "path", ""))
        else:
            for method in set(getattr(route, "methods", None) or ()) - {"HEAD"}:
                yield prefix + route.path, method.lower()


async def test_every_openai_and_vllm_route_served_is_documented() -> None:
    app = create_app(GatewaySettings(tokenizer_addresses=("127.0.0.1:9",), served_model_names=("m",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway.test") as client:
        document = (await client.get("/openapi.json")).json()
    served = {(p, m) for p, m in served_routes(list(app.routes)) if p not in DIALECT_PATHS}
    documented = {(p, m) for p, item in document["paths"].items() for m in item}
    assert {("/v1/embeddings", "post"), ("/v1/rerank", "post"), ("/v1/responses", "post")} <= served
    assert served - documented == set()
    assert documented - served == set()
    for path, method in documented:
        body = document["paths"][path][method].get("requestBody")
        if body is not None:  # every request schema it points to is in the document
            ref = body["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in document["components"]["schemas"], (path, ref)
