"""The services and the engines on different hosts, made on this machine: network namespace A (the gateway, the
tokenizer service and a decode engine, on the host's /dev/shm) and namespace B (a prefill engine, with a /dev/shm of
its own) joined by a veth pair, 10.23.0.1/24 and 10.23.0.2/24, each process started by its real entry point inside
its namespace. Requests are disaggregated: B computes each prompt and its first token, and the decode engine in A
pulls the prompt's blocks from B over TCP (MooncakeConnector) and continues with the tokens a colocated engine
gives. The tokenizer service, whose shared memory B cannot map, sends it prompt ids inline and says so once in its
log, naming the engine's address."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common.procs import stop_process
from engine.config import default_model_path
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.procs import ROOT, wait_until

pytestmark = pytest.mark.slow

_CLONE_NEWNET = 0x40000000
ENGINE_ADDR = "10.23.0.2:50051"   # the prefill engine, in B
DECODE_ADDR = "127.0.0.1:50052"   # the decode engine, in A
DECODE_METRICS = "http://127.0.0.1:9152/metrics"
BLOCK = 16
TOKENIZER_ADDR = "127.0.0.1:50061"   # in A, next to the gateway
GATEWAY_URL = "http://127.0.0.1:8000"   # in A
FALLBACK_LOG = f"the engine at {ENGINE_ADDR} cannot map our shared memory segment"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Hosts:
    a: str   # namespace names
    b: str
    tmp: Path
    client: ThreadPoolExecutor   # its one thread is in namespace A
    procs: list[subprocess.Popen[bytes]]

    def start(self, netns: str, name: str, args: list[str], own_shm: bool = False) -> Path:
        """``python args`` in ``netns`` (with a /dev/shm of its own when ``own_shm``); its log's path."""
        log = self.tmp / f"{name}.log"
        prefix = ["ip", "netns", "exec", netns]
        if own_shm:   # a mount namespace whose /dev/shm is a fresh tmpfs, as on another machine
            prefix += ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']
        with open(log, "ab") as f:
            self.procs.append(subprocess.Popen([*prefix, sys.executable, *args], cwd=ROOT, stdout=f,
                                               stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")))
        return log

    def alive(self) -> bool:
        """True while every process runs; raises naming the first that exited."""
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}")
        return True

    def in_a(self, fn, *args):  # type: ignore[no-untyped-def]
        """``fn(*args)`` on the client thread, whose sockets are namespace A's."""
        return self.client.submit(fn, *args).result()


def _enter_netns(name: str) -> None:
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's ip and util-linux's unshare"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"sluice-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns add failed: {getattr(e, 'stderr', b'') or e}"
    ip("netns", "del", probe)
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(f"cross-host tests use network namespaces: {reason}")
    tmp = tmp_path_factory.mktemp("hosts")
    tag = os.getpid()
    a, b = f"sluice-a-{tag}", f"sluice-b-{tag}"
    client = ThreadPoolExecutor(max_workers=1, initializer=_enter_netns, initargs=(a,))
    made: list[str] = []
    h = Hosts(a, b, tmp, client, [])
    try:
        for name in (a, b):
            ip("netns", "add", name)
            made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("link", "add", f"sva{tag}", "type", "veth", "peer", "name", f"svb{tag}")
        for name, dev, addr in ((a, f"sva{tag}", "10.23.0.1/24"), (b, f"svb{tag}", "10.23.0.2/24")):
            ip("link", "set", dev, "netns", name)
            ip("-n", name, "addr", "add", addr, "dev", dev)
            ip("-n", name, "link", "set", dev, "up")
        save_tiny_llama(tmp / "tiny", vocab_size=49152)   # the default model's vocabulary, for its tokenizer
        model = ["--model", str(tmp / "tiny"), "--tokenizer", default_model_path(), "--shutdown-timeout", "1"]
        engine = [*model, "--kv-cache-memory", "64MiB", "--num-threads", "1", "--block-size", str(BLOCK)]
        h.start(b, "engine", ["-m", "engine", "--host", "10.23.0.2", "--port", "50051", *engine,
                              "--kv-transfer-config", mooncake("kv_producer", "10.23.0.2")], own_shm=True)
        h.start(a, "decode", ["-m", "engine", "--host", "127.0.0.1", "--port", "50052", *engine,
                              "--metrics-port", "9152", "--kv-transfer-config", mooncake("kv_consumer", "10.23.0.1")])
        h.start(a, "tokenizer", ["-m", "services.tokenizer", "--engine", ENGINE_ADDR, "--engine", DECODE_ADDR,
                                 "--host", "127.0.0.1", "--port", "50061", *model])
        h.start(a, "gateway", ["-m", "gateway", "--tokenizer", TOKENIZER_ADDR, "--host", "127.0.0.1", "--port",
                               "8000", "--tokenizer-mux", "--shutdown-timeout", "1"])
        wait_until(lambda: h.alive() and h.in_a(_status, f"{GATEWAY_URL}/ready") == 200, 300,
                   what="gateway ready in A")
        # The gateway is ready once one engine is; requests are split once the tokenizer service knows both
        # engines' roles: until a request's blocks have crossed, warm-up requests may run whole on either.
        wait_until(lambda: h.alive() and h.in_a(_split), 120, what="a request split across the hosts")
        yield h
    finally:
        for proc in h.procs:
            if proc.poll() is None:
                stop_process(proc, 10)
        client.shutdown()
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def mooncake(role: str, host: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_ip": host})


def _split() -> bool:
    """One completion of a few blocks; True once the decode engine has pulled blocks from the prefill engine. Each
    prompt is new: one that ran whole on the decode engine before the split began is cached there, never pulled."""
    try:
        _complete(f"Warm-up {time.monotonic_ns()} across the veth: " + " ".join(["words"] * 40))
        page = httpx.get(DECODE_METRICS, timeout=10).text
        return _metric(page, "sluice:kv_transfer_blocks_total", direction="received") > 0
    except (httpx.HTTPError, AssertionError):   # an engine is not up yet (the request, the page, or the series)
        return False


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _stream(prompt: str) -> list[str]:
    """The SSE data lines of a streamed completion."""
    body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{GATEWAY_URL}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_stream_crosses_hosts_and_prompt_ids_go_inline_said_once(hosts: Hosts) -> None:
    for prompt in ("Across the veth:", "And once more:"):
        events = hosts.in_a(_stream, prompt)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c["choices"]) >= 2
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    log = (hosts.tmp / "tokenizer.log").read_text()
    fallback = [line for line in log.splitlines() if "cannot map our shared memory" in line]
    assert len(fallback) == 1 and FALLBACK_LOG in fallback[0] and "sending prompt ids inline" in fallback[0], \
        fallback


def _complete(prompt: str) -> dict:  # type: ignore[type-arg]
    body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{GATEWAY_URL}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not on the page")


def test_prefill_in_b_hands_its_blocks_to_the_decode_engine_in_a_over_tcp(hosts: Hosts) -> None:
    prompts = [f"{lead} across the veth, a prompt of some length to fill a few blocks of sixteen tokens each: "
               + " ".join(["more words"] * n) for lead, n in (("One", 3), ("Two", 11), ("Three", 24), ("Four", 40))]
    before = hosts.in_a(lambda: httpx.get(DECODE_METRICS, timeout=10).text)
    served = [hosts.in_a(_complete, p) for p in prompts]
    after = hosts.in_a(lambda: httpx.get(DECODE_METRICS, timeout=10).text)
    full_blocks = sum(r["usage"]["prompt_tokens"] // BLOCK for r in served)
    received = (_metric(after, "sluice:kv_transfer_blocks_total", direction="received")
                - _metric(before, "sluice:kv_transfer_blocks_total", direction="received"))
    assert received == full_blocks > 0
    assert _metric(after, "sluice:kv_transfer_fallbacks_total") == 0
    assert 'kv_role="kv_consumer"' in after and 'kv_connector="MooncakeConnector"' in after
    # The colocated reference: the same checkpoint in this process, one engine doing both halves.
    from engine.entrypoints.llm import LLM, SamplingParams

    llm = LLM(str(hosts.tmp / "tiny"), tokenizer=default_model_path(), kv_cache_memory=64 * 2**20)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                                ignore_eos=True))]
    assert [r["choices"][0]["text"] for r in served] == expected
