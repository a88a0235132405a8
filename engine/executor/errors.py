"""The executor's errors (a module of their own: every executor raises them, and ``base`` imports the executors)."""
from __future__ import annotations


class WorkerFailedError(RuntimeError):
    """A rank of the replica died or stopped answering: every request in flight fails, the engine exits."""
