"""``python -m engine`` / ``sluice engine``: the engine process (token-level gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from common.errors import InvalidRequestError
from common.observability import add_observability_args, observability_settings, set_up
from common.procs import die_with_parent
from common.tls import add_grpc_tls_args, grpc_tls_from_args
from engine.entrypoints.args import add_engine_args, check_local_paths, config_from_args
from engine.entrypoints.metrics import add_metrics_args
from engine.entrypoints.process import set_openmp_defaults, use_huge_pages
from engine.entrypoints.vllm_compat import check_vllm_compat, normalize_flag_spelling


def main(argv: list[str] | None = None) -> None:
    set_openmp_defaults()  # first: nothing has loaded torch yet
    use_huge_pages()
    die_with_parent()  # under `sluice serve`: end with it
    parser = argparse.ArgumentParser(prog="sluice engine", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--log-level", default="info")
    add_engine_args(parser)
    add_observability_args(parser)
    add_metrics_args(parser)
    add_grpc_tls_args(parser)
    ns = parser.parse_args(normalize_flag_spelling(sys.argv[1:] if argv is None else argv))
    try:
        notes = check_vllm_compat(ns)
        observability = observability_settings(ns)
        tls = grpc_tls_from_args(ns)
        config = config_from_args(ns)
        check_local_paths(config)
    except (InvalidRequestError, ValueError) as e:
        parser.error(str(e))
    tracing = set_up(observability, log_level=ns.log_level, process="engine")
    for note in notes:
        logging.getLogger("engine").info("%s", note)
    from engine.entrypoints.grpc_servicer import serve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from engine.executor.errors import WorkerFailedError

    try:
        asyncio.run(serve(config, ns.host, ns.port, shutdown_grace=ns.shutdown_timeout, tracing=tracing,
                          log_requests=observability.log_requests, metrics_host=ns.metrics_host,
                          metrics_port=ns.metrics_port, tls=tls))
    except WorkerFailedError:   # logged; a non-zero exit has the supervisor start the engine again
        sys.exit(1)
    finally:
        if tracing is not None:
            tracing.shutdown()


if __name__ == "__main__":
    main()
