"""services/supervisor.py: what each child is started with — the tokenizer services' chat-template and
tool-calling flags, the engines' settings, data-parallel replicas' ports and devices, a MindIE config's keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services import supervisor
from services.replicas import replica_configs


def tokenizer_argvs(*flags: str) -> list[list[str]]:
    ns = supervisor.resolve_settings(["--tokenizers", "2", *flags])
    return [child.argv for child in supervisor.Supervisor(ns, supervisor.config_from_args(ns)).tokenizers]


def test_tool_flags_and_chat_template_go_to_every_tokenizer_service() -> None:
    for argv in tokenizer_argvs("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--chat-template", "/models/qwen.jinja"):
        tail = argv[argv.index("--chat-template"):]
        assert tail[:5] == ["--chat-template", "/models/qwen.jinja", "--enable-auto-tool-choice",
                            "--tool-call-parser", "hermes"]
    for argv in tokenizer_argvs():
        assert not {"--chat-template", "--enable-auto-tool-choice", "--tool-call-parser"} & set(argv)


def test_auto_tool_choice_without_a_parser_and_unknown_parsers_are_refused(capsys: pytest.CaptureFixture[str]
                                                                           ) -> None:
    with pytest.raises(SystemExit):
        supervisor.resolve_settings(["--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        supervisor.resolve_settings(["--tool-call-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err


def test_engine_flags_round_trip_through_the_engine_cli() -> None:
    """What the supervisor hands its engine child parses back into the same settings (objects included)."""
    import argparse

    from engine.config import EngineConfig, StructuredOutputsConfig
    from engine.entrypoints.args import add_engine_args, config_from_args
    from services.child_flags import engine_flags

    config = EngineConfig(max_num_seqs=7, scheduling_policy="priority", max_logprobs=5,
                          structured_outputs_config=StructuredOutputsConfig(disable_any_whitespace=True))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(engine_flags(config))) == config


def test_several_served_model_names_are_the_model_and_its_aliases() -> None:
    """vLLM's ``--served-model-name a b``: the engine and tokenizer services take the first, the gateways
    answer to all of them."""
    ns = supervisor.resolve_settings(["--served-model-name", "smol", "gpt-4o-mini", "--gateways", "2"])
    config = supervisor.config_from_args(ns)
    assert config.model_name == "smol"
    stack = supervisor.Supervisor(ns, config)
    for gateway in stack.gateways:
        names = [gateway.argv[i + 1] for i, a in enumerate(gateway.argv) if a == "--served-model-name"]
        assert names == ["smol", "gpt-4o-mini"]
    for tokenizer in stack.tokenizers:
        assert tokenizer.argv[tokenizer.argv.index("--served-model-name") + 1] == "smol"
    engine = stack.engine.argv
    assert engine[engine.index("--served-model-name") + 1] == "smol" and "gpt-4o-mini" not in engine


def test_disable_fastapi_docs_reaches_every_gateway() -> None:
    for flags, expected in (([], False), (["--disable-fastapi-docs"], True)):
        ns = supervisor.resolve_settings(["--gateways", "2", *flags])
        stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
        assert [("--disable-fastapi-docs" in g.argv) for g in stack.gateways] == [expected, expected]


def test_cors_and_access_log_flags_reach_every_gateway() -> None:
    ns = supervisor.resolve_settings(["--gateways", "2", "--allowed-origins", "*", "--allow-credentials",
                                      "--allowed-methods", "GET,POST", "--allowed-headers", "*",
                                      "--disable-uvicorn-access-log"])
    for g in supervisor.Supervisor(ns, supervisor.config_from_args(ns)).gateways:
        tail = " ".join(g.argv)
        assert "--allow-credentials" in g.argv and "--disable-uvicorn-access-log" in g.argv
        assert "--allowed-methods GET,POST" in tail and "--allowed-headers *" in tail


def test_keys_reach_the_gateways_and_tokenizers_in_a_private_file_never_on_a_command_line() -> None:
    ns = supervisor.resolve_settings(["--api-key", "sk-one", "--api-key", "sk-two", "--gateways", "2"])
    stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns), api_keys=("sk-one", "sk-two"))
    assert stack.key_file is not None
    for child in stack.children:
        assert not {"sk-one", "sk-two"} & set(child.argv)
        keyed = child in stack.gateways or child in stack.tokenizers
        assert (child.argv[child.argv.index("--api-key-file") + 1] == stack.key_file) if keyed \
            else "--api-key-file" not in child.argv
    stack.write_key_file()
    try:
        assert os.stat(stack.key_file).st_mode & 0o777 == 0o600
        with open(stack.key_file) as f:
            assert f.read() == "sk-one\nsk-two\n"
    finally:
        assert stack.shutdown() == 0  # no child started: it only removes the file
    assert not os.path.exists(stack.key_file)


def test_the_engine_and_tokenizer_services_listen_on_loopback_only() -> None:
    ns = supervisor.resolve_settings(["--host", "0.0.0.0", "--tokenizers", "2"])
    stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
    for child in [stack.engine, *stack.tokenizers]:
        assert child.argv[child.argv.index("--host") + 1] == "127.0.0.1"
    assert all(g.argv[g.argv.index("--host") + 1] == "0.0.0.0" for g in stack.gateways)
    assert stack.key_file is None and all("--api-key-file" not in c.argv for c in stack.children)


def test_data_parallel_replicas_each_have_their_engine_tokenizers_and_ports() -> None:
    """``--data-parallel-size 2 --tokenizers 2``: two engines on consecutive ports, each replica's tokenizer
    services on their own block of ports sending requests to both engines, every gateway given all four services
    replica by replica (consecutive requests go to different replicas) and both engines' metrics in replica
    order (their ``engine`` label on the gateway's page)."""
    ns = supervisor.resolve_settings(["-dp", "2", "--tokenizers", "2", "--gateways", "2", "--engine-port", "7000",
                                      "--tokenizer-port", "7100", "--engine-metrics-port", "7200"])
    stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
    assert [c.name for c in stack.children] == ["engine-0", "engine-1", "tokenizer-0-0", "tokenizer-0-1",
                                                "tokenizer-1-0", "tokenizer-1-1", "gateway-0", "gateway-1"]

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert [(flag(e.argv, "--port"), flag(e.argv, "--metrics-port")) for e in stack.engines] == [
        ("7000", "7200"), ("7001", "7201")]
    assert all("--data-parallel-size" not in e.argv and "-dp" not in e.argv for e in stack.engines)
    assert [(flag(t.argv, "--port"), flag(t.argv, "--engine")) for t in stack.tokenizers] == [   # each routes
        (str(port), "127.0.0.1:7000,127.0.0.1:7001") for port in range(7100, 7104)]
    for gateway in stack.gateways:
        assert flag(gateway.argv, "--tokenizer") == "127.0.0.1:7100,127.0.0.1:7102,127.0.0.1:7101,127.0.0.1:7103"
        federated = [gateway.argv[i + 1] for i, a in enumerate(gateway.argv) if a == "--metrics-federate"]
        assert federated == ["http://127.0.0.1:7200/metrics", "http://127.0.0.1:7201/metrics"]


@pytest.mark.parametrize("flags", [[], ["--tokenizer-metrics-port", "7300"], ["--tokenizer-metrics-port", "0"]])
def test_each_tokenizer_service_has_a_metrics_page_the_gateways_federate(flags: list[str]) -> None:
    """By default every tokenizer service serves its page on a free port, consecutive ports from
    ``--tokenizer-metrics-port`` (replica r's i-th on P + r x T + i), none with 0; each gateway appends them in that
    order (``--metrics-federate-tokenizer``: the i-th labelled tokenizer="i" on its page)."""
    ns = supervisor.resolve_settings(["-dp", "2", "--tokenizers", "2", "--gateways", "2", *flags])
    stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
    ports = [t.argv[t.argv.index("--metrics-port") + 1] for t in stack.tokenizers]
    if flags == ["--tokenizer-metrics-port", "0"]:
        assert ports == ["0"] * 4
    elif flags:
        assert ports == ["7300", "7301", "7302", "7303"]
    else:
        assert len(set(ports)) == 4 and "0" not in ports
    for gateway in stack.gateways:
        federated = [gateway.argv[i + 1] for i, a in enumerate(gateway.argv) if a == "--metrics-federate-tokenizer"]
        assert federated == [f"http://127.0.0.1:{p}/metrics" for p in ports if p != "0"]


def test_each_replica_gets_its_own_devices() -> None:
    """On an accelerator replica r runs on the r-th block of world-size devices (of --device-ids, else of 0, 1,
    ...); on the CPU no ids are passed; too few ids for every replica's ranks stop `sluice serve` naming both."""
    def engine_device_ids(*flags: str) -> list[str | None]:
        ns = supervisor.resolve_settings(["-dp", "2", *flags])
        stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns))
        return [e.argv[e.argv.index("--device-ids") + 1] if "--device-ids" in e.argv else None
                for e in stack.engines]

    assert engine_device_ids("--device", "npu", "-tp", "2") == ["0,1", "2,3"]
    assert engine_device_ids("--device", "cuda", "-tp", "2", "--device-ids", "4,5,6,7") == ["4,5", "6,7"]
    assert engine_device_ids("--device", "npu", "-tp", "2", "-pp", "2") == ["0,1,2,3", "4,5,6,7"]
    assert engine_device_ids() == [None, None]
    ns = supervisor.resolve_settings(["-dp", "2", "--device", "npu", "-tp", "2", "--device-ids", "0,1,2"])
    with pytest.raises(ValueError, match=r"--device-ids: 2 replicas of 2 ranks need 4 device ids; got 3"):
        replica_configs(supervisor.config_from_args(ns), 2)


def test_parallel_settings_reach_the_engine_as_it_reads_them() -> None:
    import argparse

    from engine.config import EngineConfig
    from engine.entrypoints.args import add_engine_args, config_from_args
    from services.child_flags import engine_flags

    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray",
                          device="npu", device_ids=(4, 5, 6, 7))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(engine_flags(config))) == config


def mindie_config(tmp_path: Path, world_size: int, device_ids: list[list[int]] | None) -> str:
    backend: dict[str, object] = {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m", "worldSize": world_size}]}}
    if device_ids is not None:
        backend["npuDeviceIds"] = device_ids
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": backend}))
    return str(path)


def test_mindie_world_size_is_tensor_parallel_and_its_npus_the_ranks_devices(tmp_path: Path) -> None:
    config = supervisor.config_from_args(supervisor.resolve_settings(
        ["--config", mindie_config(tmp_path, 2, [[2, 3]])]))
    assert (config.tensor_parallel_size, config.device, config.device_ids) == (2, "npu", (2, 3))
    stack = supervisor.Supervisor(supervisor.resolve_settings(["--config", str(tmp_path / "config.json")]), config)
    argv = " ".join(stack.engine.argv)
    assert "--device npu" in argv and "--tensor-parallel-size 2" in argv and "--device-ids 2,3" in argv
    # --device and -tp on the command line win over the file.
    config = supervisor.config_from_args(supervisor.resolve_settings(
        ["--config", mindie_config(tmp_path, 2, [[0, 1]]), "--device", "cpu"]))
    assert (config.tensor_parallel_size, config.device) == (2, "cpu")
    config = supervisor.config_from_args(supervisor.resolve_settings(
        ["--config", mindie_config(tmp_path, 1, None)]))
    assert (config.tensor_parallel_size, config.device, config.device_ids) == (1, "cpu", None)


@pytest.mark.parametrize(("world_size", "device_ids", "message"), [
    (2, [[0]], "BackendConfig.npuDeviceIds: names 1 device(s), [0]; ModelConfig.worldSize 2 needs 2"),
    (1, [[0, 0]], "BackendConfig.npuDeviceIds: names a device twice: [0, 0]"),
    (1, [["0"]], "BackendConfig.npuDeviceIds: device ids are integers >= 0, got '0'"),
    (0, None, "ModelConfig.worldSize: must be an integer >= 1, got 0"),
])
def test_mindie_parallel_keys_that_cannot_run_are_refused_naming_them(
        tmp_path: Path, world_size: int, device_ids: list[list[int]] | None, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        supervisor.resolve_settings(["--config", mindie_config(tmp_path, world_size, device_ids)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"sluice serve: error: {message}"
