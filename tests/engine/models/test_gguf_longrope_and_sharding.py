"""GGUF Phi-3 with LongRoPE over 0.75 of each head (Phi-4-mini's layout; engine.models.gguf_families), written as
llama.cpp's Phi3MiniModel writes it (factor tensors, original context, attention factor, rope.dimension_count),
against transformers: the checkpoint directory's config and weights, logits within 1e-4 (float32) on the short
factors (a context within the original 32 positions) and on the long ones (the declared 128, past them), and the
engine's greedy tokens for both. Then Phi-3's and GLM-4's fused attn_qkv / ffn_up, F32 and Q8_0, under tensor
parallel: each rank's rows of each part, as dense weights and as blocks, and two ranks' greedy tokens."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine import LLM, SamplingParams
from engine.distributed import ParallelContext
from engine.models import load_model
from engine.models.layers.linear import Linear
from tests.engine.kernel_probe import prepare
from tests.engine.models.gguf_factory import Q, convert
from tests.engine.models.moe_factory import greedy_reference
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, hf_logits, paged, prompt, run
from tests.engine.models.test_dense_families import write

TOL = 1e-4
PHI = "phi3-partial-longrope"


@pytest.fixture(scope="module")
def phi_long(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path, Path]:
    hf, ckpt = write(PHI, tmp_path_factory.mktemp("phi-long"))
    return hf, ckpt, convert(hf, "phi3").write(ckpt / "model.gguf")


def test_the_file_reads_as_the_checkpoint_directory(phi_long: tuple[PreTrainedModel, Path, Path]) -> None:
    """The same config, but for what the file holds as float32: the factors, the attention factor (the converter's
    sqrt(1 + ln 4 / ln 32)) and the norm epsilon; the same weights."""
    _, ckpt, path = phi_long
    ours, reference = load_model(str(path), torch.float32), load_model(str(ckpt), torch.float32)
    expected = reference.config
    assert expected.rope_scaling is not None and (expected.rotary_dim, expected.rope_scaling.factor) == (12, 4.0)

    def f32(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(np.array(values, np.float32).tolist())

    scaling = dataclasses.replace(expected.rope_scaling, short_factor=f32(expected.rope_scaling.short_factor),
                                  long_factor=f32(expected.rope_scaling.long_factor),
                                  attention_factor=f32((expected.rope_scaling.attention_factor,))[0])
    assert ours.config == dataclasses.replace(expected, rope_scaling=scaling,
                                              rms_norm_eps=f32((expected.rms_norm_eps,))[0])
    params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, params[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_within_the_original_context_the_short_factors_give_transformers_logits(
        phi_long: tuple[PreTrainedModel, Path, Path], kernels: bool) -> None:
    hf, _, path = phi_long
    ours = load_model(str(path), torch.float32)
    ours.fit_context(32)
    if kernels:
        prepare(ours, torch.float32)
    assert_prefill_then_greedy_decode(hf, ours, prompt(13, 2), 12, atol=TOL)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_past_the_original_context_the_long_factors_give_transformers_logits(
        phi_long: tuple[PreTrainedModel, Path, Path], kernels: bool) -> None:
    """The default context (the file's 128) takes the long factors, which transformers applies to a sequence past
    32 at every position: prefilled in chunks and decoded; the short factors would give other logits."""
    hf, _, path = phi_long
    ours = load_model(str(path), torch.float32)
    if kernels:
        prepare(ours, torch.float32)
    tokens = prompt(40, 6)
    kv = paged(ours)
    run(ours, kv, [("a", tokens[:17])])
    logits = run(ours, kv, [("a", tokens[17:])])
    torch.testing.assert_close(logits, hf_logits(hf, tokens)[17:], atol=TOL, rtol=0)
    for _ in range(4):
        tokens.append(int(logits[-1].argmax()))
        logits = run(ours, kv, [("a", tokens[-1:])])
        torch.testing.assert_close(logits[0], hf_logits(hf, tokens)[-1], atol=TOL, rtol=0)
    ours.fit_context(32)
    assert (run(ours, paged(ours), [("a", tokens)]) - hf_logits(hf, tokens)).abs().max() > 1e-3


def test_transformers_reads_the_written_file_to_the_same_weights(phi_long: tuple[PreTrainedModel, Path, Path]
                                                                 ) -> None:
    """An independent check of the file's layout (transformers' reader skips the factor tensors and reads no rope
    keys of Phi-3, so the checkpoint's config is passed)."""
    hf, ckpt, path = phi_long
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, gguf_file=path.name, config=hf.config, dtype=torch.float32)
    for name, param in hf.state_dict().items():
        torch.testing.assert_close(theirs.state_dict()[name], param, rtol=0, atol=0, msg=name)


def test_the_engine_takes_the_factors_from_max_model_len(phi_long: tuple[PreTrainedModel, Path, Path]) -> None:
    hf, ckpt, path = phi_long
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    short = [prompt(n, 10 + n) for n in (5, 11)]
    llm = LLM(str(path), tokenizer=str(ckpt), dtype="float32", block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=8, seed=0, max_model_len=32)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in short], sp)]
    assert got == [greedy_reference(hf, p, 8) for p in short]
    long = prompt(40, 7)
    llm = LLM(str(path), tokenizer=str(ckpt), dtype="float32", block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=16, seed=0)
    assert llm.engine.max_model_len == 128
    assert llm.generate([{"prompt_token_ids": long}], sp)[0].outputs[0].token_ids == greedy_reference(hf, long, 8)


# -- fused files under tensor parallel -----------------------------------------------------------------------------

def _stored(weight: torch.Tensor, qtype: Q) -> torch.Tensor:
    """What a file of ``qtype`` gives back for ``weight`` (vectors stay F32)."""
    if qtype == Q.F32 or weight.ndim == 1:
        return weight
    return torch.from_numpy(dequantize(quantize(weight.numpy(), qtype), qtype))


def _linear(model: torch.nn.Module, name: str) -> Linear:
    layer = model.get_submodule(name)
    assert isinstance(layer, Linear)
    return layer


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("kind", [PHI, "glm4"])
def test_fused_tensors_shard_over_tensor_ranks(kind: str, qtype: Q, tmp_path: Path) -> None:
    """Phi-3's attn_qkv and ffn_up, GLM-4's ffn_up (its q/k/v come apart, with biases): each rank reads its heads'
    rows of q, k and v and its half of gate and of up, dense and (Q8_0) as blocks; two ranks give transformers'
    greedy tokens."""
    hf, ckpt = write(kind, tmp_path)
    file = convert(hf, "phi3" if kind == PHI else "glm4")
    file.qtype = qtype
    path = file.write(ckpt / "model.gguf")
    config = load_model(str(path), torch.float32).config
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    sizes = [config.q_size, config.kv_size, config.kv_size]
    weights = (attn.qkv_proj.weight.split(sizes) if kind == PHI
               else (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    q, k, v = (_stored(w.detach(), qtype) for w in weights)
    gate, up = _stored(mlp.gate_up_proj.weight.detach(), qtype).chunk(2)
    half_q, half_kv, half_inter = config.q_size // 2, config.kv_size // 2, config.intermediate_size // 2
    for rank in range(2):
        shard = load_model(str(path), torch.float32, "cpu", ParallelContext(tp_size=2, rank=rank)).layers[1]
        qkv = torch.cat([q[rank * half_q:][:half_q], k[rank * half_kv:][:half_kv], v[rank * half_kv:][:half_kv]])
        gate_up = torch.cat([gate[rank * half_inter:][:half_inter], up[rank * half_inter:][:half_inter]])
        fused = {"self_attn.qkv_proj": qkv, "mlp.gate_up_proj": gate_up}
        for name, expected in fused.items():
            layer = _linear(shard, name)
            assert torch.equal(layer.weight, expected), (rank, name)
            if qtype == Q.Q8_0:
                assert layer.quant is not None and torch.equal(layer.quant.dequantize(), expected), (rank, name)
        if kind == "glm4":
            bias = torch.cat([b.detach()[rank * n:][:n] for b, n in zip(
                (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias), (half_q, half_kv, half_kv), strict=True)])
            assert torch.equal(_linear(shard, "self_attn.qkv_proj").bias, bias)
    if qtype != Q.F32:
        return
    prompts = [prompt(n, 20 + n) for n in (6, 11)]
    llm = LLM(str(path), tokenizer=str(ckpt), dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="mp", num_kv_blocks=48, block_size=4, seed=0,
              max_model_len=32 if kind == PHI else None)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    finally:
        llm.close()
    assert got == [greedy_reference(hf, p, 8) for p in prompts]
