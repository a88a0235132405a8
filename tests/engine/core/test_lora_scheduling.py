"""LoRA in the core: the scheduler's --max-loras rule (exact admitted sets per step), and the EngineCore's adapter
lifecycle (loaded once per id, refused when LoRA is off, freed when its last request ends) over a fake executor
that records what the core asks of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig, LoRAConfig
from engine.core import engine_core
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.lora_request import LoRARequest
from engine.core.request import Request, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.worker.model_runner import RunnerOutput

EOS = 2
A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("ABC", start=1))


def make_scheduler(max_loras: int = 2, **config: Any) -> Scheduler:
    config.setdefault("lora_config", LoRAConfig(max_loras=max_loras, max_cpu_loras=4))
    return Scheduler(EngineConfig(**config), 256, eos_token_ids={EOS}, max_model_len=1024)


def make_request(rid: str, lora: LoRARequest | None, max_tokens: int = 4, **kw: Any) -> Request:
    return Request(rid, [10 + len(rid)] * 6, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lora_request=lora, **kw)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, {seq_id: [7] for s in out.scheduled for seq_id in s.sample_seq_ids})
    return out


def scheduled(out: SchedulerOutput) -> list[str]:
    return sorted(s.request.request_id for s in out.scheduled)


# -- the scheduler's rule -------------------------------------------------------------------------------------
def test_a_request_whose_adapter_is_one_too_many_is_skipped_not_blocking_those_behind_it() -> None:
    sched = make_scheduler(max_loras=2)
    # a1 and a2 end with their first token, which frees adapter A's place for C.
    for r in (make_request("a1", A, 1), make_request("b1", B), make_request("c1", C), make_request("base1", None),
              make_request("a2", A, 1), make_request("c2", C)):
        sched.add_request(r)
    assert scheduled(step(sched)) == ["a1", "a2", "b1", "base1"]
    # The skipped keep their places, ahead of a request that arrives now.
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]
    sched.add_request(make_request("a3", A))
    assert [r.request_id for r in sched.waiting] == ["c1", "c2", "a3"]
    # A's requests ended: C joins B; A is now the one too many.
    assert scheduled(step(sched)) == ["b1", "base1", "c1", "c2"]
    assert [r.request_id for r in sched.waiting] == ["a3"]
    assert {r.lora_id for r in sched.running} == {2, 3, None}


def test_base_requests_never_count_against_max_loras() -> None:
    sched = make_scheduler(max_loras=1)
    for r in (make_request("a", A), make_request("base1", None), make_request("b", B), make_request("base2", None),
              make_request("a2", A)):
        sched.add_request(r)
    assert scheduled(step(sched)) == ["a", "a2", "base1", "base2"]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_every_step_stays_within_max_loras_until_all_finish() -> None:
    sched = make_scheduler(max_loras=2, max_num_seqs=4)
    loras = [A, B, C, None]
    for i in range(12):
        sched.add_request(make_request(f"r{i}", loras[i % 4], max_tokens=1 + i % 3))
    steps = 0
    while sched.has_unfinished_requests():
        out = step(sched)
        assert len({s.request.lora_id for s in out.scheduled} - {None}) <= 2
        assert len({r.lora_id for r in sched.running} - {None}) <= 2
        steps += 1
        assert steps < 100
    assert sched.block_manager.num_free_blocks == 256


def test_without_lora_config_adapters_are_not_limited() -> None:
    sched = make_scheduler(lora_config=None)
    for r in (make_request("a", A), make_request("b", B), make_request("c", C)):
        sched.add_request(r)
    assert scheduled(step(sched)) == ["a", "b", "c"]


def test_priority_policy_skips_and_restores_queue_order() -> None:
    sched = make_scheduler(max_loras=1, scheduling_policy="priority")
    for r in (make_request("a", A, priority=1), make_request("b", B, priority=0), make_request("c", C, priority=2),
              make_request("a2", A, priority=3)):
        sched.add_request(r)
    assert scheduled(step(sched)) == ["b"]
    assert [r.request_id for r in sched.waiting] == ["a", "c", "a2"]


# -- the EngineCore's adapter lifecycle ---------------------------------------------------------------------------
class FakeExecutor:
    """Samples token 7 for every sequence; records the adapters the core loads and frees."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_config = SimpleNamespace(vocab_size=128, eos_token_ids=(EOS,), max_position_embeddings=1024,
                                            bos_token_id=1, sliding_window=None, image_token_id=None)
        self.device_name, self.dtype_name, self.kv_cache_dtype_name = "cpu", "float32", "float32"
        self.last_prepare_s = 0.0
        self.kv_source = None   # not a prefill engine
        self.added: list[int] = []
        self.removed: list[int] = []
        self.refuse: dict[str, InvalidRequestError] = {}   # lora_path -> what add_lora raises
        self.steps: list[list[int | None]] = []   # the adapter of each scheduled sequence, per step

    def initialize_cache(self, eos_token_ids: set[int], grammar_vocabulary: object = None) -> int:
        return 64

    def add_lora(self, lora: LoRARequest) -> None:
        if lora.lora_path in self.refuse:
            raise self.refuse[lora.lora_path]
        self.added.append(lora.lora_int_id)

    def remove_lora(self, lora_id: int) -> None:
        self.removed.append(lora_id)

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append([s.request.lora_id for s in sched.scheduled])
        return RunnerOutput(sampled={seq_id: [7] for s in sched.scheduled for seq_id in s.sample_seq_ids})

    def release(self, seq_ids: list[SequenceId]) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    monkeypatch.setattr(engine_core, "make_executor", FakeExecutor)
    return EngineCore(EngineConfig(block_size=4, lora_config=LoRAConfig(max_loras=2)))


def fake(core: EngineCore) -> FakeExecutor:
    assert isinstance(core.executor, FakeExecutor)
    return core.executor


def add(core: EngineCore, rid: str, lora: LoRARequest | None, max_tokens: int = 3, n: int = 1) -> None:
    core.add_request(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
                     lora_request=lora)


def drain(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def test_lora_requests_are_refused_when_lora_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_core, "make_executor", FakeExecutor)
    core = EngineCore(EngineConfig())
    with pytest.raises(InvalidRequestError) as e:
        add(core, "r", A)
    assert (e.value.field, e.value.message) == ("lora_request",
                                                "LoRA is not enabled: start the engine with --enable-lora "
                                                "(offline: LLM(..., enable_lora=True))")
    with pytest.raises(InvalidRequestError):
        core.add_lora(A)
    assert fake(core).added == [] and not core.has_unfinished_requests()


def test_an_adapter_is_loaded_once_per_id_and_a_refusal_queues_nothing(core: EngineCore) -> None:
    add(core, "a1", A)
    add(core, "a2", A)
    add(core, "base", None)
    assert fake(core).added == [1]
    assert core.add_lora(A) is False and core.add_lora(B) is True and fake(core).added == [1, 2]
    bad = LoRARequest("bad", 9, "/adapters/missing")
    fake(core).refuse[bad.lora_path] = InvalidRequestError("lora_path", "/adapters/missing: no adapter_config.json")
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        add(core, "bad", bad)
    assert core.scheduler.get_request("bad") is None and core.scheduler.num_waiting == 3
    assert core.list_loras() == {1, 2}
    drain(core)
    assert fake(core).steps[0] == [1, 1, None]


def test_an_id_given_to_another_folder_is_refused_even_after_its_removal(core: EngineCore) -> None:
    core.add_lora(A)
    other = LoRARequest("other", A.lora_int_id, "/adapters/other")
    message = ("lora_int_id 1 already names the adapter at '/adapters/A', not '/adapters/other': give each adapter "
               "its own lora_int_id")
    with pytest.raises(InvalidRequestError) as e:
        add(core, "r", other)
    assert (e.value.field, e.value.message) == ("lora_request", message)
    core.remove_lora(1)
    # Its prefix-cache blocks outlive it: the id can never mean other weights.
    with pytest.raises(InvalidRequestError):
        core.add_lora(other)
    # The same folder under another name is the same adapter.
    assert core.add_lora(LoRARequest("A-again", 1, "/adapters/A")) is True


def test_removal_of_an_unused_adapter_is_immediate_and_unknown_ids_are_ignored(core: EngineCore) -> None:
    core.add_lora(A)
    assert core.remove_lora(1) is True and fake(core).removed == [1] and core.list_loras() == set()
    assert core.remove_lora(1) is False and core.remove_lora(42) is False and fake(core).removed == [1]


def test_removal_waits_for_the_adapters_last_request_to_finish(core: EngineCore) -> None:
    add(core, "short", A, max_tokens=1)
    add(core, "long", A, max_tokens=3)
    add(core, "b", B, max_tokens=1)
    assert core.remove_lora(1) is True
    assert fake(core).removed == [] and core.list_loras() == {1, 2}
    core.step()   # short and b end
    assert fake(core).removed == []
    core.step()
    assert fake(core).removed == []
    outputs = core.step()   # long's third token ends it
    assert [o.request_id for o in outputs if o.request_finished] == ["long"]
    assert fake(core).removed == [1] and core.list_loras() == {2}


def test_removal_waits_for_every_sequence_and_follows_aborts(core: EngineCore) -> None:
    add(core, "pair", A, max_tokens=5, n=2)
    core.step()   # the fork: two sequences of one request
    core.remove_lora(1)
    core.abort_requests([SequenceId("pair", 0)])
    assert fake(core).removed == []   # sequence 1 still runs with it
    core.abort_requests(["pair"], reason=FinishReason.ERROR)   # how a failed step ends requests
    assert fake(core).removed == [1]
    drain(core)


def test_a_new_request_keeps_an_adapter_whose_removal_was_waiting(core: EngineCore) -> None:
    add(core, "first", A, max_tokens=2)
    core.remove_lora(1)
    add(core, "second", A, max_tokens=4)
    drain(core)
    assert fake(core).removed == [] and fake(core).added == [1] and core.list_loras() == {1}
    assert core.remove_lora(1) is True and fake(core).removed == [1]


def test_a_refused_request_is_not_counted_as_a_user(core: EngineCore) -> None:
    add(core, "r", A, max_tokens=1)
    with pytest.raises(InvalidRequestError, match="already running"):
        add(core, "r", A)
    drain(core)
    core.remove_lora(1)
    assert fake(core).removed == [1]
