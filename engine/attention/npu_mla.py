"""The latent cache of multi-head latent attention (:mod:`engine.attention.mla`) on an Ascend NPU, through the
torch-npu operators vLLM-Ascend's MLA backend called (``AscendMLAImpl`` in ``vllm_ascend/attention/mla_v1.py``, from
its first version, 1a1f9a6, through its chunked-prefill one, ab5d110):

* writes: ``torch_npu._npu_reshape_and_cache_siso`` (ATB ReshapeAndCacheOperation with a key cache only) puts each
  new token's latent ``[c_kv | k_pe]``, seen as one kv head, into the cache's one plane [num_blocks, 128, 1,
  latent_dim] by int32 slot;
* decodes: ``torch_npu._npu_paged_attention_mla`` (ATB PagedAttentionOperation, MLA merged kvCache) attends the
  absorbed query [N, H, latent_dim] over the cached latents, the values their first ``kv_lora_rank`` numbers, with
  the int32 block tables and host int32 context lengths the NPU backend builds for ``_npu_paged_attention``;
* prefill chunks read the cached latents back with the default gather (``sequence_latents``) and the model expands
  and attends them in PyTorch ops, as vLLM-Ascend's chunked prefill did (``vanilla_chunked_prefill_mla``,
  ``vllm_ascend/ops/attention.py``); its fresh prompts ran ``_npu_flash_attention`` over the expanded keys, padded to
  a supported head size, which is not taken here.

No hardware has run this; checked against the twin (tests/engine/npu_twin/mla.py), written from the operators'
documentation. The operators take float16 or bfloat16 latents and a cache of the same dtype; the merged-kvCache
attention takes latents of at most 576 numbers (DeepSeek's 512 + 64).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from engine.attention.mla import LatentAttention

if TYPE_CHECKING:
    from engine.attention.backend import AttentionMetadata
    from engine.attention.npu_backend import NpuAttentionMetadata


class NpuLatentAttention(LatentAttention):
    """``ops``: the ``torch_npu`` module (the NPU backend's). The metadata is the NPU backend's
    (``NpuAttentionBackend.build_metadata``): int32 slots, decode block tables and host context lengths."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def write(self, latent: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
        npu_meta = cast("NpuAttentionMetadata", meta)
        self.ops._npu_reshape_and_cache_siso(key=latent.contiguous().unsqueeze(1), key_cache=cache[0],
                                             slot_indices=npu_meta.slots)

    def decode(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv_lora_rank: int,
               scale: float) -> torch.Tensor:
        npu_meta = cast("NpuAttentionMetadata", meta)
        num_decodes, num_heads, _ = query.shape
        out = query.new_empty(num_decodes, num_heads, kv_lora_rank)
        self.ops._npu_paged_attention_mla(query=query.contiguous(), key_cache=cache[0], num_kv_heads=1,
                                          num_heads=num_heads, scale_value=float(scale),
                                          block_table=npu_meta.decode_block_table,
                                          context_lens=npu_meta.decode_context_lens,
                                          mla_vheadsize=kv_lora_rank, out=out)
        return out
