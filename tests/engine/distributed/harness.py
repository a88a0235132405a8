"""Runs a function on the ranks of a tensor × pipeline parallel replica, each a real process, and returns each
rank's result.

Every rank is a new process (one thread for torch) that joins a gloo group on 127.0.0.1 at a free port
(``engine.distributed.init_parallel``) and calls ``fn(parallel, *args)``; ``fn`` must be importable by name (a
module-level function of a module that does not import transformers, which would cost every rank seconds).
Ranks fork from multiprocessing's fork server, a clean process (no torch thread pools yet) that imported torch,
the engine's model code and the first ``fn``'s module once, so a rank starts in milliseconds instead of seconds.
Results come back through a queue in rank order. A rank that raises fails the run with its traceback, a rank
that dies without a word fails it with its exit code, and a run past ``timeout_s`` is killed: never a hang on a
collective whose peer is gone.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, tp: int, pp: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
               results: Any) -> None:
    torch.set_num_threads(1)
    try:
        from engine.distributed import init_parallel

        parallel = init_parallel(rank, tp, pp, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
        results.put((rank, True, fn(parallel, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(fn: Callable[..., Any], tp: int, pp: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``fn(parallel, *args)`` on each of the ``tp * pp`` ranks; their results, by rank."""
    ctx = mp.get_context("forkserver")
    # Read when the server starts (the first run): what ranks import, so each forks with it already there.
    ctx.set_forkserver_preload(["torch", "engine.distributed", "engine.models", "engine.device", fn.__module__])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, tp, pp, port, fn, args, results), daemon=True)
             for rank in range(tp * pp)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(out))} gave no result in {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} exited with code {dead[0][1]} and no result") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == len(procs) else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(len(procs))]
