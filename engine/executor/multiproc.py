"""The ``mp`` executor, and the driver side it shares with ``ray``.

A replica is ``tensor_parallel_size × pipeline_parallel_size`` ranks. Rank 0, the driver, is this process: it holds
the requests, lays out each step and samples. The other ranks are processes started here (``mp``) or Ray actors
(``ray``), each running :func:`engine.executor.worker_main.run_worker`. Each step the driver broadcasts the step's
inputs (``engine.executor.message``) over the replica's gloo group, then every rank runs its part of it.

A rank that dies must not leave the driver blocked in a collective. gloo cannot abort an operation in flight, but
it fails every operation on a connection whose peer has gone ("Connection closed by peer"). So a monitor thread
polls the ranks (``_dead_worker``) and, on a death, kills the others (``_kill_workers``): every connection of the
driver's closes and the step in flight raises, which the executor turns into WorkerFailedError naming the rank.
The replica is unusable from then on (its ranks' collectives are out of step); the engine fails its requests and
exits for its supervisor to restart it.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.distributed import ParallelContext, init_parallel
from engine.executor.errors import WorkerFailedError
from engine.executor.message import encode_config, encode_init_cache, encode_shutdown, encode_step
from engine.executor.uniproc import UniprocExecutor
from engine.executor.worker_main import COLLECTIVE_TIMEOUT_S
from engine.models import check_parallel_sizes
from engine.models.loader import read_model_config
from engine.worker.model_runner import PreparedStep, RunnerOutput
from engine.worker.step_inputs import StepInputs
from engine.worker.worker import Worker

if TYPE_CHECKING:
    from engine.worker.structured_output import GrammarVocabulary

logger = logging.getLogger(__name__)

_POLL_S = 0.05          # how often the monitor looks at the ranks
_NAME_WAIT_S = 0.5      # how long a failed step waits for the monitor to name the rank that died
_STOP_WAIT_S = 5.0      # how long the ranks get to leave after Shutdown before they are killed


class DistributedExecutor(UniprocExecutor, ABC):
    """The driver of a replica whose other ranks a subclass starts (``_start_workers``), watches
    (``_dead_worker``), kills (``_kill_workers``) and reaps (``_stop_workers``)."""

    def __init__(self, config: EngineConfig) -> None:
        if torch.distributed.is_initialized():
            raise RuntimeError("this process already drives a tensor or pipeline parallel replica: close that "
                               "engine (LLM.close()) before starting another")
        self.config = config
        self.num_blocks = 0
        self.parallel: ParallelContext | None = None
        self._failure: str | None = None     # what killed the replica; set once
        self._lock = threading.Lock()
        self._closed = False
        self._started = False                # every rank joined and the driver's worker loaded
        self._watching = threading.Event()   # cleared: the monitor stops
        # A model that does not split over the ranks is refused before any rank starts (each would refuse it too,
        # racing the driver to report it).
        check_parallel_sizes(read_model_config(config.model_path), config.tensor_parallel_size,
                             config.pipeline_parallel_size, config.enable_expert_parallel)
        host = self._driver_host()
        with socket.socket() as s:   # a port free now, for the driver's store
            s.bind((host, 0))
            init_method = f"tcp://{host}:{s.getsockname()[1]}"
        try:
            self._start_workers(encode_config(config), init_method)
            self._watching.set()
            self._monitor = threading.Thread(target=self._watch, name="replica-monitor", daemon=True)
            self._monitor.start()
            self.parallel = self._join(init_method)
            self.worker = Worker(config, parallel=self.parallel)
            self._started = True
        except BaseException as e:
            self.shutdown()
            if self._failure is not None and not isinstance(e, WorkerFailedError):
                raise WorkerFailedError(self._failure) from e
            raise
        logger.info("replica of %d ranks (tensor parallel %d x pipeline parallel %d) joined",
                    config.world_size, config.tensor_parallel_size, config.pipeline_parallel_size)

    # -- what a subclass provides ---------------------------------------------------------------------------
    def _driver_host(self) -> str:
        """The address the other ranks reach the driver's store at."""
        return "127.0.0.1"

    @abstractmethod
    def _start_workers(self, config_json: str, init_method: str) -> None:
        """Start ranks 1 .. world_size - 1, each running ``run_worker(config_json, rank, init_method)``."""
        ...

    @abstractmethod
    def _dead_worker(self) -> str | None:
        """A description of the first rank found dead or ended (e.g. "rank 1 (pid 42) exited with code 1"), or
        None; never blocks."""
        ...

    @abstractmethod
    def _kill_workers(self) -> None:
        """Kill every rank still running, now (a rank died: the others may be blocked in a collective)."""
        ...

    @abstractmethod
    def _stop_workers(self) -> None:
        """After the Shutdown message (or ``_kill_workers``): wait a bounded time for the ranks to end, then
        kill those left, and release what started them."""
        ...

    # -- the driver ------------------------------------------------------------------------------------------
    def _join(self, init_method: str) -> ParallelContext:
        """Rank 0's ``init_parallel``, on a thread: a rank that dies before joining would leave it waiting for
        the rank in the store, so the wait gives up when the monitor finds a rank dead. The thread stays blocked
        (until its timeout), and torch.distributed has already counted the default group it was making: the
        count goes back to 0, as destroy_process_group leaves it, so that this process can start a replica
        again (the ranks name the group by that count)."""
        joined: list[ParallelContext | BaseException] = []

        def join() -> None:
            try:
                joined.append(init_parallel(0, self.config.tensor_parallel_size, self.config.pipeline_parallel_size,
                                            init_method, self.config.device, timeout_s=COLLECTIVE_TIMEOUT_S))
            except BaseException as e:  # handed to the caller's thread
                joined.append(e)

        thread = threading.Thread(target=join, name="replica-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive() and self._failure is not None:
                torch.distributed.distributed_c10d._world.group_count = 0
                raise WorkerFailedError(self._failure)
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def _watch(self) -> None:
        while self._watching.is_set():
            dead = self._dead_worker()
            if dead is not None:
                self._fail(dead)
                return
            time.sleep(_POLL_S)

    def _fail(self, what: str) -> None:
        """The replica has failed (the first call names why): the other ranks are killed."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = what
        logger.error("%s: stopping the replica", what)
        self._kill_workers()

    def _failed_step(self, error: BaseException) -> WorkerFailedError:
        """A step that raised mid-way leaves the ranks' collectives out of step: the replica has failed. Named by
        the rank that died when there is one (a collective fails as soon as a peer's connection closes, a little
        before the monitor's next look)."""
        deadline = time.monotonic() + _NAME_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(_POLL_S / 5)
            if (dead := self._dead_worker()) is not None:
                self._fail(dead)
        self._fail(f"a step failed on rank 0: {error!r}")
        assert self._failure is not None
        return WorkerFailedError(self._failure)

    @property
    def _world_size(self) -> int:
        return self.config.world_size

    def initialize_cache(self, eos_token_ids: set[int], grammar_vocabulary: GrammarVocabulary | None = None) -> int:
        """Sizes the KV cache here and sends its block count to every rank, which allocates its own."""
        parallel = self.parallel
        assert parallel is not None

        def publish(inputs: StepInputs) -> None:
            parallel.broadcast_bytes(encode_step(inputs))

        self.check_health()
        try:
            self.num_blocks = self.worker.num_kv_blocks()
            if self._world_size > 1:
                parallel.broadcast_bytes(encode_init_cache(self.num_blocks))
            self.worker.init_runner(self.num_blocks, eos_token_ids, grammar_vocabulary,
                                    publish=publish if self._world_size > 1 else None)
        except Exception as e:
            if self._world_size == 1:
                raise
            raise self._failed_step(e) from e
        return self.num_blocks

    def execute_prepared(self, prepared: PreparedStep) -> RunnerOutput:
        self.check_health()
        try:
            return super().execute_prepared(prepared)
        except Exception as e:
            if self._world_size == 1:   # nothing else is in the step: the engine goes on, as with uniproc
                raise
            raise self._failed_step(e) from e

    def check_health(self) -> None:
        """Raises WorkerFailedError once a rank has died or a step failed mid-way."""
        if self._failure is not None:
            raise WorkerFailedError(self._failure)

    def shutdown(self) -> None:
        """Shutdown to every rank (or a kill, when the replica has failed or never started), a bounded wait for
        them to end, then this process leaves the process group; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._watching.is_set():
            self._watching.clear()
            self._monitor.join()
        healthy = self._failure is None and self._started
        if healthy and self._world_size > 1:
            assert self.parallel is not None
            try:
                self.parallel.broadcast_bytes(encode_shutdown())
            except RuntimeError as e:   # a rank died meanwhile
                logger.warning("Shutdown did not reach every rank: %s", e)
                healthy = False
        if not healthy:
            self._kill_workers()
        self._stop_workers()
        if self.parallel is not None:
            torch.distributed.destroy_process_group()


class MultiprocExecutor(DistributedExecutor):
    """Ranks 1 and up as child processes (``python -m engine.executor.worker_main``, the config as JSON on stdin:
    nothing pickled). Each is in its own process group, so a terminal's Ctrl-C reaches only the engine, which
    stops them in order, and each watches the engine's pid, so none outlives an engine that was SIGKILLed."""

    def __init__(self, config: EngineConfig) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        if config.device == "cpu" and config.num_threads is None:
            # The ranks share this host's cores: each takes its share of them (as vLLM-CPU gives each rank its
            # own OpenMP threads), instead of every rank running as many threads as there are cores.
            cores = len(os.sched_getaffinity(0))
            config = config.with_changes(num_threads=max(1, cores // config.world_size))
        super().__init__(config)

    @property
    def worker_pids(self) -> list[int]:
        """The pids of ranks 1 and up, in rank order."""
        return [proc.pid for _, proc in sorted(self._procs.items())]

    def _start_workers(self, config_json: str, init_method: str) -> None:
        # The ranks import this very engine package, wherever the engine process found it.
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        for rank in range(1, self.config.world_size):
            proc = subprocess.Popen([sys.executable, "-m", "engine.executor.worker_main", "--rank", str(rank),
                                     "--init-method", init_method, "--parent-pid", str(os.getpid())],
                                    stdin=subprocess.PIPE, env=env, start_new_session=True)
            self._procs[rank] = proc
            assert proc.stdin is not None
            try:
                proc.stdin.write(config_json.encode())
                proc.stdin.close()
            except BrokenPipeError:   # it died at once: the monitor reports it
                pass
        logger.info("started ranks 1-%d: pids %s", self.config.world_size - 1, self.worker_pids)

    def _dead_worker(self) -> str | None:
        # A rank killed by a signal is named first: the ranks it was talking to fail their collectives and exit with
        # code 1 a moment later, and one poll may find them all ended.
        dead = [(rank, proc.pid, code) for rank, proc in sorted(self._procs.items())
                if (code := proc.poll()) is not None]
        if not dead:
            return None
        dead.sort(key=lambda d: (d[2] >= 0, d[0]))
        names = [f"rank {rank} (pid {pid}) " + (f"was killed by {signal.Signals(-code).name}" if code < 0
                                                 else f"exited with code {code}") for rank, pid, code in dead]
        return names[0] + (f" (also ended: {'; '.join(names[1:])})" if len(names) > 1 else "")

    def _kill_workers(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _stop_workers(self) -> None:
        deadline = time.monotonic() + _STOP_WAIT_S
        for rank, proc in sorted(self._procs.items()):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) did not leave within %.0f s: killed", rank, proc.pid, _STOP_WAIT_S)
                self._kill_workers()
                proc.wait()
