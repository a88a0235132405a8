"""The worker half of prefill/decode disaggregation on a consumer (decode) engine: each step's new pulls are read
from their producer through the transport on an I/O thread while the model runs other requests' steps, and the
pulls whose reads ended are reported (``{job id: blocks that arrived}``) in a later step's output. The scheduler
half is ``engine.core.disagg``.

A pull writes only into blocks its request holds, which no other request reads or writes until it is reported, so
the reads need no lock against the model. A cancelled pull (its request was aborted) is waited for before the step
goes on: its blocks may be handed to another request in that very step.

``SLUICE_KV_TRANSFER_FAULT=drop`` makes every pull fail, ``drop-while:<path>`` every pull started while ``path``
exists (fault-injection switches for tests: the requests are then computed here).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from engine.worker.kv_transfer import KVTransfer, LoadJob
from engine.worker.kv_transports import CacheLayout, KVTransport

logger = logging.getLogger(__name__)

# How long a step with nothing else to run waits for a pull before handing back (the core calls again).
_IDLE_WAIT_S = 0.05
FAULT_ENV = "SLUICE_KV_TRANSFER_FAULT"


class RemoteKVWorker:
    """Runs each step's pulls against this engine's cache tensors."""

    def __init__(self, kv_caches: list[torch.Tensor], transport: KVTransport) -> None:
        self.kv_caches = kv_caches
        self.transport = transport
        self.layout = CacheLayout.of(kv_caches)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self._pending: dict[int, Future[int]] = {}
        fault = os.environ.get(FAULT_ENV, "")
        self._drop = fault == "drop"
        self._drop_while = fault.removeprefix("drop-while:") if fault.startswith("drop-while:") else None

    def execute(self, transfer: KVTransfer) -> dict[int, int]:
        """One step's pulls; returns ``{job id: blocks that arrived}`` for the pulls that ended now."""
        for job_id in transfer.cancelled:
            future = self._pending.pop(job_id, None)
            if future is not None and not future.cancel():
                future.exception()   # running: wait, its blocks may go to another request this step
        for job in transfer.loads:
            self._pending[job.job_id] = self._io.submit(self._read, job)
        if self._pending and transfer.idle:
            wait_futures(list(self._pending.values()), timeout=_IDLE_WAIT_S, return_when="FIRST_COMPLETED")
        done: dict[int, int] = {}
        for job_id, future in list(self._pending.items()):
            if future.done():
                del self._pending[job_id]
                done[job_id] = future.result()
        return done

    def _read(self, job: LoadJob) -> int:
        source = job.source
        assert source is not None, "a pull names its producer"
        if self._drop or (self._drop_while is not None and os.path.exists(self._drop_while)):
            logger.warning("KV transfer: %s=drop: the pull of %d blocks fails", FAULT_ENV, len(job.blocks))
            return 0
        layout = CacheLayout.parse(source.layout)
        if layout is None or not layout.matches(self.layout):
            logger.warning("KV transfer: the producer's cache layout %r is not this engine's (%s); its blocks are "
                           "recomputed", source.layout, self.layout.text())
            return 0
        try:
            return self.transport.read(source.address, layout, [(remote, local) for local, remote, _ in job.blocks],
                                       self.kv_caches, source.deadline)
        except Exception:   # a transport's bug must not end the engine: the blocks are recomputed
            logger.exception("KV transfer: the pull from %s failed", source.address)
            return 0

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        self.transport.close()
