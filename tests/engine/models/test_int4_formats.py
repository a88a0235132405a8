"""Weight-only 4-bit checkpoints (GPTQ v1 / v2 with and without act order, AWQ GEMM, compressed-tensors
pack-quantized W4A16) written by tests/engine/models/int4_factory.py from a tiny random Llama: they load into the
4-bit linear methods, their logits equal transformers' Llama on the dequantized weights (the dequantize-then-matmul
reference, float32), their greedy tokens equal the engine's on the dequantized float checkpoint, tensor-parallel
ranks hold their shards, the NPU method runs them on the test-only torch-npu operator twin, and the formats and
flags Sluice does not run are refused naming them.

No package that reads GPTQ or AWQ runs on this CPU without a GPU build (gptqmodel, autoawq), so their reference is
the factory's packing written from the formats' specifications; compressed-tensors' own ``pack_to_int32`` packs the
W4A16 checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import InvalidRequestError
from engine.core.sampling_params import SamplingParams
from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.entrypoints.llm import LLM
from engine.models import load_model
from engine.models.int4 import Int4Weight
from engine.models.int4_checkpoint import check_checkpoint
from engine.models.layers.int4_linear import Int4PackLinearMethod, NpuInt4LinearMethod
from engine.models.layers.linear import Linear, linear_methods
from tests.engine.kernel_probe import prepare
from tests.engine.models import int4_factory as f
from tests.engine.models.paged_run import paged, prompt, run
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[3]
FORMATS: dict[str, dict[str, Any]] = {
    "gptq-v1-g32-sym": f.gptq_config(32),
    "gptq-v1-g128-asym-act": f.gptq_config(128, desc_act=True, sym=False),
    "gptq-v2-g32-asym-act": f.gptq_config(32, desc_act=True, sym=False, v2=True),
    "gptq-v2-channel-sym": f.gptq_config(-1, v2=True),
    "gptq-v1-g64-asym": f.gptq_config(64, sym=False),
    "awq-g32": f.awq_config(32),
    "awq-g128": f.awq_config(128),
    "ct-g32": f.ct_config(32),
    "ct-channel": f.ct_config(-1),
}
LOGITS_REL_TOL = 1e-4   # float32 kernels against float32 transformers on the same dequantized weights


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _int4_of(model: torch.nn.Module) -> dict[str, Int4Weight]:
    return {n: m.int4 for n, m in model.named_modules() if isinstance(m, Linear) and m.int4 is not None}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("int4") / "float"
    f.save_float_llama(path)
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_logits_equal_the_dequantize_then_matmul_reference(float_dir: Path, tmp_path: Path, fmt: str) -> None:
    reference = f.write_int4(float_dir, tmp_path / fmt, FORMATS[fmt])
    model = load_model(str(tmp_path / fmt), torch.float32)   # detected from quantization_config
    int4 = _int4_of(model)
    assert len(int4) == 2 * 4   # qkv, o, gate_up, down of both layers; the lm_head stays float
    qkv = int4["layers.0.self_attn.qkv_proj"].dequantize()
    parts = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.allclose(qkv, torch.cat([reference[p] for p in parts]), rtol=0, atol=1e-6)
    assert (int4["layers.1.mlp.down_proj"].perm is not None) == FORMATS[fmt].get("desc_act", False)
    prepare(model, torch.float32)
    assert linear_methods(model)[Int4PackLinearMethod.__name__] == 8
    tokens = prompt(20, 4)
    got = run(model, paged(model), [("a", tokens)])
    with torch.no_grad():
        expected = f.reference_model(float_dir, reference)(input_ids=torch.tensor([tokens])).logits[0]
    assert _rel(got, expected) < LOGITS_REL_TOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_quantized_lm_head_runs_in_4_bits(float_dir: Path, tmp_path: Path) -> None:
    reference = f.write_int4(float_dir, tmp_path / "g", {**f.gptq_config(32, sym=False, v2=True), "lm_head": True})
    assert "lm_head.weight" in reference
    model = prepare(load_model(str(tmp_path / "g"), torch.float32), torch.float32)
    assert model.lm_head is not None and isinstance(model.lm_head.method, Int4PackLinearMethod)
    tokens = prompt(12, 7)
    got = run(model, paged(model), [("a", tokens)])
    with torch.no_grad():
        expected = f.reference_model(float_dir, reference)(input_ids=torch.tensor([tokens])).logits[0]
    assert _rel(got, expected) < LOGITS_REL_TOL


def test_bfloat16_logits_stay_near_the_reference(float_dir: Path, tmp_path: Path) -> None:
    reference = f.write_int4(float_dir, tmp_path / "g", FORMATS["gptq-v2-g32-asym-act"])
    model = prepare(load_model(str(tmp_path / "g"), torch.bfloat16), torch.bfloat16)
    tokens = prompt(20, 5)
    got = run(model, paged(model, dtype=torch.bfloat16), [("a", tokens)]).float()
    with torch.no_grad():
        expected = f.reference_model(float_dir, reference)(input_ids=torch.tensor([tokens])).logits[0]
    assert _rel(got, expected) < 0.03   # bfloat16 activations, scales and offsets: measured 0.5-1 %


@pytest.mark.usefixtures("torch_npu_twin")
def test_a_checkpoint_on_the_npu_twin_stays_near_the_reference(float_dir: Path, tmp_path: Path) -> None:
    reference = f.write_int4(float_dir, tmp_path / "g", FORMATS["gptq-v1-g128-asym-act"])
    model = load_model(str(tmp_path / "g"), torch.float16)
    model.use_kernels(KernelChoice(npu_ops=twin))
    assert linear_methods(model)[NpuInt4LinearMethod.__name__] == 8
    tokens = prompt(20, 6)
    twin.CALLED.clear()
    got = run(model, paged(model, dtype=torch.float16), [("a", tokens)]).float()
    assert "npu_weight_quant_batchmatmul" in twin.CALLED
    with torch.no_grad():
        expected = f.reference_model(float_dir, reference)(input_ids=torch.tensor([tokens])).logits[0]
    assert _rel(got, expected) < 0.03


def test_greedy_tokens_equal_the_dequantized_model(float_dir: Path, tmp_path: Path) -> None:
    reference = f.write_int4(float_dir, tmp_path / "awq", FORMATS["awq-g32"])
    dequantized = f.write_dequantized(float_dir, tmp_path / "deq", reference)
    prompts = [[5, 9, 17, 33, 65], [7, 3, 101, 44]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for path, quantization in ((tmp_path / "awq", "awq"), (dequantized, None)):
        llm = LLM(str(path), dtype="float32", quantization=quantization, kv_cache_memory="16MiB", max_num_seqs=4)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        llm.close()
    assert outputs[0] == outputs[1] and all(len(t) == 12 for t in outputs[0])


def test_tensor_parallel_ranks_hold_their_rows_and_whole_groups_of_columns(float_dir: Path, tmp_path: Path) -> None:
    reference = f.write_int4(float_dir, tmp_path / "g", FORMATS["gptq-v1-g32-sym"])
    for rank in range(2):
        int4 = _int4_of(load_model(str(tmp_path / "g"), torch.float32, "cpu", ParallelContext(tp_size=2, rank=rank)))
        up = reference["model.layers.0.mlp.up_proj.weight"][rank * 128:(rank + 1) * 128]   # column-parallel rows
        assert torch.allclose(int4["layers.0.mlp.gate_up_proj"].dequantize()[128:], up, atol=1e-6, rtol=0)
        down = reference["model.layers.1.mlp.down_proj.weight"][:, rank * 128:(rank + 1) * 128]   # row-parallel
        assert torch.allclose(int4["layers.1.mlp.down_proj"].dequantize(), down, atol=1e-6, rtol=0)


def test_act_order_row_parallel_shards_are_refused(float_dir: Path, tmp_path: Path) -> None:
    f.write_int4(float_dir, tmp_path / "g", FORMATS["gptq-v2-g32-asym-act"])
    with pytest.raises(ValueError, match="act-order .desc_act. 4-bit weight cannot split its input columns"):
        load_model(str(tmp_path / "g"), torch.float32, "cpu", ParallelContext(tp_size=2, rank=0))


def _with(path: Path, **changes: Any) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("fmt, changes, message", [
    ("gptq-v1-g32-sym", {"bits": 3}, r"bits 3 is not supported: Sluice runs 4-bit GPTQ only \(3-bit GPTQ"),
    ("gptq-v1-g32-sym", {"bits": 8}, "8-bit GPTQ is refused"),
    ("gptq-v1-g32-sym", {"group_size": 16}, "group_size 16 is not supported"),
    ("gptq-v1-g32-sym", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ("awq-g32", {"version": "gemv"}, "version 'gemv' is not supported"),
    ("awq-g32", {"zero_point": False}, "zero_point False is not supported"),
    ("gptq-v1-g32-sym", {"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
])
def test_refused_configurations_name_the_key(float_dir: Path, tmp_path: Path, fmt: str, changes: dict[str, Any],
                                             message: str) -> None:
    f.write_int4(float_dir, tmp_path / "q", FORMATS[fmt])
    with pytest.raises(ValueError, match=message):
        load_model(str(_with(tmp_path / "q", **changes)), torch.float32)


def test_refused_compressed_tensors_w4a16_variants(float_dir: Path, tmp_path: Path) -> None:
    qc = f.ct_config(32)
    f.write_int4(float_dir, tmp_path / "ct", qc)
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ValueError, match=r"weights\.symmetric False is not supported"):
        load_model(str(_with(tmp_path / "ct", **qc)), torch.float32)
    qc["config_groups"]["group_0"]["weights"].update(symmetric=True, actorder="group")
    with pytest.raises(ValueError, match=r"weights\.actorder 'group' is not supported"):
        load_model(str(_with(tmp_path / "ct", **qc)), torch.float32)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = None
    tensors = load_file(str(tmp_path / "ct" / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight_g_idx"] = torch.arange(128, dtype=torch.int32) // 32
    save_file(tensors, str(tmp_path / "ct" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight_g_idx: activation ordering"):
        load_model(str(_with(tmp_path / "ct", **qc)), torch.float32)


def test_flags_must_agree_with_the_checkpoint(float_dir: Path, tmp_path: Path) -> None:
    f.write_int4(float_dir, tmp_path / "awq", FORMATS["awq-g32"])
    f.write_int4(float_dir, tmp_path / "ct", FORMATS["ct-g32"])
    load_model(str(tmp_path / "ct"), torch.float32, quantization="compressed-tensors")   # its own name
    cases = [(tmp_path / "awq", "gptq", "is a AWQ GEMM 4-bit"), (tmp_path / "awq", "w8a8", "'w8a8' does not apply"),
             (float_dir, "gptq", "'gptq' needs a GPTQ checkpoint"), (float_dir, "awq", "'awq' needs a AWQ")]
    for path, flag, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as e:
            load_model(str(path), torch.float32, quantization=flag)
        assert e.value.field == "quantization"


def test_the_commands_check_the_checkpoint_before_starting(float_dir: Path, tmp_path: Path) -> None:
    f.write_int4(float_dir, tmp_path / "q", FORMATS["gptq-v1-g32-sym"])
    check_checkpoint(str(tmp_path / "q"), None)
    check_checkpoint(str(tmp_path / "q"), "gptq", "npu")
    check_checkpoint(str(float_dir), None)
    cases: list[tuple[dict[str, Any], str | None, str, str, str]] = [
        ({}, "awq", "cpu", "quantization", "'awq' does not apply"),
        ({}, None, "cuda", "--device", "no CUDA W4A16 kernel"),
        ({"bits": 2}, None, "cpu", "--model", "2-bit GPTQ is refused"),
        ({"quant_method": "hqq"}, None, "cpu", "--model", "quant_method 'hqq' is not supported"),
    ]
    for changes, flag, device, field, message in cases:
        _with(tmp_path / "q", **{"bits": 4, "quant_method": "gptq", **changes})
        with pytest.raises(InvalidRequestError, match=message) as e:
            check_checkpoint(str(tmp_path / "q"), flag, device)
        assert e.value.field == field


def test_the_engine_command_exits_2_naming_a_3_bit_gptq_checkpoint(float_dir: Path, tmp_path: Path) -> None:
    f.write_int4(float_dir, tmp_path / "q", FORMATS["gptq-v1-g32-sym"])
    _with(tmp_path / "q", bits=3)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "engine", "--model", str(tmp_path / "q"),
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bits 3 is not supported" in proc.stderr and "3-bit GPTQ" in proc.stderr
