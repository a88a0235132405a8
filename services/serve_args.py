"""``sluice serve`` as ``vllm serve``: the model as a positional argument, vLLM's ``--flag_name`` spelling, and
vLLM's API-server flags, each accepted with its effect, accepted as already Sluice's behaviour (logged), or
refused with a reason. The engine's flags of this kind are in ``engine/entrypoints/vllm_compat.py``.
"""

from __future__ import annotations

import argparse

from common.errors import InvalidRequestError
from engine.entrypoints.vllm_compat import (
    CompatFlag,
    add_compat_flags,
    check_compat_flags,
    check_vllm_compat,
    refuse_always,
    refuse_unless,
)
from engine.text.reasoning import REASONING_PARSERS


def _needs_reasoning_parser(value: object, ns: argparse.Namespace) -> str | None:
    return None if ns.reasoning_parser is not None else "does nothing without --reasoning-parser, which is not given"


SERVE_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(("--uvicorn-log-level",), None, choices=("debug", "info", "warning", "error", "critical", "trace"),
               help="the gateways' log level (default: --log-level)"),
    CompatFlag(("--root-path",), None, refuse_always("serving under a path prefix is not supported: let the proxy "
                                                     "strip it")),
    CompatFlag(("--middleware",), None, refuse_always("Sluice loads no Python code named on the command line")),
    CompatFlag(("--response-role",), "chat answers always have the role 'assistant'",
               refuse_unless(lambda v: v == "assistant", "chat answers always have the role 'assistant'")),
    CompatFlag(("--return-tokens-as-token-ids",), None, refuse_always("logprobs always name tokens by their text"),
               kind="switch"),
    CompatFlag(("--api-server-count",), "one gateway per port is how Sluice runs", type=int,
               refuse=refuse_unless(lambda v: v == 1, "Sluice's flag for several API processes on one port is "
                                                      "--gateways N (N gateway processes, SO_REUSEPORT)")),
    CompatFlag(("--disable-frontend-multiprocessing",), "the gateway and the engine are always separate processes",
               kind="switch"),
    CompatFlag(("--enable-reasoning",), "reasoning is parsed whenever --reasoning-parser is given (vLLM dropped "
                                        "this flag)", _needs_reasoning_parser, kind="switch"),
    CompatFlag(("--reasoning-parser",), None,
               refuse_unless(lambda v: v in REASONING_PARSERS, "is not a reasoning parser Sluice has: it has "
                                                               f"{', '.join(sorted(REASONING_PARSERS))}"),
               help="split chat outputs into the model's thinking (reasoning_content) and its answer: "
                    f"{', '.join(sorted(REASONING_PARSERS))}"),
    CompatFlag(("--headless",), None, refuse_always("sluice serve always runs the API server"), kind="switch"),
)


def add_vllm_serve_args(parser: argparse.ArgumentParser) -> None:
    """The positional MODEL (``vllm serve MODEL``) and vLLM's API-server flags."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF directory or .gguf file, as `vllm serve MODEL` (the same as --model)")
    add_compat_flags(parser, SERVE_FLAGS, "vLLM API-server flags without a Sluice setting of their own")


def check_vllm_serve_args(ns: argparse.Namespace) -> list[str]:
    """Moves the positional model to ``ns.model``; raises InvalidRequestError naming the first flag Sluice cannot
    honour; returns one line per accepted flag that has no effect, saying why."""
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise InvalidRequestError("--model", f"{ns.model!r} contradicts the positional MODEL {ns.model_tag!r}")
        ns.model = ns.model_tag
    return check_vllm_compat(ns, serve=True) + check_compat_flags(ns, SERVE_FLAGS)
