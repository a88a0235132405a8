"""A rank that dies mid-generation: the step raises WorkerFailedError within 2 s (never a hang on a collective)
and no rank is left behind; `sluice engine --tensor-parallel-size 2` ends every stream with an error, stops serving
and exits 1 for its supervisor to restart it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from common.procs import free_port, grpc_serving
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.executor.errors import WorkerFailedError
from engine.executor.multiproc import MultiprocExecutor
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.executor.checkpoints import alive, child_pids, write_checkpoint
from tests.procs import spawn, wait_until

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama"))


class _DiesBeforeJoining(MultiprocExecutor):
    def _start_workers(self, config_json: str, init_method: str) -> None:
        self._procs[1] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def test_a_rank_that_dies_before_joining_fails_start_up_at_once_and_a_replica_can_start_after(
        checkpoint: Path) -> None:
    config = EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=16, num_threads=1,
                          tensor_parallel_size=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        _DiesBeforeJoining(config)
    assert time.monotonic() - t0 < 2.0
    replica = MultiprocExecutor(config)   # the driver's half-made join does not get in the way
    try:
        assert replica.initialize_cache({2}) == 16
    finally:
        replica.shutdown()
    assert not alive(replica.worker_pids[0])


def test_a_killed_rank_fails_the_step_within_two_seconds_and_no_rank_is_left(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=128, num_threads=1, tensor_parallel_size=2,
              pipeline_parallel_size=2)
    ranks = llm.engine.executor.worker_pids   # type: ignore[attr-defined]
    assert len(ranks) == 3 and all(alive(pid) for pid in ranks)
    killed_at: list[float] = []

    def kill_when_running() -> None:
        wait_until(lambda: llm.engine.total_steps >= 3, 30, what="generation under way")
        killed_at.append(time.monotonic())
        os.kill(ranks[-1], signal.SIGKILL)   # rank 3: the last stage's second tensor rank, no peer of rank 0's

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    try:
        with pytest.raises(WorkerFailedError, match=rf"rank 3 \(pid {ranks[-1]}\) was killed by SIGKILL"):
            llm.generate([{"prompt_token_ids": [1, 2, 3, i]} for i in range(4)], LONG)
        assert killed_at and time.monotonic() - killed_at[0] < 2.0
    finally:
        killer.join()
    with pytest.raises(WorkerFailedError):   # the replica stays failed
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], LONG)
    llm.close()
    assert not [pid for pid in ranks if alive(pid)]


def test_the_engine_server_ends_its_streams_with_an_error_stops_serving_and_exits(checkpoint: Path,
                                                                                    tmp_path: Path) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = spawn(["-m", "engine", "--model", str(checkpoint), "--port", str(port), "--tensor-parallel-size", "2",
                  "--dtype", "float32", "--num-kv-blocks", "128", "--num-threads", "1", "--disable-log-stats"],
                 tmp_path / "engine.log")
    try:
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Engine"), 120, proc, "engine ready")
        (rank1,) = child_pids(proc.pid)
        stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(addr))
        streams = []
        for i in range(3):
            req = engine_pb2.EngineGenerateRequest(
                request_id=f"r{i}", sampling=common_pb2.SamplingParameters(temperature=0.0),
                stopping=engine_pb2.EngineStoppingCriteria(max_tokens=200, ignore_eos=True))
            req.prompt_token_ids.ids.extend([1, 2, 3, i])
            streams.append(stub.Generate(req, timeout=60))
        first = [next(s) for s in streams]   # every request is running
        assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in first)
        killed_at = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        for s in streams:
            last = list(s)[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert time.monotonic() - killed_at < 2.0
        wait_until(lambda: not grpc_serving(addr, "sluice.v1.Engine"), 2, what="health not SERVING")
        assert proc.wait(30) == 1
        assert not alive(rank1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "engine.log").read_text()
    assert "engine failed, exiting: rank 1" in log


class _Ended:
    def __init__(self, pid: int, code: int | None) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code


def test_the_rank_killed_by_a_signal_is_named_before_the_peers_that_exited_after_it() -> None:
    # One poll can find the killed rank and the peers whose collectives then failed (exit code 1) all ended: the
    # cause is the signal, whatever the ranks' order.
    executor = object.__new__(MultiprocExecutor)
    executor._procs = {1: _Ended(11, None), 2: _Ended(12, 1), 3: _Ended(13, -signal.SIGKILL)}  # noqa: SLF001
    assert executor._dead_worker() == ("rank 3 (pid 13) was killed by SIGKILL (also ended: rank 2 (pid 12) exited "  # noqa: SLF001
                                       "with code 1)")
    executor._procs = {1: _Ended(11, None), 2: _Ended(12, 1)}  # noqa: SLF001
    assert executor._dead_worker() == "rank 2 (pid 12) exited with code 1"  # noqa: SLF001
    executor._procs = {1: _Ended(11, None)}  # noqa: SLF001
    assert executor._dead_worker() is None  # noqa: SLF001
