"""The gateway's one frozen settings object, built by ``gateway/__main__.py`` and passed in."""

from __future__ import annotations

from dataclasses import dataclass

from common.auth import is_valid_key
from common.tls import GrpcTls, RestTls
from gateway.targets import tls_authority


@dataclass(frozen=True)
class GatewaySettings:
    # Tokenizer services' gRPC addresses (host:port, or one full gRPC target).
    tokenizer_addresses: tuple[str, ...] = ("127.0.0.1:50061",)
    # Multiplex generation on one GenerateStream per tokenizer address (one message per engine step
    # for all of a tokenizer's requests) instead of a Generate call per request. For listed
    # addresses: a dns:/// name with several backends behind it gets one stream, to one of them.
    tokenizer_mux: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer keys accepted; empty: no authentication. The first is also the key this gateway sends to the
    # tokenizer services: one secret per deployment, which already grants what their gRPC API does.
    api_keys: tuple[str, ...] = ()
    # CORS origins; empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # With CORS on: credentials allowed, and the methods and request headers preflights may ask for.
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type", "X-Request-Id")
    # uvicorn's one line per HTTP request (vLLM's --disable-uvicorn-access-log turns it off).
    access_log: bool = True
    # Names the model is served under; empty: the name the backend reports.
    served_model_names: tuple[str, ...] = ()
    # Largest request body; None: sized from the model's context length (routes/common.py body_limit_for).
    max_body_bytes: int | None = None
    # Connections served at once (idle keep-alive ones included); the next one's request gets uvicorn's 503.
    # None: no cap. A MindIE config's maxLinkNum sets it (services/mindie).
    max_connections: int | None = None
    # A connection must finish sending a request's headers within this many seconds (uvicorn has no
    # such bound of its own), and its body within body_read_timeout of the headers.
    header_read_timeout: float = 10.0
    body_read_timeout: float = 60.0
    # Deadline of each backend call in seconds; None: none for generation.
    request_timeout: float | None = None
    # SSE comment (`: keep-alive`) sent when no token arrived for this long; None: never (the default, as
    # vLLM: clients that strip each network read before splitting events, such as `vllm bench serve`,
    # lose the stream after a comment). Opt in for proxies that close idle connections.
    keepalive_interval: float | None = None
    # Without keep-alives: how long a stream waits for its first event before it commits to a 200 (fast
    # failures keep their status; once committed, Starlette's disconnect watch cancels a request still
    # queued whose client left). With keep-alives it waits one keep-alive interval.
    first_event_timeout: float = 5.0
    # Deadline of the /ready probe's backend call.
    ready_timeout: float = 2.0
    # Retry-After on 429/503 when the backend gives none.
    retry_after_seconds: int = 1
    # Largest `n` (sequences per prompt) one request may ask for.
    max_n: int = 16
    # After SIGTERM: new requests get 503 + Retry-After and /ready 503 while in-flight ones get this long
    # (seconds) to finish; then the listener closes.
    shutdown_timeout: float = 10.0
    # Serve /openapi.json and /docs (vLLM's --disable-fastapi-docs turns them off).
    enable_docs: bool = True
    # vLLM's development routes (POST /reset_prefix_cache), mounted only with VLLM_SERVER_DEV_MODE=1, as vLLM.
    server_dev_mode: bool = False
    # One INFO line per request received and finished (--enable-log-requests, vLLM's; off by default as there).
    log_requests: bool = False
    # Metrics pages appended to this gateway's /metrics (`sluice serve`: its engines' vllm:* pages, labelled engine="i";
    # its tokenizer services' pages, labelled tokenizer="i").
    metrics_federate: tuple[str, ...] = ()
    metrics_federate_tokenizers: tuple[str, ...] = ()
    # The KV role of each metrics_federate engine (prefill/decode disaggregation), labelled kv_role; empty: none.
    metrics_federate_kv_roles: tuple[str, ...] = ()
    # HTTPS on the REST port (uvicorn's --ssl-* settings); None: plain HTTP.
    rest_tls: RestTls | None = None
    # TLS (and mTLS with a CA) on the channels to the tokenizer services; None: plaintext.
    grpc_tls: GrpcTls | None = None

    def __post_init__(self) -> None:
        if not self.tokenizer_addresses:
            raise ValueError("tokenizer_addresses: at least one address is needed")
        if self.metrics_federate_kv_roles and len(self.metrics_federate_kv_roles) != len(self.metrics_federate):
            raise ValueError("--metrics-federate-kv-role: one per --metrics-federate, in the same order")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.header_read_timeout <= 0:
            raise ValueError("header_read_timeout must be > 0")
        if self.body_read_timeout <= 0:
            raise ValueError("body_read_timeout must be > 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")
        if self.keepalive_interval is not None and self.keepalive_interval <= 0:
            raise ValueError("keepalive_interval must be > 0 (None: no keep-alive comments)")
        if self.first_event_timeout <= 0:
            raise ValueError("first_event_timeout must be > 0")
        if self.ready_timeout <= 0:
            raise ValueError("ready_timeout must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if not all(is_valid_key(k) for k in self.api_keys):
            raise ValueError("api_keys must be printable ASCII without spaces (not empty)")
        if self.grpc_tls is not None:
            tls_authority(self.tokenizer_addresses)  # raises for listed addresses no one certificate names

    @property
    def first_event_wait(self) -> float:
        """Seconds a stream waits for its first event before its 200 is sent."""
        return self.keepalive_interval if self.keepalive_interval is not None else self.first_event_timeout

    @property
    def unary_timeout(self) -> float:
        """Deadline of tokenize / detokenize / model info calls."""
        return self.request_timeout if self.request_timeout is not None else 60.0
