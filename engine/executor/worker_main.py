"""A follower rank of a replica (ranks 1 and up; rank 0 is the driver, in the engine process).

``python -m engine.executor.worker_main --rank R --init-method URL --parent-pid PID`` with the engine's config
(``engine.executor.message.encode_config``) on stdin: what the ``mp`` executor starts. The ``ray`` executor's
actors call :func:`run_worker` directly. Either way the rank joins the replica's process group, loads its shard
or stage, allocates the KV cache the driver sized, then runs every step the driver broadcasts until Shutdown.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import torch

from common.logs import configure_logging
from engine.distributed import init_parallel
from engine.executor.message import InitCache, decode, decode_config
from engine.worker.step_inputs import StepInputs
from engine.worker.worker import Worker

logger = logging.getLogger(__name__)

# Followers wait in a broadcast for the next step however long the engine idles, and gloo fails an operation
# after its group's timeout: the groups' is a year. A rank that dies is found by the driver's monitor (and its
# peers' connections close), not by a timeout.
COLLECTIVE_TIMEOUT_S = 365 * 24 * 3600.0
_PARENT_POLL_S = 0.2


def run_worker(config_json: str, rank: int, init_method: str) -> None:
    """Runs rank ``rank`` until the driver's Shutdown; raises on any failure (the replica is then unusable)."""
    config = decode_config(config_json)
    parallel = init_parallel(rank, config.tensor_parallel_size, config.pipeline_parallel_size, init_method,
                             config.device, timeout_s=COLLECTIVE_TIMEOUT_S)
    worker = Worker(config, parallel=parallel)
    first = decode(parallel.broadcast_bytes(None))
    if first is not None:   # None: shut down before the cache was sized
        if not isinstance(first, InitCache):
            raise RuntimeError(f"rank {rank}: the driver's first message must size the KV cache, got a step")
        stage = worker.init_stage(first.num_blocks)
        logger.info("rank %d ready: layers %d-%d, %d KV blocks", rank, worker.model.start_layer,
                    worker.model.end_layer - 1, first.num_blocks)
        while (message := decode(parallel.broadcast_bytes(None))) is not None:
            if not isinstance(message, StepInputs):
                raise RuntimeError(f"rank {rank}: the KV cache was sized twice")
            stage.follow(message)
    torch.distributed.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """End this process (exit 1) once the engine that started it is gone, even SIGKILLed: a watch on the parent
    pid, which, unlike PR_SET_PDEATHSIG, does not depend on which of the engine's threads started us."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.executor.worker_main", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="tcp://host:port of the driver's store")
    parser.add_argument("--parent-pid", type=int, required=True, help="the engine's pid: exit when it is gone")
    args = parser.parse_args(argv)
    _exit_with_parent(args.parent_pid)
    configure_logging("info", "text", f"engine-rank{args.rank}")
    code = 0
    try:
        run_worker(sys.stdin.read(), args.rank, args.init_method)
    except BaseException:
        logger.exception("rank %d failed", args.rank)
        code = 1
    # Not sys.exit: tearing torch down at interpreter exit takes seconds, and with a broken process group its
    # destructors can block or abort.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
