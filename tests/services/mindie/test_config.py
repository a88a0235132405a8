"""services/mindie/config.py through ``sluice serve --config``: the settings reach the children (flags on the
command line win), each accepted key gives one start-up log line, and refusals stop start-up naming every key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import supervisor
from services.mindie import ConfigFileError, load_mindie_config
from tests.services.mindie.factory import SERVABLE, install, leaf_keys, merged, shipped, tls_material, walk


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_servable_mindie_config_configures_every_child(tmp_path: Path) -> None:
    tls_material(tmp_path, tmp_path / "pki")
    config = merged(shipped("2.x"), SERVABLE)
    path = install(tmp_path, config)
    notes: list[str] = []
    ns = supervisor.resolve_settings(["--config", str(path)], notes)
    stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns), rest_tls=supervisor.rest_tls_from_args(ns))
    gateway = stack.gateways[0].argv
    assert (flag(gateway, "--host"), flag(gateway, "--port"), flag(gateway, "--max-connections"),
            flag(gateway, "--request-timeout"), flag(gateway, "--served-model-name")) == (
        "127.0.0.1", "1025", "3000", "600.0", "llama_65b")
    assert (flag(gateway, "--ssl-certfile"), flag(gateway, "--ssl-keyfile"), flag(gateway, "--ssl-ca-certs"),
            flag(gateway, "--ssl-cert-reqs")) == (
        str(tmp_path / "security/certs/server.pem"), str(tmp_path / "security/keys/server.key.pem"),
        str(tmp_path / "security/ca/ca.pem"), "2")
    assert stack.scheme == "https" and len(stack.tokenizers) == 8
    engine = " ".join(stack.engine.argv)
    for part in ("--model /data/atb_testdata/weights/llama1-65b-safetensors", "--device npu", "--max-model-len 2560",
                 "--max-num-seqs 200", "--max-num-batched-tokens 8192", "--block-size 128",
                 "--tensor-parallel-size 4", "--device-ids 0,1,2,3"):
        assert part in engine
    assert notes == load_mindie_config(path, environ={}).notes and len(notes) == len(list(leaf_keys(config)))


def test_flags_on_the_command_line_win_over_the_file(tmp_path: Path) -> None:
    config = {"ServerConfig": {"port": 1025, "maxLinkNum": 10}, "BackendConfig": {"tokenizerProcessNumber": 4}}
    path = install(tmp_path, config)
    ns = supervisor.resolve_settings(["--config", str(path), "--port", "9000", "--max-connections", "5"])
    assert (ns.port, ns.max_connections, ns.tokenizers) == (9000, 5, 4)


def test_every_setting_a_key_sets_is_one_of_serves(tmp_path: Path) -> None:
    configs = [merged(shipped("2.x"), SERVABLE), merged(shipped("1.x"), SERVABLE), {
        "LogConfig": {"logLevel": "Debug"}, "ServerConfig": {"maxRequestLength": 10},
        "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
            {"npuMemSizeRatio": 0.5, "plugin_params": json.dumps({"plugin_type": "mtp"})}]}}}]
    names = set()
    for i, config in enumerate(configs):
        tls_material(tmp_path / str(i), tmp_path / f"pki{i}")
        names |= set(walk(tmp_path / str(i), config).settings)
    assert names == {
        "host", "port", "max_connections", "request_timeout", "max_body_bytes", "log_level", "ssl_certfile",
        "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs", "data_parallel_size", "device", "device_ids", "tokenizers",
        "max_model_len", "served_model_name", "model", "tensor_parallel_size", "device_memory_utilization",
        "speculative_config", "block_size", "max_num_batched_tokens", "max_num_seqs", "scheduling_policy"}
    assert names <= set(vars(supervisor.build_parser().parse_args([])))


def test_the_shipped_config_stops_sluice_serve_listing_every_key(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = install(tmp_path, shipped("2.x"))
    with pytest.raises(SystemExit) as info:
        supervisor.resolve_settings(["--config", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"sluice serve: error: {path}: 9 MindIE keys cannot be honoured:" in err
    assert "  ServerConfig.tlsCert: " in err and "  ScheduleConfig.maxIterTimes: " in err


def test_files_that_are_not_a_json_object_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match=r"cannot read MindIE config .*missing.json: \[Errno 2\]"):
        load_mindie_config(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigFileError, match=r"list.json: the top level must be a JSON object"):
        load_mindie_config(tmp_path / "list.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigFileError, match=r"cannot read MindIE config .*bad.json: Expecting"):
        load_mindie_config(tmp_path / "bad.json")
