"""The device interface: CPU runs everything; accelerators are imported only when chosen."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from engine.device import CpuDevice, get_device
from engine.device.cpu import advise_huge_pages

ENV_KV_HUGE_PAGES, ENV_MALLOC_TUNING = "SLUICE_KV_HUGE_PAGES", "SLUICE_MALLOC_TUNING"


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
    code = ("import sys\nfrom engine.config import EngineConfig\n"
            "import engine.core.engine_core, engine.entrypoints.llm, engine.entrypoints.grpc_servicer\n"
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


def test_importing_engine_changes_no_process_state_the_entry_points_set_openmp_defaults() -> None:
    code = ("import os, sys, engine\n"
            "if sys.argv[1] == 'llm':\n"
            "    import engine.entrypoints.llm\n"
            "import torch\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT', '-'))")
    unset: dict[str, str | None] = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    assert _pythons(code, (["library"], unset),  # import engine alone leaves the process as it was
                    (["llm"], unset),  # the offline API's entry point: a short spin, then sleep
                    (["llm"], {**unset, "OMP_WAIT_POLICY": "ACTIVE"}),
                    (["llm"], {**unset, "OMP_WAIT_POLICY": "PASSIVE"}),  # sleep at once, as chosen
                    (["llm"], {**unset, "GOMP_SPINCOUNT": "0"})) == [
        "None -", "PASSIVE 30000", "ACTIVE -", "PASSIVE -", "PASSIVE 0"]


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _pythons(code: str, *runs: tuple[list[str], dict[str, str | None]]) -> list[str]:
    """stdout of ``python -c code args`` for each run's (args, env), in fresh processes started together."""
    from tests.procs import python_outputs  # here: the scripts import this module, and need no grpc

    return python_outputs(*((["-c", code, *args], env) for args, env in runs))


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_cpu_kv_cache_is_advised_for_huge_pages_and_zeroed() -> None:
    # MADV_HUGEPAGE shows as the "hg" flag of the mapping (whether the kernel then finds free huge pages
    # is up to it). 64 MiB: a cache layer of the default model is ~70 MiB. In a fresh process with torch's
    # allocator left as it is (THP_MEM_ALLOC_ENABLE=0), so only the device's own advice can set the flag.
    code = ("import torch\n"
            "from engine.device import CpuDevice\n"
            "from tests.engine.device.test_device import _vm_flags\n"
            "dev = CpuDevice()\n"
            "cache, = dev.attention_backend().allocate_kv_caches(dev, 1, 1024, 16, 8, 128, torch.bfloat16)\n"
            "middle = cache.data_ptr() + cache.numel() * cache.element_size() // 2\n"
            "print(cache.shape == (2, 1024, 16, 8, 128), not cache.any(), 'hg' in _vm_flags(middle))\n")
    assert _pythons(code, ([], {"THP_MEM_ALLOC_ENABLE": "0"}),
                    ([], {"THP_MEM_ALLOC_ENABLE": "0", ENV_KV_HUGE_PAGES: "0"})) == [
        "True True True", "True True False"]


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_advise_huge_pages_skips_what_has_no_aligned_2mib() -> None:
    assert advise_huge_pages(torch.zeros(1024)) == 0  # 4 KiB
    big = torch.empty(8 << 20, dtype=torch.uint8)
    advised = advise_huge_pages(big)
    assert advised % (2 << 20) == 0 and (4 << 20) <= advised <= (8 << 20)


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_engine_process_allocates_large_tensors_on_huge_pages_unless_the_user_chose() -> None:
    # `python -m engine` sets THP_MEM_ALLOC_ENABLE before torch loads (the served engine's weights and
    # buffers); a library user's process (`import engine`, even `import engine.entrypoints.cli`) keeps torch's default.
    code = ("import sys, engine.entrypoints.process\n"
            "if sys.argv[1] == 'server':\n"
            "    engine.entrypoints.process.use_huge_pages()  # what the engine CLI's main() does first\n"
            "import engine, torch\n"
            "from tests.engine.device.test_device import _vm_flags\n"
            "x = torch.ones(64 << 20, dtype=torch.uint8)\n"
            "print('hg' in _vm_flags(x.data_ptr() + (32 << 20)))\n")
    unset: dict[str, str | None] = {"THP_MEM_ALLOC_ENABLE": None}
    assert _pythons(code, (["server"], unset), (["server"], {"THP_MEM_ALLOC_ENABLE": "0"}),
                    (["library"], unset)) == ["True", "False", "False"]


# A step's temporaries as the allocator sees them: blocks of 12, 12 and 20 MiB (a 2048-token prefill's
# gate/up output is 12 MiB) written and freed, five times over, counting the minor page faults.
_MALLOC_STEPS = (
    "import ctypes, resource\n"
    "from engine.device import CpuDevice\n"
    "dev = CpuDevice()\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]\n"
    "libc.free.argtypes = [ctypes.c_void_p]\n"
    "def step():\n"
    "    blocks = [(libc.malloc(n << 20), n << 20) for n in (12, 12, 20)]\n"
    "    for p, n in blocks: ctypes.memset(p, 1, n)\n"
    "    for p, _ in blocks: libc.free(p)\n"
    "step()\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "for _ in range(5): step()\n"
    "print(dev.malloc_tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="the thresholds are glibc's mallopt")
def test_cpu_device_keeps_freed_step_memory_mapped_unless_turned_off() -> None:
    on, off = _pythons(_MALLOC_STEPS, ([], {ENV_MALLOC_TUNING: None}), ([], {ENV_MALLOC_TUNING: "0"}))
    tuned, faults = on.split()
    assert tuned == "True" and int(faults) < 1000, faults  # the same pages every step
    # glibc's defaults: each block mmap'd (or the heap top trimmed) and its 11,264 pages faulted in again
    tuned, faults = off.split()
    assert tuned == "False" and int(faults) > 20000, faults


def test_env_switches_default_on_and_read_the_usual_offs() -> None:
    from engine.config import KernelSettings

    assert KernelSettings.from_env({}) == KernelSettings()  # every switch on, no row limit
    for off in ("0", "false", " No ", "OFF"):
        assert not KernelSettings.from_env({"SLUICE_AMX_LINEAR": off}).amx_linear
        assert not KernelSettings.from_env({"SLUICE_KV_HUGE_PAGES": off}).kv_huge_pages
    for on in ("1", "yes", "true", ""):
        assert KernelSettings.from_env({"SLUICE_CPU_KERNELS": on}).cpu_kernels
        assert KernelSettings.from_env({"SLUICE_MALLOC_TUNING": on}).malloc_tuning
