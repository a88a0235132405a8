"""Tensor- and pipeline-parallel models (engine.models.sharding) on real processes against the whole model.

Tiny random checkpoints written by transformers — Llama (GQA, untied, q/k/v/o bias: the row-parallel bias),
Qwen2 (q/k/v bias, tied, a vocabulary of 251: the last tensor rank's rows padded) and Qwen3 (q/k norm, one KV
head: replicated over the tensor ranks) — and a tiny GGUF Llama of Q4_1 / Q8_0 blocks. Each configuration is one
process group (``harness.run_ranks``) that runs every model in turn: a prefill of three prompts and 20 greedy
decode steps through a paged KV cache. Its float32 logits are within 1e-4 of the whole model's, its greedy tokens
identical. TP 2 runs the CPU device's kernels (each rank packs its own shard, or runs its GGUF blocks), PP 2 and
TP 2 x PP 2 PyTorch's ops.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.engine.distributed.harness import run_ranks
from tests.engine.distributed.model_ranks import RankResult, reference, run_all
from tests.engine.models.test_llama import _COMMON, _randomize

pytestmark = pytest.mark.slow  # starts processes

TOL = 1e-4
STEPS = 20
GGUF_VOCAB = 97
PROMPTS = [torch.randint(3, GGUF_VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 5, 11)]

HF_MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON, attention_bias=True, tie_word_embeddings=False)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**{**_COMMON, "vocab_size": 251}, tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**{**_COMMON, "num_key_value_heads": 1}, head_dim=32,
                                                  tie_word_embeddings=False)),
}


def _write_gguf(path: Path) -> None:
    """A tiny Llama GGUF (tied): Q4_1 projections, Q8_0 table and down_proj. Its vocabulary of 97 pads the last
    tensor rank's rows; its intermediate size of 96 gives down_proj shards of 48 columns, not whole blocks of 32."""
    rng = np.random.default_rng(5)
    hidden, inter, heads, kv, head_dim, layers = 64, 96, 4, 2, 16, 2
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_context_length(256)
    writer.add_vocab_size(GGUF_VOCAB)

    def blocks(name: str, rows: int, cols: int, qtype: GGMLQuantizationType, scale: float) -> None:
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * scale
        writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))

    blocks("token_embd.weight", GGUF_VOCAB, hidden, GGMLQuantizationType.Q8_0, 0.5)
    norm("output_norm.weight")
    q4 = GGMLQuantizationType.Q4_1
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        blocks(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, q4, 0.08)
        blocks(f"blk.{i}.attn_k.weight", kv * head_dim, hidden, q4, 0.08)
        blocks(f"blk.{i}.attn_v.weight", kv * head_dim, hidden, q4, 0.08)
        blocks(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, q4, 0.08)
        blocks(f"blk.{i}.ffn_gate.weight", inter, hidden, q4, 0.08)
        blocks(f"blk.{i}.ffn_up.weight", inter, hidden, q4, 0.08)
        blocks(f"blk.{i}.ffn_down.weight", hidden, inter, GGMLQuantizationType.Q8_0, 0.08)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf_models() -> dict[str, PreTrainedModel]:
    models = {}
    for seed, (name, make) in enumerate(HF_MODELS.items()):
        torch.manual_seed(seed)
        models[name] = make().eval()
        _randomize(models[name], seed=seed + 1)
    return models


@pytest.fixture(scope="module")
def paths(hf_models: dict[str, PreTrainedModel], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    out = {}
    for name, model in hf_models.items():
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    _write_gguf(root / "tiny.gguf")
    out["gguf"] = str(root / "tiny.gguf")
    return out


def _group(paths: dict[str, str], tp: int, pp: int, names: list[str], kernels: bool) -> dict[str, list[RankResult]]:
    runs = [(name, {"path": paths[name], "prompts": PROMPTS, "steps": STEPS, "kernels": kernels}) for name in names]
    by_rank = run_ranks(run_all, tp, pp, runs)
    return {name: [rank[name] for rank in by_rank] for name in names}


@pytest.fixture(scope="module")
def tp2(paths: dict[str, str]) -> dict[str, list[RankResult]]:
    return _group(paths, 2, 1, ["llama", "qwen2", "qwen3", "gguf"], kernels=True)


@pytest.fixture(scope="module")
def pp2(paths: dict[str, str]) -> dict[str, list[RankResult]]:
    return _group(paths, 1, 2, ["llama", "qwen2", "qwen3"], kernels=False)


@pytest.fixture(scope="module")
def tp2_pp2(paths: dict[str, str]) -> dict[str, list[RankResult]]:
    return _group(paths, 2, 2, ["llama"], kernels=False)


Whole = Callable[[str, bool], RankResult]


@pytest.fixture(scope="module")
def whole(paths: dict[str, str]) -> Whole:
    """The whole model's run of a checkpoint (``kernels``: on the CPU device's kernels), made once."""
    runs: dict[tuple[str, bool], RankResult] = {}

    def run(name: str, kernels: bool) -> RankResult:
        if (name, kernels) not in runs:
            runs[(name, kernels)] = reference(paths[name], PROMPTS, STEPS, kernels)
        return runs[(name, kernels)]

    return run


def _assert_matches(ranks: list[RankResult], expected: RankResult, tp: int) -> None:
    """The driver's logits within TOL of the whole model's, the same tokens on every rank, whole logits on every
    tensor rank of stage 0 and none on the other stages."""
    driver = ranks[0]
    assert driver.logits is not None and expected.logits is not None
    rows = sum(map(len, PROMPTS)) + STEPS * len(PROMPTS)
    assert driver.logits.shape == expected.logits.shape == (rows, expected.logits.shape[1])
    np.testing.assert_allclose(driver.logits, expected.logits, atol=TOL, rtol=0)
    assert driver.tokens == expected.tokens
    assert all(len(t) == STEPS + 1 for t in expected.tokens)
    for rank, result in enumerate(ranks):
        assert result.tokens == expected.tokens, rank
        if rank < tp:
            assert result.logits is not None and np.array_equal(result.logits, driver.logits), rank
        else:
            assert result.logits is None, rank


def test_whole_model_is_transformers(whole: Whole, hf_models: dict[str, PreTrainedModel]) -> None:
    # The reference the sharded runs are held to: the whole model through the same code, against transformers.
    for name, hf in hf_models.items():
        run = whole(name, False)
        assert run.logits is not None
        offset = sum(map(len, PROMPTS))
        for i, (prompt, tokens) in enumerate(zip(PROMPTS, run.tokens, strict=True)):
            with torch.no_grad():
                expected = hf(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0].float().numpy()
            start = sum(map(len, PROMPTS[:i]))
            got = np.concatenate([run.logits[start:start + len(prompt)], run.logits[offset + i::len(PROMPTS)]])
            np.testing.assert_allclose(got, expected, atol=TOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gguf"])
def test_tensor_parallel_2_matches_the_whole_model(tp2: dict[str, list[RankResult]], whole: Whole, name: str) -> None:
    _assert_matches(tp2[name], whole(name, True), tp=2)
    for result in tp2[name]:
        assert result.layers == (0, 2)
        assert result.holds == {"embed_tokens": True, "lm_head": True, "norm": True}


def test_tensor_ranks_hold_their_shards(tp2: dict[str, list[RankResult]]) -> None:
    # Llama: 4 heads of 16, 2 KV heads, intermediate 128, vocabulary 256; Qwen2's 251 words in 2 x 126 rows.
    for rank in tp2["llama"]:
        shapes = rank.linear_shapes
        assert shapes["layers.1.self_attn.qkv_proj"] == (2 * 16 + 2 * 16, 64)
        assert shapes["layers.1.self_attn.o_proj"] == (64, 32)
        assert shapes["layers.0.mlp.gate_up_proj"] == (2 * 64, 64)
        assert shapes["layers.0.mlp.down_proj"] == (64, 64)
        assert shapes["lm_head"] == (128, 64)
        assert rank.num_kv_heads == 1
    assert [r.linear_shapes["lm_head"] for r in tp2["qwen2"]] == [(126, 64)] * 2


def test_one_kv_head_is_replicated_over_the_tensor_ranks(tp2: dict[str, list[RankResult]]) -> None:
    # Qwen3 with 4 query heads of 32 and 1 KV head: each rank its 2 query heads and the one KV head.
    for rank in tp2["qwen3"]:
        assert rank.num_kv_heads == 1
        assert rank.linear_shapes["layers.0.self_attn.qkv_proj"] == (2 * 32 + 2 * 32, 64)


def test_each_rank_packs_its_own_shard(tp2: dict[str, list[RankResult]]) -> None:
    # 4 projections x 2 layers and the lm_head, every one on the CPU device's oneDNN-packed shard.
    for name in ("llama", "qwen2", "qwen3"):
        for rank in tp2[name]:
            assert rank.methods == {"OneDnnLinearMethod": 9}, name


def test_gguf_blocks_are_sharded_by_rows_and_whole_column_blocks(tp2: dict[str, list[RankResult]],
                                                                 whole: Whole) -> None:
    # Every rank keeps blocks for q|k|v, gate|up (rows), o_proj (32 of 64 columns: one whole block) and the tied
    # lm_head (49 rows, one of them padding); down_proj's 48 of 96 columns are not whole blocks: it runs dense.
    assert whole("gguf", True).quantized_linears == 2 * 4 + 1
    for rank in tp2["gguf"]:
        assert rank.quantized_linears == 2 * 3 + 1
        assert rank.blocks_match_dense
        assert rank.methods == {"BlockQuantLinearMethod": 7, "OneDnnLinearMethod": 2}
        assert rank.linear_shapes["layers.0.mlp.down_proj"] == (64, 48)
        assert rank.linear_shapes["lm_head"] == (49, 64)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_pipeline_parallel_2_matches_the_whole_model(pp2: dict[str, list[RankResult]], whole: Whole,
                                                     name: str) -> None:
    ranks = pp2[name]
    _assert_matches(ranks, whole(name, False), tp=1)
    assert [r.layers for r in ranks] == [(0, 1), (1, 2)]
    assert ranks[0].holds == {"embed_tokens": True, "lm_head": True, "norm": False}
    assert ranks[1].holds == {"embed_tokens": False, "lm_head": False, "norm": True}
    assert sorted(ranks[1].linear_shapes) == ["layers.0.mlp.down_proj", "layers.0.mlp.gate_up_proj",
                                              "layers.0.self_attn.o_proj", "layers.0.self_attn.qkv_proj"]


def test_tensor_2_by_pipeline_2_matches_the_whole_model(tp2_pp2: dict[str, list[RankResult]],
                                                        whole: Whole) -> None:
    ranks = tp2_pp2["llama"]
    _assert_matches(ranks, whole("llama", False), tp=2)
    assert [r.layers for r in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [r.holds["lm_head"] for r in ranks] == [True, True, False, False]
    assert [r.holds["norm"] for r in ranks] == [False, False, True, True]
    assert all(r.linear_shapes["layers.0.self_attn.o_proj"] == (64, 32) for r in ranks)
