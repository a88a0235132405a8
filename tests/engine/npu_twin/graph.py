"""TEST-ONLY TWIN of torch-npu's graph mode, on the CPU: ``torch.npu.NPUGraph``, ``torch.npu.graph``,
``graph_pool_handle``, ``is_current_stream_capturing``, ``graph_task_group_begin`` / ``_end``,
``graph_task_update_begin`` / ``_end`` and ``ExternalEvent``, written from torch-npu's documentation (developer note
"torch_npu.npu.NPUGraph", ``torch_npu/npu/graphs.py``, the op-plugin page of ``graph_task_update_begin``) with the
semantics a caller can get wrong:

* **Capture records; replay recomputes on the captured memory.** Between ``capture_begin`` and ``capture_end``
  (``with torch.npu.graph(g):``) every kernel issued — each PyTorch op and each torch-npu operator — is recorded
  with the tensors it reads and writes. ``replay()`` runs the recorded kernels again, in order, on those same
  tensors: a replay computes from what the captured tensors hold when it runs, so data copied into them (``copy_``)
  before ``replay()`` is used, while a new tensor bound to a Python name is not. The note: "the memory addresses of
  tensors allocated during capture stay fixed at replay; new data must be written into them with copy_()".
* **Capture computes nothing.** The twin runs each kernel once while capturing (it needs the outputs' shapes) and
  then undoes it: every tensor that existed before the capture and that a captured kernel wrote gets its content
  back, and every tensor the capture allocated is filled with NaN (integers: the dtype's lowest value) — the
  graph's memory holds no result until a replay.
* **What the host supplies is frozen at capture:** Python numbers and lists, and the host tensors an operator reads
  on the host when its task is built (``_npu_paged_attention``'s ``context_lens``, ``HOST_TENSORS``), are copied
  when captured; replays reuse the copies whatever the caller's objects hold later.
* **No host reads while capturing:** an op that hands a device value to the host (``.item()``, ``torch.equal``, a
  data-dependent shape such as ``nonzero``) or a synchronisation raises, as it invalidates a capture on the device.
  (``Tensor.tolist()`` / ``.numpy()`` on the twin's host tensors reach no op the twin can see.)
* **Task groups** (vLLM-Ascend's full-graph paged attention, ``attention_v1.py`` ``full_graph_pa`` /
  ``update_graph_params``): ``graph_task_group_begin(stream)`` / ``graph_task_group_end(stream)`` around operators
  issued while capturing on ``stream`` return a handle to those tasks. Outside capture, ``graph_task_update_begin(s,
  handle)``, the same operators issued again on stream ``s``, then ``graph_task_update_end(s)`` replace those tasks'
  arguments — host values included — for the following replays; the re-issued operators compute nothing then.
* **``ExternalEvent``:** ``wait`` and ``reset`` issued on a capturing stream become tasks of the graph; a replay's
  wait needs a ``record`` since the previous reset, else the device would wait forever — the twin raises instead.
  The twin replays synchronously, so the record must come before ``replay()`` (vLLM-Ascend's order when it updates
  before the forward); on the device a record issued just after ``replay()`` also releases the wait.

One capture at a time per process (as torch documents), never on the default stream. Memory pools are tokens only.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from tests.engine.npu_twin import _ops
from tests.engine.npu_twin._ops import require
from tests.engine.npu_twin.device import _CAPTURING, _DEFAULT, Stream, current_stream, synchronize
from tests.engine.npu_twin.device import stream as use_stream

# Tensor arguments that torch-npu operators read on the host when their task is built: frozen at capture (ATB
# PagedAttention's context lengths are host data its tiling reads; vLLM-Ascend updates them with task updates).
HOST_TENSORS: dict[str, tuple[str, ...]] = {
    "_npu_paged_attention": ("context_lens",),
    "_npu_paged_attention_mla": ("context_lens",),
}
# Operators that only compute on the host (a workspace size and its allocation): no task is recorded for them.
HOST_ONLY = {"_npu_paged_attention_get_workspace"}
# PyTorch ops that hand a device value to the host or size their output by the data: illegal while capturing.
_HOST_READS = {"aten.item", "aten._local_scalar_dense", "aten.equal", "aten.is_nonzero", "aten.nonzero",
               "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}
# PyTorch ops that allocate without writing: replaying them changes nothing.
_NO_DATA = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"}

_pool_ids = itertools.count(1)
# Graphs whose capture ended since the fixture last cleared this (tests count captures and replays with it).
CAPTURED: list[NPUGraph] = []


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Kernel:
    """A recorded kernel: ``fn`` over the tensors it was given (by reference) and copies of the host values; its
    outputs are the tensors the capture allocated, which each replay refills."""

    def __init__(self, name: str, fn: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                 outputs: Any) -> None:
        self.name, self.fn, self.args, self.kwargs = name, fn, args, kwargs
        self.outputs = _tensors(outputs)

    def replay(self) -> None:
        if self.fn is None:
            return
        result = self.fn(*self.args, **self.kwargs)
        for old, new in zip(self.outputs, _tensors(result), strict=True):
            if not _same_memory(old, new):
                old.copy_(new)


class _EventTask:
    """``ExternalEvent.wait`` / ``reset`` captured into a graph."""

    def __init__(self, event: ExternalEvent, kind: str) -> None:
        self.event, self.kind = event, kind

    def replay(self) -> None:
        if self.kind == "wait":
            require(self.event.recorded, "NPUGraph.replay: a captured ExternalEvent.wait has no record since its "
                                         "last reset; on the device this replay would wait forever", RuntimeError)
        else:
            self.event.recorded = False


class TaskGroupHandle:
    """What ``graph_task_group_end`` returns (``torch_npu._C._NPUTaskGroupHandle``): the operator tasks of a group."""

    def __init__(self, graph: NPUGraph, kernels: list[_Kernel]) -> None:
        self.graph, self.kernels = graph, kernels


def _freeze_operator_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                          ) -> dict[str, Any]:
    """The call's arguments by name: tensors by reference, except the host tensors the operator reads when its task
    is built (copied), and copies of every host value."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    host = HOST_TENSORS.get(fn.__name__, ())
    return {name: (value.clone() if name in host else value) if isinstance(value, torch.Tensor)
            else tree_map(lambda v: v, value) for name, value in bound.arguments.items()}


class _Capture:
    """A capture underway: the graph, its stream, and what has to be undone when it ends."""

    def __init__(self, graph: NPUGraph, on: Stream) -> None:
        self.graph, self.stream = graph, on
        self.fresh: list[torch.Tensor] = []       # tensors the capture allocated
        self.fresh_storages: set[int] = set()
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []   # (tensor, content before the capture wrote it)
        self.group: list[_Kernel] | None = None   # an open task group's kernels
        self.inside_operator = 0                  # > 0: the PyTorch ops run are a torch-npu operator's own
        self.mode = _Recorder(self)

    def save(self, tensor: torch.Tensor) -> None:
        """Keeps the content of a tensor that existed before the capture and that a captured kernel may write."""
        if tensor.numel() and _storage(tensor) not in self.fresh_storages:
            self.saved.append((tensor, tensor.clone()))

    def allocated(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """Notes the outputs that are new memory (not views of an input, not an input written in place)."""
        given = {_storage(t) for t in inputs if t.numel()}
        for out in outputs:
            if out.numel() and _storage(out) not in given and _storage(out) not in self.fresh_storages:
                self.fresh_storages.add(_storage(out))
                self.fresh.append(out)

    def record(self, kernel: _Kernel) -> None:
        self.graph._tasks.append(kernel)
        if self.group is not None:
            self.group.append(kernel)

    def undo(self) -> None:
        """What a capture on the device leaves: pre-existing tensors as they were, the graph's memory unset."""
        with torch.inference_mode():
            for tensor, before in reversed(self.saved):
                tensor.copy_(before)
            for tensor in self.fresh:
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
                elif tensor.dtype != torch.bool:
                    tensor.fill_(torch.iinfo(tensor.dtype).min)


class _Recorder(TorchDispatchMode):
    """Records each PyTorch op issued while capturing (a torch-npu operator's own ops are part of its task)."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        if capture.inside_operator:
            return func(*args, **kwargs)
        name = str(func.overloadpacket)
        require(name not in _HOST_READS, f"{name} reads a device value on the host: not allowed while capturing an "
                                         f"NPU graph", RuntimeError)
        for argument, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                          func._schema.arguments[len(args):]]):
            if argument.alias_info is not None and argument.alias_info.is_write:
                for tensor in _tensors(value):
                    capture.save(tensor)
        out = func(*args, **kwargs)
        require(all(not isinstance(v, (bool, int, float)) for v in tree_leaves(out)),
                f"{name} returns a host value: not allowed while capturing an NPU graph", RuntimeError)
        capture.allocated(_tensors((args, kwargs)), _tensors(out))
        capture.record(_Kernel(name, None if name in _NO_DATA else func, tree_map(lambda v: v, args),
                               tree_map(lambda v: v, kwargs), out))
        return out


class _Update:
    """A task update underway on ``stream``: the operators re-issued for the group ``handle``."""

    def __init__(self, on: Stream, handle: TaskGroupHandle) -> None:
        self.stream, self.handle = on, handle
        self.issued: list[tuple[str, dict[str, Any]]] = []


_state: dict[str, Any] = {"capture": None, "update": None}


def _capture() -> _Capture | None:
    capture: _Capture | None = _state["capture"]
    return capture


def _operator_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every torch-npu twin operator call goes through here (``_ops.operator``): run it, record it into the graph
    being captured, or take it as an update of a captured task."""
    update: _Update | None = _state["update"]
    if update is not None and fn.__name__ not in HOST_ONLY:
        require(current_stream() is update.stream, f"{fn.__name__}: issued on another stream than the task update "
                                                   f"underway on {update.stream!r}", RuntimeError)
        update.issued.append((fn.__name__, _freeze_operator_call(fn, args, kwargs)))
        return None   # an update rewrites the captured task's arguments; it computes nothing now
    capture = _capture()
    if capture is None or capture.inside_operator:
        return fn(*args, **kwargs)
    capture.inside_operator += 1
    try:
        with _disable_current_modes():   # the operator's own PyTorch ops are its task, not tasks of their own
            if fn.__name__ in HOST_ONLY:
                return fn(*args, **kwargs)
            inputs = _tensors((args, kwargs))
            for tensor in inputs:   # an operator may write any tensor it is given (caches, out=)
                capture.save(tensor)
            frozen = _freeze_operator_call(fn, args, kwargs)
            out = fn(*args, **kwargs)
            capture.allocated(inputs, _tensors(out))
            capture.record(_Kernel(fn.__name__, fn, (), frozen, out))
    finally:
        capture.inside_operator -= 1
    return out


_ops.GRAPH_HOOK.append(_operator_call)


class NPUGraph:
    """``torch.npu.NPUGraph``: ``capture_begin`` / ``capture_end`` (use ``torch.npu.graph``), ``replay``, ``reset``,
    ``pool``. ``replays`` counts this graph's replays (the twin's, for tests)."""

    def __init__(self) -> None:
        self._tasks: list[_Kernel | _EventTask] = []
        self._captured = False
        self._pool: int | None = None
        self.replays = 0

    def capture_begin(self, pool: int | None = None, capture_error_mode: str = "global") -> None:
        require(capture_error_mode in ("global", "thread_local", "relaxed"),
                f"capture_begin: capture_error_mode {capture_error_mode!r}", ValueError)
        require(_capture() is None, "capture_begin: a capture is already underway (one at a time)", RuntimeError)
        require(not self._captured, "capture_begin: this graph holds a capture; reset() it first", RuntimeError)
        on = current_stream()
        require(on is not _DEFAULT, "capture_begin: capture on the default stream is not allowed", RuntimeError)
        capture = _Capture(self, on)
        _state["capture"] = capture
        _CAPTURING.append(on)
        self._pool = pool if pool is not None else next(_pool_ids)
        capture.mode.__enter__()

    def capture_end(self) -> None:
        capture = _capture()
        require(capture is not None and capture.graph is self, "capture_end: this graph is not capturing",
                RuntimeError)
        assert capture is not None
        capture.mode.__exit__(None, None, None)
        _state["capture"] = None
        _CAPTURING.remove(capture.stream)
        require(capture.group is None, "capture_end: a task group is still open (graph_task_group_end)",
                RuntimeError)
        capture.undo()
        self._captured = True
        CAPTURED.append(self)

    def replay(self) -> None:
        require(self._captured, "NPUGraph.replay: nothing captured", RuntimeError)
        require(_capture() is None, "NPUGraph.replay: a capture is underway", RuntimeError)
        for task in self._tasks:
            task.replay()
        self.replays += 1

    def reset(self) -> None:
        self._tasks, self._captured = [], False

    def pool(self) -> int | None:
        return self._pool

    @property
    def kernels(self) -> list[str]:
        """The names of the recorded kernels, in order (the twin's, for tests)."""
        return [t.name for t in self._tasks if isinstance(t, _Kernel)]


class graph:  # noqa: N801  (torch.npu's name)
    """``torch.npu.graph``: synchronises, makes ``stream`` (default: a side stream of its own) current and captures
    the enclosed work into ``npu_graph``."""

    default_capture_stream: Stream | None = None

    def __init__(self, npu_graph: NPUGraph, pool: int | None = None, stream: Stream | None = None,
                 auto_dispatch_capture: bool = False, capture_error_mode: str = "global") -> None:
        require(isinstance(npu_graph, NPUGraph), f"graph: not an NPUGraph: {npu_graph!r}", TypeError)
        require(not auto_dispatch_capture, "graph twin: auto_dispatch_capture (NPUGraph.update) is not modelled")
        if graph.default_capture_stream is None:
            graph.default_capture_stream = Stream()
        self.npu_graph, self.pool, self.capture_error_mode = npu_graph, pool, capture_error_mode
        self.capture_stream = stream if stream is not None else graph.default_capture_stream
        self._stream: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        synchronize()
        self._stream = use_stream(self.capture_stream)
        self._stream.__enter__()
        try:
            self.npu_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self._stream.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.npu_graph.capture_end()
        finally:
            assert self._stream is not None
            self._stream.__exit__(*exc)


def graph_pool_handle() -> int:
    return next(_pool_ids)


def graph_task_group_begin(on: Stream) -> None:
    capture = _capture()
    require(capture is not None and on is capture.stream,
            "graph_task_group_begin: the stream is not capturing a graph", RuntimeError)
    assert capture is not None
    require(capture.group is None, "graph_task_group_begin: a task group is already open", RuntimeError)
    capture.group = []


def graph_task_group_end(on: Stream) -> TaskGroupHandle:
    capture = _capture()
    require(capture is not None and on is capture.stream and capture.group is not None,
            "graph_task_group_end: no task group open on this stream", RuntimeError)
    assert capture is not None and capture.group is not None
    kernels = [k for k in capture.group if k.fn is not None and k.name in _ops.OPERATORS]
    require(bool(kernels), "graph_task_group_end: the group holds no torch-npu operator task", RuntimeError)
    capture.group = None
    return TaskGroupHandle(capture.graph, kernels)


def graph_task_update_begin(on: Stream, handle: TaskGroupHandle) -> None:
    require(isinstance(on, Stream), f"graph_task_update_begin: not a stream: {on!r}", TypeError)
    require(isinstance(handle, TaskGroupHandle), f"graph_task_update_begin: not a task group handle: {handle!r}",
            TypeError)
    require(on not in _CAPTURING, "graph_task_update_begin: the update stream is capturing", RuntimeError)
    require(handle.graph._captured, "graph_task_update_begin: the handle's graph holds no capture", RuntimeError)
    require(_state["update"] is None, "graph_task_update_begin: an update is already underway", RuntimeError)
    _state["update"] = _Update(on, handle)


def graph_task_update_end(on: Stream) -> None:
    update: _Update | None = _state["update"]
    require(update is not None and on is update.stream, "graph_task_update_end: no update underway on this stream",
            RuntimeError)
    assert update is not None
    _state["update"] = None
    captured = [k.name for k in update.handle.kernels]
    issued = [name for name, _ in update.issued]
    require(issued == captured, f"graph_task_update_end: the update re-issued {issued}, the group holds {captured}",
            RuntimeError)
    for kernel, (_, kwargs) in zip(update.handle.kernels, update.issued):
        kernel.kwargs = kwargs


class ExternalEvent:
    """``torch.npu.ExternalEvent``: ``record`` / ``wait`` / ``reset`` on a stream (the current one by default)."""

    def __init__(self) -> None:
        self.recorded = False

    def _captured_on(self, on: Stream | None) -> _Capture | None:
        capture = _capture()
        return capture if capture is not None and (on or current_stream()) is capture.stream else None

    def record(self, stream: Stream | None = None) -> None:
        require(self._captured_on(stream) is None, "ExternalEvent.record while capturing is not modelled")
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        capture = self._captured_on(stream)
        if capture is not None:
            capture.graph._tasks.append(_EventTask(self, "wait"))
            return
        require(self.recorded, "ExternalEvent.wait: never recorded; the stream would wait forever", RuntimeError)

    def reset(self, stream: Stream | None = None) -> None:
        capture = self._captured_on(stream)
        if capture is not None:
            capture.graph._tasks.append(_EventTask(self, "reset"))
            return
        self.recorded = False
