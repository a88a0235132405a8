"""The uniproc executor: one worker in this process loads the model, sizes the cache and runs the core's steps."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig, KernelSettings
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.executor.uniproc import UniprocExecutor
from engine.models.layers.linear import DenseLinearMethod, linear_methods


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_executor_sizes_the_cache_from_the_config_and_reports_the_worker(checkpoint: Path) -> None:
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, block size, kv heads, head dim, float32
    config = EngineConfig(model=str(checkpoint), dtype="float32", kv_cache_memory=10 * per_block + 5)
    executor = UniprocExecutor(config)
    assert executor.initialize_cache({0}) == 10 == executor.num_blocks
    assert (executor.device_name, executor.dtype_name, executor.kv_cache_dtype_name) == ("cpu", "float32", "float32")
    assert executor.model_config.num_layers == 2


def test_kernel_settings_reach_the_layers(checkpoint: Path) -> None:
    off = UniprocExecutor(EngineConfig(model=str(checkpoint), dtype="float32",
                                       kernels=KernelSettings(cpu_kernels=False)))
    assert set(linear_methods(off.worker.model)) == {DenseLinearMethod.__name__}
    on = UniprocExecutor(EngineConfig(model=str(checkpoint), dtype="float32"))
    assert DenseLinearMethod.__name__ not in linear_methods(on.worker.model)


def test_core_steps_through_the_executor_and_returns_every_block(checkpoint: Path) -> None:
    core = EngineCore(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=32))
    core.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2))
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    assert sorted(o.index for o in outputs if o.finished) == [0, 1]
    assert sum(o.request_finished for o in outputs) == 1 and outputs[-1].request_finished
    assert core.scheduler.block_manager.num_free_blocks == 32


def test_a_failed_step_keeps_the_outputs_it_had_taken(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = EngineCore(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=32))
    core.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=4))
    core.add_request("running", [4, 5, 6], SamplingParams(max_tokens=4))
    core.abort_requests(["gone"])  # its ABORT output waits for the next step

    def fail(_: object) -> None:
        raise RuntimeError("device error")

    monkeypatch.setattr(core.executor, "execute_model", fail)
    with pytest.raises(RuntimeError):
        core.step()
    monkeypatch.undo()
    outputs = core.step()
    gone = [o for o in outputs if o.request_id == "gone"]
    assert len(gone) == 1 and gone[0].request_finished
