"""``python -m gateway`` as a real process (uvloop + httptools) in front of the fake server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from common.procs import free_port
from tests.gateway.fakes import FakeServer

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


async def test_gateway_process_serves_and_stops(fake_server: FakeServer) -> None:
    port = free_port()
    env = {**os.environ, "SLUICE_API_KEY": "sk-proc"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--tokenizer", fake_server.address, "--port", str(port),
        "--served-model-name", "m", "--log-level", "warning", cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            for _ in range(300):
                try:
                    if (await client.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.returncode is None
                await asyncio.sleep(0.05)
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 401
            auth = {"Authorization": "Bearer sk-proc"}
            r = await client.post("/v1/completions", json={"prompt": "x", "stream": True}, headers=auth)
            assert r.status_code == 200
            texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                     if line.startswith("data: {")]
            assert texts == ["Hel", "lo", " world"]
            assert r.text.endswith("data: [DONE]\n\n")
    finally:
        proc.terminate()
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    # SIGTERM drains (nothing was in flight), then the process exits cleanly.
    assert proc.returncode == 0, out.decode()
    assert b"Traceback" not in out
