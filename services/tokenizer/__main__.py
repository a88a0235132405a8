"""``python -m services.tokenizer`` / ``sluice tokenizer``: the public text-level gRPC service."""

from __future__ import annotations

import argparse
import asyncio

from common.auth import add_api_key_args, api_keys
from common.observability import add_observability_args, observability_settings, set_up
from common.procs import die_with_parent, port_number
from common.tls import add_grpc_tls_args, grpc_tls_from_args
from engine.text.chat import load_chat_template
from engine.text.reasoning import REASONING_PARSERS
from engine.text.tool_parsers import TOOL_PARSERS
from services.tokenizer.limits import InputLimits
from services.tokenizer.migration import MigrationMetrics, add_migration_args, migration_settings
from services.tokenizer.multimodal import add_media_args, media_settings
from services.tokenizer.routing import ROUTING_POLICIES, RoutingSettings
from services.tokenizer.tools import ToolSettings


class _JoinedAddresses(argparse.Action):
    """A repeated flag's values as one comma-separated string (what one flag with a comma list gives)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = f"_{self.dest}_given"
        value = f"{getattr(namespace, self.dest)},{values}" if getattr(namespace, given, False) else str(values)
        setattr(namespace, self.dest, value)
        setattr(namespace, given, True)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # under `sluice serve`: end with it
    parser = argparse.ArgumentParser(prog="sluice tokenizer", description=__doc__)
    parser.add_argument("--engine", action=_JoinedAddresses, default="127.0.0.1:50051", metavar="ADDRESS",
                        help="engine gRPC address; repeated or comma-separated for several engines (data-parallel "
                             "replicas of one model), each request going to one of them")
    parser.add_argument("--routing", default=None, choices=ROUTING_POLICIES,
                        help="how a request's engine is chosen among several: kv_aware (the default: the longest "
                             "cached prefix, from the engines' KV events, unless their loads drift apart), "
                             "least_loaded, round_robin")
    parser.add_argument("--routing-balance-abs-threshold", type=int, default=RoutingSettings.balance_abs_threshold,
                        metavar="N", help="kv_aware: go to the least loaded engine instead when the most loaded has "
                                          "more than N requests over it ...")
    parser.add_argument("--routing-balance-rel-threshold", type=float,
                        default=RoutingSettings.balance_rel_threshold, metavar="X",
                        help="... and more than X times its requests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--model", default=None, help="the engine's model (for its tokenizer); default model if unset")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--shm-tokens", type=int, default=4 * 2**20,
                        help="capacity of this replica's shared-memory ring in tokens (0 = always inline ids)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template (file path or the template itself) used instead of the model's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='parse tool calls out of the output for tool_choice "auto" (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the model family's tool-call syntax")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split chat outputs into the model's thinking (reasoning_content) and its answer")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render chat templates sent with requests (off: refused), each in a child process "
                             "bounded by --request-chat-template-timeout and the prompt size limit")
    parser.add_argument("--request-chat-template-timeout", type=float, default=1.0,
                        help="seconds a request's chat template may render for before it is refused")
    parser.add_argument("--tokenize-threads", type=int, default=4,
                        help="threads that tokenize and render prompts off the event loop")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--log-level", default="info")
    add_migration_args(parser)
    add_media_args(parser)
    parser.add_argument("--metrics-port", type=port_number, default=0,
                        help="serve this service's sluice:* Prometheus metrics (requests migrated) at "
                             "http://METRICS_HOST:PORT/metrics (0: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds to")
    add_api_key_args(parser)
    add_observability_args(parser)
    add_grpc_tls_args(parser)
    ns = parser.parse_args(argv)
    try:
        tools = ToolSettings(ns.enable_auto_tool_choice, ns.tool_call_parser)
        chat_template = load_chat_template(ns.chat_template) if ns.chat_template is not None else None
        limits = InputLimits(trust_request_chat_template=ns.trust_request_chat_template,
                             template_timeout_s=ns.request_chat_template_timeout,
                             tokenize_threads=ns.tokenize_threads)
        observability = observability_settings(ns)
        tls = grpc_tls_from_args(ns)
        keys = api_keys(ns)
        routing = RoutingSettings(ns.routing, ns.routing_balance_abs_threshold, ns.routing_balance_rel_threshold)
        engines = [a.strip() for a in ns.engine.split(",") if a.strip()]
        migration = migration_settings(ns)
        media = media_settings(ns)
        metrics = MigrationMetrics.serve(ns.metrics_host, ns.metrics_port) if ns.metrics_port else None
    except (ValueError, OSError) as e:   # InvalidRequestError (a bad --limit-mm-per-prompt) too
        parser.error(str(e))
    tracing = set_up(observability, log_level=ns.log_level, process="tokenizer")
    from services.tokenizer.server import serve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(engine_addrs=engines, host=ns.host, port=ns.port, model=ns.model, tokenizer=ns.tokenizer,
                          served_model_name=ns.served_model_name, shm_tokens=ns.shm_tokens,
                          shutdown_grace=ns.shutdown_timeout, chat_template=chat_template, tools=tools,
                          limits=limits, tracing=tracing, log_requests=observability.log_requests,
                          tls=tls, api_keys=keys, reasoning_parser=ns.reasoning_parser, routing=routing,
                          migration=migration, migration_metrics=metrics, media=media))
    finally:
        if tracing is not None:
            tracing.shutdown()


if __name__ == "__main__":
    main()
