"""Placeholder until the executor lands (issue 23)."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.uniproc import UniprocExecutor


class RayExecutor(UniprocExecutor):
    def __init__(self, config: EngineConfig) -> None:
        raise NotImplementedError("ray_executor executor")
