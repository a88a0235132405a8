"""``--quantization``/``-q`` as vLLM takes it, ``EngineConfig.quantization`` and the engine command line ``sluice
serve`` gives its engines: W8A8 is accepted, what Sluice cannot run is refused naming the flag and the value."""
from __future__ import annotations

import argparse

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.entrypoints.args import add_engine_args, config_from_args
from engine.entrypoints.vllm_compat import check_vllm_compat, normalize_flag_spelling
from services.child_flags import engine_flags


def _config(*argv: str) -> tuple[EngineConfig, list[str]]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(normalize_flag_spelling(argv))
    notes = check_vllm_compat(ns)
    return config_from_args(ns), notes


@pytest.mark.parametrize("argv, expected", [
    ((), None),
    (("--quantization", "w8a8"), "w8a8"),
    (("-q", "compressed-tensors", "--model", "/m/ct"), "compressed-tensors"),
    (("-q", "ascend", "--model", "/m/slim"), "ascend"),          # vLLM-Ascend's name for msModelSlim checkpoints
    (("--quantization", "modelslim", "--model", "/m/slim"), "modelslim"),
    (("-q", "gguf"), None),   # the default model is a GGUF file: its blocks run as always
])
def test_accepted_values(argv: tuple[str, ...], expected: str | None) -> None:
    config, notes = _config(*argv)
    assert config.quantization == expected
    assert notes == (["--quantization has no effect: a GGUF file's quantized blocks are always run as they are"]
                     if "gguf" in argv else [])


@pytest.mark.parametrize("value, reason", [
    ("gptq_marlin", "'gptq_marlin' is not supported: Sluice runs w8a8, compressed-tensors"),
    ("fp8", "'fp8' is not supported"),
    ("bitsandbytes", "'bitsandbytes' is not supported"),
    ("w4a8", "'w4a8' is not supported"),
])
def test_refused_values_name_the_flag_and_what_is_supported(value: str, reason: str) -> None:
    with pytest.raises(InvalidRequestError, match=reason) as e:
        _config("--model", "/m/hf", "-q", value)
    assert e.value.field == "--quantization"


def test_gguf_needs_a_gguf_model() -> None:
    with pytest.raises(InvalidRequestError, match="needs a .gguf model file"):
        _config("--model", "/m/hf", "--quantization", "gguf")


def test_engine_config_refuses_an_unknown_quantization() -> None:
    with pytest.raises(InvalidRequestError, match="'int4' is not supported; expected one of w8a8, compressed-tensors, "
                                                  "ascend, modelslim") as e:
        EngineConfig(quantization="int4")
    assert e.value.field == "quantization"


def test_sluice_serve_passes_the_quantization_to_its_engines() -> None:
    flags = engine_flags(EngineConfig(quantization="w8a8"))
    assert flags[flags.index("--quantization") + 1] == "w8a8"
    assert _config(*flags)[0].quantization == "w8a8"
    assert "--quantization" not in engine_flags(EngineConfig())


def test_w8a8_on_cuda_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="no CUDA int8 kernel"):
        EngineConfig(quantization="w8a8", device="cuda")


def test_w8a8_on_the_npu_needs_a_16_bit_dtype() -> None:
    # (npu_quant_matmul has no float32 output either; the NPU refuses float32 models altogether)
    with pytest.raises(InvalidRequestError, match="float16 or bfloat16") as info:
        EngineConfig(quantization="w8a8", device="npu", dtype="float32")
    assert info.value.field == "dtype"
    assert EngineConfig(quantization="w8a8", device="npu", dtype="auto").quantization == "w8a8"   # float16 there
