"""Prefill/decode disaggregation in the tokenizer service (services/tokenizer/disagg.py), against fake engines of
each KV role in process: the prefill engine's request and the decode engine's handoff request field by field, the
prefill engine's blocks let go only after the decode engine's first message, a client gone mid-handoff aborts both,
requests that cannot be split run whole on a decode engine, a prefill engine's death sends the request again once
(to another prefill engine, else whole to a decode engine), and every request ends with exactly one terminal event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2, generation_pb2_grpc
from services.tokenizer.disagg import Disaggregation, eligible
from services.tokenizer.engines import Engine
from services.tokenizer.migration import MigrationSettings
from services.tokenizer.service import GenerationServicer
from tests.procs import free_port
from tests.services.test_migration import moved, service
from tests.services.test_slow_engine import TOKENS, StallingEngine, _until, fake_engine

# What a fake prefill engine says of the blocks it holds (remote_engine_id: its instance id).
HELD = {"transport": "shm", "remote_address": "4242:17", "remote_block_ids": [3, 9], "hold_s": 30.0,
        "block_hashes": [b"a" * 32, b"b" * 32], "layout": "float32 2x2x16x1x8"}
PREFILL_CACHED, DECODE_CACHED = 5, 7   # the cached_tokens each kind of fake engine reports


PULLED = 3   # blocks a fake consumer says it pulled, on its first message

class RoleEngine(StallingEngine):
    """A fake engine of one KV role. A request with ``do_remote_decode`` gets ``TOKENS[0]`` and, unless
    ``end_first``, the handoff (``kv_transfer``: ``HELD``) on its last message, as a producer's contract says (with
    ``stall_prefill`` it waits for ever instead); any other request gets ``TOKENS`` from its
    ``resumed_output_tokens`` on, one per step, for each of its n sequences, its first message held until ``gate``
    is set and the rest until ``resume`` is. Aborts are recorded with their time, from the Abort RPC and the Stream
    call alike."""

    def __init__(self, role: str, *, stall_prefill: bool = False, end_first: bool = False) -> None:
        super().__init__(step=0.01)
        self.role = role
        self.stall_prefill = stall_prefill
        self.end_first = end_first
        self.received: list[engine_pb2.EngineGenerateRequest] = []
        self.aborted: list[tuple[float, str]] = []
        self.pulled: dict[str, int] = {}   # the Abort RPC's kv_blocks_pulled
        self.first_sent: dict[str, float] = {}   # when each request's first message went out
        self.gate = asyncio.Event()
        self.gate.set()
        self.resume = asyncio.Event()   # cleared: ordinary requests wait after their first message
        self.resume.set()
        self.prefilling = asyncio.Event()

    async def GetInfo(self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.GetInfoResponse:
        info = await super().GetInfo(request, context)
        info.kv_role, info.kv_transport = self.role, "shm" if self.role else ""
        return info

    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> engine_pb2.AbortResponse:
        self.aborted += [(time.monotonic(), rid) for rid in request.request_ids]
        self.pulled.update(request.kv_blocks_pulled)
        return engine_pb2.AbortResponse()

    def held(self) -> engine_pb2.KVTransferParams:
        return engine_pb2.KVTransferParams(remote_engine_id=self.instance_id, **HELD)   # type: ignore[arg-type]

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineStreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        await context.send_initial_metadata(())
        out: asyncio.Queue[engine_pb2.EngineStreamResponse] = asyncio.Queue()

        def send(msg: engine_pb2.EngineGenerateResponse) -> None:
            self.first_sent.setdefault(msg.request_id, time.monotonic())
            out.put_nowait(engine_pb2.EngineStreamResponse(outputs=[msg]))

        async def run(request: engine_pb2.EngineGenerateRequest) -> None:
            self.received.append(request)
            rid = request.request_id
            if request.kv_transfer.do_remote_decode:
                self.prefilling.set()
                if self.stall_prefill:
                    await asyncio.Event().wait()
                await asyncio.sleep(self.step)
                msg = engine_pb2.EngineGenerateResponse(request_id=rid, token_ids=TOKENS[:1], request_done=True,
                                                        cached_tokens=PREFILL_CACHED)
                if self.end_first:
                    msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
                else:
                    msg.kv_transfer.CopyFrom(self.held())
                send(msg)
                return
            await self.gate.wait()
            n = request.n or 1
            for k in range(request.resumed_output_tokens, len(TOKENS)):
                await asyncio.sleep(self.step)
                last = k == len(TOKENS) - 1
                reason = common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED
                for i in range(n):
                    send(engine_pb2.EngineGenerateResponse(
                        request_id=rid, index=i, token_ids=[TOKENS[k]], request_done=last and i == n - 1,
                        cached_tokens=DECODE_CACHED if rid not in self.first_sent else 0,
                        kv_blocks_received=PULLED if request.kv_transfer.transport and k == 1 else 0,
                        finish_reason=reason))
                await self.resume.wait()

        async def read() -> None:
            async for msg in request_iterator:
                if msg.HasField("generate"):
                    runs.append(asyncio.ensure_future(run(msg.generate)))
                elif msg.HasField("abort"):
                    self.aborted += [(time.monotonic(), rid) for rid in msg.abort.request_ids]

        runs: list[asyncio.Future[None]] = []
        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for r in runs:
                r.cancel()


def public_request(**fields: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text="hi", request_id="pd", **fields)   # type: ignore[arg-type]


async def collect(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest,
                  out: list[generation_pb2.GenerateResponse]) -> None:
    async for r in stub.Generate(request):
        out.append(r)


async def all_up(servicer: GenerationServicer, count: int) -> None:
    async def check() -> bool:
        return sum(e.up for e in servicer.engines) == count

    await _until(check, 10, f"{count} engines up")


def tokens(got: list[generation_pb2.GenerateResponse], index: int = 0) -> list[int]:
    return [t for r in got if r.index == index for t in r.token_ids]


def terminal(got: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [r.finish_reason for r in got if r.finish_reason]


def test_a_request_is_prefilled_on_the_producer_and_handed_to_the_consumer_which_lets_the_blocks_go_after() -> None:
    async def main() -> None:
        p, d = RoleEngine("kv_producer"), RoleEngine("kv_consumer")
        d.gate.clear()   # the decode engine's first message waits: the client has the first token meanwhile
        d.resume.clear()   # and after it, the rest: the producer's blocks are let go meanwhile
        ports = [free_port(), free_port()]
        async with fake_engine(p, ports[0]), fake_engine(d, ports[1]), \
                service(ports, MigrationSettings()) as (stub, servicer):
            await all_up(servicer, 2)
            got: list[generation_pb2.GenerateResponse] = []
            request = public_request(sampling=common_pb2.SamplingParameters(temperature=1.0, seed=7),
                                     response=generation_pb2.ResponseOptions(prompt_logprobs=2))
            reading = asyncio.ensure_future(collect(stub, request, got))

            async def handed_off() -> bool:
                return len(got) == 1 and len(d.received) == 1

            await _until(handed_off, 10, "first token and handoff")
            assert tokens(got) == TOKENS[:1] and not p.aborted   # held until the decode engine has answered
            d.gate.set()
            await _until(lambda: _true(len(p.aborted) == 1), 5, "the producer's abort")
            assert len(got) <= 2 and not reading.done()
            d.resume.set()
            await asyncio.wait_for(reading, 10)
        prefill, decode = p.received[0], d.received[0]
        prompt = list(prefill.prompt_token_ids.ids)
        assert prefill.kv_transfer == engine_pb2.KVTransferParams(do_remote_decode=True)
        assert prefill.prompt_logprobs == 2 and prefill.n == 1 and prefill.resumed_output_tokens == 0
        # The handoff: prompt + the first token, resumed after 1, the producer's params unchanged.
        assert list(decode.prompt_token_ids.ids) == prompt + TOKENS[:1]
        assert decode.resumed_output_tokens == 1
        assert decode.kv_transfer == p.held() and not decode.kv_transfer.do_remote_decode
        assert decode.request_id != prefill.request_id and decode.client_request_id == "pd"
        assert not decode.HasField("prompt_logprobs")
        assert (decode.sampling, decode.stopping, decode.n) == (prefill.sampling, prefill.stopping, 1)
        # The producer's blocks let go once, by its request id, after the consumer's first message.
        assert [rid for _, rid in p.aborted] == [prefill.request_id]
        assert p.aborted[0][0] >= d.first_sent[decode.request_id]
        assert p.pulled == {prefill.request_id: PULLED}   # what the consumer said it pulled: the producer's "sent"
        assert d.aborted == []
        assert tokens(got) == TOKENS and terminal(got) == [common_pb2.FINISH_REASON_LENGTH]
        usage = got[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
            len(prompt), len(TOKENS), PREFILL_CACHED)
        assert [e.open_requests for e in servicer.engines] == [0, 0] and moved(servicer) == 0.0

    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value


def test_a_client_gone_during_the_handoff_aborts_the_request_on_both_engines() -> None:
    async def main() -> None:
        p, d = RoleEngine("kv_producer"), RoleEngine("kv_consumer")
        d.gate.clear()
        ports = [free_port(), free_port()]
        async with fake_engine(p, ports[0]), fake_engine(d, ports[1]), \
                service(ports, MigrationSettings()) as (stub, servicer):
            await all_up(servicer, 2)
            call = stub.Generate(public_request())
            first = await call.read()
            assert list(first.token_ids) == TOKENS[:1]
            await _until(lambda: _true(len(d.received) == 1), 10, "handoff")
            call.cancel()

            async def both_aborted() -> bool:
                return bool(p.aborted) and bool(d.aborted)

            await _until(both_aborted, 10, "aborts on both engines")
            assert [rid for _, rid in p.aborted] == [p.received[0].request_id]
            assert [rid for _, rid in d.aborted] == [d.received[0].request_id]
            assert p.pulled == {}   # the hold ended by a plain abort: nothing was taken
            await _until(lambda: _true([e.open_requests for e in servicer.engines] == [0, 0]), 5, "no load left")

    asyncio.run(main())


@pytest.mark.parametrize("fields", [{"n": 2}, {"best_of": 3},
                                    {"beam_search": common_pb2.BeamSearch(beam_width=2)}],
                         ids=["n", "best_of", "beam_search"])
def test_a_request_that_cannot_be_split_runs_whole_on_a_consumer(fields: dict[str, object]) -> None:
    async def main() -> None:
        p, d = RoleEngine("kv_producer"), RoleEngine("kv_consumer")
        ports = [free_port(), free_port()]
        async with fake_engine(p, ports[0]), fake_engine(d, ports[1]), \
                service(ports, MigrationSettings()) as (stub, servicer):
            await all_up(servicer, 2)
            got: list[generation_pb2.GenerateResponse] = []
            await asyncio.wait_for(collect(stub, public_request(**fields), got), 10)
        assert p.received == [] and len(d.received) == 1
        whole = d.received[0]
        assert not whole.HasField("kv_transfer") and whole.resumed_output_tokens == 0
        n = int(fields.get("n", 1))   # type: ignore[call-overload]
        assert [tokens(got, i) for i in range(n)] == [TOKENS] * n
        assert terminal(got) == [common_pb2.FINISH_REASON_LENGTH] * n
        assert p.aborted == [] and d.aborted == []

    asyncio.run(main())


def test_a_first_token_that_ends_the_request_ends_it_on_the_producer() -> None:
    async def main() -> None:
        p, d = RoleEngine("kv_producer", end_first=True), RoleEngine("kv_consumer")
        ports = [free_port(), free_port()]
        async with fake_engine(p, ports[0]), fake_engine(d, ports[1]), \
                service(ports, MigrationSettings()) as (stub, servicer):
            await all_up(servicer, 2)
            got: list[generation_pb2.GenerateResponse] = []
            await asyncio.wait_for(collect(stub, public_request(), got), 10)
        assert tokens(got) == TOKENS[:1] and terminal(got) == [common_pb2.FINISH_REASON_LENGTH]
        assert got[-1].usage.cached_tokens == PREFILL_CACHED
        assert d.received == [] and p.aborted == []   # nothing held, nothing to let go

    asyncio.run(main())


def test_a_producer_that_dies_before_its_handoff_is_replaced_once_by_another_producer() -> None:
    async def main() -> None:
        dying, p2, d = RoleEngine("kv_producer", stall_prefill=True), RoleEngine("kv_producer"), \
            RoleEngine("kv_consumer")
        ports = [free_port(), free_port(), free_port()]
        async with fake_engine(d, ports[2]), service(ports, MigrationSettings()) as (stub, servicer):
            async with fake_engine(dying, ports[0]) as server:
                await all_up(servicer, 2)
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(collect(stub, public_request(), got))   # p2 is not up yet
                await asyncio.wait_for(dying.prefilling.wait(), 10)
                async with fake_engine(p2, ports[1]):
                    await all_up(servicer, 3)
                    await server.stop(0)
                    await asyncio.wait_for(reading, 10)
                    await _until(lambda: _true(len(p2.aborted) == 1), 5, "the producer's abort")
        first, again, decode = dying.received[0], p2.received[0], d.received[0]
        assert again.kv_transfer == engine_pb2.KVTransferParams(do_remote_decode=True)
        assert again.request_id != first.request_id
        assert list(again.prompt_token_ids.ids) == list(first.prompt_token_ids.ids)
        assert decode.kv_transfer == p2.held() and decode.resumed_output_tokens == 1
        assert [rid for _, rid in p2.aborted] == [again.request_id]
        assert tokens(got) == TOKENS and terminal(got) == [common_pb2.FINISH_REASON_LENGTH]
        assert got[-1].usage.cached_tokens == PREFILL_CACHED
        assert moved(servicer) == 1.0

    asyncio.run(main())


def test_a_producer_that_dies_with_no_other_producer_runs_the_request_whole_on_a_consumer() -> None:
    async def main() -> None:
        dying, d = RoleEngine("kv_producer", stall_prefill=True), RoleEngine("kv_consumer")
        ports = [free_port(), free_port()]
        async with fake_engine(d, ports[1]), service(ports, MigrationSettings()) as (stub, servicer):
            async with fake_engine(dying, ports[0]) as server:
                await all_up(servicer, 2)
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(collect(stub, public_request(), got))
                await asyncio.wait_for(dying.prefilling.wait(), 10)
                await server.stop(0)
                await asyncio.wait_for(reading, 10)
        whole = d.received[0]
        assert not whole.HasField("kv_transfer") and whole.resumed_output_tokens == 0
        assert list(whole.prompt_token_ids.ids) == list(dying.received[0].prompt_token_ids.ids)
        assert tokens(got) == TOKENS and terminal(got) == [common_pb2.FINISH_REASON_LENGTH]
        assert moved(servicer) == 1.0 and servicer.engines[1].open_requests == 0

    asyncio.run(main())


def test_a_producer_that_dies_with_nothing_live_to_take_over_fails_once() -> None:
    async def main() -> None:
        dying, d = RoleEngine("kv_producer", stall_prefill=True), RoleEngine("kv_consumer")
        ports = [free_port(), free_port()]
        async with service(ports, MigrationSettings(wait_s=0.3)) as (stub, servicer):
            async with fake_engine(dying, ports[0]) as server, fake_engine(d, ports[1]) as consumer:
                await all_up(servicer, 2)
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(collect(stub, public_request(), got))
                await asyncio.wait_for(dying.prefilling.wait(), 10)
                await consumer.stop(0)
                await _until(lambda: _true(not servicer.engines[1].up), 5, "consumer down")
                await server.stop(0)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await asyncio.wait_for(reading, 10)
        assert error.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "no live replica took the request" in (error.value.details() or "")
        assert got == [] and d.received == []

    asyncio.run(main())


def test_pd_is_on_only_with_a_live_producer_and_a_different_live_consumer() -> None:
    async def main() -> None:
        def engines(*roles: str) -> list[Engine]:
            made = []
            for role in roles:
                e = Engine(grpc.aio.insecure_channel("127.0.0.1:9"), role)
                e.kv_role, e.up = role, True
                made.append(e)
            return made

        pd = Disaggregation()
        for roles in [("kv_producer",), ("kv_both",), ("kv_producer", ""), ("kv_consumer", "kv_consumer"), ("", "")]:
            request = engine_pb2.EngineGenerateRequest(n=1)
            assert pd.route(engines(*roles), request, [1, 2]) is None, roles
            assert not request.HasField("kv_transfer")
        both = engines("kv_both", "kv_both")
        request = engine_pb2.EngineGenerateRequest(n=1)
        routed = pd.route(both, request, [1, 2])
        assert routed is not None and request.kv_transfer.do_remote_decode
        down = engines("kv_producer", "kv_consumer")
        down[1].up = False
        assert pd.route(down, engine_pb2.EngineGenerateRequest(), [1, 2]) is None
        # The least loaded producer takes a split request; a request with n = 3 goes to a consumer.
        p1, p2, c = engines("kv_producer", "kv_producer", "kv_consumer")
        p1.open_requests = 2
        routed = pd.route([p1, p2, c], engine_pb2.EngineGenerateRequest(), [1, 2])
        assert routed is not None and routed[0] is p2 and p2.open_requests == 1
        assert routed[1].policy == "prefill by least_loaded"
        routed = pd.route([p1, p2, c], engine_pb2.EngineGenerateRequest(n=3), [1, 2])
        assert routed is not None and routed[0] is c and routed[1].policy == "decode by single"
        for e in [*both, *down, p1, p2, c]:
            await e.channel.close()

    asyncio.run(main())


def test_only_single_sequence_sampling_requests_are_split() -> None:
    assert eligible(engine_pb2.EngineGenerateRequest()) and eligible(engine_pb2.EngineGenerateRequest(n=1, best_of=1))
    assert not eligible(engine_pb2.EngineGenerateRequest(n=2))
    assert not eligible(engine_pb2.EngineGenerateRequest(best_of=2))
    assert not eligible(engine_pb2.EngineGenerateRequest(beam_search=common_pb2.BeamSearch(beam_width=1)))


def test_a_consumer_that_dies_mid_decode_moves_the_request_to_another_consumer_never_a_producer() -> None:
    async def main() -> None:
        p, dying, d2 = RoleEngine("kv_producer"), RoleEngine("kv_consumer"), RoleEngine("kv_consumer")
        dying.resume.clear()   # it sends one token, then stalls until it is killed
        ports = [free_port(), free_port(), free_port()]
        async with fake_engine(p, ports[0]), service(ports, MigrationSettings()) as (stub, servicer):
            async with fake_engine(dying, ports[1]) as server:
                await all_up(servicer, 2)
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(collect(stub, public_request(), got))
                await _until(lambda: _true(len(got) == 2 and len(p.aborted) == 1), 10, "two tokens, blocks let go")
                async with fake_engine(d2, ports[2]):
                    await all_up(servicer, 3)
                    await server.stop(0)
                    await asyncio.wait_for(reading, 10)
        prompt = list(p.received[0].prompt_token_ids.ids)
        assert len(p.received) == 1 and len(d2.received) == 1
        moved_to = d2.received[0]
        assert not moved_to.HasField("kv_transfer") and moved_to.resumed_output_tokens == 2
        assert list(moved_to.prompt_token_ids.ids) == prompt + TOKENS[:2]
        assert tokens(got) == TOKENS and terminal(got) == [common_pb2.FINISH_REASON_LENGTH]
        assert got[-1].usage.cached_tokens == PREFILL_CACHED
        assert [rid for _, rid in p.aborted] == [p.received[0].request_id] and moved(servicer) == 1.0

    asyncio.run(main())
