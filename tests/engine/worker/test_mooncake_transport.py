"""MooncakeTransport (engine.worker.kv_transports.mooncake): KV blocks read between processes through Mooncake's
transfer engine over TCP, compared byte for byte with the producer's cache, which both sides build from a seed.

The producer is always another process (``_peer``, a line protocol on stdin/stdout); the consumer is this process
on 127.0.0.1, or another peer inside a network namespace joined to the producer's by a veth pair (the slow test).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.kv_transfer_config import KVTransferConfig
from engine.worker.kv_transports import CacheLayout, make_transport
from engine.worker.kv_transports.mooncake import MooncakeTransport, format_address, parse_address
from tests.procs import ROOT, wait_until

SHAPE = (2, 32, 16, 2, 8)   # [planes, num_blocks, block_size, heads, head_dim]
LOCAL_SHAPE = (2, 8, 16, 2, 8)
LAYERS = 3
BLOCKS = [(3, 0), (7, 5), (31, 2)]
# The rate figure: 64 scattered blocks of 48 KiB per layer (two planes of 16 x 8 x 96 bfloat16) x 30 layers.
BIG_SHAPE = (2, 128, 16, 8, 96)
BIG_LAYERS = 30
Caches = list[torch.Tensor]


def producer_caches(seed: int, shape: tuple[int, ...], layers: int) -> list[torch.Tensor]:
    """The producer's cache, the same in every process: random bfloat16 of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]


def expected_local(remote: Caches, blocks: list[tuple[int, int]], shape: tuple[int, ...]) -> Caches:
    """A zeroed local cache with ``blocks`` copied in: what a read must leave."""
    local = [torch.zeros(shape, dtype=torch.bfloat16) for _ in remote]
    for src, dst in zip(remote, local):
        for r, lo in blocks:
            dst[:, lo] = src[:, r]
    return local


def digest(caches: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for cache in caches:
        h.update(cache.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def config(kv_ip: str = "127.0.0.1", kv_port: int = 0) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="MooncakeConnector", kv_role="kv_both", kv_ip=kv_ip, kv_port=kv_port,
                            transfer_timeout_s=5.0)


def _peer() -> None:
    """A producer or consumer process: ``argv`` kv_ip kv_port; one JSON command a line on stdin, one JSON answer a
    line on stdout (``publish``: build and publish a seeded cache; ``read``: read blocks into a zeroed cache)."""
    transport = make_transport(config(sys.argv[1], int(sys.argv[2])))
    keep: list[list[torch.Tensor]] = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "publish":
            caches = producer_caches(cmd["seed"], tuple(cmd["shape"]), cmd["layers"])
            keep.append(caches)
            answer: dict[str, object] = {"address": transport.publish(caches),
                                         "layout": CacheLayout.of(caches).text()}
        else:
            local = [torch.zeros(cmd["shape"], dtype=torch.bfloat16) for _ in range(cmd["layers"])]
            layout = CacheLayout.parse(cmd["layout"])
            assert layout is not None
            start = time.monotonic()
            count = transport.read(cmd["address"], layout, [tuple(b) for b in cmd["blocks"]], local,
                                   start + cmd["timeout"])
            answer = {"count": count, "elapsed": time.monotonic() - start, "digest": digest(local)}
        print(json.dumps(answer), flush=True)
    transport.close()


class Peer:
    """A ``_peer`` process (optionally under a command prefix, e.g. ``ip netns exec``)."""

    def __init__(self, kv_ip: str = "127.0.0.1", kv_port: int = 0, prefix: tuple[str, ...] = ()) -> None:
        code = "from tests.engine.worker.test_mooncake_transport import _peer; _peer()"
        self.log = tempfile.TemporaryFile()   # the transfer engine's own log, for a failure's message
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", code, kv_ip, str(kv_port)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def ask(self, **cmd: object) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            raise AssertionError(f"the peer exited with {self.proc.returncode}: {self.log.read()[-3000:]!r}")
        return json.loads(line)

    def publish(self, seed: int, shape: tuple[int, ...] = SHAPE, layers: int = LAYERS) -> tuple[str, CacheLayout]:
        answer = self.ask(op="publish", seed=seed, shape=shape, layers=layers)
        layout = CacheLayout.parse(str(answer["layout"]))
        assert layout is not None
        return str(answer["address"]), layout

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def producer() -> Iterator[Peer]:
    peer = Peer()
    yield peer
    peer.kill()


@pytest.fixture(scope="module")
def consumer() -> Iterator[MooncakeTransport]:
    transport = MooncakeTransport(config())
    yield transport
    transport.close()


def test_blocks_read_from_another_process_equal_the_producers_bytes(producer: Peer,
                                                                    consumer: MooncakeTransport) -> None:
    address, layout = producer.publish(seed=1)
    local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    assert consumer.read(address, layout, BLOCKS, local, time.monotonic() + 10) == len(BLOCKS)
    want = expected_local(producer_caches(1, SHAPE, LAYERS), BLOCKS, LOCAL_SHAPE)
    for got, ref in zip(local, want):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))   # every bit, the untouched blocks zero
    # Again into the same (registered) cache, other blocks, a run of consecutive ones among them.
    again = [(0, 1), (1, 2), (2, 3), (20, 7)]
    for t in local:
        t.zero_()
    assert consumer.read(address, layout, again, local, time.monotonic() + 10) == len(again)
    assert digest(local) == digest(expected_local(producer_caches(1, SHAPE, LAYERS), again, LOCAL_SHAPE))


def test_the_address_names_the_session_and_each_layers_cache(producer: Peer) -> None:
    address, layout = producer.publish(seed=2)
    session, bases = parse_address(address)
    assert session.startswith("127.0.0.1:") and len(bases) == LAYERS == layout.layers
    assert format_address(session, bases) == address
    assert layout == CacheLayout.of(producer_caches(2, SHAPE, LAYERS))


@pytest.mark.parametrize("address", ["", "127.0.0.1", "127.0.0.1:1", "4242:3@77", "127.0.0.1:x|0x10",
                                     "127.0.0.1:5|zz", "127.0.0.1:1|0x1000,0x2000,0x3000"])   # the last: no one there
def test_an_address_that_is_not_one_reads_nothing(consumer: MooncakeTransport, address: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    layout = CacheLayout.of(producer_caches(0, SHAPE, LAYERS))
    local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with caplog.at_level(logging.WARNING):
        assert consumer.read(address, layout, BLOCKS, local, time.monotonic() + 5) == 0
    assert len(caplog.records) == 1 and "recomputed" in caplog.records[0].getMessage()
    assert all(not t.any() for t in local)


def test_a_layout_or_block_that_does_not_fit_reads_nothing(producer: Peer, consumer: MooncakeTransport) -> None:
    address, layout = producer.publish(seed=3)
    local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    deadline = time.monotonic() + 5
    assert consumer.read(address, layout, [(32, 0)], local, deadline) == 0   # past the producer's blocks
    assert consumer.read(address, layout, [(0, 8)], local, deadline) == 0    # past ours
    other = CacheLayout("float16", LAYERS, 2, 32, 16, 2, 8)
    assert consumer.read(address, other, BLOCKS, local, deadline) == 0
    # The producer refuses a read outside the memory it registered (an address naming another layer's base).
    session, bases = parse_address(address)
    assert consumer.read(format_address(session, [b + (1 << 40) for b in bases]), layout, BLOCKS, local,
                         deadline) == 0
    assert all(not t.any() for t in local)
    assert consumer.read(address, layout, [], local, deadline) == 0


def test_a_past_deadline_reads_nothing(producer: Peer, consumer: MooncakeTransport) -> None:
    address, layout = producer.publish(seed=4)
    local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    assert consumer.read(address, layout, BLOCKS, local, time.monotonic() - 1) == 0


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_stalled_producer_reads_nothing_by_the_deadline_and_its_late_bytes_never_land(
        consumer: MooncakeTransport) -> None:
    peer = Peer()
    try:
        address, layout = peer.publish(seed=8)
        local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
        assert consumer.read(address, layout, [(0, 0)], local, time.monotonic() + 10) == 1   # connected
        for t in local:
            t.zero_()
        os.kill(peer.proc.pid, signal.SIGSTOP)
        wait_until(lambda: _state(peer.proc.pid) == "T", 5, what="the producer stopped")
        start = time.monotonic()
        assert consumer.read(address, layout, BLOCKS, local, start + 1) == 0
        assert time.monotonic() - start < 2.5   # by the deadline, not the engine's own 5 s (or 60 s on first contact)
        # While that read hangs, the producer is not asked again.
        start = time.monotonic()
        assert consumer.read(address, layout, BLOCKS, local, start + 5) == 0
        assert time.monotonic() - start < 0.5
        os.kill(peer.proc.pid, signal.SIGCONT)   # the hung read completes, into a buffer the cache never sees
        time.sleep(0.5)
        assert all(not t.any() for t in local)
        assert consumer.read(address, layout, BLOCKS, local, time.monotonic() + 10) == len(BLOCKS)
        assert digest(local) == digest(expected_local(producer_caches(8, SHAPE, LAYERS), BLOCKS, LOCAL_SHAPE))
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()


def test_a_killed_producer_reads_nothing_within_the_deadline(consumer: MooncakeTransport) -> None:
    peer = Peer()
    try:
        address, layout = peer.publish(seed=5)
        local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
        assert consumer.read(address, layout, BLOCKS, local, time.monotonic() + 10) == len(BLOCKS)
    finally:
        peer.kill()
    start = time.monotonic()
    assert consumer.read(address, layout, BLOCKS, local, start + 5) == 0   # connected before
    assert time.monotonic() - start < 5


def _free_port_pair() -> int:
    """P such that P and P + 1 are both free here, below the ephemeral ports (where Mooncake takes no port)."""
    for port in random.Random(os.getpid()).sample(range(20000, 30000, 2), 200):
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_kv_port_is_where_the_producer_listens(consumer: MooncakeTransport) -> None:
    port = _free_port_pair()
    peer = Peer(kv_port=port)
    try:
        address, layout = peer.publish(seed=6)
        session, _ = parse_address(address)
        assert session in (f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}")
        local = [torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
        assert consumer.read(address, layout, BLOCKS, local, time.monotonic() + 10) == len(BLOCKS)
        assert digest(local) == digest(expected_local(producer_caches(6, SHAPE, LAYERS), BLOCKS, LOCAL_SHAPE))
    finally:
        peer.kill()


def test_without_mooncake_the_transport_refuses_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)   # makes the import fail as a missing library does
    with pytest.raises(RuntimeError) as e:
        MooncakeTransport(config())
    assert "mooncake-transfer-engine-non-cuda" in str(e.value) and "libibverbs1" in str(e.value)


def test_rate_of_a_scattered_read(producer: Peer, consumer: MooncakeTransport) -> None:
    """64 scattered blocks of 48 KiB per layer x 30 layers arrive intact; the rate is printed (-s), not judged."""
    address, layout = producer.publish(seed=7, shape=BIG_SHAPE, layers=BIG_LAYERS)
    local_shape = (2, 64, *BIG_SHAPE[2:])
    remote_ids = torch.randperm(BIG_SHAPE[1], generator=torch.Generator().manual_seed(0))[:64].tolist()
    local_ids = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    blocks = list(zip(remote_ids, local_ids))
    local = [torch.zeros(local_shape, dtype=torch.bfloat16) for _ in range(BIG_LAYERS)]
    consumer.read(address, layout, blocks[:1], local, time.monotonic() + 10)   # registration and handshake
    start = time.monotonic()
    assert consumer.read(address, layout, blocks, local, start + 60) == len(blocks)
    elapsed = time.monotonic() - start
    nbytes = len(blocks) * layout.block_bytes
    print(f"\nMooncake TCP, 127.0.0.1: {nbytes / 2**20:.0f} MiB in {len(blocks)} scattered blocks x {BIG_LAYERS} "
          f"layers: {elapsed * 1e3:.0f} ms, {nbytes / elapsed / 1e6:.0f} MB/s")
    remote = producer_caches(7, BIG_SHAPE, BIG_LAYERS)
    for src, dst in zip(remote, local):
        assert torch.equal(dst[:, local_ids].view(torch.int16), src[:, remote_ids].view(torch.int16))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's ip and util-linux's unshare"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"sluice-mc-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns add failed: {getattr(e, 'stderr', b'') or e}"
    _ip("netns", "del", probe)
    return None


@pytest.mark.slow
def test_blocks_cross_two_network_namespaces_and_a_cut_link_reads_nothing_by_the_deadline() -> None:
    """Producer in namespace B with a /dev/shm of its own, consumer in A, joined by a veth pair (10.24.0.0/24)."""
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(f"the cross-host test uses network namespaces: {reason}")
    tag = os.getpid()
    a, b, dev_a, dev_b = f"sluice-mca-{tag}", f"sluice-mcb-{tag}", f"mca{tag}", f"mcb{tag}"
    made: list[str] = []
    peers: list[Peer] = []
    try:
        for name in (a, b):
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for name, dev, addr in ((a, dev_a, "10.24.0.1/24"), (b, dev_b, "10.24.0.2/24")):
            _ip("link", "set", dev, "netns", name)
            _ip("-n", name, "addr", "add", addr, "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
        own_shm = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"')
        producer = Peer("10.24.0.2", prefix=("ip", "netns", "exec", b, *own_shm))
        consumer = Peer("10.24.0.1", prefix=("ip", "netns", "exec", a))
        peers += [producer, consumer]
        address, layout = producer.publish(seed=9)
        assert address.startswith("10.24.0.2:")
        got = consumer.ask(op="read", address=address, layout=layout.text(), blocks=BLOCKS, shape=LOCAL_SHAPE,
                           layers=LAYERS, timeout=10)
        assert got["count"] == len(BLOCKS)
        assert got["digest"] == digest(expected_local(producer_caches(9, SHAPE, LAYERS), BLOCKS, LOCAL_SHAPE))
        big_address, big_layout = producer.publish(seed=10, shape=BIG_SHAPE, layers=BIG_LAYERS)
        blocks = [(2 * i, i) for i in range(64)]
        big = dict(op="read", address=big_address, layout=big_layout.text(), blocks=blocks,
                   shape=(2, 64, *BIG_SHAPE[2:]), layers=BIG_LAYERS, timeout=30)
        consumer.ask(**{**big, "blocks": blocks[:1]})   # the handshake
        got = consumer.ask(**big)
        assert got["count"] == len(blocks)
        nbytes = len(blocks) * big_layout.block_bytes
        print(f"\nMooncake TCP, across a veth pair: {nbytes / 2**20:.0f} MiB in {len(blocks)} scattered blocks x "
              f"{BIG_LAYERS} layers: {got['elapsed'] * 1e3:.0f} ms, "
              f"{nbytes / got['elapsed'] / 1e6:.0f} MB/s")
        _ip("-n", b, "link", "set", dev_b, "down")   # the producer's host drops off the network
        got = consumer.ask(op="read", address=address, layout=layout.text(), blocks=BLOCKS, shape=LOCAL_SHAPE,
                           layers=LAYERS, timeout=2)
        assert got["count"] == 0 and got["elapsed"] < 3.5   # by the deadline (2 s), not a TCP timeout
        assert got["digest"] == digest([torch.zeros(LOCAL_SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)])
    finally:
        for peer in peers:
            peer.kill()
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
