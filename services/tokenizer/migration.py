"""Request migration: a request whose engine dies goes on, in the same client stream, on a live replica.

The tokenizer service owns each request's delivered tokens, so when the engine running it dies (its process, or a
tensor-parallel rank of it, which ends the replica) it sends the prompt plus those tokens to another engine with
``EngineGenerateRequest.resumed_output_tokens`` saying how many of them are output. The engine continues as if it had
produced them (penalties, limits, grammar, a seeded request's draws), so greedy and seeded requests continue with
exactly the tokens they would have had, and detokenization and stop strings here never notice.

What moves: any request with n >= 1, at any point; a request with nothing delivered yet is sent again as it was.
Once tokens were delivered, each unfinished sequence i of it moves as its own n = 1 resumed request seeded seed + i
(as the engine forks a seeded request's sequences), and their outputs come back into the one stream under their
index; finished sequences stay finished. best_of and beam search deliver nothing before their end, so they are sent
again as they were until then. A request moves at most ``--max-request-migrations`` times. With no live replica it
waits for one (a restart) within its deadline and at most ``--request-migration-wait``, then ends with one
UNAVAILABLE error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Counter, start_http_server

from common.argtypes import at_least
from proto.sluice.v1 import common_pb2, engine_pb2
from services.tokenizer.engines import Engine

if TYPE_CHECKING:
    from services.tokenizer.service import _Handoff

logger = logging.getLogger(__name__)

# A call that ended with one of these may have lost its engine: whether it did is asked (``_engine_died``).
_ENGINE_FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                                   grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})
# How long a dying engine may take to answer GetInfo (it answers at once when alive), and how many unanswered
# probes make it taken for alive but slow: an engine that failed may hold a probe unanswered while it exits, and
# the next one then finds it gone.
_PROBE_TIMEOUT_S = 2.0
_PROBES = 3
# How often a request waiting for a live replica looks again (``Engine.up`` follows connections within ms).
_POLL_S = 0.05


@dataclass(frozen=True)
class MigrationSettings:
    """``max_migrations``: most moves of one request (0: migration off); ``wait_s``: longest wait for a live
    replica (within the request's own deadline)."""

    max_migrations: int = 2
    wait_s: float = 60.0


@dataclass
class MigrationMetrics:
    """The service's ``sluice:requests_migrated_total`` (on its ``--metrics-port`` page when it has one)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.migrated = Counter("sluice:requests_migrated", "Requests moved to another engine after theirs died.",
                                registry=self.registry)

    @classmethod
    def serve(cls, host: str, port: int) -> MigrationMetrics:
        """The metrics on a new registry served at ``http://host:port/metrics`` (prometheus_client's server thread,
        for the process's life); OSError naming the port when it cannot listen."""
        registry = CollectorRegistry()
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise OSError(f"--metrics-port {port}: cannot listen on {host}:{port}: {e}") from e
        return cls(registry)


def add_migration_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-request-migrations", type=at_least(0, integer=True, what="a count"),
                        default=MigrationSettings.max_migrations, metavar="N",
                        help="most times one request is moved to a live replica when its engine dies (0: never; "
                             "its stream then ends with the engine's error)")
    parser.add_argument("--request-migration-wait", type=at_least(0, what="a number of seconds"),
                        default=MigrationSettings.wait_s, metavar="SECONDS",
                        help="longest wait of a request whose engine died for a live replica (a restart), within its "
                             "own deadline; then it fails with UNAVAILABLE")


def migration_settings(ns: argparse.Namespace) -> MigrationSettings:
    return MigrationSettings(ns.max_request_migrations, ns.request_migration_wait)


def migration_flags(ns: argparse.Namespace) -> list[str]:
    """The migration flags as given to ``sluice serve``, for its tokenizer services."""
    return ["--max-request-migrations", str(ns.max_request_migrations),
            "--request-migration-wait", str(ns.request_migration_wait)]


class Resubmitter(Protocol):
    """What a moving request needs of the servicer."""

    engines: list[Engine]
    migration: MigrationSettings
    migration_metrics: MigrationMetrics

    def new_engine_key(self) -> str: ...

    async def engine_request(self, req: engine_pb2.EngineGenerateRequest, prompt_ids: list[int] | np.ndarray, *,
                             source: common_pb2.TokenIds | None = None, engine: Engine | None = None
                             ) -> tuple[engine_pb2.EngineGenerateRequest, _Handoff]: ...


@dataclass
class _Leg:
    """One engine request carrying (part of) the client's request: the request as a whole (``index`` None), or,
    once a request with n > 1 has moved, the n = 1 request continuing its sequence ``index``."""

    request: engine_pb2.EngineGenerateRequest
    handoff: _Handoff
    index: int | None = None


class EngineCall:
    """One request's engine outputs, from the engine it was sent to and then from each one it moves to: the
    messages a single engine call would give (``EngineStream.generate``), with the same errors when it cannot move.

    It owns where the request is: ``engine`` (counted in its ``open_requests``), the engine requests (``_legs``:
    the request itself, or after a move of a request with n > 1 one n = 1 request per unfinished sequence, whose
    outputs are merged back under their sequence's index) and their prompts' shared-memory handoffs. ``abort``
    reaches wherever it runs now; ``aclose`` ends it there."""

    def __init__(self, owner: Resubmitter, engine: Engine, request: engine_pb2.EngineGenerateRequest,
                 handoff: _Handoff, prompt_ids: list[int] | np.ndarray, *, request_id: str,
                 timeout: float | None, deadline: float | None) -> None:
        """``request``: as sent to ``engine`` (its prompt set); ``prompt_ids``: the client's prompt; ``timeout``: the
        caller's seconds left; ``deadline``: the request's time limit (monotonic), when it has one."""
        self._owner = owner
        self.engine = engine
        self._request = request   # the request as first sent: what each move's engine requests are made from
        self._n = request.n or 1
        self._legs = [_Leg(request, handoff)]
        self._prompt_ids = prompt_ids
        self._request_id = request_id
        now = time.monotonic()
        ends = [d for d in (deadline, now + timeout if timeout is not None else None) if d is not None]
        self._deadline = min(ends) if ends else None
        self._instance = engine.instance_id   # the engine process the request runs on
        self._dead: dict[Engine, str | None] = {}   # engines found dead, by the process that died
        self._delivered: dict[int, list[int]] = {}   # tokens of each sequence, as the engines sent them
        self._finished: set[int] = set()   # sequences ended by the engine, or aborted by the caller
        self.moves = 0
        self._messages: AsyncGenerator[engine_pb2.EngineGenerateResponse, None] | None = None

    def __aiter__(self) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        if self._messages is None:
            self._messages = self._run()
        return self._messages

    async def abort(self, index: int | None = None) -> None:
        """Abort the request (or its sequence ``index``) on the engine it runs on now."""
        if index is None:
            for leg in self._legs:
                await self.engine.abort(leg.request.request_id)
            return
        self._finished.add(index)   # not moved, whatever the engine still sends
        for leg in self._legs:
            if leg.index is None:
                await self.engine.abort(leg.request.request_id, index)
            elif leg.index == index:
                await self.engine.abort(leg.request.request_id)

    async def aclose(self) -> None:
        """End the iteration (an unfinished engine request is aborted there) and give back the prompts' slots."""
        if self._messages is not None:
            await self._messages.aclose()
        for leg in self._legs:
            leg.handoff.release()

    async def _run(self) -> AsyncGenerator[engine_pb2.EngineGenerateResponse, None]:
        while True:
            failure: BaseException
            engine = self.engine
            outputs = self._outputs(engine)
            try:
                async for leg, msg in outputs:
                    if msg.HasField("released_shm_slot"):
                        leg.handoff.release()
                    self._arrived(msg)
                    if leg.index is not None:
                        msg.index = leg.index
                    if msg.finish_reason == common_pb2.FINISH_REASON_ERROR and await self._may_move(engine):
                        # A rank of the replica died: every sequence of it ends so. Tokens it carries were sampled.
                        failure = RuntimeError(msg.error_message or "the engine failed")
                        if msg.token_ids:
                            msg.ClearField("finish_reason")
                            msg.ClearField("error_message")
                            msg.request_done = False
                            self._record(msg)
                            yield msg
                        break
                    self._record(msg)
                    if leg.index is not None:
                        msg.request_done = len(self._finished) == self._n
                    yield msg
                else:
                    if not await self._carry_on():
                        return
                    continue
            except grpc.aio.AioRpcError as error:
                if error.code() not in _ENGINE_FAILURE_CODES or not await self._may_move(engine):
                    raise
                failure = error
            finally:
                await outputs.aclose()
            await self._move(failure)

    def _arrived(self, msg: engine_pb2.EngineGenerateResponse) -> None:
        """Adjust an engine message before it is recorded and passed on."""
        if self.moves:   # its cache hits on this engine say nothing of the client's prompt
            msg.cached_tokens = 0

    async def _carry_on(self) -> bool:
        """Whether the request goes on elsewhere once its engine ended it (a prefill engine's handoff,
        services/tokenizer/disagg.py); here never."""
        return False

    async def _outputs(self, engine: Engine) -> AsyncGenerator[tuple[_Leg, engine_pb2.EngineGenerateResponse], None]:
        """The messages of every engine request of the request on ``engine``, as they come; a leg's error is
        raised. With several legs it ends once every sequence has finished (an aborted leg need not answer)."""
        metadata = (("x-request-id", self._request_id),)
        if len(self._legs) == 1:
            leg = self._legs[0]
            call = engine.stream.generate(leg.request, timeout=self._remaining(), metadata=metadata)
            try:
                async for msg in call:
                    yield leg, msg
            finally:
                await call.aclose()
            return
        queue: asyncio.Queue[tuple[_Leg, engine_pb2.EngineGenerateResponse | None] | Exception] = asyncio.Queue()

        async def pump(leg: _Leg) -> None:
            try:
                async for msg in engine.stream.generate(leg.request, timeout=self._remaining(), metadata=metadata):
                    queue.put_nowait((leg, msg))
                queue.put_nowait((leg, None))
            except Exception as error:   # noqa: BLE001 - raised where the messages are read
                queue.put_nowait(error)

        pumps = [asyncio.ensure_future(pump(leg)) for leg in self._legs]
        running = len(pumps)
        try:
            while running and len(self._finished) < self._n:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                leg, out = item
                if out is None:
                    running -= 1
                else:
                    yield leg, out
        finally:
            for p in pumps:
                p.cancel()   # leaving a leg's call early aborts it on the engine
            await asyncio.gather(*pumps, return_exceptions=True)

    def _record(self, msg: engine_pb2.EngineGenerateResponse) -> None:
        self._delivered.setdefault(msg.index, []).extend(msg.token_ids)
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._finished.add(msg.index)

    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    @property
    def _unmovable(self) -> str | None:
        """Why the request cannot continue elsewhere, or None: best_of and beam search keep their candidates on
        the engine (they deliver nothing before their end, and are sent again as they were until then)."""
        if not any(self._delivered.values()):
            return None
        if self._request.HasField("beam_search") or self._request.best_of > self._n:
            return "a request with best_of or beam search is not moved once it has delivered tokens"
        return None

    async def _may_move(self, engine: Engine) -> bool:
        """Whether the request should move: migration is on and its engine process is gone — it does not answer
        GetInfo, or another process does (a refusal from an engine that lives is the request's own). One that
        cannot move ends with UNAVAILABLE saying why."""
        if self._owner.migration.max_migrations == 0:
            return False
        died = False
        for _ in range(_PROBES):
            try:
                r = await engine.get_info(_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue   # slow, or exiting with its server up (a dying engine's GetInfo may hang): ask again
                died = True
            else:
                died = r.instance_id != self._instance
            break
        if died:
            self._dead[engine] = self._instance
            if (why := self._unmovable) is not None:
                logger.warning("request %s not moved: %s died, and %s", self._request_id, engine.name, why)
                raise self._unavailable(f"{engine.name} died; {why}")
        return died

    def _live(self) -> list[Engine]:
        """Engines up now, an engine found dead only once another process answers there (a restart)."""
        return [e for e in self._owner.engines
                if e.up and (e not in self._dead or (e.instance_id is not None and e.instance_id != self._dead[e]))]

    async def _move(self, failure: BaseException) -> None:
        """Send the request to a live engine as prompt + delivered tokens, waiting for one within its deadline;
        else raise UNAVAILABLE (or the engine's own error, when it has moved as often as it may)."""
        settings = self._owner.migration
        old = self.engine
        if self.moves >= settings.max_migrations:
            logger.warning("request %s not moved again: its engine died after %d moves (at most %d)",
                           self._request_id, self.moves, settings.max_migrations)
            raise self._unavailable(f"{old.name} died and the request has moved {self.moves} times already")
        start = time.monotonic()
        wait_until = start + settings.wait_s if self._deadline is None else min(self._deadline, start + settings.wait_s)
        while not (live := self._live()):
            if time.monotonic() >= wait_until:
                logger.warning("request %s failed: %s died (%s) and no replica came up to take it",
                               self._request_id, old.name, _describe(failure))
                raise self._unavailable(f"{old.name} died and no live replica took the request within "
                                        f"{time.monotonic() - start:.1f} s")
            await asyncio.sleep(_POLL_S)
        target = min(live, key=lambda e: e.load)
        self._switch(target)
        if not any(self._delivered.values()):
            self._legs.append(await self._leg(target, None, []))   # sent again as it was
        else:
            for i in range(self._n):
                if i not in self._finished:
                    self._legs.append(await self._leg(target, i, self._delivered.get(i, [])))
        self.moves += 1
        self._owner.migration_metrics.migrated.inc()
        logger.warning("request %s moved from %s to %s after %d delivered tokens (move %d of at most %d): %s",
                       self._request_id, old.name, target.name, sum(map(len, self._delivered.values())), self.moves,
                       settings.max_migrations, _describe(failure))

    def _switch(self, target: Engine) -> None:
        """Make ``target`` the request's engine (its load counted there from now) with no engine request yet; the
        prompt slots of the old ones are given back."""
        for leg in self._legs:
            leg.handoff.release()
        self.engine.open_requests -= 1
        target.open_requests += 1
        self.engine = target
        self._instance = target.instance_id
        self._legs = []

    async def _leg(self, target: Engine, index: int | None, delivered: list[int]) -> _Leg:
        """A new engine request on ``target``: the request as it was (``index`` None), or sequence ``index`` as an
        n = 1 request resumed from its ``delivered`` tokens, seeded as the engine forks sequence ``index`` of a
        seeded request (seed + index; ``engine.worker.model_runner``), so its t-th token is the same draw."""
        request = engine_pb2.EngineGenerateRequest()
        request.CopyFrom(self._request)
        request.ClearField("prompt")
        request.request_id = self._owner.new_engine_key()
        prompt: list[int] | np.ndarray = self._prompt_ids
        if index is not None:
            base = self._prompt_ids.tolist() if isinstance(self._prompt_ids, np.ndarray) else list(self._prompt_ids)
            prompt = base + delivered
            request.resumed_output_tokens = len(delivered)
            request.ClearField("prompt_logprobs")   # sent with the first tokens: the client has them
            request.n = 1
            request.best_of = 0
            if request.sampling.HasField("seed"):   # int64 on the wire; the engine seeds with it modulo 2**64
                request.sampling.seed = (request.sampling.seed + index + 2**63) % 2**64 - 2**63
        sent, handoff = await self._owner.engine_request(request, prompt, engine=target)
        return _Leg(sent, handoff, index)

    def _unavailable(self, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    f"request {self._request_id}: {details}")


def _describe(failure: BaseException) -> str:
    """How the engine call failed, on one line."""
    if isinstance(failure, grpc.aio.AioRpcError):
        return f"{failure.code().name}: {failure.details()}"
    return str(failure)
