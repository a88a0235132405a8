"""``POST /reset_prefix_cache`` (vLLM's development route) through the gateway to the fake Generation server,
the switch that mounts it (``VLLM_SERVER_DEV_MODE``), and the tokenizer service's ResetPrefixCache fanning out
to every engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from gateway.__main__ import build_parser, server_dev_mode, settings_from_args
from proto.sluice.v1 import common_pb2
from services.tokenizer.service import GenerationServicer
from tests.gateway.conftest import API_KEY, GatewayFactory

pytestmark = pytest.mark.anyio


async def test_not_mounted_without_dev_mode(make_gateway: GatewayFactory) -> None:
    async with make_gateway() as gw:
        r = await gw.client.post("/reset_prefix_cache")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert gw.backend_calls.resets == 0


async def test_resets_every_engine_with_vllms_empty_200(make_gateway: GatewayFactory) -> None:
    async with make_gateway(server_dev_mode=True) as gw:
        r = await gw.client.post("/reset_prefix_cache")
        assert (r.status_code, r.content) == (200, b"")
        assert gw.backend_calls.resets == 1
        assert (await gw.client.get("/reset_prefix_cache")).status_code == 405


async def test_a_refusal_is_a_409(make_gateway: GatewayFactory) -> None:
    async with make_gateway(server_dev_mode=True) as gw:
        gw.backend_calls.reset_ok = False
        r = await gw.client.post("/reset_prefix_cache")
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "prefix_cache_in_use" and "not reset" in r.json()["error"]["message"]


@pytest.mark.parametrize(("query", "status"), [
    ("reset_running_requests=false&reset_external=0", 200), ("reset_running_requests=true", 400),
    ("reset_external=1", 400), ("reset_external=maybe", 400)])
async def test_vllms_query_parameters(make_gateway: GatewayFactory, query: str, status: int) -> None:
    async with make_gateway(server_dev_mode=True) as gw:
        r = await gw.client.post(f"/reset_prefix_cache?{query}")
        assert r.status_code == status
        if status == 400:
            assert r.json()["error"]["param"] == query.split("=")[0] and gw.backend_calls.resets == 0


async def test_needs_a_key_when_keys_are_on(make_gateway: GatewayFactory) -> None:
    async with make_gateway(server_dev_mode=True, api_keys=(API_KEY,)) as gw:
        assert (await gw.client.post("/reset_prefix_cache")).status_code == 401
        assert gw.backend_calls.resets == 0
        r = await gw.client.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and gw.backend_calls.resets == 1


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True), ("2", True)])
def test_vllms_switch(value: str | None, on: bool) -> None:
    environ = {} if value is None else {"VLLM_SERVER_DEV_MODE": value}
    assert server_dev_mode(environ) is on
    assert settings_from_args(build_parser().parse_args([]), environ).server_dev_mode is on


def test_a_switch_that_is_no_integer_is_refused() -> None:
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE"):
        server_dev_mode({"VLLM_SERVER_DEV_MODE": "yes"})


# ---------------------------------------------------------------- the tokenizer service's fan-out


class Stub:
    def __init__(self, answer: bool | grpc.aio.AioRpcError) -> None:
        self.answer, self.calls = answer, 0

    async def ResetPrefixCache(self, request: Any, timeout: float | None = None) -> Any:
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return common_pb2.ResetPrefixCacheResponse(ok=self.answer)


def fan_out(*stubs: Stub) -> bool:
    service = SimpleNamespace(all_engines=lambda: list(stubs))
    context = SimpleNamespace(time_remaining=lambda: 5.0)
    resp = asyncio.run(GenerationServicer.ResetPrefixCache(
        service, common_pb2.ResetPrefixCacheRequest(), context))  # type: ignore[arg-type]
    assert all(s.calls == 1 for s in stubs)   # every engine is asked, whatever the others answer
    return bool(resp.ok)


def test_the_tokenizer_service_asks_every_engine() -> None:
    unreachable = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
    assert fan_out(Stub(True), Stub(True))
    assert not fan_out(Stub(True), Stub(False))
    assert not fan_out(Stub(unreachable), Stub(True))
