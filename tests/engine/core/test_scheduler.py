"""Scheduler: exact tokens per step, chunked prefill, prefix hits, preemption, policies, stops, fork, abort."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from common.errors import InvalidRequestError, QueueFullError
from engine.config import EngineConfig
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request, RequestStatus, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput

EOS = 2


def make_scheduler(num_blocks: int = 64, *, max_model_len: int = 4096, **config: object) -> Scheduler:
    return Scheduler(EngineConfig(**config), num_blocks, eos_token_ids={EOS}, max_model_len=max_model_len)  # type: ignore[arg-type]


def make_request(request_id: str, prompt: list[int] | int, *, priority: int = 0, arrival: float | None = None,
                 **params: object) -> Request:
    tokens = prompt if isinstance(prompt, list) else [100 + i for i in range(prompt)]
    params.setdefault("ignore_eos", True)
    return Request(request_id, tokens, SamplingParams(**params), priority=priority,  # type: ignore[arg-type]
                   arrival_time=arrival)


def step(sched: Scheduler, sample: Callable[[Request], int] = lambda r: 7,
         ) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """Schedule, let a fake runner sample ``sample(request) + i`` for the i-th sequence it samples for, and
    apply it."""
    out = sched.schedule()
    sampled = {seq_id: [sample(s.request) + i] for s in out.scheduled for i, seq_id in enumerate(s.sample_seq_ids)}
    return out, sched.update_from_output(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def run_to_end(sched: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens
        _, outputs = step(sched)
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


def test_chunked_prefill_splits_a_long_prompt_by_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    r = make_request("r", 150, max_tokens=3)
    sched.add_request(r)
    got = []
    while sched.has_unfinished_requests():
        out, outputs = step(sched)
        got.append((plan(out), [s.sample for s in out.scheduled], [o.new_token_ids for o in outputs]))
    assert got == [
        ([("r", 0, 64)], [False], []),
        ([("r", 64, 64)], [False], []),
        ([("r", 128, 22)], [True], [[7]]),
        ([("r", 150, 1)], [True], [[7]]),
        ([("r", 151, 1)], [True], [[7]]),
    ]
    assert r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [7, 7, 7]
    assert sched.num_prompt_tokens == 150 and sched.num_generation_tokens == 3
    assert sched.block_manager.num_free_blocks == 64


def test_budget_is_shared_and_decodes_come_first() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, scheduling_policy="priority")
    sched.add_request(make_request("low", 3, priority=1, max_tokens=10))
    out, _ = step(sched)
    assert plan(out) == [("low", 0, 3)]
    sched.add_request(make_request("high", 40, priority=0, max_tokens=2))
    out, _ = step(sched)
    assert plan(out) == [("low", 3, 1), ("high", 0, 15)]
    # "high" now runs ahead of "low", yet the decode is listed before the prefill chunk.
    assert [r.request_id for r in sched.running] == ["high", "low"]
    out, _ = step(sched)
    assert plan(out) == [("low", 4, 1), ("high", 15, 15)]
    assert out.num_batched_tokens == 16
    out, _ = step(sched)
    assert plan(out) == [("low", 5, 1), ("high", 30, 10)]
    assert [s.is_decode for s in out.scheduled] == [True, False]


def test_shared_512_token_prefix_is_served_from_cache() -> None:
    sched = make_scheduler(256, block_size=16, max_num_batched_tokens=2048)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 30000) for _ in range(512)]
    sched.add_request(make_request("first", prefix + [rng.randrange(100, 30000) for _ in range(20)], max_tokens=6))
    run_to_end(sched)
    second = make_request("second", prefix + [rng.randrange(100, 30000) for _ in range(23)], max_tokens=6)
    sched.add_request(second)
    out, _ = step(sched)
    assert plan(out) == [("second", 512, 23)]
    assert second.num_cached_tokens == 512 and out.num_prefix_hit_tokens == 512
    computed = 23
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        computed += out.num_scheduled_tokens[SequenceId("second")]
    assert computed == 23 + (6 - 1)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (532 + 535, 512)


def test_preemption_puts_the_victim_first_in_line_and_all_finish() -> None:
    # 6 blocks of 4 tokens; two 8-token prompts growing to 18 tokens cannot both fit.
    sched = make_scheduler(6, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 8, max_tokens=10), make_request("b", 8, max_tokens=10)
    c = make_request("c", 4, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 8), ("b", 0, 8)] and [r.request_id for r in sched.waiting] == ["c"]
    for _ in range(4):   # 9..12 tokens: three blocks each
        out, _ = step(sched)
        assert out.preempted == []
    assert (a.block_ids, b.block_ids) == ([0, 1, 4], [2, 3, 5])
    out, _ = step(sched)   # "a" needs a fourth block: "b", the most recently admitted, is preempted
    assert out.preempted == [SequenceId("b")] and plan(out) == [("a", 12, 1)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.output_token_ids == [7] * 5   # outputs are kept and recomputed on resume
    # b's freed blocks were cached; the LRU tail block went to "a".
    assert a.block_ids == [0, 1, 4, 5]
    tokens = run_to_end(sched)
    assert a.finish_reason is b.finish_reason is c.finish_reason is FinishReason.LENGTH
    assert len(a.output_token_ids) == len(b.output_token_ids) == 10 and len(tokens["b"]) == 5
    assert sched.block_manager.num_free_blocks == 6
    sched.block_manager.check_invariants([])


def test_resume_after_preemption_recomputes_prompt_and_outputs() -> None:
    sched = make_scheduler(6, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    a, b = make_request("a", 8, max_tokens=10), make_request("b", 8, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    preempted_at = None
    resumed = None
    for i in range(40):
        out, _ = step(sched)
        if out.preempted and preempted_at is None:
            preempted_at = i
        if preempted_at is not None and SequenceId("b") in out.num_scheduled_tokens and resumed is None:
            resumed = plan(out)
        if not sched.has_unfinished_requests():
            break
    assert preempted_at == 5
    # "b" had 8 prompt + 5 output tokens; with no cache it recomputes all 13 in one prefill.
    assert resumed == [("b", 0, 13)]
    assert b.output_token_ids == [7] * 10


@pytest.mark.parametrize(("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])])
def test_scheduling_policy_order(policy: str, order: list[str]) -> None:
    sched = make_scheduler(scheduling_policy=policy, max_num_seqs=1)
    for i, (rid, prio) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0)]):
        sched.add_request(make_request(rid, 4, priority=prio, arrival=float(i), max_tokens=1))
    admitted = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        admitted += [rid for rid, start, _ in plan(out) if start == 0]
    assert admitted == order


def test_queue_full_raises_and_queues_nothing() -> None:
    # 2 seats and 2 queue places: the queue counts only what waits beyond the free seats.
    sched = make_scheduler(max_num_seqs=2, max_queued_requests=2)
    for rid in "abcd":
        sched.add_request(make_request(rid, 4))
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("e", 4))
    assert sched.num_waiting == 4 and sched.get_request("e") is None
    step(sched)   # a and b take the seats; c and d still wait beyond them: still full
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("e", 4))
    sched.abort_request("a")   # a seat frees: room again
    sched.add_request(make_request("e", 4))
    assert sched.num_waiting == 3 and sched.num_running == 1


@pytest.mark.parametrize("prompt", [[], [5] * 33, [5] * 20])
def test_bad_prompts_name_the_prompt(prompt: list[int]) -> None:
    # max_model_len 32; the cache holds 2 blocks of 8 = 16 tokens.
    sched = make_scheduler(2, block_size=8, max_model_len=32)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(make_request("r", prompt))
    assert err.value.field == "prompt"
    assert not sched.has_unfinished_requests() and sched.requests == {}
    sched.add_request(make_request("ok", [5] * 16))   # the whole cache is allowed


def test_abort_waiting_request_is_never_scheduled() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 4, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    assert sched.abort_request("b") == [b]
    assert b.finish_reason is FinishReason.ABORT and b.is_finished
    assert sched.abort_request("b") == [] and sched.abort_request("nope") == []
    seen = set()
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        seen |= set(out.num_scheduled_tokens)
    assert seen == {SequenceId("a")}


def test_abort_running_request_frees_blocks_at_once() -> None:
    sched = make_scheduler(16, block_size=4)
    r = make_request("r", 10, max_tokens=5)
    sched.add_request(r)
    step(sched)
    assert r.block_ids == [0, 1, 2] and sched.block_manager.num_free_blocks == 13
    assert sched.abort_request("r") == [r]
    assert r.block_ids == [] and sched.block_manager.num_free_blocks == 16
    assert r.finish_reason is FinishReason.ABORT and not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == [SequenceId("r")]


def test_abort_between_schedule_and_update_is_skipped() -> None:
    sched = make_scheduler(16, block_size=4)
    sched.add_request(make_request("r", 10, max_tokens=5))
    out = sched.schedule()
    sched.abort_request("r")
    assert sched.update_from_output(out, {SequenceId("r"): [7]}) == []
    sched.block_manager.check_invariants([])


def test_stop_conditions() -> None:
    sched = make_scheduler(max_model_len=12)
    reqs = {
        "eos": make_request("eos", 4, ignore_eos=False, max_tokens=5),
        "min": make_request("min", 4, ignore_eos=False, min_tokens=2, max_tokens=5),
        "ignore": make_request("ignore", 4, max_tokens=3),
        "stop": make_request("stop", 4, stop_token_ids=[9], max_tokens=5),
        "len": make_request("len", 10, max_tokens=None),
    }
    for r in reqs.values():
        sched.add_request(r)
    script = {"eos": [EOS], "min": [EOS, EOS], "ignore": [EOS, EOS, EOS], "stop": [3, 9], "len": [3, 3]}
    pos = {rid: 0 for rid in script}

    def sample(r: Request) -> int:
        pos[r.request_id] += 1
        return script[r.request_id][pos[r.request_id] - 1]

    while sched.has_unfinished_requests():
        step(sched, sample)
    assert {rid: (r.finish_reason, r.output_token_ids) for rid, r in reqs.items()} == {
        "eos": (FinishReason.EOS, [EOS]),
        "min": (FinishReason.EOS, [EOS, EOS]),
        "ignore": (FinishReason.LENGTH, [EOS, EOS, EOS]),
        "stop": (FinishReason.STOP, [3, 9]),
        "len": (FinishReason.LENGTH, [3, 3]),   # 10 + 2 = max_model_len
    }


def test_request_reaching_cache_capacity_finishes_with_length() -> None:
    sched = make_scheduler(2, block_size=4)   # 8 tokens of KV
    r = make_request("r", 6, max_tokens=None)
    sched.add_request(r)
    run_to_end(sched)
    # 9 tokens could never be computed: it stops once it holds more than the cache.
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 9
    assert sched.block_manager.num_free_blocks == 2


def test_n_greater_than_one_forks_children_with_copy_on_write() -> None:
    sched = make_scheduler(16, block_size=4)
    parent = make_request("p", 6, n=3, seed=5, max_tokens=3)
    sched.add_request(parent)
    out = sched.schedule()
    assert [(s.sample, s.num_samples) for s in out.scheduled] == [(True, 3)]
    assert out.scheduled[0].sample_seq_ids == [SequenceId("p", 0), SequenceId("p", 1), SequenceId("p", 2)]
    lps = [(-0.1, {10: -0.1}), (-0.2, {11: -0.2}), (-0.3, {12: -0.3})]
    outputs = sched.update_from_output(out, {SequenceId("p", i): [10 + i] for i in range(3)},
                                       {SequenceId("p", i): [lps[i]] for i in range(3)})
    assert [(o.request_id, o.index, o.new_token_ids, o.new_logprobs, o.request_finished) for o in outputs] == [
        ("p", 0, [10], [lps[0]], False), ("p", 1, [11], [lps[1]], False), ("p", 2, [12], [lps[2]], False)]
    kids = [sched.get_request("p", 1), sched.get_request("p", 2)]
    assert [(k.request_id, k.index, k.sampling_params.n, k.sampling_params.seed) for k in kids] == [
        ("p", 1, 1, 6), ("p", 2, 1, 7)]
    assert parent.sequences == [parent, *kids] and all(k.sequences is parent.sequences for k in kids)
    assert parent.sampling_params.n == 1 and parent.sampling_params.seed == 5
    assert [k.block_ids for k in kids] == [[0, 1], [0, 1]]
    assert sched.block_manager.ref_count(1) == 3
    sched.block_manager.check_invariants(sched.requests.values())

    out = sched.schedule()
    # Each writes position 6 of the shared block 1: the first two get copies, the last writes in place.
    assert [(s.request.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        (SequenceId("p", 0), 6, 1), (SequenceId("p", 1), 6, 1), (SequenceId("p", 2), 6, 1)]
    assert out.block_copies == [(1, 2), (1, 3)]
    assert [r.block_ids for r in (parent, *kids)] == [[0, 2], [0, 3], [0, 1]]
    assert [s.num_samples for s in out.scheduled] == [1, 1, 1]
    sched.update_from_output(out, {SequenceId("p", i): [20 + i] for i in range(3)})
    assert [r.output_token_ids for r in (parent, *kids)] == [[10, 20], [11, 21], [12, 22]]
    assert [r.seq_id for r in sched.abort_request("p")] == [SequenceId("p", i) for i in range(3)]
    assert [r.ends_request for r in (parent, *kids)] == [False, False, True]   # the last one ended it
    assert sched.requests == {}
    assert sched.block_manager.num_free_blocks == 16
    sched.block_manager.check_invariants([])


def _drain(sched: Scheduler, sample: Callable[[Request], int] = lambda r: 7) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        outputs += step(sched, sample)[1]
    return outputs


def test_aborting_one_sequence_keeps_its_siblings_and_frees_its_blocks() -> None:
    sched = make_scheduler(16, block_size=4)
    parent = make_request("p", 6, n=3, max_tokens=5)
    sched.add_request(parent)
    step(sched)   # the fork
    step(sched)   # each writes position 6 of the shared block: two copies, one in place
    child = sched.get_request("p", 1)
    assert child is not None and child.block_ids == [0, 3]
    free = sched.block_manager.num_free_blocks
    assert sched.abort_request("p", 1) == [child]
    assert child.finish_reason is FinishReason.ABORT and child.block_ids == [] and not child.ends_request
    assert sched.block_manager.num_free_blocks == free + 1   # its copy; the shared block 0 stays held
    assert sched.abort_request("p", 1) == [] and sched.abort_request("p", 7) == []
    sched.block_manager.check_invariants(s for s in parent.sequences if not s.is_finished)
    outputs = _drain(sched)
    # The siblings run to their end; the core says once, on the last output, that the request is done.
    assert {o.index for o in outputs} == {0, 2}
    assert [(o.index, o.finish_reason) for o in outputs if o.finished] == [(0, FinishReason.LENGTH),
                                                                           (2, FinishReason.LENGTH)]
    assert [o.request_finished for o in outputs].count(True) == 1 and outputs[-1].request_finished
    assert [len(s.output_token_ids) for s in parent.sequences] == [5, 2, 5]
    assert sched.requests == {} and sched.block_manager.num_free_blocks == 16
    sched.block_manager.check_invariants([])


def test_a_sequence_aborted_before_the_fork_ends_at_it() -> None:
    sched = make_scheduler(16, block_size=4)
    parent = make_request("p", 6, n=3, max_tokens=2)
    sched.add_request(parent)
    assert sched.abort_request("p", 2) == [] and sched.abort_request("p", 3) == []   # not made yet; no such index
    out, outputs = step(sched)
    assert out.scheduled[0].num_samples == 3
    assert [(o.index, o.new_token_ids, o.finish_reason) for o in outputs] == [
        (0, [7], None), (1, [8], None), (2, [], FinishReason.ABORT)]
    assert sched.get_request("p", 2).block_ids == [] and parent.aborted_before_fork == set()
    outputs = _drain(sched)
    assert [(o.index, o.finish_reason, o.request_finished) for o in outputs] == [
        (0, FinishReason.LENGTH, False), (1, FinishReason.LENGTH, True)]
    assert sched.block_manager.num_free_blocks == 16
    # Every sequence aborted before the fork: the request ends at once, never forked.
    sched.add_request(make_request("q", 6, n=2, max_tokens=2))
    q = sched.get_request("q")
    assert sched.abort_request("q", 0) == [] and sched.abort_request("q", 1) == [q]
    assert q.ends_request and sched.requests == {} and not sched.has_unfinished_requests()


def test_a_request_id_stays_in_use_until_every_sequence_ended() -> None:
    sched = make_scheduler(16, block_size=4)
    sched.add_request(make_request("p", 6, n=2, max_tokens=3, ignore_eos=False))
    step(sched, lambda r: EOS if r.index == 0 else 7)   # sequence 0 ends at once, sequence 1 goes on
    assert sched.get_request("p").is_finished and not sched.get_request("p", 1).is_finished
    with pytest.raises(InvalidRequestError, match="request_id"):
        sched.add_request(make_request("p", 4))   # its fork would clash with the running sequence 1
    outputs = _drain(sched)
    assert [(o.index, o.request_finished) for o in outputs] == [(1, False), (1, True)]
    sched.add_request(make_request("p", 4))


def test_missing_sample_is_an_error() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", 4))
    out = sched.schedule()
    with pytest.raises(ValueError, match="'r'"):
        sched.update_from_output(out, {})


# ----- stream interval ---------------------------------------------------------------

def _reports(sched: Scheduler, request_id: str, max_steps: int = 100,
             sample: Callable[[Request], int] = lambda r: 10 + r.num_output_tokens,
             ) -> list[tuple[list[int], FinishReason | None]]:
    """(tokens, finish reason) of each output of ``request_id``, step by step; [] for a step that held back."""
    seen: list[tuple[list[int], FinishReason | None]] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return seen
        _, outputs = step(sched, sample)
        mine = [o for o in outputs if o.request_id == request_id]
        assert len(mine) <= 1
        seen.append((mine[0].new_token_ids, mine[0].finish_reason) if mine else ([], None))
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize(("engine_interval", "request_interval"), [(1, 3), (3, None), (3, 2)])
def test_stream_interval_reports_the_first_token_then_groups_then_the_rest(
        engine_interval: int, request_interval: int | None) -> None:
    sched = make_scheduler(stream_interval=engine_interval)
    sched.add_request(make_request("r", 4, max_tokens=8, stream_interval=request_interval))
    assert _reports(sched, "r") == [
        ([10], None), ([], None), ([], None), ([11, 12, 13], None), ([], None), ([], None), ([14, 15, 16], None),
        ([17], FinishReason.LENGTH)]


def test_a_request_interval_raises_the_engine_interval_never_lowers_it() -> None:
    sched = make_scheduler(stream_interval=2)
    sched.add_request(make_request("r", 4, max_tokens=6, stream_interval=4))
    assert [t for t, _ in _reports(sched, "r") if t] == [[10], [11, 12, 13, 14], [15]]
    sched = make_scheduler(stream_interval=4)
    sched.add_request(make_request("r", 4, max_tokens=6, stream_interval=2))
    assert [t for t, _ in _reports(sched, "r") if t] == [[10], [11, 12, 13, 14], [15]]


def test_stream_interval_flushes_held_tokens_and_logprobs_when_a_stop_token_ends_the_request() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", 4, max_tokens=50, stream_interval=4, ignore_eos=False, logprobs=0))
    script = [30, 31, 32, 33, 34, 35, EOS, 99]
    outputs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        due = [s.request for s in out.scheduled if s.sample]
        sampled = {r.seq_id: [script[r.num_output_tokens]] for r in due}
        lps = {r.seq_id: [(-0.5 - r.num_output_tokens, {script[r.num_output_tokens]: -0.5})] for r in due}
        outputs += sched.update_from_output(out, sampled, lps)
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [
        ([30], None), ([31, 32, 33, 34], None), ([35, EOS], FinishReason.EOS)]
    assert [lp for o in outputs for lp, _ in o.new_logprobs or []] == [-0.5, -1.5, -2.5, -3.5, -4.5, -5.5, -6.5]
    assert sched.block_manager.num_free_blocks == 64


def test_forked_children_under_a_stream_interval_report_their_first_token_at_once() -> None:
    sched = make_scheduler(16, block_size=4)
    sched.add_request(make_request("p", 6, n=2, max_tokens=4, stream_interval=2))
    tokens: dict[SequenceId, list[list[int]]] = {}
    while sched.has_unfinished_requests():
        for o in step(sched, lambda r: 10 * (r.index + 1) + r.num_output_tokens)[1]:
            tokens.setdefault(o.seq_id, []).append(o.new_token_ids)
    # The fork's step samples 10 and 11 (parent, child); each then streams its own groups.
    assert tokens == {SequenceId("p", 0): [[10], [11, 12], [13]], SequenceId("p", 1): [[11], [21, 22], [23]]}


def test_stream_interval_must_be_positive() -> None:
    with pytest.raises(InvalidRequestError, match="stream_interval"):
        EngineConfig(stream_interval=0)
    with pytest.raises(InvalidRequestError, match="stream_interval"):
        SamplingParams(stream_interval=0)
