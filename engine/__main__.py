"""``python -m engine`` / ``sluice engine``: the engine process (token-level gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from engine.args import add_engine_args, config_from_args
from engine.parent_watch import die_with_parent


def use_huge_pages() -> None:
    """Put the engine process's large tensors (weights, KV cache, step buffers) on transparent huge pages:
    PyTorch's CPU allocator 2 MiB-aligns them and advises MADV_HUGEPAGE when THP_MEM_ALLOC_ENABLE is set
    before torch loads (unless the user set it; 0 turns it off). Each decode step streams every weight and
    reads scattered KV blocks, on 4 KiB pages a TLB miss every few KiB: on the AMX machine 128-sequence
    bfloat16 decode steps took 81.8 / 82.6 ms against 87.6 / 86.6 without (BENCHMARKS.md, "bfloat16 on
    AMX"). Only in this process, not on ``import engine``: an allocator that maps, faults and unmaps a huge
    temporary per call can be slower (a lone 12.6 MB silu_and_mul output: 9.0 ms against 0.76), which the
    engine's own steps did not show."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: list[str] | None = None) -> None:
    use_huge_pages()  # first: nothing has loaded torch yet
    die_with_parent()  # under `sluice serve`: end with it
    parser = argparse.ArgumentParser(prog="sluice engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--log-level", default="info")
    add_engine_args(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    config = config_from_args(ns)
    from engine.server import serve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(config, ns.host, ns.port, shutdown_grace=ns.shutdown_timeout))


if __name__ == "__main__":
    main()
