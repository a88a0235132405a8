"""One process's place in a tensor × pipeline parallel replica, and the collectives the model and the runner use.

Ranks are laid out as vLLM's: ``rank = pp_rank * tp_size + tp_rank``; rank 0 (pipeline stage 0, tensor rank 0)
is the driver, in the engine process. The tensor-parallel group of a stage all-reduces row-parallel outputs and
gathers vocab-parallel logits; stage ``s`` sends its hidden states and residual to stage ``s + 1`` (tensor rank
``t`` to tensor rank ``t``); the last stage sends its final hidden states back to stage 0, which holds the
embedding, the lm_head and the sampler. The step messages go over the world group's gloo backend (a CPU byte
tensor), whatever the device; tensors of the forward pass over the device's backend (gloo on CPU, NCCL on CUDA,
HCCL on NPU). A context of one process (``ParallelContext()``) makes every collective a no-op.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The layers ``[start, end)`` of pipeline stage ``pp_rank``: ``num_layers // pp_size`` each, the remainder
    one more each to the last stages (stage 0 also embeds, gathers logits and samples). Raises ValueError when a
    stage would get no layer."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base + (1 if s >= pp_size - extra else 0) for s in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass(frozen=True)
class ParallelContext:
    """This process's ranks and groups. The default is one process: every collective is a no-op. Frozen: one
    context per process, made once (``init_parallel``), so the default instance can be a default argument."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    device_type: str = "cpu"
    expert_parallel: bool = False  # --enable-expert-parallel: MoE layers split their experts over the tensor ranks
    tp_group: Any = None      # torch.distributed ProcessGroup of this stage's tensor-parallel ranks
    world_group: Any = None   # gloo group of every rank: step messages (CPU byte tensors)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    # -- tensor parallel -------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over this stage's tensor-parallel ranks (in place; ``x`` itself at size 1)."""
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This stage's tensor ranks' ``x`` concatenated along ``dim`` in rank order (``x`` at size 1)."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=dim)

    # -- pipeline parallel -----------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], to_pp_rank: int) -> list[Any]:
        """Asynchronous sends of ``tensors`` to the same tensor rank of stage ``to_pp_rank``; returns the works
        to wait on before the tensors are reused."""
        dst = self.rank_of(to_pp_rank, self.tp_rank)
        return [torch.distributed.isend(t.contiguous(), dst) for t in tensors]

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
             from_pp_rank: int) -> list[torch.Tensor]:
        """Receives (blocking) tensors of ``shapes`` from the same tensor rank of stage ``from_pp_rank``."""
        src = self.rank_of(from_pp_rank, self.tp_rank)
        out = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        for t in out:
            torch.distributed.recv(t, src)
        return out

    # -- step messages -----------------------------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """The driver's ``data`` on every rank (the driver passes it, the others None), over the gloo world
        group: its length, then its bytes."""
        assert self.world_group is not None, "broadcast_bytes needs a world group"
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        torch.distributed.broadcast(size, 0, group=self.world_group)
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            torch.distributed.broadcast(buf, 0, group=self.world_group)
        return data if data is not None else buf.numpy().tobytes()


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, device_type: str = "cpu",
                  timeout_s: float = 600.0) -> ParallelContext:
    """Joins the replica's process group (``init_method``: ``tcp://host:port`` of the driver's store) and makes
    every group, on every rank in the same order as torch.distributed requires."""
    import torch.distributed as dist

    world = tp_size * pp_size
    backend = _BACKENDS[device_type]
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    world_group = dist.new_group(list(range(world)), backend="gloo") if backend != "gloo" else dist.group.WORLD
    tp_group = None
    for pp in range(pp_size):
        ranks = [pp * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            tp_group = group
    return ParallelContext(tp_size=tp_size, pp_size=pp_size, rank=rank, device_type=device_type,
                           tp_group=tp_group, world_group=world_group)
