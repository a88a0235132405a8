"""``python -m common.health_probe ADDRESS SERVICE [--grpc-tls-...]``: exit 0 when the gRPC health service at
ADDRESS reports SERVICE SERVING, else 1.

For Kubernetes exec probes and compose healthchecks of servers on TLS: the kubelet's own gRPC probe speaks
plaintext only, so it cannot reach a port that requires TLS, let alone a client certificate.
"""

from __future__ import annotations

import argparse
import sys

from common.procs import grpc_serving
from common.tls import TlsFileError, add_grpc_tls_args, grpc_tls_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m common.health_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", help="host:port of the gRPC server")
    p.add_argument("service", help='the health service name asked for ("" for the whole server)')
    add_grpc_tls_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        tls = grpc_tls_from_args(ns)
    except TlsFileError as e:
        parser.error(str(e))
    return 0 if grpc_serving(ns.address, ns.service, tls) else 1


if __name__ == "__main__":
    sys.exit(main())
