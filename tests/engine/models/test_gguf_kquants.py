"""GGUF K-quants (Q4_K, Q5_K, Q6_K; engine.models.gguf_kquants) against gguf-py's own dequantization and transformers.

The installed gguf-py (0.19) dequantizes K-quants but has no quantizer for them, and llama.cpp's (through
llama-cpp-python) is not available here: it has no wheel on PyPI and building it takes too long for CI. So the files
are written with ``quantize_k`` below, a plain min/max quantizer that packs the super-blocks by ggml's layout; gguf-py's
``dequantize`` is the independent reader of what it wrote (its round trip lands within a quantization step of the
float weights, which a wrong layout would not), and the reference for our Q4_K unpacking, bit for bit. A tiny Llama
whose projections mix Q4_K, Q5_K and Q6_K (a Q4_K_M file's mix: Q6_K ``attn_v``, ``ffn_down`` and ``output``)
gives transformers' logits (it dequantizes K-quants through gguf-py) and greedy tokens, its Q4_K projections on the
int4 kernel with no float copy kept."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.models import CausalLM, gguf_kquants, load_model
from engine.models.gguf_kquants import q4_k_weight
from engine.models.layers.int4_linear import Int4PackLinearMethod, int4_method
from engine.models.layers.linear import Linear
from tests.engine.kernel_probe import prepare
from tests.engine.models.moe_factory import randomize
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, greedy_continuation, prompt

Q = gguf.GGMLQuantizationType
TOL = 1e-4
# max|out - reference| / max|reference| of the int4 kernel on Q4_K weights against dequantize-then-matmul (float32):
# float32 sums in another order and the kernel's (q - 8) * s + (8 s + offset) form; bfloat16: scales and offsets
# rounded to bfloat16 and a bfloat16 output (the bounds of tests/engine/models/test_int4_linear.py).
FLOAT32_BOUND = 5e-6
BFLOAT16_BOUND = 1.5e-2


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)[..., None].view(np.uint8)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's 12-byte packing of 8 six-bit scales and minimums (the inverse of ``get_scale_min_k4``)."""
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    hi = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    nib = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([lo, hi, nib], axis=-1).astype(np.uint8)


def _asymmetric(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's codes, header and packed scales for ``w`` [rows, n, 8, 32]: ``d * sc * q - dmin * m``."""
    lo = np.minimum(w.min(-1), 0)
    step, low = (w.max(-1) - lo) / levels, -lo
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (low.max(-1) / 63).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 1e-8), np.maximum(dmin.astype(np.float32), 1e-8)
    sc = np.clip(np.rint(step / d32[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(low / dmin32[..., None]), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32)[..., None] * sc)[..., None]
    shift = (dmin.astype(np.float32)[..., None] * m)[..., None]
    q = np.clip(np.rint((w + shift) / np.maximum(scale, 1e-12)), 0, levels).astype(np.uint8)
    return q, _f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, m)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes of low nibbles from codes [rows, n, 8, 32]: sub-blocks 2c and 2c + 1 share chunk c."""
    low = (q & 0x0F).reshape(*q.shape[:2], 4, 2, 32)
    return (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*q.shape[:2], 128)


def quantize_k(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """``weight`` [rows, cols] (cols a multiple of 256) as ``qtype`` super-blocks, uint8 [rows, bytes per row]."""
    rows = weight.shape[0]
    w = weight.astype(np.float32).reshape(rows, -1, 256)
    n = w.shape[1]
    if qtype == Q.Q6_K:
        sub = w.reshape(rows, n, 16, 16)
        step = np.abs(sub).max(-1) / 31
        d = (step.max(-1) / 127).astype(np.float16)
        sc = np.clip(np.rint(step / np.maximum(d.astype(np.float32), 1e-8)[..., None]), -128, 127).astype(np.int8)
        scale = (d.astype(np.float32)[..., None] * sc)[..., None]
        q = (np.clip(np.rint(sub / np.maximum(scale, 1e-12)), -32, 31) + 32).astype(np.uint8).reshape(rows, n, 256)
        low = (q & 0x0F).reshape(rows, n, 2, 2, 64)
        ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(rows, n, 128)
        high = (q >> 4).reshape(rows, n, 2, 4, 32)
        qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
        parts = [ql, qh.reshape(rows, n, 64), sc.view(np.uint8), _f16_bytes(d)]
    elif qtype == Q.Q4_K:
        q, d16, dmin16, scales = _asymmetric(w.reshape(rows, n, 8, 32), 15)
        parts = [d16, dmin16, scales, _nibbles(q)]
    else:
        q, d16, dmin16, scales = _asymmetric(w.reshape(rows, n, 8, 32), 31)
        bits = (q >> 4).transpose(0, 1, 3, 2).astype(np.uint16) << np.arange(8, dtype=np.uint16)   # [r, n, 32, 8]
        parts = [d16, dmin16, scales, bits.sum(-1).astype(np.uint8), _nibbles(q)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K bytes with random codes, scales and minimums (zero ones among them) and float16 headers of ~0.01."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = _f16_bytes(rng.uniform(0, 0.01, (rows, cols // 256, 2))).reshape(rows, -1, 4)
    raw[:, 0, 4:16] = 0   # every scale and minimum 0: a sub-block of zeros
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_written_blocks_read_back_through_gguf_py(qtype: Q) -> None:
    """gguf-py reads ``quantize_k``'s blocks back within a quantization step of the weights (a misplaced bit
    would land whole steps away)."""
    w = np.random.default_rng(1).normal(0, 0.05, (8, 512)).astype(np.float32)
    back = dequantize(quantize_k(w, qtype), qtype).reshape(w.shape)
    # a sub-block's range over its levels (a step, twice half of one with the scales' own rounding)
    bound = np.abs(w).max() * {Q.Q4_K: 2 / 15, Q.Q5_K: 2 / 31, Q.Q6_K: 1 / 31}[qtype]
    assert np.abs(back - w).max() <= bound
    assert np.abs(back - w).mean() <= bound / 4


@pytest.mark.parametrize("rows, cols", [(16, 256), (48, 768)])
def test_q4_k_unpacks_to_gguf_py_dequantization_bit_for_bit(rows: int, cols: int) -> None:
    raw = _random_q4_k(rows, cols, seed=rows)
    weight = q4_k_weight(raw)
    assert (weight.group_size, weight.shape) == (32, (rows, cols))
    expected = dequantize(raw, Q.Q4_K).reshape(rows, cols)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert (weight.dequantize()[:, :32] == 0).all()   # the zeroed sub-block, where a zero point would divide by 0


@pytest.mark.parametrize("dtype, bound", [(torch.float32, FLOAT32_BOUND), (torch.bfloat16, BFLOAT16_BOUND)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_int4_kernel_on_q4_k_equals_dequantize_then_matmul(rows: int, dtype: torch.dtype, bound: float) -> None:
    weight = q4_k_weight(_random_q4_k(48, 512, seed=3))
    method = int4_method(weight, KernelChoice())
    assert isinstance(method, Int4PackLinearMethod)
    layer = Linear(512, 48, bias=False).requires_grad_(False)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.float() @ weight.dequantize().t()
    got = method.apply(layer, x)
    assert got.dtype == dtype
    assert float((got.float() - expected).abs().max() / expected.abs().max()) <= bound


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF tensor -> its type: layer 0 all Q4_K but ffn_down (Q6_K); layer 1 a Q6_K attn_v (its q/k/v stay dense), Q5_K
# attn_output and ffn_gate / ffn_up, Q4_K ffn_down; output Q6_K (llama.cpp's Q4_K_M choices); token_embd Q4_K as
# llama.cpp's, or Q6_K (``write_llama_gguf``'s ``table``)
_TYPES = {"output.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
          "blk.1.attn_v.weight": Q.Q6_K, "blk.1.attn_output.weight": Q.Q5_K, "blk.1.ffn_gate.weight": Q.Q5_K,
          "blk.1.ffn_up.weight": Q.Q5_K}


def write_llama_gguf(hf: PreTrainedModel, path: Path, table: Q = Q.Q4_K) -> Path:
    """The file convert_hf_to_gguf.py would write from ``hf`` (q/k permuted), then quantized per ``_TYPES`` (Q4_K
    otherwise; the embedding table in ``table``) as llama-quantize would: matrices in K-quants, vectors F32."""
    types = {**_TYPES, "token_embd.weight": table}
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, value in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.float().numpy()
        if name.endswith("q_proj.weight"):
            w = _llama_permute(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _llama_permute(w, cfg.num_key_value_heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if w.ndim == 1:
            writer.add_tensor(new, np.ascontiguousarray(w))
        else:
            qtype = types.get(new, Q.Q4_K)
            writer.add_tensor(new, quantize_k(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[PreTrainedModel, Path, bool]:
    tied = bool(request.param)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=tied)).eval()
    randomize(hf, 1)
    path = tmp_path_factory.mktemp("kquant-llama")
    hf.config.save_pretrained(path)
    # untied: a Q6_K embedding table (dense); tied: a Q4_K one, which the lm_head runs on in 4 bits
    return hf, write_llama_gguf(hf, path / "model.gguf", Q.Q4_K if tied else Q.Q6_K), tied


# the projections all of whose parts are Q4_K in ``_TYPES``
_Q4_K_LAYERS = {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
                "layers.1.mlp.down_proj"}


def _int4_layers(model: CausalLM) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, Linear) and m.int4 is not None}


def test_q4_k_projections_run_on_the_int4_kernel_to_transformers_logits(
        llama_file: tuple[PreTrainedModel, Path, bool]) -> None:
    hf, path, tied = llama_file
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=hf.config,
                                                  dtype=torch.float32).eval()
    ours = load_model(str(path), torch.float32)
    expected = _Q4_K_LAYERS | ({"lm_head"} if tied else set())
    assert _int4_layers(ours) == expected
    assert all(ours.get_submodule(name).weight is None for name in expected - {"lm_head"})   # no float copy
    prepare(ours, torch.float32)
    assert {name for name, m in ours.named_modules()
            if isinstance(m, Linear) and isinstance(m.method, Int4PackLinearMethod)} == expected
    tokens = assert_prefill_then_greedy_decode(theirs, ours, prompt(11, 5), 6, atol=TOL)
    assert tokens[11:] == greedy_continuation(theirs, tokens[:11], 6)


def test_dense_weights_are_gguf_py_dequantization(llama_file: tuple[PreTrainedModel, Path, bool]) -> None:
    """The Q5_K and Q6_K tensors load as gguf-py dequantizes them (un-permuted, fused); the Q4_K ones' 4-bit weights
    as well."""
    _, path, _ = llama_file
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
           for t in reader.tensors}
    ours = load_model(str(path), torch.float32)
    qkv = ours.get_submodule("layers.1.self_attn.qkv_proj")
    assert qkv.weight is not None
    v_rows = raw["blk.1.attn_v.weight"].shape[0]
    assert torch.equal(qkv.weight[-v_rows:], torch.from_numpy(raw["blk.1.attn_v.weight"]))
    assert torch.equal(ours.get_submodule("layers.1.self_attn.o_proj").weight,
                       torch.from_numpy(raw["blk.1.attn_output.weight"]))
    down = ours.get_submodule("layers.1.mlp.down_proj").int4
    assert down is not None and torch.equal(down.dequantize(), torch.from_numpy(raw["blk.1.ffn_down.weight"]))


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_hold_their_shard_of_the_q4_k_weights(
        rank: int, llama_file: tuple[PreTrainedModel, Path, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of two ranks reads its rows (q/k/v, gate/up, the lm_head's vocabulary) or input columns (o_proj,
    down_proj) of the Q4_K tensors, un-permuted by its own heads: the same values as that rank's dense load."""
    _, path, tied = llama_file
    parallel = ParallelContext(tp_size=2, rank=rank)
    ours = load_model(str(path), torch.float32, "cpu", parallel)
    int4 = {name: m.int4 for name, m in ours.named_modules() if isinstance(m, Linear) and m.int4 is not None}
    assert set(int4) == _Q4_K_LAYERS | ({"lm_head"} if tied else set())
    monkeypatch.setattr(gguf_kquants, "attach", lambda model, weights: 0)
    dense = load_model(str(path), torch.float32, "cpu", parallel)
    for name, weight in int4.items():
        assert weight is not None
        assert torch.equal(weight.dequantize(), dense.get_submodule(name).weight), name
