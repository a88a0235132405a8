"""What one rank of a parallel replica builds and reads (engine.models.sharding and the loaders), in one process:
loading needs no collective, so a rank's shard is checked here against slices of the checkpoint transformers
wrote; the refusals of shapes that do not divide name the sizes. (Running shards: test_model_parallel.py.)"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize
from transformers import LlamaConfig, LlamaForCausalLM

from engine.distributed import ParallelContext
from engine.models import build_model, load_model
from engine.models.config import ModelConfig, config_from_hf
from engine.models.gguf_loader import read_blocks, read_tensor, tensor_to_numpy
from engine.models.loader import iter_safetensors, safetensors_files
from engine.models.sharding import Shard, ShardPlan, check_parallel_sizes
from tests.engine.models.test_llama import _COMMON, _randomize
from tests.engine.paged_factory import PagedKV

VOCAB = 255  # odd: the last of two tensor ranks holds 127 words and a zero row


def _config(**overrides: Any) -> ModelConfig:
    return config_from_hf({"model_type": "llama", **_COMMON, **overrides}, None, has_lm_head=True)


@pytest.mark.parametrize(("sizes", "tp", "pp", "message"), [
    # the default model's (SmolLM2-135M) attention
    ({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}, 2, 1,
     "the model's 9 attention heads do not divide over tensor_parallel_size 2"),
    ({"num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 96}, 4, 1,
     "the model's 6 key-value heads do not divide over tensor_parallel_size 4"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 96}, 4, 1,
     "tensor_parallel_size 4 is not a multiple of the model's 3 key-value heads"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 128, "intermediate_size": 100}, 8, 1,
     "the model's intermediate size 100 does not divide over tensor_parallel_size 8"),
    ({}, 1, 3, "pipeline_parallel_size 3 exceeds the model's 2 layers"),
    ({}, 0, 1, r"tensor_parallel_size \(0\) and pipeline_parallel_size \(1\) must be at least 1"),
])
def test_shapes_that_do_not_divide_are_refused_naming_the_sizes(sizes: dict[str, int], tp: int, pp: int,
                                                                message: str) -> None:
    config = _config(**sizes)
    with pytest.raises(ValueError, match=message):
        check_parallel_sizes(config, tp, pp)
    if tp >= 1:
        with pytest.raises(ValueError, match=message):
            build_model(config, torch.float32, "cpu", ParallelContext(tp_size=tp, pp_size=pp))


def test_sizes_that_divide_pass() -> None:
    check_parallel_sizes(_config(), 2, 2)
    check_parallel_sizes(_config(num_key_value_heads=1), 4, 1)  # 1 KV head replicated over 4 ranks
    check_parallel_sizes(_config(), 1, 2)


@pytest.mark.parametrize(("heads", "kv", "tp", "starts"), [
    (8, 2, 4, [0, 0, 1, 1]),   # replicated: each KV head over 2 ranks, the one its query heads read
    (4, 1, 2, [0, 0]),
    (8, 4, 2, [0, 2]),         # sharded: 2 heads each
])
def test_kv_heads_sharded_or_replicated_as_vllm_does(heads: int, kv: int, tp: int, starts: list[int]) -> None:
    config = _config(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=16 * heads)
    plans = [ShardPlan.of(config, ParallelContext(tp_size=tp, rank=r)) for r in range(tp)]
    assert [p.kv_head_start for p in plans] == starts
    assert all(p.num_kv_heads == max(1, kv // tp) and p.num_heads == heads // tp for p in plans)
    group = heads // kv  # query heads per KV head: rank r's first query head reads KV head starts[r]
    assert all(r * (heads // tp) // group == starts[r] for r in range(tp))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "vocab_size": VOCAB}, attention_bias=True,
                                      tie_word_embeddings=False)).eval()
    _randomize(hf, seed=3)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return path, {k: v.detach().clone() for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("rank", range(4))
def test_a_rank_loads_its_shard_of_its_stage(checkpoint: tuple[Path, dict[str, torch.Tensor]], rank: int) -> None:
    # TP 2 x PP 2 over 2 layers of 4 heads of 16 (2 KV heads), intermediate 128, vocabulary 255.
    path, hf = checkpoint
    parallel = ParallelContext(tp_size=2, pp_size=2, rank=rank)
    model = load_model(str(path), torch.float32, "cpu", parallel)
    tp, stage = parallel.tp_rank, parallel.pp_rank
    assert (model.start_layer, model.end_layer, model.num_local_layers) == (stage, stage + 1, 1)
    assert model.num_local_kv_heads == 1
    layer, attn, mlp = f"model.layers.{stage}", model.layers[0].self_attn, model.layers[0].mlp
    heads, kv, inter = slice(32 * tp, 32 * tp + 32), slice(16 * tp, 16 * tp + 16), slice(64 * tp, 64 * tp + 64)
    for kind in ("weight", "bias"):
        expected = torch.cat([hf[f"{layer}.self_attn.q_proj.{kind}"][heads], hf[f"{layer}.self_attn.k_proj.{kind}"][kv],
                              hf[f"{layer}.self_attn.v_proj.{kind}"][kv]])
        assert torch.equal(getattr(attn.qkv_proj, kind), expected)
    assert torch.equal(attn.o_proj.weight, hf[f"{layer}.self_attn.o_proj.weight"][:, heads])
    assert torch.equal(attn.o_proj.bias, hf[f"{layer}.self_attn.o_proj.bias"])  # whole: added once, after the sum
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([hf[f"{layer}.mlp.gate_proj.weight"][inter],
                                                            hf[f"{layer}.mlp.up_proj.weight"][inter]]))
    assert torch.equal(mlp.down_proj.weight, hf[f"{layer}.mlp.down_proj.weight"][:, inter])
    if stage == 0:
        assert model.norm is None
        assert model.embed_tokens is not None and model.lm_head is not None
        rows = slice(128 * tp, min(128 * tp + 128, VOCAB))
        held = rows.stop - rows.start
        for table, name in ((model.embed_tokens.weight, "model.embed_tokens.weight"),
                            (model.lm_head.weight, "lm_head.weight")):
            assert table.shape == (128, 64)
            assert torch.equal(table[:held], hf[name][rows])
            assert not table[held:].any()  # the padding row of rank 1
    else:
        assert model.embed_tokens is None and model.lm_head is None
        assert model.norm is not None and torch.equal(model.norm.weight, hf["model.norm.weight"])


def test_the_loader_reads_only_the_rank_s_part(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, hf = checkpoint
    model = build_model(_config(vocab_size=VOCAB, attention_bias=True), torch.float32, "cpu",
                        ParallelContext(tp_size=2, pp_size=2, rank=3))
    names = {name: file for file in safetensors_files(path) for name in hf}
    read = dict(iter_safetensors(names, model.weight_shard))
    assert sorted(read) == sorted(n for n in hf if n.startswith(("model.layers.1.", "model.norm.")))
    assert read["model.layers.1.self_attn.q_proj.weight"].shape == (32, 64)
    assert read["model.layers.1.mlp.down_proj.weight"].shape == (64, 64)
    assert torch.equal(read["model.layers.1.self_attn.k_proj.bias"], hf["model.layers.1.self_attn.k_proj.bias"][16:])


def test_a_later_stage_needs_the_hidden_states_of_the_stage_before(
        checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = checkpoint
    model = load_model(str(path), torch.float32, "cpu", ParallelContext(pp_size=2, rank=1))
    kv = PagedKV(model.num_local_layers, model.num_local_kv_heads, model.config.head_dim)
    step = kv.step([("a", [5, 6, 7])])
    with pytest.raises(ValueError, match="pipeline stage 1 needs the hidden states and residual"):
        model(step.input_ids, step.positions, kv.kv_caches, step.meta)
    with pytest.raises(RuntimeError, match="compute_logits runs on pipeline stage 0"):
        model.compute_logits(torch.zeros(1, 64))
    x = torch.randn(3, 64)
    hidden = model(step.input_ids, step.positions, kv.kv_caches, step.meta, (x, torch.randn(3, 64)))
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (3, 64)


def test_gguf_shards_are_read_alone(tmp_path: Path) -> None:
    # Rows of any format; columns as whole blocks of a quantized tensor, as elements of F32 / F16, and by
    # dequantizing whole rows when a shard cuts a block (read_blocks then gives none: the layer runs dense).
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(tmp_path / "t.gguf"), arch="llama")
    weights = {name: rng.standard_normal((8, 96)).astype(np.float32) for name in ("q8", "q41", "f32", "f16")}
    writer.add_tensor("q8", quantize(weights["q8"], GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("q41", quantize(weights["q41"], GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("f32", weights["f32"])
    writer.add_tensor("f16", weights["f16"].astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in GGUFReader(str(tmp_path / "t.gguf")).tensors}
    for name, tensor in tensors.items():
        whole = tensor_to_numpy(tensor)
        assert whole.shape == (8, 96)
        for shard in (Shard(0, 2, 4), Shard(1, 32, 32), Shard(1, 48, 48), Shard(1, 0, 96)):
            expected = whole[2:6] if shard.dim == 0 else whole[:, shard.start:shard.start + shard.size]
            assert np.array_equal(read_tensor(tensor, shard), expected), (name, shard)
        if name in ("q8", "q41"):
            blocks = read_blocks(tensor, Shard(1, 32, 64))
            assert blocks is not None and np.array_equal(blocks.dequantize().numpy(), whole[:, 32:])
            rows = read_blocks(tensor, Shard(0, 2, 4))
            assert rows is not None and np.array_equal(rows.dequantize().numpy(), whole[2:6])
            assert read_blocks(tensor, Shard(1, 48, 48)) is None


def test_pipeline_stages_chained_in_one_process_give_the_whole_model_s_logits_exactly(
        checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    # Without tensor parallelism a stage computes what the whole model computes for its layers, op for op.
    path, _ = checkpoint
    whole = load_model(str(path), torch.float32)
    stages = [load_model(str(path), torch.float32, "cpu", ParallelContext(pp_size=2, rank=r)) for r in range(2)]
    cfg = whole.config
    kv_whole = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    kv_stages = [PagedKV(1, cfg.num_kv_heads, cfg.head_dim) for _ in stages]
    chunks = [("a", [5, 9, 30, 2, 7]), ("b", [11, 3, 4])]
    for _ in range(4):
        step = kv_whole.step(chunks)
        expected = whole.compute_logits(whole(step.input_ids, step.positions, kv_whole.kv_caches, step.meta))
        steps = [kv.step(chunks) for kv in kv_stages]
        sent = stages[0](steps[0].input_ids, steps[0].positions, kv_stages[0].kv_caches, steps[0].meta)
        assert isinstance(sent, tuple)
        hidden = stages[1](steps[1].input_ids, steps[1].positions, kv_stages[1].kv_caches, steps[1].meta, sent)
        assert isinstance(hidden, torch.Tensor)
        assert torch.equal(stages[0].compute_logits(hidden), expected)
        first_end = len(chunks[0][1]) - 1
        chunks = [("a", [int(expected[first_end].argmax())]), ("b", [int(expected[-1].argmax())])]
