"""What one rank of a tensor × pipeline parallel replica holds of a model: its sizes, and its part of each
checkpoint tensor (which the loaders read alone).

Tensor parallel follows Megatron's layout as vLLM has it: q/k/v and gate/up are column-parallel (a rank holds
the rows of its heads and its slice of the intermediate size, each part of a fused projection sharded before the
parts are fused), o_proj and down_proj row-parallel (the matching input columns; the partial products are
all-reduced), the embedding and the lm_head vocab-parallel (``ceil(vocab / tp)`` rows each, the last rank's
padded with zero rows). With fewer KV heads than ranks each KV head is replicated over ``tp // num_kv_heads``
ranks: rank ``r`` holds head ``r * num_kv_heads // tp``, the one its query heads read. Pipeline parallel: a stage
holds its layers (``stage_layers``); stage 0 also the embedding and the lm_head, the last stage the final norm.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.distributed import ParallelContext, stage_layers
from engine.models.config import ModelConfig

_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias|e_score_correction_bias)")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
# A routed expert's projection, in the hub's per-expert names (Mixtral's w1 / w3 / w2 are gate / up / down).
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)")
_SHARED = re.compile(r"mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)")


def check_parallel_sizes(config: ModelConfig, tp: int, pp: int, expert_parallel: bool = False) -> None:
    """Raises ValueError, naming the sizes, unless the model splits over ``tp`` tensor ranks and ``pp`` stages."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({pp}) must be at least 1")
    if config.num_heads % tp:
        raise ValueError(f"the model's {config.num_heads} attention heads do not divide over "
                         f"tensor_parallel_size {tp}")
    kv = config.num_kv_heads
    if kv >= tp and kv % tp:
        raise ValueError(f"the model's {kv} key-value heads do not divide over tensor_parallel_size {tp}")
    if kv < tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the model's {kv} key-value heads "
                         "(with fewer key-value heads than ranks, each head is replicated over as many ranks)")
    if config.intermediate_size % tp:
        raise ValueError(f"the model's intermediate size {config.intermediate_size} does not divide over "
                         f"tensor_parallel_size {tp}")
    moe = config.moe
    if moe is not None:
        if expert_parallel:
            if moe.routing.num_experts % tp:
                raise ValueError(f"the model's {moe.routing.num_experts} routed experts do not divide over "
                                 f"{tp} expert-parallel ranks (--enable-expert-parallel)")
        elif moe.intermediate_size % tp:
            raise ValueError(f"the model's expert intermediate size (moe_intermediate_size) {moe.intermediate_size} "
                             f"does not divide over tensor_parallel_size {tp}")
        if moe.shared_intermediate_size % tp:
            raise ValueError(f"the model's shared-expert intermediate size {moe.shared_intermediate_size} does not "
                             f"divide over tensor_parallel_size {tp}")
    if pp > config.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {config.num_layers} layers")


@dataclass(frozen=True)
class Shard:
    """Rows or columns ``[start, start + size)`` (``dim`` 0 or 1) of a checkpoint tensor; ``dim`` None: all of it."""

    dim: int | None = None
    start: int = 0
    size: int = 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This shard of a whole tensor (a view)."""
        return tensor if self.dim is None else tensor.narrow(self.dim, self.start, self.size)


WHOLE = Shard()


@dataclass(frozen=True)
class ShardPlan:
    """One rank's sizes (per layer: its heads, its intermediate size; its vocabulary rows) and layers."""

    config: ModelConfig
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    expert_parallel: bool = False  # routed experts split whole over the tensor ranks, not sliced

    @classmethod
    def of(cls, config: ModelConfig, parallel: ParallelContext) -> ShardPlan:
        """The plan of ``parallel``'s rank (sizes checked by ``check_parallel_sizes`` first)."""
        return cls(config, parallel.tp_size, parallel.tp_rank, parallel.pp_size, parallel.pp_rank,
                   parallel.expert_parallel and config.moe is not None)

    @property
    def layers(self) -> tuple[int, int]:
        """The global indices ``[start, end)`` of this stage's layers."""
        return stage_layers(self.config.num_layers, self.pp_size, self.pp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.tp_size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds (the only one, when heads are replicated)."""
        kv = self.config.num_kv_heads
        return self.tp_rank * kv // self.tp_size if kv < self.tp_size else self.tp_rank * self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.config.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.config.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.tp_size

    @property
    def moe_intermediate_size(self) -> int:
        """This rank's slice of each routed expert's intermediate size (all of it under expert parallel)."""
        assert self.config.moe is not None
        size = self.config.moe.intermediate_size
        return size if self.expert_parallel else size // self.tp_size

    @property
    def shared_intermediate_size(self) -> int:
        assert self.config.moe is not None
        return self.config.moe.shared_intermediate_size // self.tp_size

    @property
    def experts(self) -> tuple[int, int]:
        """(first global id, count) of the routed experts this rank holds."""
        assert self.config.moe is not None
        total = self.config.moe.routing.num_experts
        if not self.expert_parallel:
            return 0, total
        per_rank = total // self.tp_size
        return self.tp_rank * per_rank, per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's embedding and lm_head: ``ceil(vocab / tp)``, past the vocabulary zeros."""
        return -(-self.config.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_rows

    @property
    def vocab_held(self) -> int:
        """Rows of this rank's embedding and lm_head that hold tokens (the rest is padding)."""
        return max(0, min(self.vocab_rows, self.config.vocab_size - self.vocab_start))

    def shard(self, name: str) -> Shard | None:
        """This rank's part of the checkpoint tensor ``name`` (Hugging Face naming, ``model.`` prefix optional);
        None: another stage's tensor."""
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            if not self.is_first_stage:
                return None
            return WHOLE if self.tp_size == 1 else Shard(0, self.vocab_start, self.vocab_held)
        if name.startswith("norm."):
            return WHOLE if self.is_last_stage else None
        m = _LAYER.fullmatch(name)
        if m is None:
            return WHOLE
        start, end = self.layers
        if not start <= int(m.group(1)) < end:
            return None
        module, kind = m.group(2), m.group(3)
        if (expert := EXPERT.fullmatch(module)) is not None:
            return self._expert_shard(int(expert.group(1)), expert.group(2))
        if self.tp_size == 1 or (module in _ROW_PARALLEL and kind == "bias"):
            return WHOLE
        if (shared := _SHARED.fullmatch(module)) is not None:
            size = self.shared_intermediate_size
            return Shard(1 if shared.group(1) == "down_proj" else 0, self.tp_rank * size, size)
        mla = self.config.mla
        if mla is not None and module.startswith("self_attn."):
            # heads' rows of the query and up projections, columns of o_proj; the latent projections replicated
            if module in ("self_attn.q_proj", "self_attn.q_b_proj"):
                return Shard(0, self.tp_rank * self.num_heads * mla.qk_head_dim, self.num_heads * mla.qk_head_dim)
            if module == "self_attn.kv_b_proj":
                rows = self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
                return Shard(0, self.tp_rank * rows, rows)
            if module == "self_attn.o_proj":
                cols = self.num_heads * mla.v_head_dim
                return Shard(1, self.tp_rank * cols, cols)
            return WHOLE
        head_dim = self.config.head_dim
        if module == "self_attn.q_proj" or module == "self_attn.o_proj":
            return Shard(0 if module == "self_attn.q_proj" else 1, self.tp_rank * self.q_size, self.q_size)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            return Shard(0, self.kv_head_start * head_dim, self.kv_size)
        if module in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            size = self.intermediate_size
            return Shard(0 if module != "mlp.down_proj" else 1, self.tp_rank * size, size)
        return WHOLE

    def _expert_shard(self, expert: int, proj: str) -> Shard | None:
        """Expert ``expert``'s projection: whole on the rank that holds it (None elsewhere) under expert parallel,
        else this rank's slice of its intermediate size."""
        start, count = self.experts
        if not start <= expert < start + count:
            return None
        if self.expert_parallel or self.tp_size == 1:
            return WHOLE
        size = self.moe_intermediate_size
        return Shard(1 if proj in ("down_proj", "w2") else 0, self.tp_rank * size, size)
