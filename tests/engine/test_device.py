"""The device interface: CPU runs everything; accelerators are imported only when chosen."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.device import CpuDevice, get_device


def test_cpu_device_is_a_complete_no_op_stream_backend() -> None:
    dev = get_device("cpu")
    assert isinstance(dev, CpuDevice) and dev.torch_device == torch.device("cpu")
    stream, event = dev.new_stream(), dev.new_event()
    with dev.use_stream(stream):
        x = torch.ones(3) * 2
    dev.record_event(event, stream)
    dev.wait_event(stream, event)
    dev.synchronize()
    assert x.tolist() == [2.0, 2.0, 2.0]
    free, total = dev.memory_info()
    assert 0 < free <= total
    assert dev.attention_backend() is not None


def test_unknown_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu")


def test_npu_backend_needs_torch_npu_and_says_so() -> None:
    # torch_npu is not installed here: choosing npu fails with a clear message, never an ImportError trace.
    code = ("from engine.device import get_device\n"
            "try:\n    get_device('npu')\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERR device 'npu' needs torch_npu" in out.stdout


def test_engine_never_imports_torch_npu_unless_chosen() -> None:
    code = ("import sys\nfrom engine.config import EngineConfig\nimport engine.core, engine.llm, engine.server\n"
            "print('torch_npu' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_and_events() -> None:
    dev = get_device("cuda")
    s1, s2, ev = dev.new_stream(), dev.new_stream(), dev.new_event()
    with dev.use_stream(s1):
        x = torch.ones(1024, device=dev.torch_device) * 3
    dev.record_event(ev, s1)
    dev.wait_event(s2, ev)
    with dev.use_stream(s2):
        y = x + 1
    dev.synchronize()
    assert y[0].item() == 4.0


def test_importing_engine_makes_openmp_workers_sleep_unless_the_user_chose() -> None:
    code = ("import os, engine, torch; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT', '-'))")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def run(**extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, **extra})
        return out.stdout.strip()

    assert run() == "PASSIVE 30000"  # a short spin, then sleep
    assert run(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE -"
    assert run(OMP_WAIT_POLICY="PASSIVE") == "PASSIVE -"  # sleep at once, as chosen
    assert run(GOMP_SPINCOUNT="0") == "PASSIVE 0"


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_importing_engine_puts_large_tensors_on_huge_pages_unless_the_user_chose() -> None:
    # THP_MEM_ALLOC_ENABLE (read by torch's CPU allocator when torch loads): large tensors advised
    # MADV_HUGEPAGE, which /proc/self/smaps shows as the "hg" flag of the tensor's mapping (whether the
    # kernel then finds free huge pages is up to it).
    code = ("import engine, torch\n"
            "x = torch.ones(64 << 20, dtype=torch.uint8)\n"
            "addr, flags, inside = x.data_ptr(), '', False\n"
            "for line in open('/proc/self/smaps'):\n"
            "    head = line.split()[0]\n"
            "    if '-' in head and ':' not in head:\n"
            "        lo, hi = (int(v, 16) for v in head.split('-'))\n"
            "        inside = lo <= addr < hi\n"
            "    elif inside and line.startswith('VmFlags:'):\n"
            "        flags = line.split()[1:]\n"
            "print('hg' in flags)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def run(**extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, **extra})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run() == "True"  # advised for huge pages
    assert run(THP_MEM_ALLOC_ENABLE="0") == "False"
