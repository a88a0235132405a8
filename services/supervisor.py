"""``sluice serve``: the whole stack from one command.

Starts D model replicas (``--data-parallel-size``; each an engine and its M
``--tokenizers`` services) and N gateways in front of all of them, as child
processes (by module name — nothing of theirs is imported here), all at once,
waits until each reports ready, prints the URL, and supervises: a crashed child is reported
and restarted on its own, the other replicas serving meanwhile. SIGTERM drains
every child at once (no new requests; in-flight ones get ``--shutdown-timeout``
to finish).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any

from common import reuse_port
from common.argtypes import at_least
from common.auth import add_api_key_args, api_keys
from common.errors import InvalidRequestError
from common.logs import configure_logging
from common.observability import (
    ObservabilitySettings,
    add_observability_args,
    observability_flags,
    observability_settings,
)
from common.procs import ENV_PARENT_PID, free_port, grpc_serving, port_number
from common.tls import (
    GrpcTls,
    RestTls,
    add_grpc_tls_args,
    add_rest_tls_args,
    grpc_tls_flags,
    grpc_tls_from_args,
    rest_tls_flags,
    rest_tls_from_args,
)
from engine.config import EngineConfig
from engine.entrypoints.args import add_engine_args, check_local_paths, config_from_args
from engine.entrypoints.vllm_compat import normalize_flag_spelling
from engine.text import Tokenizer
from engine.text.tool_parsers import TOOL_PARSERS
from services.child_flags import engine_flags, tokenizer_flags
from services.mindie import ConfigFileError, load_mindie_config
from services.pd_serve import add_pd_args, federate_role_flags, resolve_pd, with_kv_roles
from services.replicas import (
    check_model_splits,
    kv_events_for_routing,
    metrics_ports,
    replica_configs,
    shared_hash_seed,
)
from services.serve_args import add_vllm_serve_args, check_vllm_serve_args
from services.tokenizer.migration import add_migration_args
from services.tokenizer.multimodal import add_media_args
from services.tokenizer.reasoning import Reasoning
from services.tokenizer.routing import ROUTING_POLICIES

logger = logging.getLogger("sluice.serve")

_ENGINE_READY_TIMEOUT = 900.0
_READY_TIMEOUT = 120.0


@dataclass
class Child:
    name: str
    argv: list[str]
    ready: Any  # () -> bool
    ready_timeout: float = _READY_TIMEOUT
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_restart: float = 0.0
    log: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)   # over this process's environment

    def start(self) -> None:
        # The child arms its own parent-death signal (common.procs): no preexec_fn in a threaded parent.
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env, ENV_PARENT_PID: str(os.getpid())})
        logger.info("started %s (pid %d)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, stopping: Any) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline and not stopping():
            if not self.alive():
                return False
            if self.ready():
                return True
            time.sleep(0.25)
        return False


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def served_names(ns: argparse.Namespace, config: EngineConfig) -> list[str]:
    """Every name the gateways answer to: ``--served-model-name``'s (the first is the model's, given to the
    engine and the tokenizer services; the others aliases, as vLLM's), else the model argument as given (vLLM's
    name) and the file's or folder's own name as an alias."""
    names = getattr(ns, "served_model_name", None)
    if isinstance(names, str):   # a MindIE config.json's modelName
        names = [names]
    if names:
        return list(names)
    return [config.model_name] + ([config.short_model_name] if config.short_model_name else [])


# A number of seconds >= 0 (0: off).
_seconds = at_least(0, what="a number of seconds", note=" (0: off)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a MindIE config.json, used as is (flags override it)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=8000,
                   help="the gateways' port (on Linux every gateway serves on it, SO_REUSEPORT; elsewhere the "
                        "first of consecutive ports)")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway processes, each serving its own connections on the one --port (Linux; elsewhere "
                        "on consecutive ports); one that exits is restarted, the others serving meanwhile")
    p.add_argument("--tokenizers", type=int, default=1, help="tokenizer services per replica")
    p.add_argument("--routing", default=None, choices=ROUTING_POLICIES,
                   help="how the tokenizer services pick a replica for each request: kv_aware (the default with "
                        "--data-parallel-size > 1: the replica whose prefix cache holds the longest prefix of the "
                        "prompt, from the engines' KV events, unless their loads drift apart), least_loaded, "
                        "round_robin")
    p.add_argument("--engine-port", type=int, default=50051,
                   help="first engine port (replicas' engines use consecutive ports)")
    p.add_argument("--tokenizer-port", type=int, default=50061,
                   help="first tokenizer service port (all replicas' services use consecutive ports)")
    add_api_key_args(p)
    p.add_argument("--allowed-origins", default=None)
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (gateway flag)")
    p.add_argument("--allowed-methods", default=None, help="CORS: methods preflights may ask for (gateway flag)")
    p.add_argument("--allowed-headers", default=None, help="CORS: headers preflights may ask for (gateway flag)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /openapi.json and /docs on the gateways (vLLM's flag)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0)
    p.add_argument("--keepalive-interval", type=_seconds, default=0.0, metavar="SECONDS",
                   help="gateways send an SSE comment after this many seconds without a token, for proxies that "
                        "close idle connections (default 0: off, as vLLM)")
    p.add_argument("--request-timeout", type=float, default=None, help="gateway deadline per request, seconds")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections each gateway serves at once, idle keep-alive ones included; the next one's "
                        "request gets 503 (default: no cap; a MindIE config's maxLinkNum sets 3 x maxLinkNum)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body a gateway reads (default: sized from the model's context length)")
    p.add_argument("--tokenizer-mux", action=argparse.BooleanOptionalAction, default=True,
                   help="gateways multiplex requests on one GenerateStream per tokenizer service (one message per "
                        "engine step for all of its requests); --no-tokenizer-mux: a Generate call per request")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (file path or the template itself) used instead of the model's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of the output for tool_choice "auto" (needs --tool-call-parser)')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model family's tool-call syntax")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat_template (off: refused); rendered in a child process "
                        "bounded in time and output size")
    p.add_argument("--log-level", default="info")
    add_engine_args(p)
    add_vllm_serve_args(p)
    add_observability_args(p)
    add_metrics_args(p)
    add_migration_args(p)
    add_pd_args(p)
    add_media_args(p, limit=False)   # --limit-mm-per-prompt is among the engine's flags
    add_rest_tls_args(p)
    add_grpc_tls_args(p)
    return p


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("metrics")
    g.add_argument("--engine-metrics-port", type=port_number, default=None,
                   help="port of the engine's vllm:* metrics on 127.0.0.1, which each gateway's /metrics appends "
                        "to its own (replicas' engines use consecutive ports; default: free ports; 0: no engine "
                        "metrics)")
    g.add_argument("--tokenizer-metrics-port", type=port_number, default=None,
                   help="first port of the tokenizer services' sluice:* metrics on 127.0.0.1 (requests migrated), "
                        "which each gateway's /metrics appends labelled tokenizer=\"i\" (the services of all "
                        "replicas use consecutive ports; default: free ports; 0: off)")


def resolve_settings(argv: list[str], notes: list[str] | None = None) -> argparse.Namespace:
    """Flags over the MindIE config over defaults. vLLM flags accepted without effect add a line to ``notes``
    saying why; those Sluice cannot honour end here with the reason (exit 2)."""
    parser = build_parser()
    argv = normalize_flag_spelling(argv)
    ns = parser.parse_args(argv)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if ns.config:
        try:
            mindie = load_mindie_config(ns.config)
        except ConfigFileError as e:
            parser.error(str(e))
        explicit = _explicit_dests(parser, argv) | ({"model"} if ns.model_tag is not None else set())
        for key, value in mindie.settings.items():
            if key not in explicit:
                setattr(ns, key, value)
        if notes is not None:
            notes.extend(mindie.notes)
    try:
        resolve_pd(ns)   # prefill/decode engines become the replicas
        accepted = check_vllm_serve_args(ns)
    except InvalidRequestError as e:
        parser.error(str(e))
    if notes is not None:
        notes.extend(accepted)
    return ns


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    probe = argparse.ArgumentParser(add_help=False)
    for action in parser._actions:  # noqa: SLF001 — argparse has no public way to ask "was it given?"
        if action.option_strings and action.dest != "help":
            kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS}
            if action.nargs == 0:
                kwargs["action"] = "store_const"
                kwargs["const"] = True
            probe.add_argument(*action.option_strings, **kwargs)
    known, _ = probe.parse_known_args(argv)
    return set(vars(known))


@dataclass
class Replica:
    """One model replica: an engine (its ranks its own) and the tokenizer services in front of it."""

    engine: Child
    tokenizers: list[Child]
    metrics_url: str | None   # the engine's vllm:* page, None when off
    tokenizer_metrics_urls: list[str] = field(default_factory=list)   # the tokenizer services' pages, in order


class Supervisor:
    """``api_keys``: asked for by the gateways (REST) and the tokenizer services (gRPC), which read them from a
    file of this process's (mode 0600, removed at exit): a key on a child's command line would show in ``ps``."""

    def __init__(self, ns: argparse.Namespace, config: EngineConfig,
                 observability: ObservabilitySettings | None = None, api_keys: tuple[str, ...] = (), *,
                 grpc_tls: GrpcTls | None = None, rest_tls: RestTls | None = None) -> None:
        """``grpc_tls``: TLS on every gRPC hop, the same files forwarded to every child (and used by the
        readiness probes); ``rest_tls``: HTTPS on every gateway."""
        self.ns = ns
        self.api_keys = api_keys
        self.key_file = (os.path.join(tempfile.gettempdir(), f"sluice-api-keys-{os.getpid()}-{secrets.token_hex(8)}")
                         if api_keys else None)
        # Several replicas: every tokenizer service fronts every engine and routes each request (--routing); by
        # cache, it follows the engines' KV events and hashes prompts as they do (the same PYTHONHASHSEED).
        config = kv_events_for_routing(config, ns.data_parallel_size, ns.routing)
        self.child_env = {"PYTHONHASHSEED": shared_hash_seed()} if ns.data_parallel_size > 1 else {}
        self.engine_addrs = [f"127.0.0.1:{ns.engine_port + r}" for r in range(ns.data_parallel_size)]
        self.config = config
        self.observability = observability if observability is not None else observability_settings(ns)
        self.grpc_tls = grpc_tls
        self.stopping = False
        self.replicas = [self._replica(r, replica_config, metrics)
                         for r, (replica_config, metrics) in enumerate(zip(
                             with_kv_roles(replica_configs(config, ns.data_parallel_size), ns), metrics_ports(ns),
                             strict=True))]
        # Replica by replica within each rank of tokenizer: the gateways take their addresses in turn, so
        # consecutive requests go to different replicas.
        tok_addrs = [f"127.0.0.1:{ns.tokenizer_port + r * ns.tokenizers + i}"
                     for i in range(ns.tokenizers) for r in range(ns.data_parallel_size)]
        self.scheme = "http" if rest_tls is None else "https"
        self.shared_port = ns.gateways > 1 and reuse_port.SUPPORTED  # else consecutive ports
        self.gateways = [self._gateway(i, tok_addrs, rest_tls) for i in range(ns.gateways)]

    def _child_flags(self, *, log_requests: bool = True) -> list[str]:
        """Every child traces and logs alike; request lines come from the gateways and the engine (as vLLM's API
        server and engine), and from the tokenizer services in between only where they choose a replica (their
        line says which, and why)."""
        obs = self.observability if log_requests else replace(self.observability, log_requests=False)
        return [*observability_flags(obs), *grpc_tls_flags(self.grpc_tls)]

    def _key_flags(self) -> list[str]:
        return ["--api-key-file", self.key_file] if self.key_file else []

    def _replica(self, r: int, config: EngineConfig, metrics_port: int) -> Replica:
        """Replica ``r``: its engine on the r-th engine port, its tokenizer services on the r-th block of
        ``--tokenizers`` ports, each sending requests to every replica's engine."""
        ns, py, tls = self.ns, sys.executable, self.grpc_tls
        suffix = "" if ns.data_parallel_size == 1 else f"-{r}"
        port = ns.engine_port + r
        engine_addr = f"127.0.0.1:{port}"
        engine = Child(f"engine{suffix}", [py, "-m", "engine", "--host", "127.0.0.1", "--port", str(port),
                                           "--log-level", ns.log_level, "--shutdown-timeout",
                                           str(ns.shutdown_timeout), "--metrics-port", str(metrics_port),
                                           *engine_flags(config), *self._child_flags()],
                       ready=lambda: grpc_serving(engine_addr, "sluice.v1.Engine", tls),
                       ready_timeout=_ENGINE_READY_TIMEOUT, env=self.child_env)
        model_flags = (["--model", config.model] if config.model else []) + (
            ["--tokenizer", config.tokenizer] if config.tokenizer else []) + tokenizer_flags(ns)
        tokenizers, tok_urls = [], []
        for i in range(ns.tokenizers):
            tok_port = ns.tokenizer_port + r * ns.tokenizers + i
            addr = f"127.0.0.1:{tok_port}"
            first = ns.tokenizer_metrics_port
            tok_metrics = free_port() if first is None else first + r * ns.tokenizers + i if first else 0
            if tok_metrics:
                tok_urls.append(f"http://127.0.0.1:{tok_metrics}/metrics")
            tokenizers.append(Child(
                f"tokenizer{suffix}-{i}",
                [py, "-m", "services.tokenizer", "--engine", ",".join(self.engine_addrs), "--host", "127.0.0.1",
                 "--port",
                 str(tok_port), "--served-model-name", config.model_name, "--log-level", ns.log_level,
                 "--shutdown-timeout", str(ns.shutdown_timeout), "--metrics-port", str(tok_metrics), *model_flags,
                 *self._key_flags(),
                 *self._child_flags(log_requests=ns.data_parallel_size > 1)],
                ready=(lambda a=addr: grpc_serving(a, "sluice.v1.Generation", tls)), env=self.child_env))
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
        return Replica(engine, tokenizers, metrics_url, tok_urls)

    def _gateway(self, i: int, tok_addrs: list[str], rest_tls: RestTls | None) -> Child:
        ns, config = self.ns, self.config
        port = ns.port if self.shared_port else ns.port + i
        argv = [sys.executable, "-m", "gateway", "--tokenizer", ",".join(tok_addrs), "--host", ns.host,
                "--port", str(port), *[f for name in served_names(ns, config) for f in ("--served-model-name", name)],
                "--shutdown-timeout", str(ns.shutdown_timeout), "--keepalive-interval", str(ns.keepalive_interval),
                "--log-level", ns.uvicorn_log_level or ns.log_level, *self._key_flags(), *self._child_flags()]
        if ns.request_timeout is not None:
            argv += ["--request-timeout", str(ns.request_timeout)]
        for flag in ("max_connections", "max_body_bytes"):
            if getattr(ns, flag) is not None:
                argv += ["--" + flag.replace("_", "-"), str(getattr(ns, flag))]
        if ns.tokenizer_mux:
            argv.append("--tokenizer-mux")
        if ns.allowed_origins:
            argv += ["--allowed-origins", ns.allowed_origins]
        if ns.disable_fastapi_docs:
            argv.append("--disable-fastapi-docs")
        for flag in ("allow_credentials", "disable_uvicorn_access_log"):
            if getattr(ns, flag):
                argv.append("--" + flag.replace("_", "-"))
        for flag in ("allowed_methods", "allowed_headers"):
            if getattr(ns, flag) is not None:
                argv += ["--" + flag.replace("_", "-"), getattr(ns, flag)]
        for replica in self.replicas:
            if replica.metrics_url is not None:
                argv += ["--metrics-federate", replica.metrics_url]
        for replica in self.replicas:   # the i-th overall is labelled tokenizer="i": replica r's j-th is r x T + j
            for url in replica.tokenizer_metrics_urls:
                argv += ["--metrics-federate-tokenizer", url]
        argv += federate_role_flags(ns, [replica.metrics_url for replica in self.replicas])
        argv += rest_tls_flags(rest_tls)
        if self.shared_port:
            argv.append("--reuse-port")
        probe = None if rest_tls is None else rest_tls.probe_context()
        scheme = self.scheme
        child = Child(f"gateway-{i}", argv, ready=(lambda: http_ok(f"{scheme}://127.0.0.1:{port}/health", probe)),
                      env=self.child_env)
        if self.shared_port:  # any gateway may answer the probe: this one is ready once it listens as well
            child.ready = lambda: (child.proc is not None and reuse_port.listens_on(child.proc.pid, port)
                                   and http_ok(f"{scheme}://127.0.0.1:{port}/health", probe))
        return child

    @property
    def engines(self) -> list[Child]:
        return [replica.engine for replica in self.replicas]

    @property
    def engine(self) -> Child:
        """The first replica's engine (the only one without --data-parallel-size)."""
        return self.replicas[0].engine

    @property
    def tokenizers(self) -> list[Child]:
        return [child for replica in self.replicas for child in replica.tokenizers]

    @property
    def children(self) -> list[Child]:
        """In the order they start: the engines, then the tokenizer services, then the gateways."""
        return [*self.engines, *self.tokenizers, *self.gateways]

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.shared_port and not reuse_port.port_free(self.ns.host, self.ns.port):
            logger.error("port %d is in use: the gateways would share it with what listens there", self.ns.port)
            return 1
        self.write_key_file()
        # Every child starts at once: the tokenizer services and gateways load while the engines load the model
        # (each waits for the hop behind it, NOT_SERVING / 503 until then), and readiness is waited for in order.
        for child in self.children:
            child.start()
        for child in self.children:
            if not child.wait_ready(lambda: self.stopping):
                if self.stopping:
                    return self.shutdown()
                logger.error("%s did not become ready; stopping", child.name)
                self.shutdown()
                return 1
        ports = [self.ns.port] if self.shared_port else [self.ns.port + i for i in range(self.ns.gateways)]
        urls = ", ".join(f"{self.scheme}://{self.ns.host}:{port}/v1" for port in ports)
        if self.observability.log_format == "json":  # every line it prints stays JSON
            logger.info("Sluice is serving %s at %s", self.config.model_name, urls)
        else:
            print(f"Sluice is serving {self.config.model_name} at {urls}", flush=True)
        while not self.stopping:
            for child in self.children:
                if not child.alive() and not self.stopping:
                    self._restart(child)
            time.sleep(0.2)
        return self.shutdown()

    def write_key_file(self) -> None:
        """The keys, for the children to read; removed by ``shutdown``."""
        if self.key_file is not None:
            # O_EXCL: never through a file or link someone else put there first.
            fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"{key}\n" for key in self.api_keys))

    def _restart(self, child: Child) -> None:
        now = time.monotonic()
        if child.next_restart == 0.0:
            code = child.proc.returncode if child.proc else None
            logger.error("%s exited unexpectedly (code %s); restarting", child.name, code)
            child.next_restart = now + min(10.0, 0.5 * 2 ** min(child.restarts, 5))
            return
        if now < child.next_restart:
            return
        child.restarts += 1
        child.next_restart = 0.0
        child.start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            logger.info("received %s: draining", signal.Signals(signum).name)
        self.stopping = True

    def shutdown(self) -> int:
        """Every child drains at once: each stops taking new calls and lets in-flight ones finish within
        the grace period, so a request in flight keeps its whole path (gateway → tokenizer → engine)."""
        deadline = time.monotonic() + self.ns.shutdown_timeout + 1.5
        for child in self.children:
            if child.alive():
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", child.name)
                child.proc.kill()
                child.proc.wait()
        if self.key_file is not None and os.path.exists(self.key_file):
            os.remove(self.key_file)
        logger.info("stopped")
        return 0


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    notes: list[str] = []
    ns = resolve_settings(args, notes)
    try:
        config = config_from_args(ns)
        check_local_paths(config)
        with_kv_roles(replica_configs(config, ns.data_parallel_size), ns)
        observability = observability_settings(ns)
        grpc_tls, rest_tls = grpc_tls_from_args(ns), rest_tls_from_args(ns)
        keys = api_keys(ns)
    except InvalidRequestError as e:   # a flag's value (--speculative-config's, say): argparse's one line, exit 2
        build_parser().error(str(e))
    except ValueError as e:
        raise SystemExit(f"sluice serve: {e}") from e
    try:
        check_model_splits(config)
    except OSError as e:
        build_parser().error(f"cannot read the model's sizes from {config.model_path}: {e}")
    except ValueError as e:   # "the model's 9 attention heads do not divide over tensor_parallel_size 2",
        # "deepseek_v3: topk_method='greedy' is not supported (...)"
        build_parser().error(str(e))
    if ns.reasoning_parser is not None:   # its tags must be plain tokens of the vocabulary: said before any start
        try:
            Reasoning.load(ns.reasoning_parser, Tokenizer.from_pretrained(config.tokenizer or config.model_path))
        except (OSError, ValueError) as e:
            build_parser().error(str(e))
    supervisor = Supervisor(ns, config, observability, keys, grpc_tls=grpc_tls, rest_tls=rest_tls)
    configure_logging(ns.log_level, observability.log_format, "serve")
    for note in notes:
        logger.info("%s", note)
    raise SystemExit(supervisor.run())


if __name__ == "__main__":
    main()
