"""What ``sluice serve -dp N`` sets up for routing (services/supervisor.py, services/replicas.py): every tokenizer
service gets every engine, the engines publish KV events on ports of their own when routing is by cache, and all
children share one ``PYTHONHASHSEED``. The engines' own parser reads the flags they are given."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from engine.config import KVEventsConfig
from engine.core.kv_events import offset_endpoint_port
from engine.entrypoints.args import add_engine_args, config_from_args
from engine.entrypoints.grpc_servicer import _connectable
from services import supervisor
from services.tokenizer.__main__ import _JoinedAddresses


def stack(*flags: str) -> supervisor.Supervisor:
    ns = supervisor.resolve_settings(["--engine-port", "7000", *flags])
    return supervisor.Supervisor(ns, supervisor.config_from_args(ns))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def engine_config(argv: list[str]) -> KVEventsConfig | None:
    """The KV events settings the engine child parses from its command line."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns, _ = parser.parse_known_args(argv[3:])   # the engine's settings; its port, logs, metrics left aside
    return config_from_args(ns).kv_events_config


def test_kv_aware_replicas_publish_kv_events_on_sockets_of_their_own_and_share_a_hash_seed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    s = stack("-dp", "2")
    configs = [engine_config(e.argv) for e in s.engines]
    assert configs[0] == configs[1] and configs[0] is not None and configs[0].enable_kv_cache_events
    ranks = [int(flag(e.argv, "--data-parallel-rank") or 0) for e in s.engines]
    assert ranks == [0, 1]
    endpoints = [offset_endpoint_port(configs[0].endpoint, r) for r in ranks]
    replays = [offset_endpoint_port(configs[0].replay_endpoint, r) for r in ranks]
    # ipc sockets in a folder only this user can enter: the events carry token ids, they stay off the network.
    assert len(set(endpoints + replays)) == 4 and all(str(e).startswith("ipc://") for e in endpoints + replays)
    folder = os.path.dirname(str(configs[0].endpoint).removeprefix("ipc://"))
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert {flag(t.argv, "--engine") for t in s.tokenizers} == {"127.0.0.1:7000,127.0.0.1:7001"}
    assert all(flag(t.argv, "--routing") is None for t in s.tokenizers)   # the service's default: kv_aware
    seeds = {c.env.get("PYTHONHASHSEED") for c in s.children}
    assert len(seeds) == 1 and None not in seeds
    assert stack("-dp", "2").child_env["PYTHONHASHSEED"] != s.child_env["PYTHONHASHSEED"]   # drawn per run
    monkeypatch.setenv("PYTHONHASHSEED", "77")
    assert stack("-dp", "2").child_env == {"PYTHONHASHSEED": "77"}


def test_an_explicit_kv_events_config_another_policy_or_one_replica_publish_nothing_new() -> None:
    given = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "kv"})
    explicit = stack("-dp", "2", "--kv-events-config", given)
    assert {engine_config(e.argv) for e in explicit.engines} == {
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6000", topic="kv")}
    round_robin = stack("-dp", "2", "--routing", "round_robin")
    assert all(engine_config(e.argv) is None for e in round_robin.engines)
    assert {flag(t.argv, "--routing") for t in round_robin.tokenizers} == {"round_robin"}
    no_cache = stack("-dp", "2", "--no-enable-prefix-caching")
    assert all(engine_config(e.argv) is None for e in no_cache.engines)
    single = stack()
    assert engine_config(single.engine.argv) is None and single.child_env == {}
    assert flag(single.tokenizers[0].argv, "--engine") == "127.0.0.1:7000"


def test_the_engine_reports_its_kv_events_endpoints_as_a_client_on_its_host_connects_to_them() -> None:
    assert _connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert _connectable("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert _connectable("ipc:///tmp/kv") == "ipc:///tmp/kv"
    assert _connectable("tcp://10.0.0.2:5557") == ""   # the PUB socket connects out there: nothing to connect to
    assert _connectable("tcp://10.0.0.2:5558", always_bound=True) == "tcp://10.0.0.2:5558"   # a replay ROUTER
    assert _connectable("inproc://kv") == "" and _connectable(None) == ""


def test_a_tokenizer_service_takes_its_engines_repeated_or_comma_separated() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", action=_JoinedAddresses, default="127.0.0.1:50051")
    assert parser.parse_args([]).engine == "127.0.0.1:50051"
    assert parser.parse_args(["--engine", "a:1"]).engine == "a:1"
    assert parser.parse_args(["--engine", "127.0.0.1:50051", "--engine", "b:2,c:3"]).engine == "127.0.0.1:50051,b:2,c:3"
