"""W8A8 on tiny random Llama and Qwen2 checkpoints: what ``--quantization w8a8`` quantizes, how close the whole
model's logits stay to the float model's, that the engine's W8A8 path equals a forward with every projection
computed by the reference arithmetic, each tensor-parallel rank's shard, and the NPU mapping on the torch-npu twin."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import InvalidRequestError
from engine.device import CpuDevice
from engine.device.npu import NpuDevice
from engine.distributed import ParallelContext
from engine.models import CausalLM, load_model
from engine.models.layers.linear import Linear, LinearMethod, NpuW8A8LinearMethod, linear_methods
from engine.models.w8a8 import Int8Weight, quantize_weight, w8a8_reference
from tests.engine.executor.checkpoints import write_checkpoint
from tests.engine.kernel_probe import prepare
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)
from tests.engine.paged_factory import PagedKV

KINDS = ["llama", "qwen2"]   # untied lm_head, GQA / q-k-v bias, tied lm_head
PROJECTIONS = 4 * 4          # 4 layers x (qkv, o, gate_up, down)

# Whole-model tolerance, as the relative error ||W8A8 - float|| / ||float|| over every logit of a 24-token prompt.
# Per-channel int8 weights and per-token int8 activations each round to 1/254 of their row's range: about 0.2 %
# RMS error per product. Through 4 layers of 4 products and the residual stream this measured 1.4-1.8 % on these
# checkpoints (float32 and bfloat16); 4 % allows 2x for other seeds, and a broken W8A8 (a scale on the wrong axis,
# a fused part's scales swapped, zeroed codes) gives tens of percent. The lower bound proves int8 actually ran.
MODEL_REL_TOL = 0.04
MODEL_REL_MIN = 1e-3
# The engine's W8A8 method against the reference arithmetic, through the whole model: each product may differ from
# the reference by an ulp of its output (summation order, the kernel's scaling), which can move a later token's
# activation across a rounding boundary of its int8 code (one step in 254 of that row's range).
REFERENCE_REL_TOL = 5e-3


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _logits(model: CausalLM, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    cfg = model.config
    kv = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=4, dtype=dtype,
                 backend=CpuDevice().attention_backend())
    step = kv.step([("a", tokens)])
    with torch.no_grad():
        return model.compute_logits(model(step.input_ids, step.positions, kv.kv_caches, step.meta))


def _prompt(n: int = 24) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def _int8_of(model: CausalLM) -> dict[str, Int8Weight]:
    return {name: m.int8 for name, m in model.named_modules() if isinstance(m, Linear) and m.int8 is not None}


def test_w8a8_quantizes_every_projection_and_the_lm_head_not_the_embedding(checkpoint: Path) -> None:
    float_model = load_model(str(checkpoint), torch.float32)
    model = load_model(str(checkpoint), torch.float32, quantization="w8a8")
    int8 = _int8_of(model)
    assert model.int8_linears == PROJECTIONS + 1 == len(int8)
    assert all(".self_attn." in n or ".mlp." in n or n == "lm_head" for n in int8)
    for name, weight in int8.items():   # each is quantize_weight of the float weight, the fused layout included
        expected = quantize_weight(float_model.get_submodule(name).weight)
        assert torch.equal(weight.qweight, expected.qweight) and torch.equal(weight.scale, expected.scale)
        layer = model.get_submodule(name)
        assert (layer.weight is None) != layer.shares_weight   # freed as it went, unless the embedding's (tied)
    assert model.lm_head is not None and model.embed_tokens is not None
    torch.testing.assert_close(model.embed_tokens.weight, float_model.embed_tokens.weight, rtol=0, atol=0)
    prepare(model, torch.float32)
    methods = linear_methods(model)
    assert sum(n for name, n in methods.items() if "W8A8" in name) == sum(methods.values()) == PROJECTIONS + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_w8a8_logits_stay_within_tolerance_of_the_float_model(checkpoint: Path, dtype: torch.dtype) -> None:
    tokens = _prompt()
    reference = _logits(prepare(load_model(str(checkpoint), dtype), dtype), tokens, dtype)
    w8a8 = _logits(prepare(load_model(str(checkpoint), dtype, quantization="w8a8"), dtype), tokens, dtype)
    assert MODEL_REL_MIN < _rel(w8a8, reference) < MODEL_REL_TOL


class _Reference(LinearMethod):
    """The layer computed by ``w8a8_reference`` (engine.models.w8a8), whatever the device would pick."""

    def __init__(self, weight: Int8Weight) -> None:
        self.weight = weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return w8a8_reference(x, self.weight, layer.method_bias)


def test_w8a8_model_equals_a_forward_on_the_reference_arithmetic(checkpoint: Path) -> None:
    tokens = _prompt()
    engine = prepare(load_model(str(checkpoint), torch.float32, quantization="w8a8"), torch.float32)
    reference = load_model(str(checkpoint), torch.float32, quantization="w8a8")
    weights = _int8_of(reference)
    prepare(reference, torch.float32)
    for name, weight in weights.items():
        reference.get_submodule(name).method = _Reference(weight)
    got, expected = _logits(engine, tokens, torch.float32), _logits(reference, tokens, torch.float32)
    assert _rel(got, expected) < REFERENCE_REL_TOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_each_tensor_parallel_rank_quantizes_its_shard(tmp_path: Path) -> None:
    path = write_checkpoint("llama", tmp_path)
    whole = _int8_of(load_model(str(path), torch.float32, quantization="w8a8"))
    models = [load_model(str(path), torch.float32, "cpu", ParallelContext(tp_size=2, rank=r), quantization="w8a8")
              for r in range(2)]
    ranks = [_int8_of(m) for m in models]
    float_model = load_model(str(path), torch.float32)
    for r, shard in enumerate(ranks):
        assert len(shard) == PROJECTIONS + 1
        # The vocabulary-parallel lm_head: its rows, quantized as in the whole model.
        plan = models[r].plan
        held = slice(plan.vocab_start, plan.vocab_start + plan.vocab_held)
        assert torch.equal(shard["lm_head"].qweight[:plan.vocab_held], whole["lm_head"].qweight[held])
        assert torch.equal(shard["lm_head"].scale[:plan.vocab_held], whole["lm_head"].scale[held])
        # A column-parallel shard's rows are quantized as in the whole model (one scale per row either way).
        gate_up = shard["layers.0.mlp.gate_up_proj"]
        rows = torch.cat([torch.arange(r * 64, r * 64 + 64), torch.arange(128 + r * 64, 128 + r * 64 + 64)])
        assert torch.equal(gate_up.qweight, whole["layers.0.mlp.gate_up_proj"].qweight[rows])
        assert torch.equal(gate_up.scale, whole["layers.0.mlp.gate_up_proj"].scale[rows])
        # A row-parallel shard holds half the columns: its scales are its own (max of its half of each row).
        down = shard["layers.0.mlp.down_proj"]
        columns = float_model.layers[0].mlp.down_proj.weight[:, r * 64:(r + 1) * 64]
        expected = quantize_weight(columns)
        assert torch.equal(down.qweight, expected.qweight) and torch.equal(down.scale, expected.scale)


def test_unknown_quantization_is_refused_by_the_loader(checkpoint: Path) -> None:
    with pytest.raises(InvalidRequestError, match="quantization: 'int4' is not supported"):
        load_model(str(checkpoint), torch.float32, quantization="int4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_method_calls_the_documented_operators_and_gives_the_reference(dtype: torch.dtype, smooth: bool) -> None:
    import torch_npu  # the twin (tests/engine/npu_twin), installed by the fixture

    gen = torch.Generator().manual_seed(3)
    layer = Linear(96, 40, bias=True).to(dtype).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen) * 0.1)
        layer.bias.copy_(torch.randn(40, generator=gen))
    factor = torch.rand(96, generator=gen) + 0.5 if smooth else None
    weight = quantize_weight(layer.weight, factor)
    layer.int8 = weight
    device = object.__new__(NpuDevice)   # its __init__ needs an NPU; the choice needs only the torch_npu module
    device.torch_npu = torch_npu
    layer.use_kernels(device.kernel_choice(dtype, int8_layers=1))
    assert isinstance(layer.method, NpuW8A8LinearMethod) and layer.weight is None
    x = torch.randn(7, 96, generator=gen).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (7, 40)
    expected = w8a8_reference(x, weight, layer.bias)
    if smooth:   # the operator multiplies by smooth_scales (x's dtype): the reciprocal, rounded to it
        torch.testing.assert_close(out.float(), expected.float(), rtol=0.02, atol=0.02 * float(expected.abs().max()))
    else:        # one rounding of the output dtype apart at most (the scales multiply in another order)
        torch.testing.assert_close(out, expected)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        layer(x.float())
