"""What every twin operator shares: the argument check that raises as torch-npu's front end does (ValueError for a
wrong shape or value, TypeError for a wrong dtype or argument type), and the record of which operators ran."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# Names of the twin operators called since the fixture last cleared it (tests compare it with what the engine names).
CALLED: set[str] = set()
# Every twin operator, by name.
OPERATORS: dict[str, Callable[..., Any]] = {}
# Graph mode (graph.py) takes every operator call while it is loaded: it records calls into a graph being captured
# and takes them as task updates; otherwise it runs them.
GRAPH_HOOK: list[Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]] = []


def require(ok: bool, message: str, error: type[Exception] = ValueError) -> None:
    if not ok:
        raise error(message)


def operator(fn: F) -> F:
    """Registers ``fn`` as a twin operator and records each call by name (after its checks pass or fail)."""
    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        CALLED.add(fn.__name__)
        if GRAPH_HOOK:
            return GRAPH_HOOK[-1](fn, args, kwargs)
        return fn(*args, **kwargs)

    OPERATORS[fn.__name__] = recorded
    return recorded  # type: ignore[return-value]


def require_contiguous(name: str, op: str, t: torch.Tensor) -> None:
    """The fused operators take ND-format tensors and refuse non-contiguous ones."""
    require(t.is_contiguous(), f"{op}: {name} must be contiguous (ND format)")


def require_dtype(name: str, op: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    require(t.dtype in dtypes, f"{op}: {name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}", TypeError)
