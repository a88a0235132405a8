"""Priority scheduling: a waiting request with a better priority takes the seat or the blocks of the worst
running one (preempted by recompute) when it cannot otherwise be admitted; equal priorities and fcfs never do.
Also the scheduler's side of prompt logprobs (no prefix hit while they are owed, reset on preemption)."""

from __future__ import annotations

import numpy as np

from engine.core.request import RequestStatus, SequenceId
from engine.core.scheduler import Scheduler
from tests.engine.core.test_scheduler import make_request, make_scheduler, plan, step


def test_a_better_priority_takes_the_seat_of_the_worst_running_request() -> None:
    sched = make_scheduler(max_num_seqs=2, scheduling_policy="priority", block_size=4)
    a, b = make_request("a", 8, priority=1), make_request("b", 8, priority=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 8), ("b", 0, 8)]
    sched.add_request(make_request("c", 4, priority=0))
    out, outputs = step(sched)
    # b's decode was scheduled before c was looked at: it is taken out of the step and its budget given back.
    assert out.preempted == [SequenceId("b")]
    assert plan(out) == [("a", 8, 1), ("c", 0, 4)] and out.num_batched_tokens == 5
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [7]), ("c", [7])]
    assert (b.status, b.block_ids, b.num_computed_tokens, b.output_token_ids) == (RequestStatus.PREEMPTED, [], 0, [7])
    assert sched.waiting == [b] and [r.request_id for r in sched.running] == ["c", "a"]
    assert sched.num_preemptions == 1
    assert sorted(run_all(sched)) == ["a", "b", "c"]
    assert sched.block_manager.num_free_blocks == 64


def test_a_better_priority_takes_the_blocks_of_the_worst_running_request() -> None:
    sched = make_scheduler(num_blocks=4, scheduling_policy="priority", block_size=4)
    a, b = make_request("a", 7, priority=1), make_request("b", 7, priority=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    sched.add_request(make_request("c", 4, priority=0))
    out, _ = step(sched)
    assert out.preempted == [SequenceId("b")]
    # b's prompt is a's: a prefix hit on a's first block would fit it again at once, but it waits a step.
    assert plan(out) == [("a", 7, 1), ("c", 0, 4)]
    assert b.block_ids == [] and sched.block_manager.num_free_blocks == 1
    assert sorted(run_all(sched)) == ["a", "b", "c"]
    assert sched.block_manager.num_free_blocks == 4


def test_equal_priorities_and_fcfs_never_preempt_for_a_waiting_request() -> None:
    for policy, priorities in (("priority", (1, 2, 2)), ("fcfs", (1, 2, 0))):
        sched = make_scheduler(max_num_seqs=2, scheduling_policy=policy, block_size=4)
        for rid, priority in zip("abc", priorities):
            sched.add_request(make_request(rid, 8, priority=priority))
        step(sched)
        out, _ = step(sched)
        assert out.preempted == [] and plan(out) == [("a", 8, 1), ("b", 8, 1)], policy
        assert [r.request_id for r in sched.waiting] == ["c"]


def test_owed_prompt_logprobs_skip_the_prefix_cache_and_restart_on_preemption() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, scheduling_policy="priority", max_num_seqs=1)
    sched.add_request(make_request("warm", 12, max_tokens=1))
    run_all(sched)
    asked = make_request("asked", 12, max_tokens=1, prompt_logprobs=2, priority=1)
    sched.add_request(asked)
    out, _ = step(sched)
    # No cached block taken; the chunk's positions predict prompt tokens 1..8 and the runner is told so.
    assert plan(out) == [("asked", 0, 8)] and out.scheduled[0].num_prompt_logprobs == 2
    assert out.num_prefix_hit_tokens == 0
    asked.add_prompt_logprobs((1, np.zeros(8, np.float32), np.zeros((8, 2), np.int64), np.zeros((8, 2), np.float32)))
    sched.add_request(make_request("urgent", 4, max_tokens=1, priority=0))
    out, outputs = step(sched)
    # asked's second chunk was scheduled, then given up for urgent's seat; its partial prompt logprobs go too.
    assert out.preempted == [SequenceId("asked")] and plan(out) == [("urgent", 0, 4)]
    assert asked.prompt_logprob_chunks == [] and [o.request_id for o in outputs] == ["urgent"]
    out, _ = step(sched)
    assert plan(out) == [("asked", 0, 8)] and out.scheduled[0].num_prompt_logprobs == 2
    # The prompt's last chunk: positions 8..10 predict tokens 9..11; position 11 predicts the first output.
    out, _ = step(sched)
    assert plan(out) == [("asked", 8, 4)] and out.scheduled[0].num_prompt_logprobs == 2
    # A request owing none takes the hit the asking one passed over.
    sched.add_request(make_request("plain", 12, max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("plain", 8, 4)] and out.num_prefix_hit_tokens == 8


def run_all(sched: Scheduler) -> list[str]:
    """Step until every request ended; the ids of those that ended, in order."""
    ended: list[str] = []
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return ended
        _, outputs = step(sched)
        ended += [o.request_id for o in outputs if o.request_finished]
    raise AssertionError("requests did not finish")
