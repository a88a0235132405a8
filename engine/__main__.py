"""``python -m engine`` / ``sluice engine``: the engine process (token-level gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from engine.args import add_engine_args, config_from_args
from engine.parent_watch import die_with_parent


def main(argv: list[str] | None = None) -> None:
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
