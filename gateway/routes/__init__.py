"""The gateway's routes, in one table."""

from __future__ import annotations

from starlette.routing import Route

from gateway.routes.dialects import dialect_routes
from gateway.routes.generate import chat_completions, completions
from gateway.routes.lora import load_lora_adapter, unload_lora_adapter
from gateway.routes.ops import health, list_models, metrics, ready
from gateway.routes.pooling import pooling_routes
from gateway.routes.responses import cancel_response, create_response, delete_response, get_response, list_input_items
from gateway.routes.tokens import detokenize, tokenize


def build_routes() -> list[Route]:
    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *pooling_routes(),  # /v1/embeddings, /pooling, /score, /rerank, /classify
        *dialect_routes(),  # TGI, vLLM's legacy /generate, Triton's generate extension, MindIE's /infer
    ]
