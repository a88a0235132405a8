"""services/mindie/server.py: the top-level keys, LogConfig and ServerConfig's listener and request keys, value by
value; and the walk's own rules (unknown keys, sections that are not objects, MindIE 1.0.RC1/RC2's layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.mindie import Treatment
from services.mindie.config import MindieConfig
from tests.services.mindie.factory import walk

E, N, R = Treatment.EFFECT, Treatment.NO_EFFECT, Treatment.REFUSED


def one(tmp_path: Path, config: dict[str, Any], key: str, environ: dict[str, str] | None = None
        ) -> tuple[Treatment, str, dict[str, Any]]:
    result = walk(tmp_path, config, environ).result(key)
    return result.treatment, result.outcome.message, dict(result.outcome.settings)


def server(**keys: Any) -> dict[str, Any]:
    return {"ServerConfig": keys}


@pytest.mark.parametrize(("links", "cap"), [(1, 3), (300, 900), (4096, 12288)])
def test_max_link_num_caps_each_gateways_connections_at_three_times_it(tmp_path: Path, links: int, cap: int) -> None:
    """MindIE: maxLinkNum requests in progress and 2 x maxLinkNum queued; the (3 x maxLinkNum + 1)-th is refused."""
    assert one(tmp_path, server(maxLinkNum=links), "ServerConfig.maxLinkNum") == (
        E, f"each gateway serves {cap} connections at once (MindIE: {links} requests in progress and {2 * links} "
           "queued); the next connection's request gets 503", {"max_connections": cap})


@pytest.mark.parametrize("links", [0, 4097, True, "300"])
def test_max_link_num_out_of_range_is_refused(tmp_path: Path, links: Any) -> None:
    assert one(tmp_path, server(maxLinkNum=links), "ServerConfig.maxLinkNum") == (
        R, f"must be an integer in [1, 4096], got {links!r}", {})


def test_every_address_needs_allow_all_zero_ip_listening(tmp_path: Path) -> None:
    assert one(tmp_path, server(ipAddress="0.0.0.0"), "ServerConfig.ipAddress") == (
        R, "0.0.0.0 listens on every address, which MindIE allows only with allowAllZeroIpListening true, and so "
           "does Sluice", {})
    assert one(tmp_path, server(ipAddress="0.0.0.0", allowAllZeroIpListening=True), "ServerConfig.ipAddress") == (
        E, "the gateways listen on 0.0.0.0", {"host": "0.0.0.0"})
    assert one(tmp_path, server(ipAddress="localhost"), "ServerConfig.ipAddress")[:2] == (
        R, "'localhost' is not an IPv4 or IPv6 address")


def test_the_container_ip_variables_win_over_the_addresses_as_in_mindie(tmp_path: Path) -> None:
    config = server(ipAddress="127.0.0.1", managementIpAddress="127.0.0.2")
    env = {"MIES_CONTAINER_IP": "10.0.0.5", "MIES_CONTAINER_MANAGEMENT_IP": "10.0.0.5"}
    assert one(tmp_path, config, "ServerConfig.ipAddress", env) == (
        E, "the gateways listen on 10.0.0.5 (MIES_CONTAINER_IP, over '127.0.0.1')", {"host": "10.0.0.5"})
    assert one(tmp_path, config, "ServerConfig.managementIpAddress", env)[0] is N


def test_management_and_metrics_on_the_api_port_are_served_there(tmp_path: Path) -> None:
    config = walk(tmp_path, server(ipAddress="127.0.0.1", managementIpAddress="127.0.0.1", port=1025,
                                   managementPort=1025, metricsPort=1025))
    assert config.refusals == []
    assert config.result("ServerConfig.metricsPort").outcome.message == (
        "the same port as the API: the metrics (/metrics) are served there, as MindIE does with equal ports")
    assert config.settings == {"host": "127.0.0.1", "port": 1025}


@pytest.mark.parametrize("port", [80, 65536, "1025"])
def test_ports_outside_mindies_range_are_refused(tmp_path: Path, port: Any) -> None:
    assert one(tmp_path, server(port=port), "ServerConfig.port")[:2] == (
        R, f"must be an integer in [1024, 65535], got {port!r}")


def test_the_end_to_end_timeout_is_the_gateway_deadline_unless_lifted(tmp_path: Path) -> None:
    assert one(tmp_path, server(e2eTimeout=30), "ServerConfig.e2eTimeout")[::2] == (E, {"request_timeout": 30.0})
    lifted = {**server(e2eTimeout=30), "EnableDynamicAdjustTimeoutConfig": True}
    assert one(tmp_path, lifted, "ServerConfig.e2eTimeout") == (
        N, "EnableDynamicAdjustTimeoutConfig lifts it: no gateway deadline", {})
    assert one(tmp_path, lifted, "EnableDynamicAdjustTimeoutConfig")[0] is E


def test_max_request_length_is_the_body_limit_in_mib(tmp_path: Path) -> None:
    assert one(tmp_path, server(maxRequestLength=40), "ServerConfig.maxRequestLength") == (
        E, "request bodies of up to 40 MiB; a larger one gets 413", {"max_body_bytes": 40 * 2**20})
    assert one(tmp_path, server(maxRequestLength=101), "ServerConfig.maxRequestLength")[0] is R


@pytest.mark.parametrize(("key", "value", "message"), [
    ("fullTextEnabled", True, "streams carry each event's new text only (OpenAI's format); streaming the whole text "
                              "so far is not implemented"),
    ("inferMode", "dmi", "\"dmi\": prefill-decode disaggregation is not implemented (Sluice's instances run both)"),
    ("inferMode", "pd", "'pd' is not a MindIE mode (standard, dmi)"),
    ("distDPServerEnabled", True, "the distributed DP server of large-scale expert parallel is not implemented: run "
                                  "replicas with modelInstanceNumber"),
    ("layerwiseDisaggregated", True, "layer-wise disaggregation is not implemented"),
    ("tokenTimeout", 0, "must be an integer in [1, 3600], got 0"),
])
def test_what_sluice_does_not_run_is_refused_with_the_reason(tmp_path: Path, key: str, value: Any, message: str
                                                             ) -> None:
    assert one(tmp_path, server(**{key: value}), f"ServerConfig.{key}") == (R, message, {})


@pytest.mark.parametrize(("level", "python"), [("Info", "info"), ("Verbose", "debug"), ("debug", "debug"),
                                               ("WARN", "warning"), ("Warning", "warning"), ("Error", "error"),
                                               ("None", "critical")])
def test_the_log_level_is_every_processs(tmp_path: Path, level: str, python: str) -> None:
    assert one(tmp_path, {"LogConfig": {"logLevel": level}}, "LogConfig.logLevel") == (
        E, f"log level {python} in every process", {"log_level": python})


def test_log_keys_without_a_counterpart(tmp_path: Path) -> None:
    assert one(tmp_path, {"LogConfig": {"logLevel": "Loud"}}, "LogConfig.logLevel")[0] is R
    assert one(tmp_path, {"LogConfig": {"dynamicLogLevel": "debug"}}, "LogConfig.dynamicLogLevel") == (
        R, "'debug': a log level that changes while serving is not supported; start with the level "
           "(LogConfig.logLevel or --log-level)", {})


def test_only_version_1_0_0_exists(tmp_path: Path) -> None:
    assert one(tmp_path, {"Version": "2.0.0"}, "Version")[:2] == (
        R, "'2.0.0': MindIE's config.json has one version, \"1.0.0\"")


def refused_keys(config: MindieConfig) -> dict[str, str]:
    return {r.key: r.outcome.message for r in config.refusals}


def test_keys_mindie_does_not_document_are_refused_at_every_level(tmp_path: Path) -> None:
    config = walk(tmp_path, {
        "Foo": 1, "ServerConfig": {"timeoutInSeconds": 300}, "LogConfig": {"logColor": True},
        "BackendConfig": {"kvPoolConfig": {"size": 1},
                          "ModelDeployConfig": {"maxSeqLen": 64, "ModelConfig": [
                              {"modelName": "m", "dtype": "bf16", "models": {"extra": 1}}]},
                          "ScheduleConfig": {"enablePrefixCache": True}},
    })
    unknown = ("not a key of MindIE's documented config.json (1.0.RC3 to 2.x): Sluice cannot tell what it would do, "
               "so it does not guess")
    assert refused_keys(config) == {key: unknown for key in (
        "Foo", "ServerConfig.timeoutInSeconds", "LogConfig.logColor", "BackendConfig.kvPoolConfig.size",
        "ModelConfig.dtype", "ModelConfig.models.extra", "ScheduleConfig.enablePrefixCache")}


def test_sections_of_the_wrong_shape_and_the_old_layout_are_refused(tmp_path: Path) -> None:
    config = walk(tmp_path, {"ServerConfig": [], "OtherParam": {}, "BackendConfig": {"ModelDeployConfig": {
        "ModelConfig": [{"modelName": "a"}, {"modelName": "b"}]}}})
    assert refused_keys(config) == {
        "ServerConfig": "must be a JSON object, got []",
        "OtherParam": "MindIE 1.0.RC1/RC2's layout (OtherParam, WorkFlowParam, ModelDeployParam) is not read: write "
                      "the ServerConfig / BackendConfig layout of MindIE 1.0.RC3 and later",
        "ModelDeployConfig.ModelConfig": "one model per Sluice replica (modelInstanceNumber replicas of it); got 2",
    }
