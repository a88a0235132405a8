"""Process-wide settings that only the engine's entry points make (``python -m engine``, ``LLM``), before torch
loads its OpenMP runtime: ``import engine`` itself changes nothing in the process."""

from __future__ import annotations

import os


def set_openmp_defaults() -> None:
    """OpenMP workers that spin while they wait fight the tokenizer's own threads and the other processes of the
    stack for the cores: measured on 2 cores, the same ``LLM.generate`` took 46.8 s on the main thread with
    workers spinning for libgomp's default 3 ms and 1.8 s with sleeping ones. Sleeping at once costs a futex
    wake-up at each of a step's ~400 parallel regions, so unless the user chose a policy, workers spin for
    ~0.3 ms (``GOMP_SPINCOUNT``, ~100 spins per microsecond) before they sleep: 3-9 % faster decode steps,
    and an idle engine still uses no CPU (docs/cpu-kernels.md). Other OpenMP runtimes ignore GOMP_SPINCOUNT."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "30000")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def use_huge_pages() -> None:
    """Put the engine process's large tensors (weights, KV cache, step buffers) on transparent huge pages:
    PyTorch's CPU allocator 2 MiB-aligns them and advises MADV_HUGEPAGE when THP_MEM_ALLOC_ENABLE is set
    before torch loads (unless the user set it; 0 turns it off). Each decode step streams every weight and
    reads scattered KV blocks, on 4 KiB pages a TLB miss every few KiB: on the AMX machine 128-sequence
    bfloat16 decode steps took 81.8 / 82.6 ms against 87.6 / 86.6 without (docs/cpu-kernels.md). Only in the
    engine process, not in the offline API's: an allocator that maps, faults and unmaps a huge temporary per
    call can be slower (a lone 12.6 MB silu_and_mul output: 9.0 ms against 0.76), which the engine's own steps
    did not show."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
