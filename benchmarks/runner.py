"""The two load shapes: a closed loop (N clients, each sends its next request when the last ends) and
an open loop (requests sent at given times whatever the server's pace, optionally capped in flight)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from benchmarks.client import Clock, Target, send_request
from benchmarks.metrics import RequestResult
from benchmarks.workload import RequestSpec

OnDone = Callable[[RequestResult], None]
T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, on uvloop when it is installed (a dependency of Sluice): the client shares the cores
    with the server it measures, and uvloop's loop costs it less CPU than asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _noop(_: RequestResult) -> None:
    return None


async def run_closed_loop(client: aiohttp.ClientSession, target: Target, specs: Sequence[RequestSpec],
                          concurrency: int, *, on_done: OnDone = _noop,
                          clock: Clock = time.perf_counter) -> tuple[list[RequestResult], float]:
    """Results in the order of ``specs`` and the wall time from the first send to the last answer."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[RequestResult | None] = [None] * len(specs)
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(specs):
            i = next_index  # no await between the check and the claim: asyncio is cooperative
            next_index += 1
            results[i] = r = await send_request(client, target, specs[i], clock)
            on_done(r)

    start = clock()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return [r for r in results if r is not None], clock() - start


async def run_open_loop(client: aiohttp.ClientSession, target: Target, specs: Sequence[RequestSpec],
                        arrivals: Sequence[float], *, max_concurrency: int | None = None,
                        on_done: OnDone = _noop,
                        clock: Clock = time.perf_counter) -> tuple[list[RequestResult], float]:
    """Send ``specs[i]`` at ``arrivals[i]`` seconds after the start (waiting for a slot when capped)."""
    if len(arrivals) != len(specs):
        raise ValueError("one arrival time per request")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(spec: RequestSpec) -> RequestResult:
        if limit is None:
            r = await send_request(client, target, spec, clock)
        else:
            async with limit:
                r = await send_request(client, target, spec, clock)
        on_done(r)
        return r

    start = clock()
    tasks = []
    for spec, at in zip(specs, arrivals):
        delay = start + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    results = list(await asyncio.gather(*tasks))
    return results, clock() - start
