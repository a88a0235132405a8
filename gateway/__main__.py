"""``python -m gateway``: the OpenAI-compatible REST gateway (Starlette on uvicorn).

API keys come from ``--api-key`` (repeatable) and ``--api-key-file``, else the ``SLUICE_API_KEY``
environment variable. ``/health``, ``/ready`` and ``/metrics`` need no key. The first key is also sent to
the tokenizer services, whose public gRPC API asks for one when it has keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from common.argtypes import at_least
from common.auth import add_api_key_args, api_keys
from common.observability import add_observability_args, observability_settings, set_up
from common.procs import die_with_parent
from common.tls import add_grpc_tls_args, add_rest_tls_args, grpc_tls_from_args, rest_tls_from_args
from gateway.metrics import add_metrics_args, federate_targets
from gateway.settings import GatewaySettings


def _csv(value: str) -> tuple[str, ...]:
    """``a,b`` — or a JSON list (``'["a", "b"]'``), as vLLM's ``--allowed-origins`` takes it."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
        return tuple(items)
    return tuple(v.strip() for v in value.split(",") if v.strip())


_seconds = at_least(0, what="a number of seconds", note=" (0: off)")


def _keepalive(value: str) -> float | None:
    """``--keepalive-interval``: seconds > 0, or 0 for none."""
    return _seconds(value) or None


def server_dev_mode(environ: Mapping[str, str]) -> bool:
    """vLLM's ``VLLM_SERVER_DEV_MODE``: an integer, non-zero mounts the development routes (unset: off)."""
    value = environ.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_SERVER_DEV_MODE must be an integer (1: on, 0: off), got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=_csv, default=("127.0.0.1:50061",), metavar="ADDR[,ADDR...]",
                   help="tokenizer services' gRPC addresses, balanced round-robin (or one dns:/// target)")
    p.add_argument("--tokenizer-mux", action=argparse.BooleanOptionalAction, default=False,
                   help="multiplex requests on one GenerateStream per tokenizer address (one message per engine "
                        "step for all of its requests) instead of a Generate call each; for listed host:port "
                        "addresses, not a dns:/// name balanced over several services (default: off; "
                        "`sluice serve` turns it on)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--reuse-port", action="store_true",
                   help="bind the port with SO_REUSEPORT (Linux), so several gateways share it and the kernel "
                        "spreads connections over them (`sluice serve --gateways N` sets it)")
    add_api_key_args(p)
    p.add_argument("--allowed-origins", type=_csv, default=(), metavar="ORIGIN[,ORIGIN...]",
                   help="CORS origins ('*' for any); default: CORS off")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization) from the allowed origins")
    p.add_argument("--allowed-methods", type=_csv, default=None, metavar="METHOD[,METHOD...]",
                   help="CORS: methods preflights may ask for ('*' for any; default: GET,POST,OPTIONS)")
    p.add_argument("--allowed-headers", type=_csv, default=None, metavar="HEADER[,HEADER...]",
                   help="CORS: request headers preflights may ask for ('*' for any; default: Authorization,"
                        "Content-Type,X-Request-Id)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per HTTP request")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="model name(s) to answer to (default: the name the backend reports)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (default: the model's max_model_len x 16 bytes + 1 MiB, as soon "
                        "as the backend answers; 32 MiB before)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections served at once, idle keep-alive ones included; the next one's request gets "
                        "503 (default: no cap)")
    p.add_argument("--header-read-timeout", type=float, default=10.0,
                   help="seconds a connection gets to send a request's headers before it is closed")
    p.add_argument("--body-read-timeout", type=float, default=60.0,
                   help="seconds a request's body gets to arrive (408 after)")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds per backend call (default: none)")
    p.add_argument("--keepalive-interval", type=_keepalive, default=None, metavar="SECONDS",
                   help="send an SSE comment (': keep-alive') after this many seconds without a token, for "
                        "proxies that close idle connections (default: off, as vLLM; 0 also means off)")
    p.add_argument("--max-n", type=int, default=16, choices=range(1, 17), metavar="1..16",
                   help="largest n (and best_of) per request; the tokenizer service allows at most 16")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM, while new ones get 503 + "
                        "Retry-After; then the listener closes")
    p.add_argument("--log-level", default="info")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve neither /openapi.json nor /docs (vLLM's flag; the name is vLLM's, there is no FastAPI)")
    add_observability_args(p)
    add_metrics_args(p)
    add_rest_tls_args(p)
    add_grpc_tls_args(p)
    return p


def settings_from_args(ns: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> GatewaySettings:
    return GatewaySettings(
        tokenizer_addresses=tuple(ns.tokenizer),
        tokenizer_mux=ns.tokenizer_mux,
        host=ns.host,
        port=ns.port,
        api_keys=api_keys(ns, environ),
        allowed_origins=tuple(ns.allowed_origins),
        allow_credentials=ns.allow_credentials,
        **({"allowed_methods": ns.allowed_methods} if ns.allowed_methods is not None else {}),
        **({"allowed_headers": ns.allowed_headers} if ns.allowed_headers is not None else {}),
        access_log=not ns.disable_uvicorn_access_log,
        served_model_names=tuple(ns.served_model_name or ()),
        max_body_bytes=ns.max_body_bytes,
        max_connections=ns.max_connections,
        header_read_timeout=ns.header_read_timeout,
        body_read_timeout=ns.body_read_timeout,
        request_timeout=ns.request_timeout,
        keepalive_interval=ns.keepalive_interval,
        max_n=ns.max_n,
        shutdown_timeout=ns.shutdown_timeout,
        enable_docs=not ns.disable_fastapi_docs,
        server_dev_mode=server_dev_mode(environ),
        log_requests=ns.log_requests,
        metrics_federate=federate_targets(ns.metrics_federate),
        metrics_federate_tokenizers=federate_targets(ns.metrics_federate_tokenizer, "--metrics-federate-tokenizer"),
        metrics_federate_kv_roles=tuple(ns.metrics_federate_kv_role or ()),
        rest_tls=rest_tls_from_args(ns),
        grpc_tls=grpc_tls_from_args(ns),
    )


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # under `sluice serve`: end with it
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        settings = settings_from_args(ns, os.environ)
        observability = observability_settings(ns)
    except ValueError as err:
        parser.error(str(err))
    tracing = set_up(observability, log_level=ns.log_level, process="gateway")
    from gateway.app import create_app
    from gateway.drain import Drain
    from gateway.server import build_server

    drain = Drain()
    server = build_server(create_app(settings, drain=drain, tracing=tracing), settings, drain, log_level=ns.log_level)
    sockets = None
    if ns.reuse_port:
        from common.reuse_port import shared_socket

        sockets = [shared_socket(settings.host, settings.port)]
    try:
        server.run(sockets=sockets)
    finally:
        if tracing is not None:
            tracing.shutdown()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the app failed to start


if __name__ == "__main__":
    main()
