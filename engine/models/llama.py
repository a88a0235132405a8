"""The decoder-only model of every family Sluice serves: the Llama block family (Llama 2/3, SmolLM2, Mistral,
Qwen2/2.5 with q/k/v bias, Qwen3 with q/k RMSNorm) and the mixture-of-experts families (Mixtral, Qwen2/3-MoE,
DeepSeek-V2/V3 with latent attention), their layers built per ``engine.models.decoder_layer``.

Layout differs from transformers in fused projections — q/k/v is one Linear, gate/up is one Linear, a layer's
routed experts are two stacked parameters — so each layer runs fewer matmuls; ``load_weights`` splices the
checkpoint's separate tensors into them (``engine.models.weight_names``). Sliding-window layers (Mistral, Mixtral,
Qwen2/3 with ``use_sliding_window``; ``ModelConfig.window_of``) attend over their last ``sliding_window``
positions in every backend; when every layer slides, the scheduler gives back the blocks behind the window. The
layers pick their kernels once, in ``use_kernels``; the forward pass does not branch on them.

One rank of a tensor × pipeline parallel replica builds and loads only its shard of its stage
(``engine.models.sharding``): ``layers[i]`` is the model's layer ``start_layer + i``.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.models.config import ModelConfig
from engine.models.decoder_layer import KERNEL_LAYERS, Attention, DecoderLayer
from engine.models.layers.embedding import Embedding, VocabParallelEmbedding
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.linear import Linear
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding
from engine.models.moe import MoeGate
from engine.models.quant import QuantWeight, cat_rows, pad_rows
from engine.models.sharding import Shard, ShardPlan, check_parallel_sizes
from engine.models.w8a8 import Int8Weight, quantize_weight
from engine.models.w8a8_static import AnyInt8Weight, cat_parts
from engine.models.weight_names import ALL_PARTS, local_part, map_name, num_parts, part_view

# The hidden states and the residual stream a pipeline stage hands the next.
Intermediate = tuple[torch.Tensor, torch.Tensor]


class CausalLM(nn.Module):
    """Decoder-only language model over a flat batch of tokens (no padding) and a paged KV cache: the whole model, or
    one rank's shard of its pipeline stage (``parallel``). Stage 0 holds the embedding and the lm_head, the last
    stage the final norm; a module a rank does not hold is None."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.plan = plan = ShardPlan.of(config, parallel)
        self.start_layer, self.end_layer = plan.layers
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's local layers rotate on a base of their own, unscaled
        self.rotary_local = (RotaryEmbedding(replace(config, rope_theta=config.rope_local_theta, rope_scaling=None))
                             if config.rope_local_theta is not None else None)
        self.embed_tokens: Embedding | None = None
        self.lm_head: Linear | None = None
        if plan.is_first_stage:
            self.embed_tokens = (VocabParallelEmbedding(plan.vocab_rows, config.hidden_size, plan.vocab_start, parallel)
                                 if parallel.tp_size > 1 else Embedding(config.vocab_size, config.hidden_size))
            # A tied lm_head shares the embedding table (``tie_weights``): its methods never free it.
            self.lm_head = Linear(config.hidden_size, plan.vocab_rows, bias=False)
            self.lm_head.is_lm_head = True
            self.lm_head.shares_weight = config.tie_word_embeddings
        self.layers = nn.ModuleList(DecoderLayer(config, plan, self._rotary_of(layer), parallel, layer)
                                    for layer in range(self.start_layer, self.end_layer))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if plan.is_last_stage else None

    def _rotary_of(self, layer: int) -> RotaryEmbedding:
        if self.rotary_local is not None and layer in self.config.rope_local_layers:
            return self.rotary_local
        return self.rotary

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads of this rank's caches: its share of the model's, or one replicated head (MLA: one latent)."""
        return 1 if self.config.mla is not None else self.plan.num_kv_heads

    @property
    def kv_head_dim(self) -> int:
        """Width of a cached head: the model's head_dim, or MLA's latent (``kv_lora_rank + qk_rope_head_dim``)."""
        return self.config.mla.latent_dim if self.config.mla is not None else self.config.head_dim

    @property
    def kv_planes(self) -> int:
        """2: keys and values cached apart; 1: one latent per token (MLA)."""
        return 1 if self.config.mla is not None else 2

    def kv_bytes_per_token(self, element_size: int) -> int:
        """What one token takes in this rank's caches, every local layer."""
        return self.kv_planes * self.num_local_layers * self.num_local_kv_heads * self.kv_head_dim * element_size

    def disable_sliding_window(self) -> None:
        """Every layer attends over the whole context (``--disable-sliding-window``; the engine caps the context at
        the window, so that this changes no answer)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.window = None

    def fit_context(self, max_model_len: int) -> None:
        """Frequencies for sequences of at most ``max_model_len`` tokens, where they depend on it (longrope: the
        short factors when it is within the original context, as transformers uses them for such a sequence)."""
        for rotary in (self.rotary, self.rotary_local):
            if rotary is not None and rotary.depends_on_context and rotary.context != max_model_len:
                rotary.build_cache(rotary.cos_cache.device, rotary.cos_cache.dtype, max_model_len)

    def keep_float32(self) -> None:
        """Routers and DeepSeek's correction bias stay float32 in any model dtype (they decide the experts)."""
        for module in self.modules():
            if isinstance(module, MoeGate):
                module.float()
            elif isinstance(module, FusedMoE) and module.correction_bias is not None:
                module.correction_bias.data = module.correction_bias.data.float()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | Intermediate:
        """input_ids, positions: int64 [T]; one KV cache per local layer. The first stage embeds ``input_ids`` (or
        takes ``inputs_embeds`` [T, hidden] as they are: a vision-language model's, images merged in), a later one
        continues from ``intermediate``, the (hidden states, residual) pair the stage before returned.
        Returns the final hidden states [T, hidden] on the last stage, else the pair to send on."""
        residual: torch.Tensor | None = None
        if inputs_embeds is not None:
            x = inputs_embeds
        elif self.embed_tokens is not None:
            x = self.embed_tokens(input_ids)
            if self.config.embed_scale:   # Gemma: by sqrt(hidden), rounded to the table's dtype as transformers does
                x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
            elif self.config.embedding_multiplier != 1.0:   # Granite
                x = x * self.config.embedding_multiplier
        elif intermediate is not None:
            x, residual = intermediate
        else:
            raise ValueError(f"pipeline stage {self.parallel.pp_rank} needs the hidden states and residual of the "
                             "stage before it (intermediate)")
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        assert residual is not None
        if self.norm is None:
            return x, residual
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in ``dtype``; ``None``: as the lm_head computes them (the model's
        dtype, float32 on the quantized blocks). The engine passes None: its sampler widens what it must, and
        greedy rows take the argmax of bfloat16 logits as they are (the same answer, no float32 copy).
        Pipeline stage 0 only; with tensor parallelism every tensor rank of the stage calls it with as many rows
        (it gathers their vocabulary shards) and gets the whole logits."""
        if self.lm_head is None:
            raise RuntimeError(f"compute_logits runs on pipeline stage 0 (the lm_head's), not on stage "
                               f"{self.parallel.pp_rank}")
        logits = self.parallel.all_gather(self.lm_head(hidden), dim=-1)
        vocab = self.config.vocab_size
        if logits.shape[-1] != vocab:  # the last rank's padding rows
            logits = logits[..., :vocab].contiguous()
        if self.config.logits_scaling != 1.0:   # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if dtype is None else logits.to(dtype)

    def use_kernels(self, choice: KernelChoice) -> None:
        """Every layer picks its kernel from ``choice``, once, after the weights are loaded (the device decides
        the choice: ``Device.kernel_choice``)."""
        for module in self.modules():
            if isinstance(module, KERNEL_LAYERS):
                module.use_kernels(choice)

    def amx_pack_bytes(self) -> int:
        """How much memory tile-packed copies of every linear's weight would add (``KernelChoice.amx_linear``)."""
        return sum(m.amx_pack_bytes() for m in self.modules() if isinstance(m, Linear))

    @property
    def quantized_linears(self) -> int:
        """How many projections (and the lm_head) hold GGUF blocks."""
        return sum(1 for m in self.modules() if isinstance(m, Linear) and m.holds_blocks)

    def weight_shard(self, hf_name: str) -> Shard | None:
        """The part of checkpoint tensor ``hf_name`` this rank loads (the loaders read only it); None: not loaded
        here (another stage's, or one the model recomputes or shares)."""
        if map_name(hf_name, self.config) is None:
            return None
        return self.plan.shard(hf_name)

    def _target(self, hf_name: str) -> tuple[str, int] | None:
        """(parameter name, part of a fused parameter) of this rank's ``hf_name``, or None when not loaded here."""
        if self.weight_shard(hf_name) is None:
            return None
        target = map_name(hf_name, self.config)
        assert target is not None
        name, part = target
        if (m := _LAYER_INDEX.fullmatch(name)) is not None:
            name = f"layers.{int(m.group(1)) - self.start_layer}.{m.group(2)}"
        return name, local_part(name, part, self.plan)

    def load_quantized(self, weights: Iterable[tuple[str, QuantWeight]]) -> int:
        """Keeps block-quantized copies of projection weights (named and sharded as in ``load_weights``, which must
        have loaded the same values dequantized), for ``use_kernels`` to run them. A fused projection gets one only
        when all its parts come quantized in one format. Returns how many projections got one."""
        shards: dict[str, dict[int, QuantWeight]] = {}
        for hf_name, weight in weights:
            target = self._target(hf_name)
            if target is None or not target[0].endswith(".weight"):
                continue
            shards.setdefault(target[0], {})[target[1]] = weight
        count = 0
        for name, parts in shards.items():
            if len(parts) != num_parts(name, self.plan):
                continue
            fused = cat_rows([parts[i] for i in range(len(parts))])
            module: nn.Module | None
            if name == "embed_tokens.weight":  # the tied lm_head computes on the table's blocks
                module = self.lm_head if self.config.tie_word_embeddings else None
            else:
                module = self.get_submodule(name.removesuffix(".weight"))
            if fused is None or not isinstance(module, Linear):
                continue
            if module.is_lm_head and fused.shape[0] < module.out_features:  # the vocabulary shard's padding
                fused = pad_rows(fused, module.out_features)
            if fused.shape != (module.out_features, module.in_features):
                continue
            module.quant = fused
            count += 1
        return count

    def drop_quantized(self) -> None:
        """Forgets the blocks ``load_quantized`` kept (before ``use_kernels``): every layer stays dense."""
        for module in self.modules():
            if isinstance(module, Linear):
                if module.weight is None:
                    raise RuntimeError("drop_quantized: some layers have only their blocks left (float32 freed)")
                module.quant = None

    def quantize_w8a8(self) -> int:
        """W8A8 (engine.models.w8a8) for every projection without an int8 weight yet, and for the lm_head: its weight
        (this rank's shard) quantized per output channel, its GGUF blocks dropped and its float weight freed as it
        goes (a tied lm_head's is the embedding table's, which stays). The embedding stays in the model's dtype: a
        lookup, no product. The lm_head is quantized too because it was measured: on the default model a 32-sequence
        decode step took 43.0 ms against 48.0 with a bfloat16 lm_head, for a greedy agreement with bfloat16 of
        0.858 against 0.860 and perplexity +1.8 % against +1.4 % (docs/quantization.md). Returns how many linears
        were quantized."""
        count = 0
        for module in self.modules():
            if isinstance(module, FusedMoE) and module.int8 is None:
                module.quantize_w8a8()
                count += 2 * module.num_local_experts
                continue
            if isinstance(module, Linear) and module.int8 is None:
                if module.weight is None:
                    raise RuntimeError("quantize_w8a8 runs after the weights load and before use_kernels")
                module.int8 = quantize_weight(module.weight)
                module.quant = None
                if not module.shares_weight:
                    module.weight = None  # type: ignore[assignment]
                count += 1
        return count

    def load_int8(self, weights: Iterable[tuple[str, AnyInt8Weight]]) -> int:
        """Gives projections a checkpoint's own int8 weights (named and sharded as in ``load_weights``, which must
        have loaded the same values dequantized): dynamic W8A8 (``Int8Weight``) or static (``StaticInt8Weight``);
        the parts of a fused projection (q/k/v, gate/up) are stacked (``cat_parts``). Frees the float weights they
        replace. Raises ValueError when only some parts of a fused projection come as int8, for an int8 embedding
        table (an untied lm_head may be int8), or for static experts. Returns how many linears got one."""
        shards: dict[str, dict[int, AnyInt8Weight]] = {}
        experts: dict[str, dict[int, Int8Weight]] = {}
        for hf_name, weight in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            if target[0] == "embed_tokens.weight":
                raise ValueError(f"{hf_name}: an int8 embedding table is not supported (a W8A8 checkpoint lists it, "
                                 "or a tied lm_head, in quantization_config.ignore)")
            if ".mlp.experts." not in target[0]:
                shards.setdefault(target[0], {})[target[1]] = weight
            elif isinstance(weight, Int8Weight):
                experts.setdefault(target[0], {})[target[1]] = weight
            else:
                raise ValueError(f"{hf_name}: experts with static activation quantization are not supported (only "
                                 "dynamic W8A8 experts)")
        count = self._load_int8_experts(experts)
        for name, parts in shards.items():
            module = self.get_submodule(name.removesuffix(".weight"))
            if len(parts) != num_parts(name, self.plan) or not isinstance(module, Linear):
                raise ValueError(f"{name}: the parts of a fused projection must all be int8 or all float (got int8 "
                                 f"for {len(parts)} of {num_parts(name, self.plan)})")
            fused = cat_parts([parts[i] for i in range(len(parts))], name)
            if module.is_lm_head and fused.shape[0] < module.out_features:  # the vocabulary shard's padding rows
                fused = fused.pad_rows(module.out_features)
            if fused.shape != (module.out_features, module.in_features):
                raise ValueError(f"{name}: int8 weight shape {fused.shape} != expected "
                                 f"{(module.out_features, module.in_features)}")
            module.int8 = fused.to(module.weight.device)
            module.quant = None
            module.weight = None  # type: ignore[assignment]
        return len(shards) + count

    def _load_int8_experts(self, shards: dict[str, dict[int, Int8Weight]]) -> int:
        """A checkpoint's int8 experts (``mlp.experts.w13`` parts 2e / 2e + 1: expert e's gate and up, ``w2`` part e)
        into their layers' ``FusedMoE.int8``; every expert of a layer must come as int8. Returns the products."""
        count = 0
        layers = {name.rsplit(".", 1)[0] for name in shards}
        for layer_name in layers:
            module = self.get_submodule(layer_name)
            assert isinstance(module, FusedMoE)
            w13, w2 = shards.get(f"{layer_name}.w13", {}), shards.get(f"{layer_name}.w2", {})
            n = module.num_local_experts
            if len(w13) != 2 * n or len(w2) != n:
                raise ValueError(f"{layer_name}: the experts' weights must all be int8 or all float (got int8 for "
                                 f"{len(w13) + len(w2)} of {3 * n})")
            module.int8 = ([Int8Weight(torch.cat([w13[2 * e].qweight, w13[2 * e + 1].qweight]),
                                       torch.cat([w13[2 * e].scale, w13[2 * e + 1].scale])) for e in range(n)],
                           [w2[e] for e in range(n)])
            module._free_float()
            count += 2 * n
        return count

    @property
    def int8_linears(self) -> int:
        """How many linears (an expert's two products counted as two) hold W8A8 int8 weights waiting for
        ``use_kernels`` to hand them to their method."""
        modules = list(self.modules())
        return (sum(1 for m in modules if isinstance(m, Linear) and m.int8 is not None)
                + sum(2 * m.num_local_experts for m in modules if isinstance(m, FusedMoE) and m.int8 is not None))

    def language_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters ``load_weights`` fills: all of them (a vision-language model loads its tower apart)."""
        return dict(self.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies tensors named as in a Hugging Face checkpoint into this model's fused layout: each this rank's
        part of the checkpoint's tensor (``weight_shard(name).take(tensor)``; the whole tensor without tensor
        parallelism); tensors this rank does not hold are skipped.

        Raises if a parameter is left unloaded, a name is unknown or a shape differs.
        """
        params = self.language_parameters()
        loaded: set[tuple[str, int]] = set()  # (parameter, part index)
        for hf_name, tensor in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            name, part = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model ({name!r})")
            dest = part_view(params[name], name, part, self.plan)
            with torch.no_grad():
                if name in _VOCAB_TABLES:  # rows past the vocabulary (the last tensor rank's) are zeros
                    dest[self.plan.vocab_held:].zero_()
                    dest = dest[:self.plan.vocab_held]
                if dest.shape != tensor.shape:
                    raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected "
                                     f"{tuple(dest.shape)}")
                if self.config.norm_weight_offset and name.endswith("norm.weight"):   # Gemma's (1 + weight)
                    tensor = tensor.float() + self.config.norm_weight_offset
                dest.copy_(tensor)
            if part == ALL_PARTS:
                loaded.update((name, s) for s in range(num_parts(name, self.plan)))
            else:
                loaded.add((name, part))
        missing = [n for n in params if not all((n, s) in loaded for s in range(num_parts(n, self.plan)))]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.(.+)")
_VOCAB_TABLES = ("embed_tokens.weight", "lm_head.weight")


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                parallel: ParallelContext = ParallelContext()) -> CausalLM:
    """An uninitialised model on ``device`` (weights are garbage until ``load_weights``): the whole model, or the
    shard of ``parallel``'s rank of its stage. Raises ValueError naming the sizes when the model does not split
    over ``parallel``'s tensor ranks and stages."""
    check_parallel_sizes(config, parallel.tp_size, parallel.pp_size, parallel.expert_parallel)
    with torch.device("meta"):
        model = CausalLM(config, parallel)
    model = model.to(dtype=dtype)
    model.keep_float32()
    # Materialising from meta skips random initialisation, which would cost seconds for nothing.
    model = model.to_empty(device=device)
    model.tie_weights()
    model.rotary.build_cache(device, dtype)
    if model.rotary_local is not None:
        model.rotary_local.build_cache(device, dtype)
    return model.eval().requires_grad_(False)
