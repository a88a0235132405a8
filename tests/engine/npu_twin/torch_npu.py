"""TEST-ONLY TWIN of the ``torch_npu`` module, on the CPU: every torch-npu operator Sluice calls, each written from
torch-npu's documentation (Ascend Extension for PyTorch API reference; CANN's ATB reference for the ``_npu_*``
bindings vLLM-Ascend uses) with the documented signature (keyword-only arguments where the documentation makes them
so), the documented argument checks (dtypes, ranks, shapes, layouts, masks; ValueError or TypeError) and the
documented arithmetic in plain PyTorch; plus ``npu``, the twin of ``torch.npu`` with its graph mode (``graph``:
capture records the kernels, replay reruns them on the captured tensors, host values stay frozen, task groups are
updated as vLLM-Ascend's full-graph paged attention does). It proves that Sluice calls the operators as documented;
it says nothing about the hardware's speed or rounding.

Add an operator in the module of its kind (``quant``, ``attention``, ``mla``, ``layers``, ``moe``) with
``@operator`` and export it here.
"""
from __future__ import annotations

from tests.engine.npu_twin import npu
from tests.engine.npu_twin._ops import CALLED, OPERATORS
from tests.engine.npu_twin.attention import (
    _npu_paged_attention,
    _npu_paged_attention_get_workspace,
    _npu_reshape_and_cache,
    npu_fused_infer_attention_score,
)
from tests.engine.npu_twin.layers import npu_add_rms_norm, npu_rms_norm, npu_rotary_mul, npu_swiglu
from tests.engine.npu_twin.mla import _npu_paged_attention_mla, _npu_reshape_and_cache_siso
from tests.engine.npu_twin.moe import (
    npu_grouped_matmul,
    npu_moe_compute_expert_tokens,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
)
from tests.engine.npu_twin.quant import (
    npu_convert_weight_to_int4pack,
    npu_dynamic_quant,
    npu_quant_matmul,
    npu_quantize,
    npu_weight_quant_batchmatmul,
)

__all__ = ["CALLED", "OPERATORS", "npu", "_npu_paged_attention", "_npu_paged_attention_get_workspace",
           "_npu_reshape_and_cache",
           "npu_fused_infer_attention_score", "npu_add_rms_norm", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu",
           "npu_dynamic_quant", "npu_quantize", "npu_quant_matmul", "npu_grouped_matmul",
           "npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul",
           "npu_moe_compute_expert_tokens",
           "npu_moe_finalize_routing", "npu_moe_gating_top_k_softmax", "npu_moe_init_routing",
           "_npu_paged_attention_mla", "_npu_reshape_and_cache_siso"]
