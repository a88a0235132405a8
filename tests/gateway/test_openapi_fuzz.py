"""Schemathesis over the served ``/openapi.json``: requests generated from the document (valid ones, and ones
that break it) reach the real gateway, in front of the fake Generation server, on 127.0.0.1. No answer is a
5xx, every 4xx is exactly OpenAI's error body, and every 2xx (and every error) conforms to the documented
response schema. Fixed seed, bounded examples: the same requests every run."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import hypothesis
import jsonschema
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.app import create_app
from gateway.models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from gateway.settings import GatewaySettings
from tests.gateway.conftest import SERVED
from tests.gateway.fakes import start_fake_server
from tests.gateway.test_app import sse_data

EXAMPLES = 260  # per route and mode: >= 500 requests per route
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
          ("GET", "/v1/models")]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class LiveGateway:
    """The gateway app (with the gRPC client it opens itself) and the fake Generation server, served by uvicorn
    in a thread of their own: schemathesis calls them over HTTP with requests, synchronously."""

    def __init__(self) -> None:
        self.url = ""
        self._started = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        fake = await start_fake_server()
        fake.servicer.lora_enabled = True  # the LoRA routes answer, and /v1/models lists adapters
        settings = GatewaySettings(tokenizer_addresses=(fake.address,), served_model_names=(SERVED,),
                                   request_timeout=5.0, max_body_bytes=1 << 20)
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning",
                                http="httptools", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._started.set()
        await task
        await fake.server.stop(0)

    def __enter__(self) -> LiveGateway:
        self._thread.start()
        assert self._started.wait(30), "the gateway did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    with LiveGateway() as gw:
        yield gw


@pytest.fixture(scope="module")
def schema(live: LiveGateway) -> schemathesis.BaseSchema:
    """The served document; loading it fails on a document that is not valid OpenAPI."""
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


def content_type(response: schemathesis.Response) -> str:
    return response.headers.get("content-type", [""])[0]


def check_openai_error(response: schemathesis.Response) -> None:
    assert content_type(response).startswith("application/json"), response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def check_stream(response: schemathesis.Response, path: str, document: dict[str, Any]) -> None:
    """A 200 stream: every event but ``[DONE]`` is a chunk of the documented shape (or an error body)."""
    chunk = "ChatCompletionChunk" if path.endswith("chat/completions") else "Completion"
    schemas = document["components"]["schemas"]
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    for data in events[:-1]:
        event = json.loads(data)
        name = "ErrorResponse" if "error" in event else chunk
        root = {"$ref": f"#/components/schemas/{name}", "components": {"schemas": schemas}}
        jsonschema.Draft202012Validator(root).validate(event)


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[p for _, p in ROUTES])
def test_generated_requests_get_no_5xx_and_documented_bodies(schema: schemathesis.BaseSchema, live: LiveGateway,
                                                             method: str, path: str) -> None:
    operation = schema[path][method]
    document = requests.get(f"{live.url}/openapi.json", timeout=10).json()
    statuses: Counter[int] = Counter()
    session = requests.Session()

    def run(mode: GenerationMode) -> None:
        @hypothesis.settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                             suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
        @given(case=operation.as_strategy(generation_mode=mode))
        def one(case: schemathesis.Case) -> None:
            response = case.call(base_url=live.url, session=session, timeout=30)
            statuses[response.status_code] += 1
            case.validate_response(response, checks=CHECKS)
            if 400 <= response.status_code < 500:
                check_openai_error(response)
            elif content_type(response).startswith("text/event-stream"):
                check_stream(response, path, document)

        one()

    run(GenerationMode.POSITIVE)
    if method == "POST":  # a GET without parameters has no way to break the document
        run(GenerationMode.NEGATIVE)
    assert sum(statuses.values()) >= (500 if method == "POST" else 1), statuses
    assert not any(s >= 500 for s in statuses), statuses


def test_the_document_is_openapi_3_1_with_every_route(schema: schemathesis.BaseSchema, live: LiveGateway) -> None:
    document = requests.get(f"{live.url}/openapi.json", timeout=10).json()
    assert document["openapi"] == "3.1.0"
    assert {(m.upper(), p) for p, item in document["paths"].items() for m in item} >= set(ROUTES)
    results = list(schema.get_all_operations())
    assert all(isinstance(r, Ok) for r in results), results  # an Err: an operation the loader could not read
    assert {r.ok().path for r in results if isinstance(r, Ok)} >= {p for _, p in ROUTES}
    page = requests.get(f"{live.url}/docs", timeout=10)  # public, as /health: no key
    assert page.status_code == 200 and "swagger-ui" in page.text and "/openapi.json" in page.text


# The fields tests/gateway exercises on each route: each request model declares them (with its alias).
EXERCISED = {
    CompletionRequest: "model prompt max_tokens temperature top_p top_k min_p n best_of stop stop_token_ids seed "
                       "logprobs echo stream stream_options logit_bias presence_penalty frequency_penalty "
                       "repetition_penalty min_tokens ignore_eos include_stop_str_in_output skip_special_tokens "
                       "stream_interval prompt_logprobs priority use_beam_search length_penalty early_stopping "
                       "user response_format guided_json guided_regex guided_choice guided_grammar "
                       "guided_decoding_backend structured_outputs",
    ChatCompletionRequest: "model messages max_tokens max_completion_tokens logprobs top_logprobs tools tool_choice "
                           "parallel_tool_calls chat_template chat_template_kwargs add_generation_prompt echo "
                           "response_format n best_of stream stream_options",
    TokenizeRequest: "model prompt messages tools chat_template chat_template_kwargs add_generation_prompt "
                     "add_special_tokens return_token_strs",
    DetokenizeRequest: "model tokens",
}


@pytest.mark.parametrize("model", list(EXERCISED), ids=[m.__name__ for m in EXERCISED])
def test_each_request_model_names_the_fields_the_tests_send(model: Any, live: LiveGateway) -> None:
    document = requests.get(f"{live.url}/openapi.json", timeout=10).json()
    served = set(document["components"]["schemas"][model.__name__]["properties"])
    assert set(EXERCISED[model].split()) <= served
