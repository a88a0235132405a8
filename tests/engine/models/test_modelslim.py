"""msModelSlim checkpoints, written here in the layout msModelSlim's saver writes and vLLM-Ascend reads
(``quant_model_description.json`` beside ``quant_model_weights.safetensors``; per linear ``W8A8``: int8 weight,
float32 [1] ``input_scale`` / ``input_offset``, ``deq_scale`` float32 or int64 float32-bits, int32 ``quant_bias`` with
the float bias folded in; ``W8A8_DYNAMIC``: int8 weight, float32 [out, 1] ``weight_scale`` and zero
``weight_offset``; a few ``FLOAT`` linears). Static activation scales are calibrated on the float model as
msModelSlim's min-max observer does. The loaded model's logits equal an int8 reference computed here from the stored
integers and scales (transformers' float model with its linears replaced by plain-PyTorch int8 arithmetic); the
dynamic checkpoint's greedy tokens equal ``--quantization w8a8`` on its dequantized twin; the NPU methods call
``npu_quantize`` / ``npu_dynamic_quant`` and ``npu_quant_matmul`` as vLLM-Ascend does, on the operator twin; what
Sluice does not run is refused naming the type, key or tensor."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from common.errors import InvalidRequestError
from engine.core.sampling_params import SamplingParams
from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.entrypoints.llm import LLM
from engine.models import load_model
from engine.models.layers.linear import Linear, NpuW8A8LinearMethod, linear_methods
from engine.models.layers.static_w8a8_linear import NpuStaticW8A8LinearMethod, StaticW8A8LinearMethod
from engine.models.w8a8 import Int8Weight
from engine.models.w8a8_static import StaticInt8Weight, w8a8_static_reference
from tests.engine.executor.checkpoints import write_checkpoint
from tests.engine.kernel_probe import prepare
from tests.engine.models import moe_factory
from tests.engine.models.paged_run import paged, prompt, run
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

STATIC, DYNAMIC = "W8A8", "W8A8_DYNAMIC"
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "w1", "w2", "w3")   # Mixtral's experts' gate, down, up
# Left FLOAT, as msModelSlim leaves layers its accuracy analysis falls back on (the lm_head by default).
FLOAT_LINEARS = ("lm_head", "model.layers.1.mlp.down_proj")
# The engine's int8 path against the reference on transformers' layers: each product equals the reference's when
# its int8 codes do; the float paths around them (attention, norms) differ in the last bits, which can move an
# activation across a rounding boundary of its code (one step of 1/255 of a static scale's range, 1/254 of a row's),
# as test_w8a8's REFERENCE_REL_TOL allows for the same reason. Measured here: 1-2e-7 (no code moved).
REFERENCE_REL_TOL = 5e-3


# --- writing checkpoints in msModelSlim's layout ----------------------------------------------------------------

def _calibrate(float_dir: Path, linears: list[str]) -> dict[str, tuple[float, float]]:
    """Per linear, the (min, max) of its inputs over calibration prompts: msModelSlim's min-max observer."""
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    ranges: dict[str, tuple[float, float]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            lo, hi = float(args[0].min()), float(args[0].max())
            old = ranges.get(name, (lo, hi))
            ranges[name] = (min(lo, old[0]), max(hi, old[1]))
        return record

    for name in linears:
        hf.get_submodule(name).register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for seed in range(4):
            hf(input_ids=torch.tensor([prompt(24, 100 + seed)]))
    return ranges


def _static_params(w: torch.Tensor, bias: torch.Tensor | None, lo: float, hi: float) -> dict[str, torch.Tensor]:
    """msModelSlim's ``on_w8a8_static``: asymmetric int8 activations over [lo, hi], symmetric per-channel int8
    weights, ``deq_scale = input_scale * weight_scale``, ``quant_bias = round(bias / deq_scale - input_offset *
    sum(weight))``."""
    input_scale = torch.tensor([(hi - lo) / 255], dtype=torch.float32)
    input_offset = torch.clamp(torch.round(-128 - lo / input_scale), -128, 127)
    weight_scale = w.abs().amax(dim=1) / 127
    qweight = torch.round(w / weight_scale.unsqueeze(1)).clamp(-128, 127).to(torch.int8)
    deq_scale = input_scale * weight_scale
    fp_bias = bias if bias is not None else torch.zeros(w.shape[0])
    correction = qweight.float().sum(dim=1) * input_offset
    quant_bias = torch.round(fp_bias / deq_scale - correction).to(torch.int32)
    return {"weight": qweight, "input_scale": input_scale, "input_offset": input_offset.float(),
            "deq_scale": deq_scale, "quant_bias": quant_bias}


def _int64_bits(scale: torch.Tensor) -> torch.Tensor:
    """msModelSlim's ``deqscale2int64``: a float32 scale's bits as int64 (its form for float16 models)."""
    return torch.from_numpy(np.frombuffer(scale.float().numpy().tobytes(), dtype=np.int32).astype(np.int64))


def write_modelslim(float_dir: Path, out: Path, kind: str, float_linears: tuple[str, ...] = FLOAT_LINEARS,
                    int64_deq_scale: bool = False) -> Path:
    """``float_dir``'s checkpoint as msModelSlim writes it with every linear of ``kind`` but ``float_linears``."""
    shutil.copytree(float_dir, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(str(float_dir / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    bases = [n.removesuffix(".weight") for n in tensors
             if n.endswith(".weight") and (n.split(".")[-2] in _PROJ or n == "lm_head.weight")]
    quantized = [b for b in bases if b not in float_linears]
    ranges = _calibrate(float_dir, quantized) if kind == STATIC else {}
    description: dict[str, Any] = {"version": "1.0.0", "model_quant_type": kind, "group_size": 0, "metadata": {},
                                   "optional": {}}
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        description[name] = "FLOAT"
        written[name] = tensor
    for base in quantized:
        w, bias = tensors[base + ".weight"].float(), tensors.get(base + ".bias")
        if kind == STATIC:
            params = _static_params(w, bias, *ranges[base])
            if int64_deq_scale:
                params["deq_scale"] = _int64_bits(params["deq_scale"])
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            params = {"weight": torch.round(w / scale).clamp(-128, 127).to(torch.int8), "weight_scale": scale,
                      "weight_offset": torch.zeros_like(scale)}
        for suffix, value in params.items():
            written[f"{base}.{suffix}"] = value.contiguous()
            description[f"{base}.{suffix}"] = kind
    save_file(written, str(out / "quant_model_weights.safetensors"))
    (out / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    return out


def _dequantized_twin(float_dir: Path, slim: Path, out: Path) -> Path:
    """``float_dir`` with every W8A8_DYNAMIC weight of ``slim`` replaced by its codes times its scales."""
    twin_dir = shutil.copytree(float_dir, out)
    tensors, stored = load_file(str(twin_dir / "model.safetensors")), _stored(slim)
    for name in tensors:
        if name.removesuffix(".weight") + ".weight_scale" in stored:
            tensors[name] = stored[name].float() * stored[name.removesuffix(".weight") + ".weight_scale"]
    save_file(tensors, str(twin_dir / "model.safetensors"))
    return twin_dir


def _untie(float_dir: Path) -> Path:
    """A tied checkpoint made untied (an lm_head equal to the embedding), as Qwen2.5-7B and larger are."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(float_dir / "model.safetensors"))
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (float_dir / "config.json").write_text(json.dumps(cfg))
    return float_dir


def _stored(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "quant_model_weights.safetensors"))


# --- the int8 reference: transformers' model, its linears computed from the stored integers -------------------

def _deq_scale(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:   # the float32's bits
        return torch.from_numpy(t.numpy().astype(np.int32).view(np.float32).copy())
    return t.float()


class _StaticInt8Linear(nn.Module):
    """msModelSlim's documented W8A8 arithmetic: ``x_q = clamp(round(x / input_scale + input_offset))``, then
    ``(x_q @ weight.T + quant_bias) * deq_scale``."""

    def __init__(self, t: dict[str, torch.Tensor], base: str) -> None:
        super().__init__()
        self.q = t[base + ".weight"].long()
        self.scale, self.offset = t[base + ".input_scale"].float(), t[base + ".input_offset"].float()
        self.deq, self.bias = _deq_scale(t[base + ".deq_scale"]), t[base + ".quant_bias"].long()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = torch.round(x.float() / self.scale + self.offset).clamp(-128, 127).long()
        return ((codes @ self.q.t() + self.bias).float() * self.deq).to(x.dtype)


class _DynamicInt8Linear(nn.Module):
    """Per-token symmetric int8 activations (``scale = max|row| / 127``), per-channel weights, the float bias."""

    def __init__(self, t: dict[str, torch.Tensor], base: str) -> None:
        super().__init__()
        self.q, self.w_scale = t[base + ".weight"].long(), t[base + ".weight_scale"].float().reshape(-1)
        self.bias = t.get(base + ".bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        x_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        codes = torch.round(xf / x_scale).clamp(-128, 127).long()
        out = (codes @ self.q.t()).float() * x_scale * self.w_scale
        return (out if self.bias is None else out + self.bias.float()).to(x.dtype)


def _reference(float_dir: Path, slim_dir: Path) -> PreTrainedModel:
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    stored = _stored(slim_dir)
    description = json.loads((slim_dir / "quant_model_description.json").read_text())
    for name, kind in description.items():
        if name.endswith(".weight") and kind in (STATIC, DYNAMIC):
            base = name.removesuffix(".weight")
            parent, _, child = base.rpartition(".")
            layer = _StaticInt8Linear(stored, base) if kind == STATIC else _DynamicInt8Linear(stored, base)
            setattr(hf.get_submodule(parent) if parent else hf, child, layer)
    return hf


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def _int8_of(model: torch.nn.Module) -> dict[str, Int8Weight | StaticInt8Weight]:
    return {n: m.int8 for n, m in model.named_modules() if isinstance(m, Linear) and m.int8 is not None}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def float_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "float")


# --- loading and the CPU arithmetic ----------------------------------------------------------------------------

@pytest.mark.parametrize("int64_deq_scale", [False, True], ids=["float32-deq", "int64-deq"])
def test_static_checkpoint_loads_its_integers_and_gives_the_int8_reference_logits(
        float_dir: Path, tmp_path: Path, int64_deq_scale: bool) -> None:
    slim = write_modelslim(float_dir, tmp_path / "slim", STATIC, int64_deq_scale=int64_deq_scale)
    stored = _stored(slim)
    model = load_model(str(slim), torch.float32)   # detected from quant_model_description.json
    int8 = _int8_of(model)
    assert len(int8) == 4 * 4 - 1 and all(isinstance(w, StaticInt8Weight) for w in int8.values())
    assert "layers.1.mlp.down_proj" not in int8 and (model.lm_head is None or model.lm_head.int8 is None)  # FLOAT
    qkv = int8["layers.2.self_attn.qkv_proj"]
    assert isinstance(qkv, StaticInt8Weight)
    parts = [f"model.layers.2.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.qweight, torch.cat([stored[p + ".weight"] for p in parts]))
    assert torch.equal(qkv.quant_bias, torch.cat([stored[p + ".quant_bias"] for p in parts]))
    assert torch.equal(qkv.deq_scale, torch.cat([_deq_scale(stored[p + ".deq_scale"]) for p in parts]))
    assert float(qkv.input_scale) == float(stored[parts[0] + ".input_scale"])
    assert float(qkv.input_offset) == float(stored[parts[0] + ".input_offset"])
    # quant_bias holds the float bias (Qwen2's q/k/v): the layer does not add the file's copy again
    assert all(m.bias is None for n, m in model.named_modules() if n in int8)
    prepare(model, torch.float32)
    assert linear_methods(model)[StaticW8A8LinearMethod.__name__] == len(int8)
    assert not isinstance(model.get_submodule("layers.1.mlp.down_proj").method, StaticW8A8LinearMethod)
    tokens = prompt(24, 1)
    got = run(model, paged(model), [("a", tokens)])
    with torch.no_grad():
        expected = _reference(float_dir, slim)(input_ids=torch.tensor([tokens])).logits[0]
    assert _rel(got, expected) < REFERENCE_REL_TOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_static_method_equals_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(5)
    k = 2100   # past the exact float32 depth: the sums are sliced
    weight = StaticInt8Weight(torch.randint(-128, 128, (24, k), generator=gen, dtype=torch.int8),
                              torch.tensor(0.05), torch.tensor(-7.0), torch.rand(24, generator=gen) * 1e-3,
                              torch.randint(-5000, 5000, (24,), generator=gen, dtype=torch.int32))
    method = StaticW8A8LinearMethod(weight)
    layer = Linear(k, 24, bias=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(9, k, generator=gen) * 4).to(dtype)   # some codes saturate at -128 and 127
        assert torch.equal(method.apply(layer, x), w8a8_static_reference(x, weight))
    worst = torch.full((3, k), -1e4)   # every code -128 against weights of -128: sums of k * 16384 > 2^24
    weight.qweight.fill_(-128)
    out = StaticW8A8LinearMethod(weight).apply(layer, worst)
    assert torch.equal(out, w8a8_static_reference(worst, weight))
    assert float(out[0, 0]) == pytest.approx((k * 16384 + int(weight.quant_bias[0])) * float(weight.deq_scale[0]))


def test_dynamic_checkpoint_gives_the_int8_reference_logits(float_dir: Path, tmp_path: Path) -> None:
    slim = write_modelslim(float_dir, tmp_path / "slim", DYNAMIC)
    stored = _stored(slim)
    model = load_model(str(slim), torch.float32)
    int8 = _int8_of(model)
    assert len(int8) == 4 * 4 - 1 and all(isinstance(w, Int8Weight) for w in int8.values())
    gate_up = int8["layers.3.mlp.gate_up_proj"]
    assert isinstance(gate_up, Int8Weight)
    parts = [f"model.layers.3.mlp.{p}" for p in ("gate_proj", "up_proj")]
    assert torch.equal(gate_up.qweight, torch.cat([stored[p + ".weight"] for p in parts]))
    assert torch.equal(gate_up.scale, torch.cat([stored[p + ".weight_scale"][:, 0] for p in parts]))
    prepare(model, torch.float32)
    tokens = prompt(24, 2)
    got = run(model, paged(model), [("a", tokens)])
    with torch.no_grad():
        expected = _reference(float_dir, slim)(input_ids=torch.tensor([tokens])).logits[0]
    assert _rel(got, expected) < REFERENCE_REL_TOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dynamic_greedy_tokens_equal_w8a8_on_the_dequantized_twin(kind: str, tmp_path: Path) -> None:
    # Every linear W8A8_DYNAMIC, the lm_head too (Qwen2 untied for it: --quantization w8a8 gives a tied lm_head an
    # int8 copy of the embedding, which no msModelSlim file has): the layers --quantization w8a8 quantizes.
    float_dir = write_checkpoint(kind, tmp_path / "float")
    if kind == "qwen2":
        _untie(float_dir)
    slim = write_modelslim(float_dir, tmp_path / "slim", DYNAMIC, float_linears=())
    twin_dir = _dequantized_twin(float_dir, slim, tmp_path / "dequantized")
    prompts = [[5, 9, 17, 33, 65], [7, 3, 101, 44]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for path, quantization in ((slim, "ascend"), (twin_dir, "w8a8")):
        llm = LLM(str(path), dtype="float32", quantization=quantization, kv_cache_memory="16MiB", max_num_seqs=4)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        llm.close()
    assert outputs[0] == outputs[1] and all(len(t) == 12 for t in outputs[0])


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_dynamic_experts_load_as_w8a8_experts(kind: str, tmp_path: Path) -> None:
    # transformers keeps experts fused in memory, so the reference here is --quantization w8a8 on the dequantized
    # twin: the same codes, and scales max|codes * scale| / 127 that come back to the stored ones.
    _, float_dir = moe_factory.write_checkpoint(kind, tmp_path / "float")
    slim = write_modelslim(float_dir, tmp_path / "slim", DYNAMIC, float_linears=())
    stored = _stored(slim)
    assert any(".experts.3." in name and name.endswith(".weight_scale") for name in stored)
    model = load_model(str(slim), torch.float32)
    twin_model = load_model(str(_dequantized_twin(float_dir, slim, tmp_path / "dequantized")), torch.float32,
                            quantization="w8a8")
    assert model.int8_linears == twin_model.int8_linears
    prepare(model, torch.float32)
    prepare(twin_model, torch.float32)
    tokens = prompt(24, 4)
    assert _rel(run(model, paged(model), [("a", tokens)]), run(twin_model, paged(twin_model), [("a", tokens)])) < 1e-6


def test_llm_runs_a_static_checkpoint_detected_or_named(tmp_path: Path) -> None:
    float_dir = write_checkpoint("qwen2", tmp_path / "float")
    slim = write_modelslim(float_dir, tmp_path / "slim", STATIC)
    reference = _reference(float_dir, slim)
    tokens = [5, 9, 17, 33, 65]
    expected = list(tokens)
    with torch.no_grad():
        for _ in range(8):
            expected.append(int(reference(input_ids=torch.tensor([expected])).logits[0, -1].argmax()))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for quantization in (None, "ascend", "modelslim"):
        llm = LLM(str(slim), dtype="float32", quantization=quantization, kv_cache_memory="16MiB", max_num_seqs=2)
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0].outputs[0].token_ids
        llm.close()
        assert list(out) == expected[len(tokens):]


def test_tensor_parallel_ranks_read_their_shards(tmp_path: Path) -> None:
    float_dir = write_checkpoint("qwen2", tmp_path / "float")
    slim = write_modelslim(float_dir, tmp_path / "slim", STATIC)
    stored = _stored(slim)
    for rank in range(2):
        int8 = _int8_of(load_model(str(slim), torch.float32, "cpu", ParallelContext(tp_size=2, rank=rank)))
        up = "model.layers.0.mlp.up_proj"      # column-parallel: its rows of codes and per-channel tensors
        gate_up = int8["layers.0.mlp.gate_up_proj"]
        assert isinstance(gate_up, StaticInt8Weight)
        rows = slice(rank * 64, (rank + 1) * 64)
        assert torch.equal(gate_up.qweight[64:], stored[up + ".weight"][rows])
        assert torch.equal(gate_up.quant_bias[64:], stored[up + ".quant_bias"][rows])
        assert torch.equal(gate_up.deq_scale[64:], stored[up + ".deq_scale"][rows])
        o = "model.layers.0.self_attn.o_proj"  # row-parallel: its columns; quant_bias added by the first rank only
        o_proj = int8["layers.0.self_attn.o_proj"]
        assert isinstance(o_proj, StaticInt8Weight)
        assert torch.equal(o_proj.qweight, stored[o + ".weight"][:, rank * 32:(rank + 1) * 32])
        assert torch.equal(o_proj.deq_scale, stored[o + ".deq_scale"])
        assert torch.equal(o_proj.quant_bias, stored[o + ".quant_bias"] if rank == 0
                           else torch.zeros_like(stored[o + ".quant_bias"]))


# --- the NPU methods on the operator twin ------------------------------------------------------------------------

def _recording(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {name: [] for name in names}
    for name in names:
        op = getattr(twin, name)

        def record(*args: Any, _op: Callable[..., Any] = op, _name: str = name, **kwargs: Any) -> Any:
            calls[_name].append((args, kwargs))
            return _op(*args, **kwargs)
        monkeypatch.setattr(twin, name, record)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_static_method_calls_npu_quantize_and_npu_quant_matmul_as_vllm_ascend(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 96, generator=gen) * 0.1, torch.randn(40, generator=gen)
    params = _static_params(w, bias, -3.0, 2.5)
    weight = StaticInt8Weight(params["weight"], params["input_scale"].reshape(()),
                              params["input_offset"].reshape(()), params["deq_scale"], params["quant_bias"])
    layer = Linear(96, 40, bias=False)
    layer.int8 = weight
    calls = _recording(monkeypatch, "npu_quantize", "npu_quant_matmul")
    layer.use_kernels(KernelChoice(npu_ops=twin))
    assert isinstance(layer.method, NpuStaticW8A8LinearMethod) and layer.weight is None
    x = (torch.rand(7, 96, generator=gen) * 5 - 2.5).to(dtype)
    twin.CALLED.clear()
    out = layer(x)
    assert twin.CALLED == {"npu_quantize", "npu_quant_matmul"}
    (q_args, q_kwargs), = calls["npu_quantize"]
    assert q_args[0] is x and q_args[3:] == (torch.qint8, -1, False) and not q_kwargs
    assert q_args[1].dtype == q_args[2].dtype == dtype and q_args[1].shape == q_args[2].shape == (96,)
    (m_args, m_kwargs), = calls["npu_quant_matmul"]
    assert m_args[1].shape == (96, 40) and m_args[1].dtype == torch.int8                  # [in, out]
    assert m_args[2].dtype == (torch.float32 if dtype == torch.bfloat16 else torch.int64)   # deq_scale's form
    assert torch.equal(m_kwargs["bias"], weight.quant_bias) and m_kwargs["output_dtype"] == dtype
    assert out.dtype == dtype and out.shape == (7, 40)
    # The reciprocal of the scale in x's dtype (and float16's 19-bit deq_scale) may move a code by one step
    expected = w8a8_static_reference(x, weight).float()
    torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        layer(x.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", [STATIC, DYNAMIC])
@pytest.mark.usefixtures("torch_npu_twin")
def test_checkpoints_on_the_npu_twin_call_the_documented_operators(kind: str, dtype: torch.dtype,
                                                                   tmp_path: Path) -> None:
    float_dir = write_checkpoint("qwen2", tmp_path / "float")
    slim = write_modelslim(float_dir, tmp_path / "slim", kind)
    exact = prepare(load_model(str(slim), torch.float32), torch.float32)   # the int8 reference's logits (above)
    cpu = prepare(load_model(str(slim), dtype), dtype)
    npu = load_model(str(slim), dtype)
    npu.use_kernels(KernelChoice(npu_ops=twin))
    method = NpuStaticW8A8LinearMethod if kind == STATIC else NpuW8A8LinearMethod
    assert linear_methods(npu)[method.__name__] == 4 * 4 - 1
    tokens = prompt(24, 3)
    twin.CALLED.clear()
    got = run(npu, paged(npu, dtype=dtype), [("a", tokens)])
    quantize = "npu_quantize" if kind == STATIC else "npu_dynamic_quant"
    assert {quantize, "npu_quant_matmul"} <= twin.CALLED
    assert ({"npu_quantize", "npu_dynamic_quant"} - {quantize}).isdisjoint(twin.CALLED)
    # In 16 bits both paths move some activation codes against the float32 run (static scales more: 1.8-2.9 % on
    # these checkpoints, dynamic 1.2-1.8 %); the NPU's (the scale's reciprocal in the model's dtype, float16's
    # 19-bit deq_scale, fused norms) measured 0.96-1.2x the CPU path's.
    expected = run(exact, paged(exact), [("a", tokens)])
    cpu_error = _rel(run(cpu, paged(cpu, dtype=dtype), [("a", tokens)]), expected)
    assert _rel(got, expected) < min(1.5 * cpu_error, 0.05)


# --- refusals ----------------------------------------------------------------------------------------------------

def _edit(path: Path, description: Callable[[dict[str, Any]], None] | None = None,
          tensors: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    if description is not None:
        desc = json.loads((path / "quant_model_description.json").read_text())
        description(desc)
        (path / "quant_model_description.json").write_text(json.dumps(desc))
    if tensors is not None:
        stored = _stored(path)
        tensors(stored)
        save_file(stored, str(path / "quant_model_weights.safetensors"))
    return path


_Q = "model.layers.0.self_attn.q_proj"
_DOWN = "model.layers.0.mlp.down_proj"


def _retype(name: str, kind: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.update({name: kind})


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.update({name: value})


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__delitem__(name)


REFUSED: dict[str, tuple[str, Callable[[Path], Path], str]] = {
    "W4A8_DYNAMIC": (DYNAMIC, lambda p: _edit(p, _retype(_DOWN + ".weight", "W4A8_DYNAMIC")),
                     "down_proj.weight: msModelSlim type 'W4A8_DYNAMIC' is not supported"),
    "W8A16": (DYNAMIC, lambda p: _edit(p, _retype(_DOWN + ".weight", "W8A16")), "type 'W8A16' is not supported"),
    "W4A16": (DYNAMIC, lambda p: _edit(p, _retype(_DOWN + ".weight", "W4A16")), "type 'W4A16' is not supported"),
    "W8A8_MIX": (STATIC, lambda p: _edit(p, _retype(_DOWN + ".weight", "W8A8_MIX")),
                 "type 'W8A8_MIX' is not supported"),
    "W8A8S sparse": (STATIC, lambda p: _edit(p, _retype(_DOWN + ".weight", "W8A8S")), "type 'W8A8S' is not supported"),
    "C8 KV cache": (STATIC, lambda p: _edit(p, lambda d: d.update(kv_cache_type="C8")),
                    "kv_cache_type 'C8' is not supported"),
    "FA quant": (STATIC, lambda p: _edit(p, lambda d: d.update(fa_quant_type="FAKQuant")),
                 "fa_quant_type 'FAKQuant' is not supported"),
    "per-group": (DYNAMIC, lambda p: _edit(p, lambda d: d.update(group_size=32)), "group_size 32 is not supported"),
    "norm bias": (STATIC, lambda p: _edit(p, tensors=_set("model.layers.0.input_layernorm.bias", torch.zeros(64))),
                  "input_layernorm.bias: normalization biases"),
    "fused parts of two types": (STATIC, lambda p: _edit(p, _retype(_Q + ".weight", DYNAMIC)),
                                 "qkv_proj.weight: the parts of a fused projection must have one msModelSlim type"),
    "fused parts with a float one": (STATIC, lambda p: _edit(p, _retype(_Q + ".weight", "FLOAT")),
                                     "the parts of a fused projection must have one msModelSlim type"),
    "static parts of two input scales": (
        STATIC, lambda p: _edit(p, tensors=_set(_Q + ".input_scale", torch.tensor([1.0]))),
        "qkv_proj.weight: the parts of a fused projection have different static input scales"),
    "missing deq_scale": (STATIC, lambda p: _edit(p, tensors=_drop(_DOWN + ".deq_scale")),
                          "down_proj.deq_scale is missing"),
    "asymmetric weights": (DYNAMIC, lambda p: _edit(p, tensors=_set(_DOWN + ".weight_offset", torch.ones(64, 1))),
                           "down_proj.weight_offset: non-zero weight offsets"),
    "undescribed int8": (DYNAMIC, lambda p: _edit(p, _retype(_DOWN + ".weight", "FLOAT")),
                         "down_proj.weight is int8 but quant_model_description.json does not give it a type"),
    "static experts": (DYNAMIC, lambda p: _edit(p, lambda d: d.update(
        {n: STATIC for n in d if ".experts." in n and n.endswith(".weight")})),
                       "experts.0.(gate|up|down)_proj.weight: static W8A8 experts are not supported"),
    "fractional offset": (STATIC, lambda p: _edit(p, tensors=_set(_DOWN + ".input_offset", torch.tensor([0.5]))),
                          "down_proj.input_offset: 0.5 is not an int8 offset"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_sluice_does_not_run_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    kind, edit, message = REFUSED[case]
    float_dir = (moe_factory.write_checkpoint("qwen3_moe", tmp_path / "float")[1] if case == "static experts"
                 else write_checkpoint("llama", tmp_path / "float"))
    path = edit(write_modelslim(float_dir, tmp_path / "slim", kind))
    with pytest.raises(ValueError, match=message):
        load_model(str(path), torch.float32)


@pytest.mark.parametrize("value", ["ascend", "modelslim"])
def test_the_flag_on_a_checkpoint_without_a_description_is_refused(value: str, tmp_path: Path) -> None:
    float_dir = write_checkpoint("llama", tmp_path / "float")
    with pytest.raises(InvalidRequestError, match=f"'{value}' needs an msModelSlim checkpoint") as e:
        load_model(str(float_dir), torch.float32, quantization=value)
    assert e.value.field == "quantization" and "quant_model_description.json" in e.value.message
    slim = write_modelslim(float_dir, tmp_path / "slim", DYNAMIC)
    with pytest.raises(InvalidRequestError, match="is an msModelSlim one: use --quantization ascend"):
        load_model(str(slim), torch.float32, quantization="compressed-tensors")
    assert load_model(str(slim), torch.float32, quantization="w8a8").int8_linears == 4 * 4 - 1  # read as it is
