"""The shared-memory ring: cross-process handoff, slot allocation, and clean failures."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.shm import ShmOpenError, ShmReader, ShmRef, ShmRefError, ShmRing


@pytest.fixture
def reader() -> Iterator[ShmReader]:
    with ShmReader() as r:
        yield r


def _ring(capacity: int) -> ShmRing:
    return ShmRing(capacity)


def _read_in_child(segment: str, size_bytes: int, refs: list[ShmRef], results: multiprocessing.Queue) -> None:
    with ShmReader() as r:
        r.register(segment, size_bytes)
        results.put([r.read(ref) for ref in refs])


def test_roundtrip_across_processes_1k_and_128k() -> None:
    rng = np.random.default_rng(0)
    short = rng.integers(0, 50_000, size=1024, dtype=np.int64)
    long = rng.integers(0, 150_000, size=128 * 1024, dtype=np.int64)
    with ShmRing(130 * 1024) as ring:
        refs = [ring.put(short), ring.put(long.tolist())]
        assert refs == [ShmRef(ring.name, 0, 1024, 0), ShmRef(ring.name, 1024, 128 * 1024, 1)]
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(ring.name, ring.size_bytes, refs, results))
        child.start()
        got = results.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert [a.dtype for a in got] == [np.int32, np.int32]
        assert np.array_equal(got[0], short) and np.array_equal(got[1], long)
        # The reader's exit must not unlink the writer's segment (resource_tracker pitfall).
        assert os.path.exists(f"/dev/shm/{ring.name}")
        assert ring.release(0) and ring.release(1)
        assert ring.put([7]) == ShmRef(ring.name, 0, 1, 2)


def test_segment_is_private_to_its_owner() -> None:
    with _ring(16) as ring:
        st_ = os.stat(f"/dev/shm/{ring.name}")
        assert st_.st_mode & 0o777 == 0o600
        assert st_.st_uid == os.getuid()
        assert st_.st_size == 64 == ring.size_bytes


def test_wraparound_reuses_the_start_once_the_tail_moves(reader: ShmReader) -> None:
    with _ring(10) as ring:
        reader.register(ring.name, ring.size_bytes)
        a, b = ring.put([1, 2, 3, 4]), ring.put([5, 6, 7, 8])
        assert (a.offset, b.offset) == (0, 4)
        assert ring.put([9, 9, 9]) is None          # 2 free at the end, none before the tail
        assert ring.release(a.slot)
        c = ring.put([10, 11, 12])                  # does not fit at the end: wraps to 0
        assert (c.offset, c.length, c.slot) == (0, 3, 2)
        assert ring.put([13, 14]) is None           # only [3, 4) is free now
        d = ring.put([13])
        assert (d.offset, d.length) == (3, 1)
        assert ring.put([1]) is None
        assert reader.read(b).tolist() == [5, 6, 7, 8]
        assert reader.read(c).tolist() == [10, 11, 12]
        assert reader.read(d).tolist() == [13]


def test_out_of_order_release_waits_for_older_slots() -> None:
    with _ring(9) as ring:
        a, b, c = ring.put([1, 1, 1]), ring.put([2, 2, 2]), ring.put([3, 3, 3])
        assert ring.release(b.slot)
        assert ring.num_live_slots == 3              # b is free but behind live a
        assert ring.put([4]) is None
        assert ring.release(a.slot)
        assert ring.num_live_slots == 1              # a and b reclaimed together
        e = ring.put([4, 4, 4, 4, 4, 4])
        assert (e.offset, e.length) == (0, 6)
        assert ring.release(c.slot) and ring.num_live_slots == 1
        assert ring.release(e.slot) and ring.num_live_slots == 0


def test_empty_ring_restarts_at_offset_zero() -> None:
    with _ring(8) as ring:
        a = ring.put([1] * 5)
        ring.release(a.slot)
        b = ring.put([2] * 8)                        # would not fit after offset 5
        assert (b.offset, b.length) == (0, 8)


def test_release_is_idempotent() -> None:
    with _ring(8) as ring:
        a = ring.put([1, 2])
        assert ring.release(a.slot) is True
        assert ring.release(a.slot) is False
        assert ring.release(12345) is False


def test_full_ring_returns_none() -> None:
    with _ring(8) as ring:
        assert ring.put(list(range(9))) is None
        assert ring.put([]) is None
        full = ring.put(list(range(8)))
        assert (full.offset, full.length, full.slot) == (0, 8, 0)
        assert ring.put([1]) is None


def test_put_rejects_ids_that_are_not_int32_token_ids() -> None:
    with _ring(8) as ring:
        for bad in ([-1], [2**31], [1.5], [[1, 2]], np.array([2**40], dtype=np.int64)):
            with pytest.raises(ValueError, match="ids"):
                ring.put(bad)  # type: ignore[arg-type]
        assert ring.num_live_slots == 0
        ref = ring.put(np.array([2**31 - 1, 0], dtype=np.uint64))
        with ShmReader() as r:
            r.register(ring.name, ring.size_bytes)
            assert r.read(ref).tolist() == [2**31 - 1, 0]


def test_ids_are_little_endian_int32_on_disk() -> None:
    with _ring(4) as ring:
        ring.put([1, 258])
        with open(f"/dev/shm/{ring.name}", "rb") as f:
            assert f.read(8) == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_close_unlinks_and_readers_keep_their_mapping(reader: ShmReader) -> None:
    ring = _ring(4)
    name = ring.name
    ref = ring.put([3, 1, 4])
    reader.register(name, ring.size_bytes)
    ring.close()
    ring.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert reader.read(ref).tolist() == [3, 1, 4]
    with pytest.raises(ValueError, match="closed"):
        ring.put([1])
    with pytest.raises(ShmOpenError, match=name):
        ShmReader().register(name, 16)


def test_register_nonexistent_segment_fails_cleanly(reader: ShmReader) -> None:
    with pytest.raises(ShmOpenError, match="sluice-does-not-exist"):
        reader.register("sluice-does-not-exist", 64)
    assert not reader.is_registered("sluice-does-not-exist")


@pytest.mark.parametrize("name", ["", "../etc/passwd", "a/b", ".hidden", "x" * 300])
def test_register_rejects_names_that_are_not_plain_segment_names(reader: ShmReader, name: str) -> None:
    with pytest.raises(ShmOpenError, match="invalid shared-memory segment name"):
        reader.register(name, 64)


def test_register_rejects_a_size_beyond_the_segment(reader: ShmReader) -> None:
    with _ring(4) as ring:
        with pytest.raises(ShmOpenError, match="fewer than"):
            reader.register(ring.name, ring.size_bytes + 4)
        with pytest.raises(ShmOpenError, match="multiple of 4"):
            reader.register(ring.name, 6)
        assert not reader.is_registered(ring.name)


@pytest.mark.parametrize(("offset", "length", "field"), [
    (10, 1, "offset"), (-1, 2, "offset"), (8, 3, "length"), (0, 11, "length"), (3, 0, "length"),
])
def test_out_of_bounds_refs_are_rejected(reader: ShmReader, offset: int, length: int, field: str) -> None:
    with _ring(10) as ring:
        reader.register(ring.name, ring.size_bytes)
        with pytest.raises(ShmRefError, match=f"^{field}: ") as err:
            reader.read(ShmRef(ring.name, offset, length, 0))
        assert err.value.field == field
        assert reader.read(ShmRef(ring.name, 8, 2, 0)).shape == (2,)   # the last two tokens are in bounds


def test_unregistered_segment_ref_is_rejected(reader: ShmReader) -> None:
    with pytest.raises(ShmRefError) as err:
        reader.read(ShmRef("sluice-never-registered", 0, 1, 0))
    assert err.value.field == "segment"
    assert reader.unregister("sluice-never-registered") is False


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(1, 12), st.integers(-8, -1)), max_size=40))
def test_live_slots_never_overlap(ops: list[int]) -> None:
    """Positive op: put that many ids; negative op: release the k-th oldest live slot."""
    with _ring(24) as ring, ShmReader() as r:
        r.register(ring.name, ring.size_bytes)
        live: list[tuple[ShmRef, list[int]]] = []
        for step, op in enumerate(ops):
            if op > 0:
                ids = [step * 100 + i for i in range(op)]
                ref = ring.put(ids)
                if ref is not None:
                    live.append((ref, ids))
            elif live:
                ref, _ = live.pop((-op - 1) % len(live))
                assert ring.release(ref.slot)
            for ref, ids in live:
                assert r.read(ref).tolist() == ids
        assert ring.num_live_slots >= len(live)
        for ref, _ in live:
            ring.release(ref.slot)
        assert ring.num_live_slots == 0
