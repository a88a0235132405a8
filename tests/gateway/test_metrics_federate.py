"""``--metrics-federate``: the gateway's /metrics appends other processes' pages (the engine's vllm:* series)
after its own, and a target that is down or too slow adds nothing but reads 0 in sluice:metrics_federate_up."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import free_port
from gateway.__main__ import build_parser, settings_from_args
from gateway.app import create_app
from gateway.client import GrpcBackend
from gateway.metrics import GatewayMetrics
from services.tokenizer.migration import MigrationMetrics

pytestmark = pytest.mark.anyio

ENGINE_PAGE = (b'# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n'
               b'# TYPE vllm:num_requests_waiting gauge\n'
               b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
               b'# HELP vllm:lora_requests_info Running stats on lora requests.\n'
               b'# TYPE vllm:lora_requests_info gauge\n'
               b'vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters=""} 1.5e9\n')




def _tokenizer_page() -> bytes:
    """A tokenizer service's page (services/tokenizer/migration.py) after two moves, as prometheus_client writes it."""
    metrics = MigrationMetrics()
    metrics.migrated.inc(2)
    return generate_latest(metrics.registry)


TOKENIZER_PAGE = _tokenizer_page()


class _Target(BaseHTTPRequestHandler):
    delay_s = 0.0
    page = ENGINE_PAGE

    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        time.sleep(self.delay_s)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(self.page)
        except BrokenPipeError:   # the slow one: the gateway gave up on it
            pass

    def log_message(self, *args: object) -> None:
        pass


def _serve(delay_s: float, page: bytes = ENGINE_PAGE) -> Iterator[str]:
    handler = type("Handler", (_Target,), {"delay_s": delay_s, "page": page})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def engine_url() -> Iterator[str]:
    yield from _serve(0.0)


@pytest.fixture
def slow_url() -> Iterator[str]:
    yield from _serve(2.0)


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


async def test_metrics_page_appends_a_target_and_marks_one_that_is_down(engine_url: str) -> None:
    down = f"http://127.0.0.1:{free_port()}/metrics"   # nothing listens there
    ns = build_parser().parse_args(["--metrics-federate", engine_url, "--metrics-federate", down])
    settings = settings_from_args(ns, {})
    assert settings.metrics_federate == (engine_url, down)
    backend = GrpcBackend.connect(("127.0.0.1:1",))   # /metrics never calls it
    try:
        app = create_app(settings, backend)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            r = await client.get("/metrics")
            again = await client.get("/metrics")
    finally:
        await backend.close()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = families(r.text)   # the whole page parses: the gateway's own families, then the engine's
    assert got["vllm:num_requests_waiting"] == [({"engine": "0", "model_name": "m"}, 3.0)]
    assert sorted(got["sluice:metrics_federate_up"], key=lambda s: s[1]) == [
        ({"target": down}, 0.0), ({"target": engine_url}, 1.0)]
    assert "sluice:http_requests" in got
    assert r.text.index("sluice:http_requests_total") < r.text.index("vllm:num_requests_waiting")
    # Appended once per scrape, never accumulated.
    assert again.text.count("vllm:num_requests_waiting{") == 1


async def test_a_target_slower_than_the_timeout_is_left_out(engine_url: str, slow_url: str) -> None:
    metrics = GatewayMetrics(federate=(slow_url, engine_url), federate_timeout=0.3)
    body, _ = await metrics.render()   # the slow one would answer after 2 s: it is given up on at 0.3 s
    got = families(body.decode())
    # The second target's series: engine "1" (the target's position), whatever the page said.
    assert got["vllm:num_requests_waiting"] == [({"engine": "1", "model_name": "m"}, 3.0)]
    assert dict((s[0]["target"], s[1]) for s in got["sluice:metrics_federate_up"]) == {slow_url: 0.0,
                                                                                      engine_url: 1.0}


async def test_replicas_engines_are_merged_and_labelled_by_their_position(engine_url: str) -> None:
    """Two data-parallel replicas' engines, each labelling itself engine "0": one family on the page, a series per
    replica (engine "0" and "1"), so Prometheus sees neither a family twice nor a series twice."""
    second = _serve(0.0)
    other_url = next(second)
    try:
        body, _ = await GatewayMetrics(federate=(engine_url, other_url)).render()
    finally:
        second.close()
    text = body.decode()
    assert families(text)["vllm:num_requests_waiting"] == [({"engine": "0", "model_name": "m"}, 3.0),
                                                          ({"engine": "1", "model_name": "m"}, 3.0)]
    assert text.count("# TYPE vllm:num_requests_waiting gauge") == 1
    # A series the engine does not label by engine (the inference extension's LoRA gauge) is told apart too.
    lora = {"max_lora": "1", "running_lora_adapters": "a", "waiting_lora_adapters": ""}
    assert families(text)["vllm:lora_requests_info"] == [({**lora, "engine": "0"}, 1.5e9),
                                                        ({**lora, "engine": "1"}, 1.5e9)]


def test_a_federate_target_must_be_an_http_url() -> None:
    ns = build_parser().parse_args(["--metrics-federate", "127.0.0.1:9000/metrics"])
    with pytest.raises(ValueError, match="--metrics-federate: '127.0.0.1:9000/metrics' is not an http"):
        settings_from_args(ns, {})


class _CutOff(BaseHTTPRequestHandler):
    """A target that dies mid-answer (an engine killed or restarting): more bytes promised than sent."""

    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(ENGINE_PAGE) + 100))
        self.end_headers()
        self.wfile.write(ENGINE_PAGE[:40])
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


async def test_a_target_that_dies_mid_answer_is_left_out(engine_url: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CutOff)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    cut = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        body, _ = await GatewayMetrics(federate=(cut, engine_url)).render()   # http.client.IncompleteRead inside
    finally:
        server.shutdown()
        server.server_close()
    got = families(body.decode())
    assert got["vllm:num_requests_waiting"] == [({"engine": "1", "model_name": "m"}, 3.0)]
    assert dict((s[0]["target"], s[1]) for s in got["sluice:metrics_federate_up"]) == {cut: 0.0, engine_url: 1.0}


async def test_tokenizer_services_pages_are_labelled_by_tokenizer_not_engine(engine_url: str) -> None:
    """``--metrics-federate-tokenizer``: each tokenizer service's series once, labelled tokenizer="i" by its
    position (not as an engine: the engine label still counts engines only), after the engines' families."""
    pages = [_serve(0.0, TOKENIZER_PAGE) for _ in range(2)]
    first, second = (next(p) for p in pages)
    ns = build_parser().parse_args(["--metrics-federate", engine_url, "--metrics-federate-tokenizer", first,
                                    "--metrics-federate-tokenizer", second])
    settings = settings_from_args(ns, {})
    assert settings.metrics_federate_tokenizers == (first, second)
    try:
        body, _ = await GatewayMetrics(federate=settings.metrics_federate,
                                       federate_tokenizers=settings.metrics_federate_tokenizers).render()
    finally:
        for p in pages:
            p.close()
    got = families(body.decode())
    assert got["sluice:requests_migrated"] == [({"tokenizer": "0"}, 2.0), ({"tokenizer": "1"}, 2.0)]
    assert got["vllm:num_requests_waiting"] == [({"engine": "0", "model_name": "m"}, 3.0)]
    assert dict((s[0]["target"], s[1]) for s in got["sluice:metrics_federate_up"]) == {
        engine_url: 1.0, first: 1.0, second: 1.0}
    ns = build_parser().parse_args(["--metrics-federate-tokenizer", "127.0.0.1:9100/metrics"])
    with pytest.raises(ValueError, match="--metrics-federate-tokenizer: '127.0.0.1:9100/metrics' is not an http"):
        settings_from_args(ns, {})
