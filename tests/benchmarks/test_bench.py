"""End to end: benchmarks.bench against a fake OpenAI SSE server on 127.0.0.1 with known delays."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench import main
from tests.benchmarks.fake_server import FakeBehaviour, FakeServer

FIRST_TOKEN_S = 0.05
TOKEN_S = 0.005


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with FakeServer(FakeBehaviour(first_token_delay_s=FIRST_TOKEN_S, token_delay_s=TOKEN_S)) as s:
        yield s


@pytest.fixture(autouse=True)
def reset(server: FakeServer) -> None:
    server.behaviour.bodies.clear()
    server.behaviour.send_usage = True


def run(server: FakeServer, tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "r.json"
    argv = ["--base-url", server.base_url, "--disable-tqdm", "--result-file", str(out), *args]
    rc = main(argv)
    return rc, json.loads(out.read_text(encoding="utf-8"))


def test_closed_loop_sweep(server: FakeServer, tmp_path: Path) -> None:
    rc, doc = run(server, tmp_path, "--concurrency", "1,3", "--num-prompts", "6", "--warmup", "1",
                  "--input-len", "20", "--output-len", "4", "--goodput", "ttft:60000", "tpot:60000")
    assert rc == 0
    assert doc["command"].startswith("python -m benchmarks.bench --base-url http://127.0.0.1:")
    assert doc["command"].endswith("--goodput ttft:60000 tpot:60000")
    assert doc["config"]["model"] == "fake-model"  # from GET /v1/models
    assert doc["machine"]["cpu_cores"] >= 1 and doc["timestamp"]
    assert [(r["mode"], r["concurrency"]) for r in doc["runs"]] == [("closed", 1), ("closed", 3)]
    bodies = server.behaviour.bodies
    assert len(bodies) == 2 * (1 + 6)  # warm-up + measured, per step
    assert len({b["prompt"] for b in bodies}) == 14  # every step sends fresh prompts
    assert all(b["max_tokens"] == 4 and b["ignore_eos"] is True and b["stream"] is True
               and b["stream_options"] == {"include_usage": True} and "logit_bias" not in b for b in bodies)
    for run_ in doc["runs"]:
        assert (run_["completed"], run_["failed"], run_["num_requests"]) == (6, 0, 6)
        assert run_["total_output_tokens"] == 24 and run_["total_input_tokens"] == 6 * 7  # the fake's usage
        assert run_["good_completed"] == 6
        assert len(run_["requests"]) == 6
        for row in run_["requests"]:
            # The fake server's sleeps may end up to a millisecond early (libuv timers run on a cached ms clock).
            assert row["ttft_ms"] >= FIRST_TOKEN_S * 1000 - 2
            assert row["e2el_ms"] >= (FIRST_TOKEN_S + 3 * TOKEN_S) * 1000 - 2
            assert row["output_tokens"] == 4 and row["error"] is None
        assert run_["ttft"]["p99_ms"] >= FIRST_TOKEN_S * 1000 - 2
        assert run_["output_throughput"] == pytest.approx(24 / run_["duration_s"])


def test_open_loop_chat_counts_chunks_without_usage(server: FakeServer, tmp_path: Path) -> None:
    server.behaviour.send_usage = False
    rc, doc = run(server, tmp_path, "--endpoint", "chat", "--request-rate", "40", "--num-prompts", "5",
                  "--warmup", "0", "--output-len", "3", "--force-length-logit-bias", "--no-ignore-eos",
                  "--save-detailed", "--api-key", "secret")
    assert rc == 0
    (run_,) = doc["runs"]
    assert (run_["mode"], run_["request_rate"], run_["concurrency"]) == ("open", 40.0, None)
    assert run_["completed"] == 5 and run_["total_output_tokens"] == 15  # 3 content chunks each
    assert all(len(row["itls_ms"]) == 2 and row["ttft_ms"] >= FIRST_TOKEN_S * 1000 - 2 for row in run_["requests"])
    bodies = server.behaviour.bodies
    assert len(bodies) == 5
    assert all(b["messages"][0]["role"] == "user" and b["logit_bias"] == {"0": -100, "2": -100}
               and "ignore_eos" not in b for b in bodies)


def test_failures_are_counted_not_fatal(server: FakeServer, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "one two", "output_len": 2}, {"prompt": "FAIL please", "output_len": 2},
            {"prompt": "three", "output_len": 5}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    rc, doc = run(server, tmp_path, "--dataset", str(data), "--num-prompts", "3", "--warmup", "0",
                  "--concurrency", "2")
    assert rc == 0
    (run_,) = doc["runs"]
    assert (run_["completed"], run_["failed"], run_["total_output_tokens"]) == (2, 1, 7)
    assert list(run_["errors"].values()) == [1] and next(iter(run_["errors"])).startswith("HTTP 500")
    assert sorted(b["prompt"] for b in server.behaviour.bodies) == ["FAIL please", "one two", "three"]


def test_unreachable_server_fails_cleanly(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm", "--num-prompts", "1"]) == 1


def test_resolve_model_reads_the_first_model_and_fails_clearly() -> None:
    from aiohttp import web
    from aiohttp.test_utils import RawTestServer

    from benchmarks.bench import resolve_model
    from benchmarks.client import make_client

    answers = [(200, b'{"data":[{"id":"m1"},{"id":"m2"}]}'), (401, b'{"error":"bad key"}'), (200, b'{"data":[]}')]
    auth: list[str | None] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        auth.append(request.headers.get("Authorization"))
        status, body = answers[len(auth) - 1]
        return web.Response(status=status, body=body, content_type="text/plain")  # the type is not checked

    async def go() -> None:
        async with RawTestServer(handler) as server, make_client(5.0) as client:
            base = str(server.make_url("/v1"))
            assert await resolve_model(client, base, "k") == "m1"
            with pytest.raises(ValueError, match=r"/v1/models: HTTP 401: \{\"error\":\"bad key\"\}"):
                await resolve_model(client, base, None)
            with pytest.raises(ValueError, match="no models listed"):
                await resolve_model(client, base, None)
    asyncio.run(go())
    assert auth == ["Bearer k", None, None]


def test_sluice_bench_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from services import cli

    for name in ("benchmarks.bench", "benchmarks.runner", "benchmarks.client"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # what an install without the `bench` extra looks like
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 1
    assert "pip install 'sluice[bench]'" in capsys.readouterr().err
