"""Settings a mixture-of-experts or latent-attention model cannot run with are refused before it loads, naming
the setting: through the offline API, and by `sluice serve` before it starts a process (exit 2)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, InvalidRequestError
from engine.config import EngineConfig, LoRAConfig
from engine.models.loader import read_model_config
from engine.worker.model_checks import check_model_options
from tests.engine.models.moe_factory import write_checkpoint
from tests.procs import ROOT


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek"))[1]


def test_lora_on_a_moe_model_is_refused_naming_enable_lora(deepseek: Path) -> None:
    with pytest.raises(InvalidRequestError, match="enable_lora: LoRA adapters on mixture-of-experts and "
                                                  "latent-attention models"):
        LLM(str(deepseek), dtype="float32", num_kv_blocks=16, enable_lora=True)


def test_w8a8_experts_off_the_cpu_are_refused_naming_quantization(deepseek: Path) -> None:
    config = EngineConfig(model=str(deepseek), device="npu", quantization="w8a8")
    with pytest.raises(InvalidRequestError, match="quantization: W8A8 experts run on the CPU only"):
        check_model_options(read_model_config(str(deepseek)), config)
    check_model_options(read_model_config(str(deepseek)), EngineConfig(model=str(deepseek), quantization="w8a8"))
    check_model_options(read_model_config(str(deepseek)), EngineConfig(model=str(deepseek)))
    dense = EngineConfig(lora_config=LoRAConfig())
    check_model_options(read_model_config(dense.model_path), dense)   # the default (dense) model takes LoRA


def test_sluice_serve_exits_2_naming_the_setting(deepseek: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(deepseek), "--enable-lora"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "enable_lora: LoRA adapters on mixture-of-experts" in proc.stderr
