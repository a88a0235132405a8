"""The handoff benchmark measures what it claims: correctness of both paths, not timings."""

from __future__ import annotations

import pytest

from benchmarks.handoff import HandoffRun, HandoffSettings, Sample, make_prompts, markdown, run_handoff, summarize


def test_both_paths_deliver_the_same_ids_to_the_engine_as_an_integer_array() -> None:
    settings = HandoffSettings(sizes=(1024, 3000), repeat=2, warmup=1)
    prompts = make_prompts(settings)
    run = run_handoff(settings, keep_ids=True)

    # Every request reached the engine, through the path its mode names (run_client checks the oneof),
    # as the array the engine core keeps: the int32 copy out of the ring, or protobuf's uint32 field.
    expected = {f"{mode}-{size}-{rep}" for mode in ("inline", "shm") for size in (1024, 3000) for rep in range(3)}
    assert set(run.arrivals) == expected
    for rid, arrival in run.arrivals.items():
        size = int(rid.split("-")[1])
        assert arrival.ids == prompts[size], rid
        assert arrival.form == ("ndarray[int32]" if rid.startswith("shm") else "ndarray[uint32]"), rid
    # Warm-up repetitions are left out of the samples; each timing is positive and ordered.
    assert sorted((s.mode, s.size) for s in run.samples) == sorted(
        (m, n) for m in ("inline", "shm") for n in (1024, 3000) for _ in range(2))
    for s in run.samples:
        assert 0 < s.send_to_engine_us < s.round_trip_us


def test_prompts_are_deterministic_ids_in_the_vocabulary() -> None:
    settings = HandoffSettings(sizes=(5, 2000), vocab_size=7, seed=3)
    a, b = make_prompts(settings), make_prompts(settings)
    assert a == b
    assert [len(a[5]), len(a[2000])] == [5, 2000]
    assert set(a[2000]) == set(range(7)) and all(type(t) is int for t in a[2000])


def test_summary_and_table_from_known_samples() -> None:
    settings = HandoffSettings(sizes=(1024,))
    run = HandoffRun(samples=[Sample("inline", 1024, v, v + 100) for v in (100.0, 300.0, 200.0)]
                     + [Sample("shm", 1024, v, v + 100) for v in (40.0, 50.0, 60.0)])
    [row] = summarize(run, settings)
    assert row["inline.send_to_engine_us.p50"] == 200.0
    assert row["inline.send_to_engine_us.p90"] == pytest.approx(280.0)   # numpy's linear interpolation
    assert row["shm.send_to_engine_us.p50"] == 50.0
    assert row["ratio.send_to_engine_us"] == pytest.approx(4.0)
    assert row["ratio.round_trip_us"] == pytest.approx(300.0 / 150.0)
    assert markdown([row]).splitlines()[2] == "| 1024 | 200 / 280 | 50 / 58 | 4.00× | 300 | 150 | 2.00× |"


def test_token_id_prompts_reach_the_engine_through_both_paths() -> None:
    settings = HandoffSettings(sizes=(2000,), repeat=1, warmup=0, token_ids=True)
    prompts = make_prompts(settings)
    run = run_handoff(settings, keep_ids=True)
    assert {rid: a.form for rid, a in run.arrivals.items()} == {
        "inline-2000-0": "ndarray[uint32]", "shm-2000-0": "ndarray[int32]",
        "inline.ids-2000-0": "ndarray[uint32]", "shm.ids-2000-0": "ndarray[int32]"}
    assert all(a.ids == prompts[2000] for a in run.arrivals.values())
    [row] = summarize(run, settings)
    assert row["ratio_ids.send_to_engine_us"] > 0
    table = markdown([row])
    assert "Prompts given as token ids" in table and table.count("| 2000 |") == 2
