"""The whole engine with ``--device npu`` on the torch-npu operator twin (tests/engine/npu_twin), against the CPU
backend: the same greedy tokens on tiny random Llama, Qwen2 and Mistral (an 8-position sliding window in every layer)
checkpoints in float16, through fresh prefill, chunked prefill (a 64-token budget), a prefix hit (two prompts sharing
150 tokens: one full 128-token block) and decode (replayed from NPU graphs, the default; tests/engine/test_npu_graphs.py
checks them further); Mistral's prompts outrun its window and give back the blocks
behind it. Every torch-npu operator the engine names is called, and only those. Also: the NPU device on the
twin, and the config rules of --device npu (block size 128, half precision)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import InvalidRequestError
from engine.attention.backend import StepLayout
from engine.attention.npu_backend import NpuAttentionBackend, NpuAttentionMetadata
from engine.config import EngineConfig
from engine.core.block_manager import RELEASED
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams
from engine.device import get_device
from tests.engine.executor.checkpoints import write_checkpoint
from tests.engine.npu_twin import npu_device_twin, torch_npu_twin  # noqa: F401  (fixtures)
from tests.engine.npu_twin import torch_npu as twin

ENGINE = Path(__file__).resolve().parents[2] / "engine"
rng = np.random.default_rng(11)
SHARED = [int(t) for t in rng.integers(3, 128, 150)]
FIRST = SHARED + [int(t) for t in rng.integers(3, 128, 10)]
SECOND = SHARED + [int(t) for t in rng.integers(3, 128, 30)]
SHORT = [int(t) for t in rng.integers(3, 128, 9)]
MAX_TOKENS = 6


def _generate(path: Path, device: str) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens of FIRST alone, then SECOND (a prefix hit on FIRST's first block) beside SHORT."""
    # Decode graphs of 1, 2 and 4 rows (the twin computes while it captures: every bucket up to 128 rows would
    # take seconds).
    core = EngineCore(EngineConfig(model=str(path), dtype="float16", device=device, block_size=128,
                                   max_num_batched_tokens=64, num_kv_blocks=8, max_model_len=256,
                                   cuda_graph_sizes=(1, 2, 4)))
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


def _referenced_operators(*files: str) -> set[str]:
    """The torch-npu operators these engine files call (``<module>.npu_x`` / ``<module>._npu_x`` attributes)."""
    names: set[str] = set()
    for name in files:
        names |= set(re.findall(r"\.(_?npu_(?!ops\b|backend\b|mla\b|graphs\b)\w+)", (ENGINE / name).read_text()))
    return names


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.usefixtures("npu_device_twin")
def test_engine_on_the_twin_matches_the_cpu_backend(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    path = write_checkpoint(kind, tmp_path / kind)
    expected, expected_cached = _generate(path, "cpu")
    twin.CALLED.clear()
    table_entries: set[int] = set()
    build = NpuAttentionBackend.build_metadata

    def recording(self: NpuAttentionBackend, layout: StepLayout, device: torch.device) -> NpuAttentionMetadata:
        table_entries.update(layout.block_tables.ravel().tolist())
        return build(self, layout, device)

    monkeypatch.setattr(NpuAttentionBackend, "build_metadata", recording)
    got, cached = _generate(path, "npu")
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got.values()) and set(got) == {"first", "second", "short"}
    assert cached == expected_cached and cached["second"] == 128
    # Every operator the backend, the layers and the decode graphs name ran (prefill with and without context,
    # decode), no other; sliding-window layers send decodes to the fused operator too (_npu_paged_attention takes no
    # window), so their models run eagerly, and a sequence past the window gives back its first block: later steps
    # read RELEASED table entries.
    used = _referenced_operators("attention/npu_backend.py", "models/layers/norm.py", "models/layers/activation.py",
                                 "models/layers/rotary.py", "worker/npu_graphs.py")
    assert used == {"_npu_reshape_and_cache", "_npu_paged_attention", "npu_fused_infer_attention_score",
                    "npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul",
                    "_npu_paged_attention_get_workspace"}
    windowed = kind == "mistral"
    paged = {"_npu_paged_attention", "_npu_paged_attention_get_workspace"}
    assert twin.CALLED == (used - paged if windowed else used)
    assert bool(twin.npu.CAPTURED) != windowed   # decode graphs captured (not for a windowed model)
    assert (RELEASED in table_entries) == windowed


def test_every_operator_the_engine_names_is_in_the_twin() -> None:
    named: set[str] = set()
    for source in ENGINE.rglob("*.py"):
        named |= set(re.findall(r"\.(_?npu_(?!ops\b|backend\b|mla\b|graphs\b)\w+)", source.read_text()))
    assert {"npu_dynamic_quant", "npu_quant_matmul", "_npu_paged_attention"} <= named   # the scan sees them
    assert named <= set(twin.OPERATORS)


def test_npu_config_takes_block_size_128_and_half_precision() -> None:
    assert EngineConfig(device="npu").block_size == 128          # the default 16 becomes the operators' 128
    assert EngineConfig(device="npu", block_size=128).block_size == 128
    assert EngineConfig(device="cpu").block_size == 16
    with pytest.raises(InvalidRequestError, match="block_size.*blocks of 128 tokens.*got 32"):
        EngineConfig(device="npu", block_size=32)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype.*model's dtype"):
        EngineConfig(device="npu", kv_cache_dtype="bfloat16")
    with pytest.raises(InvalidRequestError, match="dtype.*no float32"):
        EngineConfig(device="npu", dtype="float32")


@pytest.mark.usefixtures("npu_device_twin")
def test_npu_device_drives_torch_npu_and_hands_out_its_operators() -> None:
    device = get_device("npu", index=0)
    assert device.name == "npu" and device.torch_device == torch.device("cpu")   # the twin's placement
    assert not device.pin_memory   # host tensors: nothing to pin
    assert isinstance(device.attention_backend(), NpuAttentionBackend)
    assert device.kernel_choice(torch.float16).npu_ops is twin
    stream, event = device.new_stream(), device.new_event()
    assert isinstance(stream, twin.npu.Stream) and isinstance(event, twin.npu.Event)
    with device.use_stream(stream):
        assert twin.npu.current_stream() is stream
    device.record_event(event, stream)
    device.wait_event(stream, event)
    assert event.recorded
    free, total = device.memory_info()
    assert 0 < free <= total
