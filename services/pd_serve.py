"""``sluice serve --prefill-replicas N --decode-replicas M``: prefill/decode disaggregation (xPyD) on one host.

The N prefill engines (``kv_producer``) and M decode engines (``kv_consumer``) are data-parallel replicas whose
engines have a KV role: each has its own engine port, devices, metrics port and ``--tokenizers`` services, every
tokenizer service fronts all N + M engines and splits each request between a prefill and a decode engine by the
roles their GetInfo reports (services/tokenizer/disagg.py), and each child is supervised and restarted as any
replica's. ``--kv-connector`` picks the transport (``SharedMemoryConnector``, the default: the decode engine maps the
prefill engine's KV cache; ``MooncakeConnector``: Mooncake's transfer engine over TCP). ``sluice serve`` writes
each engine's ``--kv-transfer-config`` itself, so that flag is refused here; engines on other hosts are started with
``sluice engine --kv-transfer-config`` and named to the tokenizer services' ``--engine`` list.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from common.argtypes import at_least
from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.kv_transfer_config import KVTransferConfig

# The connectors ``--kv-connector`` offers (engine.kv_transfer_config.KV_CONNECTORS, one name per transport).
SERVE_CONNECTORS = ("SharedMemoryConnector", "MooncakeConnector")
PREFILL_ROLE, DECODE_ROLE = "kv_producer", "kv_consumer"


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prefill/decode disaggregation")
    count = at_least(1, integer=True, what="a count")
    g.add_argument("--prefill-replicas", type=count, default=None, metavar="N",
                   help="run N prefill engines (kv_producer) beside --decode-replicas decode engines: each request's "
                        "prompt and first token on a prefill engine, the rest on a decode engine that reads the "
                        "prompt's KV blocks from it (docs/serving.md, 'Prefill/decode disaggregation')")
    g.add_argument("--decode-replicas", type=count, default=None, metavar="M",
                   help="run M decode engines (kv_consumer) beside --prefill-replicas prefill engines")
    g.add_argument("--kv-connector", default=None, choices=SERVE_CONNECTORS,
                   help="the KV transport between them: SharedMemoryConnector (the default; one host, blocks copied "
                        "once through shared memory) or MooncakeConnector (Mooncake's transfer engine over TCP)")


def resolve_pd(ns: argparse.Namespace) -> None:
    """Checks the disaggregation flags and lays the engines out as replicas: ``ns.data_parallel_size`` becomes
    N + M and ``ns.kv_roles`` each replica's role, prefill engines first (None: no disaggregation).
    InvalidRequestError naming the flag."""
    ns.kv_roles = None
    if getattr(ns, "kv_transfer_config", None) is not None:
        raise InvalidRequestError("--kv-transfer-config", "sluice serve writes each engine's itself: use "
                                  "--prefill-replicas N --decode-replicas M (--kv-connector for the transport); one "
                                  "engine of a role on its own is `sluice engine --kv-transfer-config`")
    prefill, decode = ns.prefill_replicas, ns.decode_replicas
    if prefill is None and decode is None:
        if ns.kv_connector is not None:
            raise InvalidRequestError("--kv-connector", "needs --prefill-replicas and --decode-replicas")
        return
    if prefill is None or decode is None:
        given, missing = ("--prefill-replicas", "--decode-replicas") if decode is None else (
            "--decode-replicas", "--prefill-replicas")
        raise InvalidRequestError(missing, f"is needed with {given}: a request goes from a prefill engine to a "
                                           "decode engine")
    if ns.data_parallel_size > 1:
        raise InvalidRequestError("--data-parallel-size", f"{ns.data_parallel_size} cannot be combined with "
                                  "--prefill-replicas / --decode-replicas: the prefill and decode engines are the "
                                  "replicas (N + M of them)")
    ns.data_parallel_size = prefill + decode
    ns.kv_roles = [PREFILL_ROLE] * prefill + [DECODE_ROLE] * decode


def with_kv_roles(configs: Sequence[EngineConfig], ns: argparse.Namespace) -> list[EngineConfig]:
    """Each replica's engine settings with its ``--kv-transfer-config`` (its role, ``--kv-connector``'s transport);
    as they are without disaggregation. InvalidRequestError where the engine settings cannot go with a role."""
    roles = getattr(ns, "kv_roles", None)
    if roles is None:
        return list(configs)
    connector = ns.kv_connector or SERVE_CONNECTORS[0]
    return [config.with_changes(kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role=role))
            for config, role in zip(configs, roles, strict=True)]


def federate_role_flags(ns: argparse.Namespace, metrics_urls: Sequence[str | None]) -> list[str]:
    """The gateways' ``--metrics-federate-kv-role`` flags: the role of each engine whose metrics page they federate
    (``metrics_urls``, by replica, None: none), in the order of their ``--metrics-federate`` flags."""
    roles = getattr(ns, "kv_roles", None)
    if roles is None:
        return []
    return [flag for url, role in zip(metrics_urls, roles, strict=True) if url is not None
            for flag in ("--metrics-federate-kv-role", role)]
