"""The whole engine with ``--device npu`` on the torch-npu operator twin (tests/engine/npu_twin) serving mixture-of-
experts models, against the CPU backend: the same greedy tokens, and their logprobs within float16 rounding, on tiny
random Qwen3-MoE and DeepSeek-V3 checkpoints in float16, through fresh prefill, chunked prefill (a 64-token budget), a
prefix hit (one full 128-token block) and decode. The experts run torch-npu's MoE operators; DeepSeek-V3's latent
cache is written and decoded by torch-npu's MLA operators, never by the PyTorch latent path."""
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
from engine.executor.uniproc import UniprocExecutor
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.fused_moe_npu import NpuMoEMethod
from tests.engine.models.moe_factory import VOCAB, write_checkpoint
from tests.engine.npu_twin import npu_device_twin, torch_npu_twin  # noqa: F401  (fixtures)
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.test_npu_engine import _referenced_operators

rng = np.random.default_rng(12)
SHARED = [int(t) for t in rng.integers(3, VOCAB, 140)]
FIRST = SHARED + [int(t) for t in rng.integers(3, VOCAB, 6)]
SECOND = SHARED + [int(t) for t in rng.integers(3, VOCAB, 20)]
SHORT = [int(t) for t in rng.integers(3, VOCAB, 9)]
MAX_TOKENS = 5
# The sampled tokens' logprobs agree within float16's rounding (~1e-3 seen); an MLA decode off by a 1.2x scale or a
# 0.01 noise moves them by 0.01 or more while the argmax of these tiny random models' flat distributions holds.
LOGPROB_ATOL = 5e-3
MOE_OPERATORS = {"npu_moe_init_routing", "npu_moe_compute_expert_tokens", "npu_grouped_matmul",
                 "npu_moe_finalize_routing", "npu_swiglu"}
MLA_OPERATORS = {"_npu_reshape_and_cache_siso", "_npu_paged_attention_mla"}


def _core(path: Path, device: str) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float16", device=device, block_size=128,
                                   max_num_batched_tokens=64, num_kv_blocks=8, max_model_len=256))


def _generate(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list[float]], dict[str, int]]:
    """Greedy tokens (and their logprobs) of FIRST alone, then SECOND (a prefix hit on FIRST's first block) beside
    SHORT."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    cached: dict[str, int] = {}

    def run() -> None:
        outputs: list[EngineCoreOutput] = []
        while core.has_unfinished_requests():
            outputs.extend(core.step())
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.new_logprobs is not None
            logprobs.setdefault(out.request_id, []).extend(sampled for sampled, *_ in out.new_logprobs)
            cached.setdefault(out.request_id, out.num_cached_tokens)   # said on a request's first output

    core.add_request("first", FIRST, greedy)
    run()
    core.add_request("second", SECOND, greedy)
    core.add_request("short", SHORT, greedy)
    run()
    return tokens, logprobs, cached


def _refuse(name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the PyTorch latent path ({name}) ran on the NPU")
    return refused


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.usefixtures("npu_device_twin")
def test_moe_engine_on_the_twin_matches_the_cpu_backend(kind: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = write_checkpoint(kind, tmp_path / kind)
    expected, expected_logprobs, expected_cached = _generate(_core(path, "cpu"))
    twin.CALLED.clear()
    # The PyTorch latent cache's write and decode must not run on the NPU (its prefill gather may).
    monkeypatch.setattr(torch_latent, "write_latent", _refuse("write_latent"))
    monkeypatch.setattr(torch_latent, "decode_latent_attention", _refuse("decode_latent_attention"))
    core = _core(path, "npu")
    got, logprobs, cached = _generate(core)
    assert got == expected
    for request, values in logprobs.items():
        np.testing.assert_allclose(values, expected_logprobs[request], atol=LOGPROB_ATOL, rtol=0, err_msg=request)
    assert all(len(t) == MAX_TOKENS for t in got.values()) and set(got) == {"first", "second", "short"}
    assert cached == expected_cached and cached["second"] == 128
    assert isinstance(core.executor, UniprocExecutor)
    worker = core.executor.worker
    moe_layers = [m for m in worker.model.modules() if isinstance(m, FusedMoE)]
    assert moe_layers and all(isinstance(m.method, NpuMoEMethod) for m in moe_layers)
    assert worker.stage is not None and isinstance(worker.stage.backend.latent_attention(), NpuLatentAttention)
    # Every operator the layers, the MoE method and the attention backend name ran, and no other: DeepSeek-V3's
    # latent cache on the MLA operators (and its sigmoid routing outside the fused gating operator), Qwen3-MoE's
    # grouped-query attention on the paged ones.
    layers = _referenced_operators("models/layers/norm.py", "models/layers/activation.py", "models/layers/rotary.py",
                                   "models/layers/fused_moe_npu.py")
    assert MOE_OPERATORS <= layers
    if kind == "deepseek_v3":
        assert _referenced_operators("attention/npu_mla.py") == MLA_OPERATORS
        assert twin.CALLED == (layers - {"npu_moe_gating_top_k_softmax"}) | MLA_OPERATORS
    else:
        assert twin.CALLED == layers | _referenced_operators("attention/npu_backend.py")
