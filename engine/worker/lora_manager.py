"""The worker's LoRA adapters: a host LRU cache of loaded adapters, ``max_loras`` slots of stacked weights on the
device, and each step's token -> slot mask.

The cache holds up to ``max_cpu_loras`` validated adapters; one evicted from it is read again from its path the
next time a step needs it (a request names its adapter by ``LoRARequest``, path included). A slot holds the
weights of one adapter in every wrapped layer; a step's adapters get slots (a free one, else the one used least
recently by an earlier step), so adapters that keep running stay resident and cost no copy.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import LoRAConfig
from engine.models import CausalLM
from engine.models.layers.linear import Linear
from engine.models.layers.lora import LoRALinearMethod, LoRAStepPlan, LoRAStepState
from engine.models.lora import TARGET_MODULES, LoRAAdapter, load_adapter

if TYPE_CHECKING:  # the core's types, handed down by the executor: annotations only
    from engine.core.lora_request import LoRARequest
    from engine.core.scheduler_output import ScheduledRequest

# (layer index, fused layer name such as "self_attn.qkv_proj")
LayerKey = tuple[int, str]

# A sequence with at least this many tokens in a step (a prefill chunk) is computed with its adapter's own
# weights; shorter ones (decodes) share the masked pass over every slot the step uses (engine.models.layers.lora).
SEGMENT_MIN_TOKENS = 16


def wrap_lora_layers(model: CausalLM, state: LoRAStepState, config: LoRAConfig, dtype: torch.dtype,
                     device: torch.device) -> dict[LayerKey, LoRALinearMethod]:
    """Wraps the method of every projection an adapter may target (after ``use_kernels`` chose it)."""
    mc = model.config
    slices = {"self_attn.qkv_proj": (mc.q_size, mc.kv_size, mc.kv_size), "self_attn.o_proj": (mc.hidden_size,),
              "mlp.gate_up_proj": (mc.intermediate_size, mc.intermediate_size), "mlp.down_proj": (mc.hidden_size,)}
    methods: dict[LayerKey, LoRALinearMethod] = {}
    for index, layer in enumerate(model.layers):
        for name, sizes in slices.items():
            linear = layer.get_submodule(name)
            assert isinstance(linear, Linear) and linear.out_features == sum(sizes)
            method = LoRALinearMethod(linear.method, state, slices=sizes, in_features=linear.in_features,
                                      max_loras=config.max_loras, max_rank=config.max_lora_rank, dtype=dtype,
                                      device=device)
            linear.method = method
            methods[(index, name)] = method
    return methods


class LoRAManager:
    """Owns the adapters' weights on the worker; ``prepare_step`` makes a step's adapters resident and sets the
    mask every wrapped layer reads."""

    def __init__(self, model: CausalLM, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model_config = model.config
        self.config = config
        self.dtype = dtype
        self.device = device
        self.state = LoRAStepState()
        self.layers = wrap_lora_layers(model, self.state, config, dtype, device)
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()   # host copies, least recently used first
        self.slots: list[int | None] = [None] * config.max_loras       # the lora id each slot holds
        self._slot_used: list[int] = [0] * config.max_loras            # the step that last used each slot
        self._step = 0
        self.num_loads = 0          # adapters read from their folder (a reload after eviction counts)
        self.num_slot_writes = 0    # adapters copied into a slot

    @property
    def cached_ids(self) -> list[int]:
        """Ids of the adapters in the host cache, least recently used first."""
        return list(self._cache)

    def add_lora(self, lora: LoRARequest, keep: Sequence[int] = ()) -> None:
        """Loads and validates ``lora`` into the host cache (nothing to do when it is there already), evicting the
        least recently used adapter not in ``keep`` (ids the current step needs) when the cache is full."""
        lora_id = lora.lora_int_id
        if lora_id in self._cache:
            self._cache.move_to_end(lora_id)
            return
        adapter = load_adapter(lora.lora_path, self.model_config, max_rank=self.config.max_lora_rank,
                               dtype=self.dtype)
        self.num_loads += 1
        while len(self._cache) >= self.config.cpu_capacity:
            victim = next((i for i in self._cache if i not in keep), None)
            if victim is None:   # cannot happen: a step has at most max_loras <= cpu_capacity adapters
                raise RuntimeError(f"LoRA cache full of adapters the step needs: {list(self._cache)}")
            del self._cache[victim]   # its slot, if any, keeps its weights: still resident for the device
        self._cache[lora_id] = adapter

    def remove_lora(self, lora_id: int) -> None:
        """Forgets an adapter: its host copy and its slot (zeroed). Unknown ids are ignored."""
        self._cache.pop(lora_id, None)
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
            for method in self.layers.values():
                method.clear_slot(slot)
            self.slots[slot] = None
            self._slot_used[slot] = 0

    def prepare_step(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Makes the adapters of ``scheduled`` resident and sets the mask of the step's flat token layout (the
        tokens of scheduled[0], then scheduled[1], ...)."""
        self.activate([(s.request.lora_request, s.num_new_tokens) for s in scheduled])

    def activate(self, rows: Sequence[tuple[LoRARequest | None, int]]) -> None:
        """``rows``: (adapter or None for the base model, number of tokens) of each sequence, in token order."""
        self._step += 1
        loras = {lora.lora_int_id: lora for lora, _ in rows if lora is not None}
        if not loras:
            self.state.set(None)
            return
        if len(loras) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(loras)} LoRA adapters, more than --max-loras "
                               f"{self.config.max_loras} (the scheduler must not schedule that)")
        slot_of = {lora_id: self._slot_for(lora, list(loras)) for lora_id, lora in loras.items()}
        # The masked rows: the leading run of short sequences (decodes come first in a step).
        dense = 0
        while dense < len(rows) and rows[dense][1] < SEGMENT_MIN_TOKENS:
            dense += 1
        token_slot = np.full(sum(n for _, n in rows[:dense]), -1, dtype=np.int64)
        segments: list[tuple[int, int, int]] = []
        offset = 0
        for i, (lora, n) in enumerate(rows):
            if lora is not None:
                slot = slot_of[lora.lora_int_id]
                if i < dense:
                    token_slot[offset:offset + n] = slot
                else:
                    segments.append((offset, offset + n, slot))
            offset += n
        used = token_slot.max(initial=-1) + 1
        if used == 0:   # no adapter among the masked rows: nothing to mask
            token_slot = token_slot[:0]
        self.state.set(LoRAStepPlan(torch.from_numpy(token_slot).to(self.device), int(used), tuple(segments)))

    def _slot_for(self, lora: LoRARequest, step_ids: list[int]) -> int:
        """The slot holding ``lora`` (copied there first, into a free slot or the least recently used one no
        other adapter of this step holds)."""
        lora_id = lora.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [i for i, held in enumerate(self.slots) if held is None or held not in step_ids]
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._slot_used[i]))
            self.add_lora(lora, keep=step_ids)   # read again from its path if the host cache let it go
            self._write_slot(slot, self._cache[lora_id])
            self.slots[slot] = lora_id
        self._slot_used[slot] = self._step
        if lora_id in self._cache:
            self._cache.move_to_end(lora_id)
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        parts: dict[LayerKey, list[tuple[torch.Tensor, torch.Tensor] | None]] = {
            key: [None] * len(method.slices) for key, method in self.layers.items()}
        for (layer, module), weights in adapter.modules.items():
            fused, part = TARGET_MODULES[module]
            parts[(layer, fused)][part] = (weights.a, weights.b)
        for key, method in self.layers.items():
            method.set_slot(slot, parts[key])
        self.num_slot_writes += 1
