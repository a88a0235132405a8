"""SSE over a real socket: keep-alives while waiting, errors after the 200, and a
client that goes away cancelling the backend call."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.gateway.conftest import SERVED, Gateway

pytestmark = pytest.mark.anyio

KEEPALIVE = ": keep-alive"


@pytest.fixture
def gateway(live_gateway: Gateway) -> Gateway:
    """Every test here needs a real socket: incremental bodies, timing, disconnects."""
    return live_gateway


def frames(body: str) -> list[str]:
    assert body.endswith("\n\n")
    return body.split("\n\n")[:-1]


async def test_keepalives_while_waiting_for_the_first_token(gateway: Gateway) -> None:
    # keepalive_interval is 0.2 s: a first token after 0.9 s gets at least 3 comments before it.
    r = await gateway.client.post("/v1/completions", json={"prompt": "slow:0.9", "stream": True})
    assert r.status_code == 200
    fs = frames(r.text)
    first_data = next(i for i, f in enumerate(fs) if f.startswith("data: "))
    assert first_data >= 3
    assert fs[:first_data] == [KEEPALIVE] * first_data
    data = [f for f in fs if f != KEEPALIVE]
    assert [json.loads(f[6:])["choices"][0]["text"] for f in data[:-1]] == ["Hel", "lo", " world"]
    assert data[-1] == "data: [DONE]"


async def test_chat_keepalives_follow_the_role_chunk(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "slow:0.7"}], "stream": True})
    fs = frames(r.text)
    assert json.loads(fs[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert fs[1] == KEEPALIVE


async def test_keepalives_between_tokens(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "gap:0.5", "stream": True})
    fs = frames(r.text)
    data_positions = [i for i, f in enumerate(fs) if f.startswith("data: {")]
    assert len(data_positions) == 3
    # between the first and the second token (0.5 s apart) come at least 2 comments
    between = fs[data_positions[0] + 1:data_positions[1]]
    assert len(between) >= 2 and set(between) == {KEEPALIVE}


async def test_no_keepalive_when_tokens_come_fast(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert KEEPALIVE not in frames(r.text)


async def test_backend_failure_after_the_200_is_an_error_event(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "midfail:UNAVAILABLE", "stream": True})
    assert r.status_code == 200
    fs = frames(r.text)
    assert json.loads(fs[0][6:])["choices"][0]["text"] == "Hel"
    err = json.loads(fs[-2][6:])["error"]
    assert err["code"] == "backend_unavailable" and err["type"] == "service_unavailable_error"
    assert fs[-1] == "data: [DONE]"
    assert "127.0.0.1" not in r.text


async def test_sequence_error_in_stream_is_an_error_event(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "fail"}], "stream": True})
    fs = frames(r.text)
    assert json.loads(fs[-2][6:])["error"]["type"] == "server_error"
    assert fs[-1] == "data: [DONE]"
    assert "/work" not in r.text and "device lost" not in r.text


async def _running(gateway: Gateway) -> float:
    text = (await gateway.client.get("/metrics")).text
    line = next(ln for ln in text.splitlines()
                if ln.startswith(f'sluice:num_requests_running{{model_name="{SERVED}"}}'))
    return float(line.split()[-1])


async def test_disconnect_mid_stream_cancels_the_backend_call(gateway: Gateway) -> None:
    fake = gateway.backend_calls
    async with gateway.client.stream("POST", "/v1/completions", json={"prompt": "stall", "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"][0]["text"] == "Hel"
                break
        assert not fake.cancelled.is_set()
    # Leaving the block closed the connection mid-body.
    await asyncio.wait_for(fake.cancelled.wait(), 15)
    assert not fake.finished.is_set()
    for _ in range(100):
        if await _running(gateway) == 0:
            break
        await asyncio.sleep(0.02)
    assert await _running(gateway) == 0


async def test_disconnect_while_waiting_for_a_whole_response_cancels_too(gateway: Gateway) -> None:
    fake = gateway.backend_calls
    task = asyncio.create_task(gateway.client.post("/v1/completions", json={"prompt": "stall"}))
    for _ in range(250):
        if fake.generate_requests:
            break
        await asyncio.sleep(0.02)
    assert fake.generate_requests
    task.cancel()  # httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(fake.cancelled.wait(), 15)
