"""``GET /openapi.json`` (OpenAPI 3.1, generated from the models) and ``GET /docs`` (Swagger UI), as vLLM serves them.

The document is built once per app from gateway/models.py (requests) and gateway/response_models.py
(responses); JSON Schema 2020-12, which pydantic writes, is OpenAPI 3.1's dialect, so the schemas go in
unchanged. Both routes are public (as /health), and ``--disable-fastapi-docs`` (vLLM's flag) leaves them out.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from gateway import models, pooling_schemas, response_models
from gateway.responses_api.request import ResponsesRequest

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
_REF = "#/components/schemas/{model}"
_SWAGGER_UI = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"


# pydantic writes the bounds of an integer that has a validator in front (models.Int: 16.0 reads as 16) by their
# Python names; JSON Schema's are these.
_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(schema: object) -> None:
    if isinstance(schema, list):
        for item in schema:
            _standard_bounds(item)
    elif isinstance(schema, dict):
        if "type" in schema:
            for python_name, name in _BOUNDS.items():
                if python_name in schema:
                    schema[name] = schema.pop(python_name)
        for value in schema.values():
            _standard_bounds(value)


def _json(model: type[BaseModel], description: str = "") -> dict[str, Any]:
    return {"description": description or (model.__doc__ or model.__name__).strip().splitlines()[0],
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}


def _generation(request: type[BaseModel], whole: type[BaseModel], chunk: type[BaseModel], summary: str) \
        -> dict[str, Any]:
    ok = _json(whole, "The whole response; with `stream`, server-sent events instead.")
    # Before OpenAPI 3.2 (itemSchema), an event stream's schema describes one event: its data is a chunk's JSON
    # text (an error body after a failure mid-stream), then "[DONE]".
    events = {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)},
                        {"$ref": _REF.format(model=response_models.ErrorResponse.__name__)}]}
    ok["content"]["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {"data": {
        "anyOf": [{"const": "[DONE]"},
                  {"type": "string", "contentMediaType": "application/json", "contentSchema": events}]}}}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=request.__name__)}}}}, "responses": {"200": ok}}}


def _post(request: type[BaseModel], ok: dict[str, Any], summary: str) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=request.__name__)}}}}, "responses": {"200": ok}}}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


def _object(description: str) -> dict[str, Any]:
    """A JSON object response whose fields the summary's API (OpenAI's, vLLM's) defines."""
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def _pooling_paths() -> dict[str, dict[str, Any]]:
    """vLLM's pooling routes (a pooling model: ``--runner pooling``, an encoder or a cross-encoder)."""
    rerank = _post(pooling_schemas.RerankRequest, _object("Jina's and Cohere's rerank response"),
                   "Rerank documents against a query (a cross-encoder, or an embedding model by cosine)")
    score = _post(pooling_schemas.ScoreRequest, _object("vLLM's score response: one score per pair"),
                  "Score text pairs")
    return {
        "/v1/embeddings": _post(pooling_schemas.EmbeddingRequest, _object("OpenAI's embeddings list"),
                                "Create embeddings"),
        "/pooling": _post(pooling_schemas.PoolingRequest, _object("vLLM's pooling response"),
                          "The model's pooled output"),
        "/classify": _post(pooling_schemas.ClassificationRequest, _object("vLLM's classification response"),
                           "Classify inputs (a sequence-classification model)"),
        "/score": score, "/v1/score": score, "/rerank": rerank, "/v1/rerank": rerank, "/v2/rerank": rerank,
    }


def _responses_paths() -> dict[str, dict[str, Any]]:
    """OpenAI's Responses API (stored responses live in the gateway's bounded memory)."""
    response = _object("A response object; with `stream`, server-sent events instead")
    response["content"]["text/event-stream"] = {"schema": {"type": "object"}}
    ident = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/responses": _post(ResponsesRequest, response, "Create a response"),
        "/v1/responses/{response_id}": {
            "get": {"summary": "Retrieve a stored response", "parameters": ident,
                    "responses": {"200": _object("The response object")}},
            "delete": {"summary": "Delete a stored response", "parameters": ident,
                       "responses": {"200": _object("The deletion confirmation")}}},
        "/v1/responses/{response_id}/input_items": {"get": {
            "summary": "List a stored response's input items", "parameters": ident,
            "responses": {"200": _object("A list of input items")}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "summary": "Cancel a background response (refused: `background` is not supported)",
            "parameters": ident, "responses": {"200": _object("The response object")}}},
    }


def build_document(*, secured: bool) -> dict[str, Any]:
    """The OpenAPI document; with ``secured``, the API routes ask for a bearer key."""
    listed: list[type[BaseModel]] = [models.CompletionRequest, models.ChatCompletionRequest, models.TokenizeRequest,
                                     models.DetokenizeRequest, models.LoadLoraAdapterRequest,
                                     models.UnloadLoraAdapterRequest, pooling_schemas.EmbeddingRequest,
                                     pooling_schemas.PoolingRequest, pooling_schemas.ClassificationRequest,
                                     pooling_schemas.ScoreRequest, pooling_schemas.RerankRequest, ResponsesRequest]
    shown: list[type[BaseModel]] = [response_models.Completion, response_models.ChatCompletion,
                                    response_models.ChatCompletionChunk, response_models.ModelList,
                                    response_models.TokenizeResponse, response_models.DetokenizeResponse,
                                    response_models.ErrorResponse]
    _, schemas = models_json_schema([(m, "validation") for m in listed] + [(m, "serialization") for m in shown],
                                    ref_template=_REF)
    _standard_bounds(schemas)
    paths: dict[str, dict[str, Any]] = {
        "/v1/completions": _generation(models.CompletionRequest, response_models.Completion,
                                       response_models.Completion, "Create a completion"),
        "/v1/chat/completions": _generation(models.ChatCompletionRequest, response_models.ChatCompletion,
                                            response_models.ChatCompletionChunk, "Create a chat completion"),
        "/v1/models": {"get": {"summary": "List models", "responses": {"200": _json(response_models.ModelList)}}},
        "/tokenize": _post(models.TokenizeRequest, _json(response_models.TokenizeResponse, "The prompt's tokens"),
                           "Tokenize a prompt or a conversation"),
        "/detokenize": _post(models.DetokenizeRequest, _json(response_models.DetokenizeResponse, "The text"),
                             "Detokenize token ids"),
        "/v1/load_lora_adapter": _post(models.LoadLoraAdapterRequest, _text("vLLM's success sentence"),
                                       "Load a LoRA adapter (with --allow-runtime-lora-updating)"),
        "/v1/unload_lora_adapter": _post(models.UnloadLoraAdapterRequest, _text("vLLM's success sentence"),
                                         "Unload a LoRA adapter (with --allow-runtime-lora-updating)"),
        **_responses_paths(),
        **_pooling_paths(),
    }
    error = _json(response_models.ErrorResponse, "OpenAI's error body")
    for item in paths.values():
        for operation in item.values():
            operation["responses"]["default"] = error
            if secured:
                operation["security"] = [{"bearer": []}]
    for path, description in (("/health", "Liveness"), ("/ready", "Readiness: the backend serves")):
        paths[path] = {"get": {"summary": description, "responses": {
            "200": {"description": description, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}}}},
            "default": error}}}
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "responses": {"200": _text("Prometheus text")}}}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Sluice", "version": "1", "description": "OpenAI-compatible API, with vLLM's extensions."},
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
    }
    if secured:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def docs_routes(*, secured: bool) -> list[Route]:
    """``/openapi.json`` and ``/docs``; the document is rendered once, here."""
    body = json.dumps(build_document(secured=secured), ensure_ascii=False).encode()
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Sluice API</title>
<link rel="stylesheet" href="{_SWAGGER_UI}/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="{_SWAGGER_UI}/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({{url: "{OPENAPI_PATH}", dom_id: "#swagger-ui"}});</script>
</body></html>"""

    async def openapi(request: Request) -> Response:
        return Response(body, media_type="application/json")

    async def docs(request: Request) -> Response:
        return HTMLResponse(page)

    return [Route(OPENAPI_PATH, openapi, methods=["GET"]), Route(DOCS_PATH, docs, methods=["GET"])]
