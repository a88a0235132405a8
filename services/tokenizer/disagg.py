"""Prefill/decode disaggregation in the tokenizer service: a request's prompt runs on a prefill engine, the rest of
it on a decode engine that reads the prompt's KV blocks from the prefill engine instead of computing them again.

PD is on while the service's live generate engines include a prefill-capable one (GetInfo's ``kv_role``:
``kv_producer`` or ``kv_both``) and a different decode-capable one (``kv_consumer`` or ``kv_both``). Then:

* An eligible request (n = 1, no best_of above n, no beam search) goes to a prefill engine with
  ``kv_transfer.do_remote_decode``: that engine computes the prompt, samples the first token (passed on to the client
  at once) and holds the prompt's blocks; its last message says where they are (``kv_transfer``). The request then
  goes on from a decode engine other than it, resubmitted as request migration does (prompt + the
  first token, ``resumed_output_tokens`` 1, a new engine request id, no prompt_logprobs) with the prefill engine's
  ``kv_transfer`` copied unchanged: the decode engine pulls the blocks and continues exactly as one engine would
  have. Once the decode engine's first message came, or its request ended or failed, or the client went away, the
  prefill engine is told to let the blocks go (Abort of its request id). A first token that ends the request (EOS,
  a stop token, max_tokens 1) ends it on the prefill engine as any request ends.
* Other requests (n > 1, best_of, beam search: several candidates live on one engine) run whole on a
  decode-capable engine.
* Each engine of a role is chosen among those of that role as the service's ``--routing`` chooses among replicas
  (services/tokenizer/routing.py): by default the one whose prefix cache holds the longest prefix of the prompt,
  from the engines' KV events, unless their loads drift apart; by load where nothing is cached. A decode engine that
  has the prefix pulls only the blocks after it.
* Usage is the client's as on one engine: the prompt's tokens, and the cached tokens the prefill engine found.
* Faults: a prefill engine that dies before its handoff → the request is sent again, once, to another live prefill
  engine, else whole to a decode engine; a decode engine that dies → request migration moves the request (to
  decode-capable engines only; the new one computes the prompt itself). Both are moves of request migration: with
  ``--max-request-migrations 0`` the request fails with its engine's error instead.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from proto.sluice.v1 import engine_pb2
from services.tokenizer.engines import Engine
from services.tokenizer.migration import EngineCall, Resubmitter, _Leg
from services.tokenizer.routing import Decision, Router, RoutingSettings

if TYPE_CHECKING:
    from services.tokenizer.service import _Handoff

logger = logging.getLogger(__name__)

# How often a handed-off request waiting for a live decode engine looks again.
_POLL_S = 0.05


class Phase(enum.Enum):
    """Where a request is: computing its prompt on a prefill engine, going on from a decode engine after the
    handoff, or running whole on one engine."""

    PREFILL = "prefill"
    DECODE = "decode"
    WHOLE = "whole"


def eligible(request: engine_pb2.EngineGenerateRequest) -> bool:
    """Whether ``request`` may be split over two engines: one sequence, no candidates kept on the engine."""
    n = request.n or 1
    return n == 1 and request.best_of <= n and not request.HasField("beam_search")


class Disaggregation:
    """The service's PD routing: whether PD is on (from the engines' roles and liveness, at each request), and which
    engine of a role takes a request (``router``'s choice among them; None: the least loaded, ties in turn)."""

    def __init__(self, router: Router | None = None) -> None:
        self._router = router or Router(RoutingSettings("least_loaded"))

    def route(self, engines: Sequence[Engine], request: engine_pb2.EngineGenerateRequest,
              prompt_ids: Sequence[int] | np.ndarray) -> tuple[Engine, Decision] | None:
        """With PD on, the engine for ``request``, counted as one of its open requests from here (the caller takes
        one off when the request ends): a prefill engine, with ``do_remote_decode`` set on ``request``, when it is
        eligible; else a decode engine. None: PD is off."""
        live = [e for e in engines if e.up and (e.info is None or e.info.runner == "generate")]
        prefill = [e for e in live if e.can_prefill]
        decode = [e for e in live if e.can_decode]
        if not any(p is not d for p in prefill for d in decode):
            return None
        role = "prefill" if eligible(request) else "decode"
        if role == "prefill":
            request.kv_transfer.do_remote_decode = True
        engine, decision = self.pick(prefill if role == "prefill" else decode, prompt_ids, request)
        engine.open_requests += 1
        return engine, Decision(decision.choice, f"{role} by {decision.policy}", decision.matched_tokens)

    def pick(self, engines: Sequence[Engine], prompt_ids: Sequence[int] | np.ndarray,
             request: engine_pb2.EngineGenerateRequest) -> tuple[Engine, Decision]:
        """The engine of ``engines`` (at least one) for the prompt, and why. Its blocks are hashed only as far as
        some engine has them cached."""
        ids = prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else prompt_ids
        decision = self._router.choose(engines, ids, lora_name=request.lora_adapter or None,
                                       cache_salt=request.cache_salt or None)
        return engines[decision.choice], decision

    def call(self, owner: Resubmitter, engine: Engine, request: engine_pb2.EngineGenerateRequest, handoff: _Handoff,
             prompt_ids: list[int] | np.ndarray, *, request_id: str, timeout: float | None,
             deadline: float | None) -> DisaggCall:
        """The engine call of a request that :meth:`route` sent to ``engine`` (as :class:`EngineCall` takes it)."""
        return DisaggCall(self, owner, engine, request, handoff, prompt_ids, request_id=request_id, timeout=timeout,
                          deadline=deadline)


class DisaggCall(EngineCall):
    """A request's engine outputs across the prefill/decode split: from the prefill engine, then from the decode
    engine it is handed to (or, for a request not split, from the decode engine it runs on), with request
    migration's moves when an engine dies. It owns the prefill engine's hold on the prompt's blocks until it lets
    them go (``_hold``)."""

    def __init__(self, disagg: Disaggregation, owner: Resubmitter, engine: Engine,
                 request: engine_pb2.EngineGenerateRequest, handoff: _Handoff, prompt_ids: list[int] | np.ndarray, *,
                 request_id: str, timeout: float | None, deadline: float | None) -> None:
        super().__init__(owner, engine, request, handoff, prompt_ids, request_id=request_id, timeout=timeout,
                         deadline=deadline)
        self._disagg = disagg
        self.phase = Phase.PREFILL if request.kv_transfer.do_remote_decode else Phase.WHOLE
        self._prefill_sends = 1
        self._kv: engine_pb2.KVTransferParams | None = None   # the prefill engine's answer, until the handoff
        self._hold: tuple[Engine, str] | None = None   # the prefill engine and its request holding the blocks
        self._releases: set[asyncio.Future[None]] = set()

    async def abort(self, index: int | None = None) -> None:
        await super().abort(index)
        if index is None:
            await self._release()

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self._release()
            await asyncio.gather(*self._releases)

    def _arrived(self, msg: engine_pb2.EngineGenerateResponse) -> None:
        """The prefill engine's last message hands the request on (it is not the request's last); a decode
        engine's cache hits are not the client's (the prompt's were counted on the prefill engine), and its first
        tokens (it has read the blocks by then) let the prefill engine's blocks go."""
        if self.phase == Phase.PREFILL:
            if msg.HasField("kv_transfer"):
                self._kv = engine_pb2.KVTransferParams()
                self._kv.CopyFrom(msg.kv_transfer)
                msg.ClearField("kv_transfer")
                msg.request_done = False
            return
        if self.phase == Phase.DECODE or self.moves:
            msg.cached_tokens = 0
        if self._hold is not None and (msg.token_ids or msg.request_done):   # without holding the message up
            engine, key = self._hold
            self._hold = None
            future = asyncio.ensure_future(engine.abort(key, kv_blocks_pulled=msg.kv_blocks_received))
            self._releases.add(future)
            future.add_done_callback(self._releases.discard)

    async def _carry_on(self) -> bool:
        """After the prefill engine's handoff: the request on the least-loaded live decode engine other than it,
        waiting for one (a restart) within the request's deadline and migration's wait."""
        if self._kv is None:
            return False
        params, self._kv = self._kv, None
        producer = self.engine
        self._hold = (producer, self._legs[0].request.request_id)
        self.phase = Phase.DECODE
        settings = self._owner.migration
        start = time.monotonic()
        wait_until = start + settings.wait_s if self._deadline is None else min(self._deadline, start + settings.wait_s)
        while not (decode := [e for e in self._live() if e is not producer]):
            if time.monotonic() >= wait_until:
                raise self._unavailable(f"{producer.name} computed the prompt, and no decode engine was live to go "
                                        f"on within {time.monotonic() - start:.1f} s")
            await asyncio.sleep(_POLL_S)
        target, _ = self._disagg.pick(decode, self._prompt_ids, self._request)
        self._switch(target)
        leg = await self._leg(target, 0, self._delivered.get(0, []))
        leg.request.kv_transfer.CopyFrom(params)
        self._legs.append(leg)
        logger.debug("request %s handed from %s to %s (%d blocks)", self._request_id, producer.name, target.name,
                     len(params.remote_block_ids))
        return True

    def _live(self) -> list[Engine]:
        """Engines a request moves to: the live decode-capable ones (a prefill engine only computes prompts)."""
        return [e for e in super()._live() if e.can_decode]

    async def _move(self, failure: BaseException) -> None:
        """A prefill engine that died before its handoff: the request is sent again, once, to another live
        prefill engine; else it runs whole on a decode engine, as request migration moves it."""
        await self._release()   # whoever was to read the blocks will not
        settings = self._owner.migration
        if self.phase == Phase.PREFILL and not any(self._delivered.values()):
            old = self.engine
            others = [e for e in super()._live() if e.can_prefill and e is not old]
            if others and self._prefill_sends < 2 and self.moves < settings.max_migrations:
                target, _ = self._disagg.pick(others, self._prompt_ids, self._request)
                self._switch(target)
                leg = await self._leg(target, None, [])
                leg.request.kv_transfer.do_remote_decode = True
                self._legs.append(leg)
                self._prefill_sends += 1
                self.moves += 1
                self._owner.migration_metrics.migrated.inc()
                logger.warning("request %s sent again from %s to the prefill engine %s: %s", self._request_id,
                               old.name, target.name, failure)
                return
        self.phase = Phase.WHOLE
        await super()._move(failure)

    async def _leg(self, target: Engine, index: int | None, delivered: list[int]) -> _Leg:
        """A new engine request as request migration makes it, with no KV transfer unless the caller adds one."""
        leg = await super()._leg(target, index, delivered)
        leg.request.ClearField("kv_transfer")
        return leg

    async def _release(self) -> None:
        """Tell the prefill engine to let the prompt's blocks go (once; a late Abort finds nothing there)."""
        if self._hold is not None:
            engine, key = self._hold
            self._hold = None
            await engine.abort(key)
