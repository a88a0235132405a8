from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from common.procs import free_port, grpc_serving, stop_process


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_stop_process_terminates_then_kills_what_ignores_sigterm() -> None:
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(polite, 5) == -signal.SIGTERM
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(60)"], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    assert stop_process(stubborn, 0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 5
    assert stop_process(stubborn, 0.5) == -signal.SIGKILL  # already gone: nothing sent, same code


def test_stop_process_group_reaches_the_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                               "print(child.pid, flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, start_new_session=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    stop_process(parent, 5, group=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the child outlived its process group's SIGTERM")


def test_grpc_serving_is_false_where_nothing_listens() -> None:
    assert not grpc_serving(f"127.0.0.1:{free_port()}")
