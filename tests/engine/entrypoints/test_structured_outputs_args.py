"""--structured-outputs-config and --guided-decoding-backend: llguidance accepted under vLLM's names, the backends
that are not built in refused at start-up naming the flag."""

from __future__ import annotations

import argparse

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig, StructuredOutputsConfig
from engine.entrypoints.args import add_engine_args, config_from_args


def _config(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults_and_accepted_backends() -> None:
    assert _config().structured_outputs_config == StructuredOutputsConfig(backend="auto")
    for backend in ("auto", "guidance", "llguidance"):
        assert _config("--guided-decoding-backend", backend).structured_outputs_config.backend == backend
    config = _config("--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}')
    assert config.structured_outputs_config == StructuredOutputsConfig(backend="guidance",
                                                                       disable_any_whitespace=True)


@pytest.mark.parametrize("argv, flag", [
    (("--guided-decoding-backend", "xgrammar"), "--guided-decoding-backend"),
    (("--guided-decoding-backend", "lm-format-enforcer"), "--guided-decoding-backend"),
    (("--structured-outputs-config", '{"backend": "outlines"}'), "--structured-outputs-config backend"),
    (("--structured-outputs-config", '{"backend": "auto", "reasoning_parser": "x"}'), "--structured-outputs-config"),
    (("--structured-outputs-config", "backend=auto"), "--structured-outputs-config"),
])
def test_refused_naming_the_flag(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        _config(*argv)
    assert e.value.field == flag
    if "xgrammar" in argv or '{"backend": "outlines"}' in argv:
        assert "llguidance" in e.value.message and "not built in" in e.value.message


def test_the_settings_object_refuses_them_too() -> None:
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"))
    assert e.value.field == "structured_outputs_config.backend"
