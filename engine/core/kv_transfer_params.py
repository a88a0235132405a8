"""A request's part in prefill/decode disaggregation, as the engine core sees it (the wire's
``KVTransferParams``; converted at the servicer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteKV:
    """To a producer: ``do_remote_decode`` (compute the prompt and the first token, then hold the blocks). From a
    producer, and to a consumer: where the prompt's full blocks are held (``remote_*``), their prefix-cache hashes,
    for how long (``hold_s`` from when it was sent) and the producer's cache layout
    (``engine.worker.kv_transports.CacheLayout.text``)."""

    do_remote_decode: bool = False
    remote_engine_id: str = ""
    transport: str = ""
    remote_address: str = ""
    remote_block_ids: tuple[int, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    hold_s: float = 0.0
    layout: str = ""

    @property
    def has_source(self) -> bool:
        """It names blocks to pull (a consumer's request)."""
        return bool(self.transport)
