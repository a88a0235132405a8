"""A two-node Ray cluster on this machine for the ray executor's tests, made of two hosts as DESIGN.md §7 says.

Node ``a`` (the head) runs in this network namespace, where the tests and the engine's driver run; node ``b`` runs
in a network namespace of its own, reachable only through a veth pair (``a`` at ``10.x.y.1``, ``b`` at
``10.x.y.2``), so whatever crosses from one node to the other crosses a network link as between two hosts. Each
node has one CPU, so a placement group of two ``{"CPU": 1}`` bundles must put one on each. Each node's processes
use their end of the pair for torch.distributed's gloo (``GLOO_SOCKET_IFNAME``): this machine's hostname resolves to
127.0.0.1, which the other host cannot reach — as a multi-homed host would be told to.

Both nodes are ``ray start --block`` processes with their own temp dir (so no other Ray user on the machine finds
this cluster); :meth:`TwoNodeRayCluster.stop` kills every process under them and removes the veth pair and the
namespace.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.procs import free_port

RAY = str(Path(sys.executable).with_name("ray"))
ROOT = Path(__file__).resolve().parent.parent


def netns_available() -> bool:
    """Whether this process may create network namespaces (root and the ``ip`` tool)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _free_subnet() -> str:
    """A ``10.231.N`` /24 no interface of this machine uses."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for n in range(os.getpid() % 200, 256):
        if f" 10.231.{n}." not in used:
            return f"10.231.{n}"
    raise RuntimeError("no free 10.231.N.0/24 subnet")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def net_namespace(pid: int) -> int:
    """The inode of the network namespace ``pid`` runs in (what tells one of these hosts from the other)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


class TwoNodeRayCluster:
    """Node ``a`` (head, this namespace) and node ``b`` (its own namespace), one CPU each."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.netns = f"sluice-ray-{tag}"
        self.veth_a, self.veth_b = f"sra{tag}"[:15], f"srb{tag}"[:15]
        self.subnet = _free_subnet()
        self.ip_a, self.ip_b = f"{self.subnet}.1", f"{self.subnet}.2"
        self.port = free_port()
        # Short: Ray's unix socket paths under it must stay under 108 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="sr", dir="/tmp")
        self.procs: list[subprocess.Popen[bytes]] = []
        self._netns_made = False

    @property
    def address(self) -> str:
        """The GCS address, as ``RAY_ADDRESS`` or ``ray.init(address=...)`` take it."""
        return f"{self.ip_a}:{self.port}"

    def netns_b(self) -> int:
        """The inode of node ``b``'s network namespace, as :func:`net_namespace` gives it."""
        return os.stat(f"/run/netns/{self.netns}").st_ino

    def driver_env(self) -> dict[str, str]:
        """What a driver on node ``a`` needs: the cluster's address and gloo on ``a``'s end of the pair."""
        return {"RAY_ADDRESS": self.address, "GLOO_SOCKET_IFNAME": self.veth_a}

    def start(self, timeout: float = 90) -> TwoNodeRayCluster:
        try:
            self._make_netns()
            common = ["--block", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats",
                      "--object-store-memory=80000000", f"--temp-dir={self.temp_dir}"]
            self._spawn("a", [], self.veth_a,
                        ["--head", f"--node-ip-address={self.ip_a}", f"--port={self.port}",
                         "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                         f"--dashboard-agent-listen-port={free_port()}", *common])
            self._wait_started("a", timeout)
            self._spawn("b", ["ip", "netns", "exec", self.netns], self.veth_b,
                        [f"--address={self.address}", f"--node-ip-address={self.ip_b}", *common])
            self._wait_started("b", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _make_netns(self) -> None:
        _ip("netns", "add", self.netns)
        self._netns_made = True
        _ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        _ip("link", "set", self.veth_b, "netns", self.netns)
        _ip("addr", "add", f"{self.ip_a}/24", "dev", self.veth_a)
        _ip("link", "set", self.veth_a, "up")
        for args in (["addr", "add", f"{self.ip_b}/24", "dev", self.veth_b], ["link", "set", self.veth_b, "up"],
                     ["link", "set", "lo", "up"]):
            _ip("netns", "exec", self.netns, "ip", *args)

    def log(self, node: str) -> Path:
        return Path(self.temp_dir) / f"ray-start-{node}.log"

    def _spawn(self, node: str, prefix: list[str], ifname: str, flags: list[str]) -> None:
        # The workers inherit the raylet's environment: this checkout's code, gloo on this node's interface.
        env = dict(os.environ, GLOO_SOCKET_IFNAME=ifname, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        with open(self.log(node), "ab") as f:
            self.procs.append(subprocess.Popen([*prefix, RAY, "start", *flags], stdout=f, stderr=subprocess.STDOUT,
                                               env=env, cwd=ROOT))

    def _wait_started(self, node: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while b"Ray runtime started" not in self.log(node).read_bytes():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {node} did not start:\n{self.log(node).read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Ends every process of the cluster, then removes the network. The whole tree under each ``ray start`` is
        stopped first (nothing spawns any more), then killed: Ray's workers leave their parent's process group and
        rename themselves, so neither the group nor the command line finds them once their raylet is gone."""
        tree = _descendants([p.pid for p in self.procs])
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            tree |= _descendants([p.pid for p in self.procs])
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait()
        self.procs.clear()
        if self._netns_made:
            subprocess.run(["ip", "link", "del", self.veth_a], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
            self._netns_made = False
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _descendants(roots: list[int]) -> set[int]:
    """``roots`` and every living process under them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found
