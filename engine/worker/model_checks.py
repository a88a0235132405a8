"""Engine settings a model cannot run with, refused before anything loads (by the worker, and by ``sluice serve``
before it starts a process), naming the setting."""
from __future__ import annotations

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.models import ModelConfig


def check_model_options(model: ModelConfig, config: EngineConfig) -> None:
    """Raises InvalidRequestError naming the setting that ``model`` cannot run with."""
    kinds = [k for k, on in (("mixture-of-experts", model.moe is not None),
                             ("latent-attention", model.mla is not None)) if on]
    if config.lora_config is not None and kinds:
        raise InvalidRequestError("enable_lora", f"LoRA adapters on {' and '.join(kinds)} models "
                                                 f"({model.architecture}) are not supported: the adapters' targets are "
                                                 "the dense q/k/v/o and gate/up/down projections")
    if model.attn_logit_softcapping is not None and config.device == "npu":
        raise InvalidRequestError("attn_logit_softcapping", f"{model.architecture}'s soft-capped attention scores "
                                                            "cannot run on the NPU: neither "
                                                            "npu_fused_infer_attention_score nor _npu_paged_attention "
                                                            "takes a cap")
    if config.quantization is not None and model.moe is not None and config.device != "cpu":
        raise InvalidRequestError("quantization", f"W8A8 experts run on the CPU only ({config.device} has no int8 "
                                                  "mixture-of-experts kernel wired)")
