"""The KV cache's memory as arithmetic a reader can check (issue 44): what the device share or
``--kv-cache-memory`` gives, what is taken before the cache (weights, a max-size step's activation peak, what
other processes hold), one block's bytes, and the blocks and tokens that leaves; what is held besides (weights
and LoRA slots in host memory on CPU, the draft model). Start-up logs it; a model or a context that does not
fit is refused with it, and with the largest ``--max-model-len`` and ``--max-num-seqs`` that would fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.layers.linear import Linear
from engine.models.layers.lora import LoRALinearMethod

Term = tuple[str, int]  # (what, bytes)


@dataclass(frozen=True)
class BlockBytes:
    """One KV block: ``planes`` (keys and values: 2; MLA's latent: 1) x layers x tokens x KV heads x head width x
    element bytes, plus the draft model's (or the MTP layers') keys and values under the same block id."""

    planes: int
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    elem: int
    draft: int = 0

    @property
    def total(self) -> int:
        return self.planes * self.layers * self.block_size * self.kv_heads * self.head_dim * self.elem + self.draft

    def formula(self) -> str:
        base = (f"{self.planes} x {self.layers} layers x {self.block_size} tokens x {self.kv_heads} KV heads x "
                f"{self.head_dim} x {self.elem} B")
        return f"{base}{f' + {self.draft} B of the draft model' if self.draft else ''} = {self.total} B"


@dataclass(frozen=True)
class MemoryBudget:
    """``given`` less each of ``taken`` is the KV cache; ``held`` is memory shown for the reader, not subtracted
    (``held_label`` says how it relates: held besides the cache, or counted in a term already)."""

    given: Term
    taken: tuple[Term, ...]
    held: tuple[Term, ...]
    block: BlockBytes
    held_label: str = "held besides"

    @property
    def kv_bytes(self) -> int:
        return self.given[1] - sum(b for _, b in self.taken)

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_bytes // self.block.total)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block.block_size

    def arithmetic(self) -> str:
        terms = " - ".join(f"{what} {n} B" for what, n in (self.given, *self.taken))
        text = (f"{terms} = {self.kv_bytes} B for the KV cache; one block = {self.block.formula()}; "
                f"{self.kv_bytes} B // {self.block.total} B = {self.num_blocks} blocks x {self.block.block_size} "
                f"tokens = {self.tokens} tokens")
        held = [f"{what} {n} B" for what, n in self.held if n]
        return text + (f" ({self.held_label}: {', '.join(held)})" if held else "")

    def sequences_at(self, max_model_len: int) -> int:
        """How many sequences of ``max_model_len`` tokens the cache holds at once."""
        return self.num_blocks // -(-max_model_len // self.block.block_size)

    def refusal(self, max_model_len: int | None) -> str | None:
        """Why this budget cannot serve (the arithmetic, and what would fit), or None when it can:
        no room for one block, or an asked-for ``max_model_len`` longer than the cache holds."""
        per_block = self.block.total
        if self.num_blocks < 1:
            return (f"{self.kv_bytes} B leave no room for one KV block ({per_block} B), {per_block - self.kv_bytes} "
                    f"B short: {self.arithmetic()}")
        if max_model_len is not None and self.tokens < max_model_len:
            need = -(-max_model_len // self.block.block_size)
            return (f"--max-model-len {max_model_len} needs {need} blocks ({need * per_block} B) for one sequence, "
                    f"more than the cache holds: {self.arithmetic()}; the largest --max-model-len that fits is "
                    f"{self.tokens} (one sequence of it at a time), or give the cache "
                    f"{need * per_block - self.kv_bytes} B more")
        return None

    def summary(self, max_model_len: int | None, max_num_seqs: int) -> str:
        """The start-up line: the arithmetic, and how many full-length sequences fit at once."""
        text = f"KV cache memory: {self.arithmetic()}"
        if max_model_len:
            fit = self.sequences_at(max_model_len)
            note = "" if fit >= max_num_seqs else ": more wait, or are preempted, when all are that long"
            text += (f"; {fit} sequences of max_model_len {max_model_len} fit at once "
                     f"(--max-num-seqs {max_num_seqs}{note})")
        return text


def module_bytes(module: nn.Module) -> tuple[int, int]:
    """(weights, LoRA slots) of ``module`` in bytes: every tensor its modules hold (parameters, buffers, and the
    tensors a layer's method keeps, quantized codes and scales included), each storage counted once."""
    storages: dict[int, int] = {}
    lora: dict[int, int] = {}
    for m in module.modules():
        holders: list[object] = [m]
        method = m.method if isinstance(m, Linear) else None
        if method is not None:
            holders.append(method)
        for holder in holders:
            into = lora if isinstance(holder, LoRALinearMethod) else storages
            for t in _tensors(holder):
                try:
                    storage = t.untyped_storage()
                    into[storage.data_ptr()] = storage.nbytes()
                except (NotImplementedError, RuntimeError):  # an opaque (packed) tensor has no storage to share
                    into[id(t)] = t.numel() * t.element_size()
    return sum(n for ptr, n in storages.items() if ptr not in lora), sum(lora.values())


def _tensors(holder: object, depth: int = 0) -> list[torch.Tensor]:
    """The tensors ``holder`` keeps: its own parameters and buffers (a module), its tensor attributes, and those
    of plain objects it holds (a quantized weight's codes and scales), not of sub-modules (``modules()`` visits
    those)."""
    found: list[torch.Tensor] = []
    if isinstance(holder, nn.Module):
        found += [*holder.parameters(recurse=False), *holder.buffers(recurse=False)]
    for value in vars(holder).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
        elif depth < 2 and hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
            found += _tensors(value, depth + 1)
    return found
