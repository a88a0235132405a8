"""Admission (Scheduler.add_request's queue bound): max_queued_requests counts the waiting requests beyond the
free running seats, not len(waiting); and the servers' bounded default (engine.config, engine.entrypoints.args)."""

from __future__ import annotations

import argparse

import pytest

from common.errors import QueueFullError
from engine.config import EngineConfig, default_max_queued_requests
from engine.core.finish_reason import FinishReason
from engine.core.request import Request, RequestStatus, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.entrypoints.args import add_engine_args, config_from_args

EOS = 2


def make_scheduler(num_blocks: int = 512, **config: object) -> Scheduler:
    return Scheduler(EngineConfig(**config), num_blocks, eos_token_ids={EOS}, max_model_len=4096)  # type: ignore[arg-type]


def make_request(request_id: str, **params: object) -> Request:
    params.setdefault("ignore_eos", True)
    params.setdefault("max_tokens", 8)
    return Request(request_id, [100, 101, 102, 103], SamplingParams(**params))  # type: ignore[arg-type]


def burst(sched: Scheduler, count: int, prefix: str = "r") -> tuple[list[str], list[str]]:
    """Add ``count`` requests before any step; (accepted ids, refused ids)."""
    accepted, refused = [], []
    for i in range(count):
        rid = f"{prefix}{i}"
        try:
            sched.add_request(make_request(rid))
        except QueueFullError:
            refused.append(rid)
        else:
            accepted.append(rid)
    return accepted, refused


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_from_output(out, {seq_id: [7] for s in out.scheduled for seq_id in s.sample_seq_ids})


def test_a_burst_on_an_idle_engine_fills_the_seats_then_the_queue() -> None:
    # The case: 64 seats and 16 queue places, 100 requests before any step: 80 in, the last 20 out.
    sched = make_scheduler(max_num_seqs=64, max_queued_requests=16)
    accepted, refused = burst(sched, 100)
    assert accepted == [f"r{i}" for i in range(80)] and refused == [f"r{i}" for i in range(80, 100)]
    assert sched.num_waiting == 80 and sched.num_running == 0
    assert all(sched.get_request(rid) is None for rid in refused)   # a refused request leaves nothing behind


def test_after_a_step_the_seated_are_running_and_the_queue_is_still_full() -> None:
    sched = make_scheduler(max_num_seqs=64, max_queued_requests=16)
    burst(sched, 80)
    step(sched)
    assert sched.num_running == 64 and sched.num_waiting == 16 and sched.num_free_seats == 0
    with pytest.raises(QueueFullError) as err:
        sched.add_request(make_request("late"))
    assert str(err.value) == ("the request queue is full: 16 requests wait for 0 free seats (max_num_seqs=64) and "
                              "at most 16 may wait beyond them (max_queued_requests=16)")
    assert sched.num_waiting == 16 and sched.get_request("late") is None


def test_a_finished_request_frees_a_seat_for_one_more() -> None:
    sched = make_scheduler(max_num_seqs=2, max_queued_requests=1)
    short = make_request("short", max_tokens=1)
    sched.add_request(short)
    assert burst(sched, 3) == (["r0", "r1"], ["r2"])   # short + r0 seated, r1 waits beyond them
    step(sched)   # short ends with its one token; r0 runs; r1 still waits for the next step's admission
    assert short.status is RequestStatus.FINISHED and short.finish_reason is FinishReason.LENGTH
    assert sched.num_running == 1 and sched.num_waiting == 1 and sched.num_free_seats == 1
    sched.add_request(make_request("r3"))   # r1 takes the free seat, r3 is the one waiting beyond
    with pytest.raises(QueueFullError):
        sched.add_request(make_request("r4"))


def test_zero_means_no_waiting_beyond_the_seats() -> None:
    # Counting len(waiting), 0 refused every request; now it admits what the free seats can take.
    sched = make_scheduler(max_num_seqs=3, max_queued_requests=0)
    assert burst(sched, 5) == (["r0", "r1", "r2"], ["r3", "r4"])


def test_forks_past_the_seats_leave_none_free() -> None:
    # n = 4 is one sequence until its first sample, then 4 running on 2 seats: no seat free until they end.
    sched = make_scheduler(max_num_seqs=2, max_queued_requests=1)
    sched.add_request(make_request("wide", n=4, max_tokens=4))
    step(sched)
    assert sched.num_running == 4 and sched.num_free_seats == 0
    assert [s.seq_id for s in sched.running] == [SequenceId("wide", i) for i in range(4)]
    assert burst(sched, 2) == (["r0"], ["r1"])


def test_none_is_unbounded() -> None:
    sched = make_scheduler(max_num_seqs=1, max_queued_requests=None)
    accepted, refused = burst(sched, 1000)
    assert len(accepted) == 1000 and refused == []


# ----- the servers' default -----------------------------------------------------------------------------


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_the_servers_default_is_four_batches_and_at_least_256() -> None:
    assert default_max_queued_requests(128) == 512 and default_max_queued_requests(4) == 256
    assert parse().max_queued_requests == 512   # the default 128 seats
    assert parse("--max-num-seqs", "100").max_queued_requests == 400
    assert parse("--max-num-seqs", "8").max_queued_requests == 256


@pytest.mark.parametrize("flag, bound", [("16", 16), ("0", 0), ("unbounded", None), ("Unbounded", None)])
def test_the_flag_overrides_it(flag: str, bound: int | None) -> None:
    assert parse("--max-num-seqs", "64", "--max-queued-requests", flag).max_queued_requests == bound


@pytest.mark.parametrize("flag", ["-1", "none", "1.5"])
def test_a_bad_flag_is_refused_naming_it(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--max-queued-requests", flag)
    assert "--max-queued-requests" in capsys.readouterr().err


def test_the_config_object_stays_unbounded_for_the_offline_api() -> None:
    # LLM.generate adds a whole batch before stepping: a bound there would refuse its own batch.
    assert EngineConfig().max_queued_requests is None
