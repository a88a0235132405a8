"""services/supervisor.py: the tokenizer services get the chat-template and tool-calling flags as given."""

from __future__ import annotations

import os

import pytest

from services import supervisor


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
        supervisor.resolve_settings(["--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err


def test_engine_flags_round_trip_through_the_engine_cli() -> None:
    """What the supervisor hands its engine child parses back into the same settings (objects included)."""
    import argparse

    from engine.config import EngineConfig, StructuredOutputsConfig
    from engine.entrypoints.args import add_engine_args, config_from_args
    from services.supervisor import engine_flags

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
