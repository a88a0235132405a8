"""The whole engine with ``--device npu`` on the torch-npu operator twin (tests/engine/npu_twin) serving mixture-of-
experts models, against the CPU backend: the same greedy tokens on tiny random Qwen3-MoE and DeepSeek-V3 checkpoints
in float16, through fresh prefill, chunked prefill (a 64-token budget), a prefix hit (one full 128-token block) and
decode. The experts run torch-npu's MoE operators; DeepSeek-V3's latent cache is written and decoded by torch-npu's
MLA operators, never by the PyTorch latent path."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine.attention.mla as torch_latent
from engine.attention.npu_mla import NpuLatentAttention
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.fused_moe_npu import NpuMoEMethod
from tests.engine.models.moe_factory import VOCAB, write_checkpoint
from tests.engine.npu_twin import npu_device_twin, torch_npu_twin  # noqa: F401  (fixtures)
from tests.engine.npu_twin import torch_npu as twin

rng = np.random.default_rng(12)
SHARED = [int(t) for t in rng.integers(3, VOCAB, 140)]
FIRST = SHARED + [int(t) for t in rng.integers(3, VOCAB, 6)]
SECOND = SHARED + [int(t) for t in rng.integers(3, VOCAB, 20)]
SHORT = [int(t) for t in rng.integers(3, VOCAB, 9)]
MAX_TOKENS = 5
MOE_OPERATORS = {"npu_moe_init_routing", "npu_moe_compute_expert_tokens", "npu_grouped_matmul",
                 "npu_moe_finalize_routing", "npu_swiglu"}
MLA_OPERATORS = {"_npu_reshape_and_cache_siso", "_npu_paged_attention_mla"}


def _core(path: Path, device: str) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float16", device=device, block_size=128,
                                   max_num_batched_tokens=64, num_kv_blocks=8, max_model_len=256))


def _generate(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens of FIRST alone, then SECOND (a prefix hit on FIRST's first block) beside SHORT."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def run() -> None:
        outputs: list[EngineCoreOutput] = []
        while core.has_unfinished_requests():
            outputs.extend(core.step())
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached.setdefault(out.request_id, out.num_cached_tokens)   # said on a request's first output

    core.add_request("first", FIRST, greedy)
    run()
    core.add_request("second", SECOND, greedy)
    core.add_request("short", SHORT, greedy)
    run()
    return tokens, cached


def _refuse(name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the PyTorch latent path ({name}) ran on the NPU")
    return refused


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.usefixtures("npu_device_twin")
def test_moe_engine_on_the_twin_matches_the_cpu_backend(kind: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = write_checkpoint(kind, tmp_path / kind)
    expected, expected_cached = _generate(_core(path, "cpu"))
    twin.CALLED.clear()
    # The PyTorch latent cache's write and decode must not run on the NPU (its prefill gather may).
    monkeypatch.setattr(torch_latent, "write_latent", _refuse("write_latent"))
    monkeypatch.setattr(torch_latent, "decode_latent_attention", _refuse("decode_latent_attention"))
    core = _core(path, "npu")
    got, cached = _generate(core)
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got.values()) and set(got) == {"first", "second", "short"}
    assert cached == expected_cached and cached["second"] == 128
    worker = core.executor.worker   # type: ignore[attr-defined]   (the uniproc executor's one worker)
    moe_layers = [m for m in worker.model.modules() if isinstance(m, FusedMoE)]
    assert moe_layers and all(isinstance(m.method, NpuMoEMethod) for m in moe_layers)
    assert isinstance(worker.stage.backend.latent_attention(), NpuLatentAttention)
    assert MOE_OPERATORS <= twin.CALLED
    if kind == "deepseek_v3":   # MLA's latent cache; V3's sigmoid routing runs outside the fused gating operator
        assert MLA_OPERATORS <= twin.CALLED
        assert not {"_npu_reshape_and_cache", "_npu_paged_attention", "npu_fused_infer_attention_score"} & twin.CALLED
    else:   # grouped-query attention on the paged operators; softmax top-k through the fused gating operator
        assert "npu_moe_gating_top_k_softmax" in twin.CALLED and not MLA_OPERATORS & twin.CALLED
        assert {"_npu_reshape_and_cache", "_npu_paged_attention", "npu_fused_infer_attention_score"} <= twin.CALLED
