"""TEST-ONLY TWIN of ``torch.npu``'s device calls (``npu`` gathers them with graph mode), on the CPU: the stream,
event, memory and seed calls Sluice's accelerator device makes, with torch.npu's names (they mirror torch.cuda's).
Work on the CPU is synchronous, so streams and events only check their argument types (waiting on an event never
recorded completes at once, as on CUDA and the NPU); synchronising while a graph is captured raises."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from tests.engine.npu_twin._ops import require


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        require(stream is None or isinstance(stream, Stream), f"Event.record: not a stream: {stream!r}", TypeError)
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        require(stream is None or isinstance(stream, Stream), f"Event.wait: not a stream: {stream!r}", TypeError)

    def synchronize(self) -> None:
        _not_capturing("Event.synchronize")

    def query(self) -> bool:
        return True


class Stream:
    def __init__(self, device: torch.device | int | None = None, priority: int = 0) -> None:
        self.device = device

    def wait_event(self, event: Event) -> None:
        require(isinstance(event, Event), f"Stream.wait_event: not an event: {event!r}", TypeError)
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        require(isinstance(stream, Stream), f"Stream.wait_stream: not a stream: {stream!r}", TypeError)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _not_capturing("Stream.synchronize")

    def query(self) -> bool:
        return True


_DEFAULT = Stream()
_current: list[Stream] = [_DEFAULT]
# Streams capturing a graph (graph.py): synchronising while one captures is an error, as on the device.
_CAPTURING: list[Stream] = []


def _not_capturing(call: str) -> None:
    require(not _CAPTURING, f"{call}: synchronising while a graph is being captured invalidates the capture",
            RuntimeError)


def is_current_stream_capturing() -> bool:
    return current_stream() in _CAPTURING


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def set_device(device: torch.device | int) -> None:
    require(isinstance(device, (torch.device, int)), f"set_device: not a device: {device!r}", TypeError)


def current_device() -> int:
    return 0


def current_stream(device: torch.device | int | None = None) -> Stream:
    return _current[-1]


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    require(s is None or isinstance(s, Stream), f"stream: not a stream: {s!r}", TypeError)
    _current.append(s if s is not None else _current[-1])
    try:
        yield
    finally:
        _current.pop()


def synchronize(device: torch.device | int | None = None) -> None:
    _not_capturing("synchronize")


def mem_get_info(device: torch.device | int | None = None) -> tuple[int, int]:
    """(free, total) bytes: the host's, standing in for the NPU's HBM."""
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")


def max_memory_allocated(device: torch.device | int | None = None) -> int:
    return 0


def reset_peak_memory_stats(device: torch.device | int | None = None) -> None:
    pass


def empty_cache() -> None:
    pass


def manual_seed_all(seed: int) -> None:
    require(isinstance(seed, int), f"manual_seed_all: seed must be an int, got {seed!r}", TypeError)
