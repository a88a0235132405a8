"""DeepSeek-V3's multi-token prediction (MTP) layers, loaded from the checkpoint for speculative decoding.

A checkpoint with ``num_nextn_predict_layers`` = n stores, after its L decoder layers, n more at ``model.layers.{L}``
.. ``{L + n - 1}``: each a decoder layer (latent attention and experts) with ``enorm`` / ``hnorm`` (RMSNorms),
``eh_proj`` (Linear 2H -> H) and ``shared_head.norm``, plus its own copies of the embedding (``embed_tokens``) and
the lm_head (``shared_head.head``). The layer's entry for position p reads the hidden state of position p (the
target model's final, normalised one; or the previous MTP step's output) and the embedding of the token after it:

    h = post_norm(block(eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])))        logits(t_{p+2}) = head(h)

as transformers' ``MtpLayer`` computes it (``modeling_layers.py``, with ``shared_head.norm`` as its ``post_norm``).
The block keeps its own KV cache, one layer per MTP layer, under the target's block tables.

The module runs unsharded on the driver (as a draft model does), whatever the target's tensor parallelism: it
embeds and projects with the checkpoint's own copies, or the target's when the checkpoint has none and the target
is whole.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.distributed import ParallelContext
from engine.models.config import ModelConfig, config_from_hf
from engine.models.decoder_layer import KERNEL_LAYERS, DecoderLayer
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.linear import Linear
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding
from engine.models.loader import safetensors_files
from engine.models.moe import MoeGate
from engine.models.sharding import ShardPlan
from engine.models.weight_names import map_name, num_parts, part_view


class MtpLayer(nn.Module):
    def __init__(self, config: ModelConfig, plan: ShardPlan, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.block = DecoderLayer(config, plan, rotary, ParallelContext(), layer)
        self.post_norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous)), dim=-1))
        out, residual = self.block(x, None, positions, kv_cache, meta)
        return self.post_norm(out + residual)


class MtpModel(nn.Module):
    """The checkpoint's MTP layers (whole), with an embedding and an lm_head of their own when it has them."""

    def __init__(self, config: ModelConfig, num_layers: int, own_head: bool) -> None:
        super().__init__()
        self.config = config
        plan = ShardPlan(config)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(MtpLayer(config, plan, self.rotary, config.num_layers + k)
                                    for k in range(num_layers))
        self.embed_tokens: nn.Embedding | None = None
        self.head: Linear | None = None
        if own_head:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.head = Linear(config.hidden_size, config.vocab_size, bias=False)
            self.head.is_lm_head = True

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def use_kernels(self, choice: object) -> None:
        for module in self.modules():
            if isinstance(module, KERNEL_LAYERS):
                module.use_kernels(choice)  # type: ignore[arg-type]


_MTP_EXTRAS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "post_norm"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def num_mtp_layers(directory: str) -> int:
    """``num_nextn_predict_layers`` of a Hugging Face directory's config (0 for a GGUF file or none)."""
    path = Path(directory) / "config.json"
    if not path.exists():
        return 0
    return int(json.loads(path.read_text()).get("num_nextn_predict_layers") or 0)


def load_mtp(directory: str, dtype: torch.dtype, device: torch.device | str) -> MtpModel:
    """The MTP layers of a DeepSeek-V3-layout checkpoint. Raises ValueError naming what is missing."""
    cfg = json.loads((Path(directory) / "config.json").read_text())
    count = int(cfg.get("num_nextn_predict_layers") or 0)
    if count == 0:
        raise ValueError(f"{directory} has no multi-token prediction layers (num_nextn_predict_layers is 0)")
    config = config_from_hf(cfg, None, has_lm_head=True)
    first = config.num_layers
    files = safetensors_files(Path(directory))
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                m = _LAYER.fullmatch(name)
                if m is not None and first <= int(m.group(1)) < first + count:
                    names[name] = file
    if not names:
        raise ValueError(f"{directory}: config.json declares {count} MTP layer(s) but the checkpoint holds no "
                         f"model.layers.{first}.* tensors")
    own_head = f"model.layers.{first}.embed_tokens.weight" in names and \
        f"model.layers.{first}.shared_head.head.weight" in names
    with torch.device("meta"):
        model = MtpModel(config, count, own_head)
    model = model.to(dtype=dtype)
    for module in model.modules():   # routers and the correction bias stay float32, as in the target
        if isinstance(module, MoeGate):
            module.float()
        elif isinstance(module, FusedMoE) and module.correction_bias is not None:
            module.correction_bias.data = module.correction_bias.data.float()
    model = model.to_empty(device=device)
    model.rotary.build_cache(device, dtype)
    _load(model, names, first)
    return model.eval().requires_grad_(False)


def _tensors(names: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    for file, wanted in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in wanted:
                yield name, f.get_tensor(name)


def _load(model: MtpModel, names: dict[str, Path], first: int) -> None:
    params = dict(model.named_parameters())
    plan = ShardPlan(model.config)
    loaded: set[tuple[str, int]] = set()
    for hf_name, tensor in _tensors(names):
        m = _LAYER.fullmatch(hf_name)
        assert m is not None
        k, rest = int(m.group(1)) - first, m.group(2)
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            if model.embed_tokens is None:
                continue
            name, part = ("embed_tokens.weight" if rest.startswith("embed") else "head.weight"), 0
            if k > 0:   # every MTP layer carries a copy; the first one's is used
                continue
        elif rest.removesuffix(".weight") in _MTP_EXTRAS:
            name, part = f"layers.{k}.{_MTP_EXTRAS[rest.removesuffix('.weight')]}.weight", 0
        else:
            target = map_name(f"model.layers.0.{rest}", model.config)
            if target is None:
                continue
            name, part = f"layers.{k}.block.{target[0].removeprefix('layers.0.')}", target[1]
        if name not in params:
            raise ValueError(f"MTP checkpoint tensor {hf_name!r} has no place in the MTP layer ({name!r})")
        dest = part_view(params[name], name, part, plan)
        if dest.shape != tensor.shape:
            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        loaded.add((name, part))
    missing = [n for n in params if not all((n, s) in loaded for s in range(num_parts(n, plan)))]
    if missing:
        raise ValueError(f"the checkpoint's MTP layers are missing: {', '.join(missing[:8])}")
