"""The REST dialects MindIE Service speaks besides OpenAI's — TGI's, vLLM's legacy ``/generate``, Triton's
generate extension and MindIE's own ``/infer`` — each a thin layer over the completion route's typed request,
its backend calls and its error mapping, answering (and failing) in the dialect's own shapes."""

from __future__ import annotations

from starlette.routing import Route

from gateway.routes.dialects import mindie, tgi, triton


def dialect_routes() -> list[Route]:
    return [
        Route("/", tgi.compat_generate, methods=["POST"]),
        Route("/generate", mindie.generate, methods=["POST"]),
        Route("/generate_stream", tgi.generate_stream, methods=["POST"]),
        Route("/info", tgi.info, methods=["GET"]),
        Route("/infer", mindie.infer, methods=["POST"]),
        Route("/v2/models/{model}/generate", triton.generate, methods=["POST"]),
        Route("/v2/models/{model}/generate_stream", triton.generate_stream, methods=["POST"]),
        Route("/v2/models/{model}/ready", triton.model_ready, methods=["GET"]),
        Route("/v2/health/live", triton.live, methods=["GET"]),
        Route("/v2/health/ready", triton.ready, methods=["GET"]),
    ]
