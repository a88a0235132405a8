"""The worker's LoRA manager: the host LRU cache, the max_loras device slots, each step's token -> slot mask."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import LoRAConfig
from engine.core.lora_request import LoRARequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest
from engine.models import CausalLM, load_model
from engine.models.layers.lora import LoRALinearMethod
from engine.worker.lora_manager import LoRAManager
from tests.lora_factory import make_tiny_model, save_adapter, save_tiny_model

R = 8   # max_lora_rank


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    save_tiny_model(root / "model", "llama")
    base = make_tiny_model("llama")
    save_adapter(base, root / "qv", r=4, targets=("q_proj", "v_proj"), seed=3)
    save_adapter(base, root / "all", r=8, seed=4)
    save_adapter(base, root / "mlp", r=8, targets=("up_proj", "down_proj"), seed=5)
    return {"model": root / "model", "1": root / "qv", "2": root / "all", "3": root / "mlp"}


def _manager(paths: dict[str, Path], max_loras: int = 2, max_cpu_loras: int | None = 2) -> LoRAManager:
    model = load_model(str(paths["model"]), torch.float32)
    config = LoRAConfig(max_loras=max_loras, max_lora_rank=R, max_cpu_loras=max_cpu_loras)
    return LoRAManager(model, config, torch.float32, torch.device("cpu"))


def _lora(paths: dict[str, Path], lora_id: int) -> LoRARequest:
    return LoRARequest(f"a{lora_id}", lora_id, str(paths[str(lora_id)]))


def _qkv(manager: LoRAManager, layer: int = 0) -> LoRALinearMethod:
    return manager.layers[(layer, "self_attn.qkv_proj")]


def _slot_rows(method: LoRALinearMethod, slot: int) -> slice:
    """The rows of ``a`` and ``bt`` that hold ``slot`` (every slice)."""
    return slice(slot * method.width, (slot + 1) * method.width)


def _mask(manager: LoRAManager, width: int = R) -> torch.Tensor | None:
    plan = manager.state.plan
    return None if plan is None else plan.mask(width, torch.float32)


def _slot_mask(token_slots: list[int], num_slots: int, width: int) -> torch.Tensor:
    expected = torch.zeros(len(token_slots), num_slots * width)
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            expected[row, slot * width:(slot + 1) * width] = 1
    return expected


def test_host_cache_is_lru_and_idempotent(paths: dict[str, Path]) -> None:
    manager = _manager(paths)
    manager.add_lora(_lora(paths, 1))
    manager.add_lora(_lora(paths, 2))
    manager.add_lora(_lora(paths, 1))          # already there: only refreshed
    assert (manager.cached_ids, manager.num_loads) == ([2, 1], 2)
    manager.add_lora(_lora(paths, 3))          # full (max_cpu_loras 2): the least recently used goes
    assert (manager.cached_ids, manager.num_loads) == ([1, 3], 3)
    assert manager.slots == [None, None] and manager.num_slot_writes == 0   # loading touches no slot


def test_step_mask_follows_the_flat_token_layout(paths: dict[str, Path]) -> None:
    manager = _manager(paths)
    a1, a2 = _lora(paths, 1), _lora(paths, 2)
    rows = [(a2, 1), (None, 1), (a1, 3), (None, 2), (a2, 2)]   # tokens: 1 + 1 + 3 + 2 + 2
    manager.activate(rows)
    assert manager.slots == [2, 1]
    slots = [0, -1, 1, 1, 1, -1, -1, 0, 0]
    assert manager.state.plan is not None and manager.state.plan.segments == ()
    assert torch.equal(_mask(manager), _slot_mask(slots, 2, R))
    assert torch.equal(_mask(manager, 3 * R), _slot_mask(slots, 2, 3 * R))   # a slot's 3 slices side by side
    manager.activate([(None, 4)])
    assert manager.state.plan is None


def test_long_chunks_run_alone_with_their_own_slot(paths: dict[str, Path]) -> None:
    manager = _manager(paths)
    a1, a2 = _lora(paths, 1), _lora(paths, 2)
    # Two decodes (masked), then a 20-token prefill chunk of a2, a base chunk, a short chunk of a1 after them.
    manager.activate([(a1, 1), (None, 1), (a2, 20), (None, 16), (a1, 3)])
    plan = manager.state.plan
    assert manager.slots == [1, 2] and plan is not None
    assert plan.token_slot.tolist() == [0, -1] and plan.num_slots == 1
    assert plan.segments == ((2, 22, 1), (38, 41, 0))
    manager.activate([(None, 1), (a2, 16)])       # no adapter among the masked rows: nothing masked
    plan = manager.state.plan
    assert plan is not None and plan.dense_rows == 0 and plan.segments == ((1, 17, 1),)


def test_prepare_step_reads_each_scheduled_request(paths: dict[str, Path]) -> None:
    manager = _manager(paths)
    params = SamplingParams(max_tokens=4)
    a = Request("a", [5, 6, 7], params, lora_request=_lora(paths, 3))
    b = Request("b", [5, 6], params)
    manager.prepare_step([ScheduledRequest.of(b, 2), ScheduledRequest.of(a, 3)])
    assert manager.slots == [3, None] and torch.equal(_mask(manager), _slot_mask([-1, -1, 0, 0, 0], 1, R))


def test_slot_holds_the_adapter_weights_per_slice(paths: dict[str, Path]) -> None:
    manager = _manager(paths)
    manager.activate([(_lora(paths, 1), 1)])      # rank 4 on q and v: slot 0
    adapter = manager._cache[1]
    qkv = _qkv(manager, 1)
    q_rows, k_rows, v_rows = (qkv._rows(0, part) for part in range(3))
    q, v = adapter.modules[(1, "q_proj")], adapter.modules[(1, "v_proj")]
    assert torch.equal(qkv.a[q_rows][:4], q.a) and not qkv.a[q_rows][4:].any()   # rank 4 of R = 8
    assert torch.equal(qkv.bt[q_rows][:4, :64], q.b.t())
    assert torch.equal(qkv.bt[v_rows][:4, 96:], v.b.t()) and torch.equal(qkv.a[v_rows][:4], v.a)
    assert not qkv.a[k_rows].any() and not qkv.bt[k_rows].any()                 # k not targeted
    assert not qkv.bt[q_rows][:, 64:].any() and not qkv.bt[v_rows][:, :96].any()  # block-diagonal
    assert not qkv.a[_slot_rows(qkv, 1)].any()                                    # slot 1 empty
    assert not manager.layers[(1, "mlp.gate_up_proj")].a.any()                    # not targeted anywhere


def test_slots_are_reused_and_the_least_recently_used_is_replaced(paths: dict[str, Path]) -> None:
    manager = _manager(paths, max_cpu_loras=3)
    a1, a2, a3 = (_lora(paths, i) for i in (1, 2, 3))
    manager.activate([(a1, 1), (a2, 1)])
    assert (manager.slots, manager.num_slot_writes) == ([1, 2], 2)
    manager.activate([(a2, 1)])
    manager.activate([(a1, 1), (None, 1)])         # resident: no copy
    assert (manager.slots, manager.num_slot_writes) == ([1, 2], 2)
    manager.activate([(a3, 1)])                    # a2's slot was used least recently
    assert (manager.slots, manager.num_slot_writes) == ([1, 3], 3)
    manager.activate([(a2, 1), (a3, 1)])           # a3 is in this step: a1's slot goes, though a3's is older
    assert (manager.slots, manager.num_slot_writes) == ([2, 3], 4)
    fresh = _manager(paths)
    fresh.activate([(a2, 1)])                      # a2 alone in slot 0: a1's weights left nothing behind
    for key, method in manager.layers.items():
        rows = _slot_rows(method, 0)
        assert torch.equal(method.a[rows], fresh.layers[key].a[rows])
        assert torch.equal(method.bt[rows], fresh.layers[key].bt[rows])


def test_evicted_adapter_is_reloaded_from_its_path_keeping_the_steps_own(paths: dict[str, Path]) -> None:
    manager = _manager(paths, max_loras=2, max_cpu_loras=2)
    a1, a2, a3 = (_lora(paths, i) for i in (1, 2, 3))
    for lora in (a1, a3, a2):
        manager.add_lora(lora)
    assert manager.cached_ids == [3, 2] and manager.num_loads == 3
    # a1 was evicted: this step reads it again. The cache's least recently used (a3) is in the step: a2 goes.
    manager.activate([(a1, 1), (a3, 1)])
    assert manager.num_loads == 4 and manager.cached_ids == [1, 3]
    assert manager.slots == [1, 3]
    assert torch.equal(_mask(manager), _slot_mask([0, 1], 2, R))


def test_remove_lora_drops_cache_and_zeroes_its_slot(paths: dict[str, Path]) -> None:
    manager = _manager(paths)
    a1, a2 = _lora(paths, 1), _lora(paths, 2)
    manager.activate([(a1, 1), (a2, 1)])
    manager.remove_lora(2)
    assert manager.slots == [1, None] and manager.cached_ids == [1]
    for method in manager.layers.values():
        assert not method.a[_slot_rows(method, 1)].any()
        assert not method.bt[_slot_rows(method, 1)].any()
    assert _qkv(manager).a[_slot_rows(_qkv(manager), 0)].any()   # the other adapter stays
    manager.remove_lora(99)                                          # unknown: ignored
    manager.activate([(a2, 1)])                                      # asked again: read again into a free slot
    assert manager.slots == [1, 2] and manager.num_loads == 3


def test_a_step_over_max_loras_is_a_scheduler_bug(paths: dict[str, Path]) -> None:
    manager = _manager(paths, max_cpu_loras=3)
    with pytest.raises(RuntimeError, match="a step uses 3 LoRA adapters, more than --max-loras 2"):
        manager.activate([(_lora(paths, i), 1) for i in (1, 2, 3)])


def test_base_only_steps_leave_every_layer_output_untouched(paths: dict[str, Path]) -> None:
    model: CausalLM = load_model(str(paths["model"]), torch.float32)
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=R), torch.float32, torch.device("cpu"))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    qkv = model.layers[0].self_attn.qkv_proj
    plain = qkv(x)                                 # no step set yet: the base method alone
    manager.activate([(_lora(paths, 2), 3), (None, 2)])
    with_lora = qkv(x)
    assert not torch.equal(with_lora[:3], plain[:3])
    assert torch.equal(with_lora[3:], plain[3:])   # base rows: the delta is an exact zero
    manager.activate([(None, 5)])
    assert torch.equal(qkv(x), plain)
