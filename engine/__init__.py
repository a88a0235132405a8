"""Sluice engine: continuous batching, paged KV cache, and the offline ``LLM`` API."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Set before torch loads its OpenMP runtime (nothing in this package imports torch at import time).
# OpenMP workers that spin while they wait fight the tokenizer's own threads and the other processes
# of the stack for the cores: measured on 2 cores, the same LLM.generate took 46.8 s on the main
# thread with workers spinning for libgomp's default 3 ms and 1.8 s with sleeping ones. Sleeping at
# once costs a futex wake-up at each of a step's ~400 parallel regions, so unless the user chose a
# policy, workers spin for ~0.3 ms (libgomp's GOMP_SPINCOUNT, ~100 spins per microsecond) before
# they sleep: a 32-sequence decode step 3-9 % faster in-process, 1 sequence 9 %, served throughput
# within noise of before, and an idle engine still uses no CPU (BENCHMARKS.md). Other OpenMP
# runtimes ignore GOMP_SPINCOUNT.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError, SluiceError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "InvalidRequestError", "QueueFullError", "EngineDeadError", "SluiceError"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the models; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
