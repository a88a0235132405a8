"""LoRA adapters through the gateway: requests naming an adapter, /v1/models' listing, and vLLM's runtime
load / unload routes, against the fake Generation server (which serves adapters as the tokenizer service does)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proto.sluice.v1 import common_pb2, generation_pb2
from tests.gateway.conftest import API_KEY, SERVED, Gateway, GatewayFactory
from tests.gateway.fakes import MODEL_NAME

pytestmark = pytest.mark.anyio

RUNTIME_OFF = ("Loading and unloading LoRA adapters at runtime is off: start the engine with "
               "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true).")


def error(message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_not_found(model: str) -> dict[str, Any]:
    return error(f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found")


@pytest.fixture
async def lora(gateway: Gateway) -> AsyncIterator[Gateway]:
    """The gateway in front of a backend with LoRA on and one adapter, "sql", fine-tuned from "base-7b"."""
    gateway.backend_calls.lora_enabled = True
    gateway.backend_calls.lora_adapters = {"sql": "base-7b"}
    yield gateway


def generated_models(gw: Gateway) -> list[str]:
    return [r.model for r in gw.backend_calls.generate_requests]


async def test_a_request_naming_an_adapter_runs_through_it_and_echoes_its_name(lora: Gateway) -> None:
    r = await lora.client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
    assert r.status_code == 200 and r.json()["model"] == "sql"
    assert r.json()["choices"][0]["text"] == "Hello world"
    r = await lora.client.post("/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "x"}], "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in r.text.split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and {c["model"] for c in chunks} == {"sql"}
    r = await lora.client.post("/v1/completions", json={"model": SERVED, "prompt": "x"})
    assert r.status_code == 200 and r.json()["model"] == SERVED
    assert generated_models(lora) == ["sql", "sql", ""]  # the base model travels as no name


async def test_metrics_label_the_request_with_the_adapter(lora: Gateway) -> None:
    await lora.client.post("/v1/completions", json={"model": "sql", "prompt": "a b", "max_tokens": 2})
    text = (await lora.client.get("/metrics")).text
    assert 'sluice:request_success_total{finished_reason="length",model_name="sql"} 1.0' in text
    assert 'sluice:generation_tokens_total{model_name="sql"} 2.0' in text
    assert f'model_name="{SERVED}"' not in text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_unknown_model_is_a_404_model_not_found_with_lora_on(lora: Gateway, stream: bool) -> None:
    r = await lora.client.post("/v1/completions", json={"model": "ghost", "prompt": "x", "stream": stream})
    assert (r.status_code, r.json()) == (404, model_not_found("ghost"))
    assert lora.backend_calls.generate_requests == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_adapter_unloaded_since_the_gateway_asked_is_the_backends_404(lora: Gateway, stream: bool) -> None:
    assert (await lora.client.post("/v1/completions", json={"model": "sql", "prompt": "x"})).status_code == 200
    lora.backend_calls.lora_adapters.clear()  # unloaded through another gateway: the list here is stale
    r = await lora.client.post("/v1/completions", json={"model": "sql", "prompt": "x", "stream": stream})
    assert (r.status_code, r.json()) == (404, model_not_found("sql"))
    assert generated_models(lora) == ["sql", "sql"]  # forwarded: the backend said NOT_FOUND


async def test_an_adapter_loaded_behind_the_gateways_back_is_found_on_a_miss(lora: Gateway) -> None:
    assert (await lora.client.post("/v1/completions", json={"model": "sql", "prompt": "x"})).status_code == 200
    lora.backend_calls.lora_adapters["late"] = MODEL_NAME
    r = await lora.client.post("/v1/completions", json={"model": "late", "prompt": "x"})
    assert r.status_code == 200 and r.json()["model"] == "late"


async def test_with_lora_off_an_unknown_model_is_a_404_without_asking_again(gateway: Gateway) -> None:
    for _ in range(2):
        r = await gateway.client.post("/v1/completions", json={"model": "ghost", "prompt": "x"})
        assert (r.status_code, r.json()) == (404, model_not_found("ghost"))
    # Asked once whether LoRA is on: the backend's flag does not change while it runs.
    assert gateway.backend_calls.unary_requests == [generation_pb2.GetModelInfoRequest()]
    assert gateway.backend_calls.generate_requests == []


async def test_tokenize_and_detokenize_name_the_adapter_to_the_backend(lora: Gateway) -> None:
    r = await lora.client.post("/tokenize", json={"model": "sql", "prompt": "one two"})
    assert r.status_code == 200 and r.json()["tokens"] == [1, 2]
    r = await lora.client.post("/detokenize", json={"model": "sql", "tokens": [4]})
    assert r.status_code == 200 and r.json() == {"prompt": "t4"}
    sent = [r for r in lora.backend_calls.unary_requests if not isinstance(r, generation_pb2.GetModelInfoRequest)]
    assert [(type(r).__name__, r.model) for r in sent] == [("TokenizeRequest", "sql"), ("DetokenizeRequest", "sql")]
    r = await lora.client.post("/tokenize", json={"model": "ghost", "prompt": "one"})
    assert (r.status_code, r.json()) == (404, model_not_found("ghost"))


async def test_models_lists_the_adapters_after_the_base_model_with_their_parent(lora: Gateway) -> None:
    lora.backend_calls.lora_adapters["chat"] = MODEL_NAME
    body = (await lora.client.get("/v1/models")).json()
    created = body["data"][0]["created"]
    assert isinstance(created, int)
    entry = {"object": "model", "created": created, "owned_by": "sluice", "max_model_len": 2048}
    assert body == {"object": "list", "data": [
        {"id": SERVED, "root": SERVED, "parent": None, **entry},
        {"id": "sql", "root": "sql", "parent": "base-7b", **entry},
        {"id": "chat", "root": "chat", "parent": MODEL_NAME, **entry},
    ]}


async def test_load_then_unload_at_runtime(lora: Gateway) -> None:
    r = await lora.client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat",
                                                                "base_model_name": "base-7b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert r.headers["content-type"].startswith("text/plain")
    assert lora.backend_calls.lora_requests == [common_pb2.LoadLoRAAdapterRequest(
        lora_name="chat", lora_path="/adapters/chat", base_model_name="base-7b")]
    models = (await lora.client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(SERVED, None), ("sql", "base-7b"), ("chat", "base-7b")]
    assert (await lora.client.post("/v1/completions", json={"model": "chat", "prompt": "x"})).json()["model"] == "chat"

    r = await lora.client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    assert r.headers["content-type"].startswith("text/plain")
    assert lora.backend_calls.lora_requests[-1] == common_pb2.UnloadLoRAAdapterRequest(lora_name="chat")
    r = await lora.client.post("/v1/completions", json={"model": "chat", "prompt": "x"})
    assert (r.status_code, r.json()) == (404, model_not_found("chat"))


async def test_load_without_a_base_model_name_lists_the_served_model_as_parent(lora: Gateway) -> None:
    r = await lora.client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a"})
    assert r.status_code == 200
    assert lora.backend_calls.lora_requests == [common_pb2.LoadLoRAAdapterRequest(lora_name="chat", lora_path="/a")]
    models = (await lora.client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"]) for m in models][-1] == ("chat", MODEL_NAME)


LOAD_REFUSED = [  # (id, body, the error, whether the backend was asked)
    ("missing-name", {"lora_path": "/a"}, error("`lora_name` is required.", param="lora_name"), False),
    ("empty-path", {"lora_name": "a", "lora_path": ""}, error("`lora_path` is required.", param="lora_path"), False),
    ("null-path", {"lora_name": "a", "lora_path": None}, error("`lora_path` is required.", param="lora_path"), False),
    ("name-not-string", {"lora_name": 3, "lora_path": "/a"},
     error("`lora_name` must be a string, got number.", param="lora_name"), False),
    ("unknown-field", {"lora_name": "a", "lora_path": "/a", "load_inplace": True},
     error("`load_inplace` is not supported here; the fields are lora_name, lora_path, base_model_name.",
           param="load_inplace"), False),
    ("served-name", {"lora_name": SERVED, "lora_path": "/a"},
     error(f"`lora_name` '{SERVED}' is the served model's name.", param="lora_name"), False),
    ("already-loaded", {"lora_name": "sql", "lora_path": "/a"},
     error("The lora adapter 'sql' has already been loaded.", param="lora_name"), True),
    ("bad-folder", {"lora_name": "a", "lora_path": "bad/a"},
     error("lora_path: bad/a/adapter_config.json: r: 64 is above --max-lora-rank 16", param="lora_path"), True),
]


@pytest.mark.parametrize(("body", "expected", "asked"), [c[1:] for c in LOAD_REFUSED],
                         ids=[c[0] for c in LOAD_REFUSED])
async def test_load_refusals_are_400s_naming_the_field(lora: Gateway, body: dict[str, Any],
                                                       expected: dict[str, Any], asked: bool) -> None:
    r = await lora.client.post("/v1/load_lora_adapter", json=body)
    assert (r.status_code, r.json()) == (400, expected)
    assert lora.backend_calls.lora_adapters == {"sql": "base-7b"}
    assert [r.lora_name for r in lora.backend_calls.lora_requests] == ([body["lora_name"]] if asked else [])


async def test_unload_of_an_unknown_adapter_is_a_404(lora: Gateway) -> None:
    r = await lora.client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert (r.status_code, r.json()) == (404, error("The lora adapter 'nope' cannot be found.", "not_found_error",
                                                    "lora_name", "lora_adapter_not_found"))
    r = await lora.client.post("/v1/unload_lora_adapter", json={})
    assert (r.status_code, r.json()) == (400, error("`lora_name` is required.", param="lora_name"))


@pytest.mark.parametrize("route", ["load", "unload"])
async def test_with_runtime_updating_off_the_routes_are_a_404_saying_how_to_turn_it_on(lora: Gateway,
                                                                                        route: str) -> None:
    lora.backend_calls.runtime_lora = False
    r = await lora.client.post(f"/v1/{route}_lora_adapter", json={"lora_name": "sql", "lora_path": "/a"}
                               if route == "load" else {"lora_name": "sql"})
    assert (r.status_code, r.json()) == (404, error(RUNTIME_OFF, "not_found_error",
                                                    code="runtime_lora_updating_disabled"))
    assert lora.backend_calls.lora_adapters == {"sql": "base-7b"}


async def test_the_routes_need_the_api_key(make_gateway: GatewayFactory) -> None:
    async with make_gateway(api_keys=(API_KEY,)) as gw:
        gw.backend_calls.lora_enabled = True
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"})):
            r = await gw.client.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert gw.backend_calls.lora_requests == []
        auth = {"Authorization": f"Bearer {API_KEY}"}
        r = await gw.client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}, headers=auth)
        assert r.status_code == 200
        r = await gw.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=auth)
        assert r.status_code == 200
        assert gw.backend_calls.lora_adapters == {}
