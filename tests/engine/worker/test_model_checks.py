"""Settings a model cannot run with are refused before it loads, naming the setting: through the offline API, and by
`sluice serve` before it starts a process (exit 2). A sliding window runs on the NPU (the fused operator's band);
soft-capped attention scores do not (no NPU attention operator takes a cap)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, InvalidRequestError
from engine.config import EngineConfig, LoRAConfig
from engine.models.config import ModelConfig
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


def _dense(architecture: str, **extra: Any) -> ModelConfig:
    return ModelConfig(architecture=architecture, vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False, **extra)


def test_a_sliding_window_runs_on_the_npu_and_soft_capped_scores_are_refused() -> None:
    npu = EngineConfig(device="npu")
    check_model_options(_dense("mistral", sliding_window=64), npu)
    check_model_options(_dense("qwen2", sliding_window=64, sliding_layers=frozenset({1})), npu)
    gemma2 = _dense("gemma2", sliding_window=64, sliding_layers=frozenset({0}), attn_logit_softcapping=50.0)
    with pytest.raises(InvalidRequestError, match="attn_logit_softcapping: gemma2's soft-capped attention scores "
                                                  "cannot run on the NPU: neither npu_fused_infer_attention_score "
                                                  "nor _npu_paged_attention takes a cap"):
        check_model_options(gemma2, npu)
    check_model_options(gemma2, EngineConfig(device="cpu"))


def test_sluice_serve_exits_2_naming_the_setting(deepseek: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(deepseek), "--enable-lora"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "enable_lora: LoRA adapters on mixture-of-experts" in proc.stderr
