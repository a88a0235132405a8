"""A preempted request is not preempted again before it makes progress (engine.core.admission.PreemptionGuard):
the victim choice, and a scheduler where two decodes grow past the free blocks while a long prompt is prefilled."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.admission import PreemptionGuard
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

EOS = 2


def make_request(request_id: str, num_prompt: int, *, priority: int = 0, **params: object) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(request_id, [100 + i for i in range(num_prompt)], SamplingParams(**params),  # type: ignore[arg-type]
                   priority=priority)


def test_protection_lasts_until_a_token_is_sampled_since_the_preemption() -> None:
    guard = PreemptionGuard()
    r = make_request("r", 10, max_tokens=8)
    r.append_output_token(5)
    assert not guard.is_protected(r)
    guard.mark(r)
    assert guard.is_protected(r)
    r.num_computed_tokens = 11   # the recomputed prefill alone is no progress
    assert guard.is_protected(r)
    r.append_output_token(6)
    assert not guard.is_protected(r) and not guard.is_protected(r)


def test_a_pending_token_at_preemption_is_not_progress() -> None:
    """Async scheduling: the token of the step in flight when it was preempted is appended after it."""
    guard = PreemptionGuard()
    r = make_request("r", 10, max_tokens=8)
    r.num_pending = 1
    guard.mark(r)
    r.num_pending = 0
    r.append_output_token(5)
    assert guard.is_protected(r)
    r.append_output_token(6)
    assert not guard.is_protected(r)


def test_the_victim_is_the_last_unprotected_candidate() -> None:
    guard = PreemptionGuard()
    a, b, c, d = (make_request(x, 4) for x in "abcd")
    units = [[a], [b], [c], [d]]
    assert guard.victim_index(units, 1, can_wait=True) == 3   # unprotected: the tail, as without protection
    guard.mark(d)
    assert guard.victim_index(units, 1, can_wait=True) == 2
    guard.mark(c)
    assert guard.victim_index(units, 1, can_wait=True) == 1   # the requester itself
    guard.mark(b)
    assert guard.victim_index(units, 1, can_wait=True) is None   # it waits: the others run
    assert guard.victim_index(units, 1, can_wait=False) == 3   # nothing else runs: the choice without protection
    assert guard.victim_index(units, 0, can_wait=True) == 0    # a (unprotected) gives way to the protected


def test_priority_preemption_passes_over_a_protected_request() -> None:
    guard = PreemptionGuard()
    good, mid, bad = make_request("good", 4, priority=0), make_request("mid", 4, priority=5), \
        make_request("bad", 4, priority=9)
    running = [good, mid, bad]   # best first
    assert guard.priority_victim(running, 1) is bad
    guard.mark(bad)
    assert guard.priority_victim(running, 1) is mid
    guard.mark(mid)
    assert guard.priority_victim(running, 1) is None
    assert guard.priority_victim([good], 0) is None   # equal priorities never preempt each other


def run_long_prompt_beside_growing_decodes(protect: bool) -> tuple[list[tuple[int, list[str]]], int, int]:
    """9 blocks of 16 tokens, a 32-token budget, no prefix caching: "a" and "b" (15-token prompts) decode 60 tokens
    each, and "L" (100-token prompt) is prefilled in chunks beside them. Returns the preemptions of each step, and
    L's preemptions when its first token came, and in all."""
    sched = Scheduler(EngineConfig(max_num_batched_tokens=32, enable_prefix_caching=False), 9, eos_token_ids={EOS},
                      max_model_len=4096)
    if not protect:
        sched.preemption_guard.is_protected = lambda request: False   # type: ignore[method-assign]
    sched.add_request(make_request("a", 15, max_tokens=60))
    sched.add_request(make_request("b", 15, max_tokens=60))
    sched.add_request(make_request("L", 100, max_tokens=4))
    long = sched.get_request("L")
    assert long is not None
    events: list[tuple[int, list[str]]] = []
    at_first_token = None
    for i in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        outputs = sched.update_from_output(out, {seq_id: [7] for s in out.scheduled for seq_id in s.sample_seq_ids})
        if out.preempted:
            events.append((i, [p.request_id for p in out.preempted]))
        if at_first_token is None and any(o.request_id == "L" and o.new_token_ids for o in outputs):
            at_first_token = long.num_preemptions
    else:
        raise AssertionError("the requests did not finish")
    assert at_first_token is not None and long.is_finished and long.num_output_tokens == 4
    assert sched.block_manager.num_free_blocks == 9
    return events, at_first_token, long.num_preemptions


def test_a_long_prompt_preempted_once_is_not_preempted_again_before_its_first_token() -> None:
    events, at_first_token, total = run_long_prompt_beside_growing_decodes(protect=True)
    assert events[0] == (3, ["L"])   # "a" needed a block: L, admitted last, was the victim
    assert at_first_token == 1
    later = [victims for _, victims in events[1:]]
    assert later and all("L" not in v for v in later)   # the decodes gave way to it instead
    assert total == 1


def test_without_the_rule_the_same_prompt_is_preempted_again_and_again() -> None:
    """The scenario above discriminates: without protection L is the victim each time it is re-admitted."""
    events, at_first_token, _ = run_long_prompt_beside_growing_decodes(protect=False)
    assert at_first_token > 5
    assert [v for _, v in events[:5]] == [["L"]] * 5
