"""``sluice serve --prefill-replicas N --decode-replicas M`` (services/pd_serve.py): the flags' refusals (exit 2,
one line naming the flag), the layout (N producer and M consumer engines, each given a ``--kv-transfer-config``
its own engine CLI reads back, every tokenizer service fronting all of them), and the engines' metrics federated on
the gateways labelled with their role."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.args import add_engine_args, config_from_args
from engine.kv_transfer_config import KVTransferConfig
from gateway.metrics import _Merged
from gateway.settings import GatewaySettings
from services import supervisor


def resolve(command: str) -> argparse.Namespace:
    return supervisor.resolve_settings(shlex.split(command), [])


def refusal(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        resolve(command)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("command", "names"), [
    ("--prefill-replicas 1", ("--decode-replicas: is needed with --prefill-replicas",)),
    ("--decode-replicas 2", ("--prefill-replicas: is needed with --decode-replicas",)),
    ("--prefill-replicas 1 --decode-replicas 1 --data-parallel-size 2",
     ("--data-parallel-size: 2 cannot be combined with", "--prefill-replicas")),
    ("--prefill-replicas 1 --decode-replicas 1 -dp 3", ("--data-parallel-size: 3 cannot be combined with",)),
    ("--kv-connector MooncakeConnector", ("--kv-connector: needs --prefill-replicas and --decode-replicas",)),
    ("--prefill-replicas 1 --decode-replicas 1 --kv-transfer-config "
     "'{\"kv_connector\": \"SharedMemoryConnector\", \"kv_role\": \"kv_producer\"}'",
     ("--kv-transfer-config: sluice serve writes each engine's itself", "--prefill-replicas", "--kv-connector")),
    ("--kv-transfer-config '{\"kv_connector\": \"SharedMemoryConnector\", \"kv_role\": \"kv_both\"}'",
     ("--kv-transfer-config: ", "sluice engine --kv-transfer-config")),
    ("--prefill-replicas 0 --decode-replicas 1", ("--prefill-replicas",)),
    ("--prefill-replicas 1 --decode-replicas 1 --kv-connector NixlConnector", ("--kv-connector",)),
])
def test_disaggregation_flags_sluice_cannot_honour_are_refused_naming_them(
        command: str, names: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(command, capsys)
    assert err.startswith("sluice serve: error: ") and "unrecognized arguments" not in err
    assert all(name in err for name in names), err


def engine_cli_config(argv: list[str]) -> KVTransferConfig | None:
    """What the engine's own command line makes of a child engine's argv."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flag in ("--host", "--port", "--log-level", "--shutdown-timeout", "--metrics-port"):
        parser.add_argument(flag)
    return config_from_args(parser.parse_known_args(argv[argv.index("engine") + 1:])[0]).kv_transfer_config


@pytest.mark.parametrize("connector", [None, "MooncakeConnector"])
def test_two_prefill_and_one_decode_engines_are_replicas_with_roles(connector: str | None) -> None:
    ns = resolve("--prefill-replicas 2 --decode-replicas 1 --engine-port 51000 --tokenizer-port 51100"
                 + (f" --kv-connector {connector}" if connector else ""))
    sup = supervisor.Supervisor(ns, config_from_args(ns))
    engines = [child.argv for child in sup.engines]
    assert [argv[argv.index("--port") + 1] for argv in engines] == ["51000", "51001", "51002"]
    configs = [engine_cli_config(argv) for argv in engines]
    assert [(c.kv_connector, c.kv_role) if c else None for c in configs] == [
        (connector or "SharedMemoryConnector", "kv_producer")] * 2 + [
        (connector or "SharedMemoryConnector", "kv_consumer")]
    # Every tokenizer service fronts all three engines and tells them apart by the role their GetInfo reports.
    assert len(sup.tokenizers) == 3
    for child in sup.tokenizers:
        assert child.argv[child.argv.index("--engine") + 1] == "127.0.0.1:51000,127.0.0.1:51001,127.0.0.1:51002"
    # The same PYTHONHASHSEED everywhere: the decode engine checks the prefill engine's block hashes against its own.
    assert {child.env.get("PYTHONHASHSEED") for child in sup.children} == {sup.child_env["PYTHONHASHSEED"]}
    gateway = sup.gateways[0].argv
    federated = [gateway[i + 1] for i, a in enumerate(gateway) if a == "--metrics-federate"]
    roles = [gateway[i + 1] for i, a in enumerate(gateway) if a == "--metrics-federate-kv-role"]
    assert federated == [replica.metrics_url for replica in sup.replicas] and len(federated) == 3
    assert roles == ["kv_producer", "kv_producer", "kv_consumer"]


def test_without_disaggregation_engines_have_no_kv_role() -> None:
    ns = resolve("--data-parallel-size 2")
    sup = supervisor.Supervisor(ns, config_from_args(ns))
    assert [engine_cli_config(child.argv) for child in sup.engines] == [None, None]
    assert "--metrics-federate-kv-role" not in sup.gateways[0].argv
    assert "--kv-transfer-config" not in json.dumps([child.argv for child in sup.children])


ENGINE_PAGE = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} %d
"""


def test_federated_engine_series_carry_their_kv_role() -> None:
    pages = [list(text_string_to_metric_families(ENGINE_PAGE % i)) for i in (3, 5)]
    text = generate_latest(_Merged(pages, [], ("kv_producer", "kv_consumer"))).decode()   # type: ignore[arg-type]
    samples = {(s.labels["engine"], s.labels["kv_role"]): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples == {("0", "kv_producer"): 3.0, ("1", "kv_consumer"): 5.0}
    with pytest.raises(ValueError, match="--metrics-federate-kv-role: one per --metrics-federate"):
        GatewaySettings(tokenizer_addresses=("127.0.0.1:1",), metrics_federate=("http://a/metrics",),
                        metrics_federate_kv_roles=("kv_producer", "kv_consumer"))
