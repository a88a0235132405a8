"""TLS on every hop: the flags, the checks of their files, and the one place that picks a secure or an
insecure gRPC port or channel.

gRPC (every process): ``--grpc-tls-cert`` / ``--grpc-tls-key`` turn TLS on; ``--grpc-tls-ca`` adds mutual
TLS — servers then require a client certificate signed by that CA, and clients verify the server's against
it (without it, clients verify against the system's roots). A process presents the same certificate as a
server and as a client of the next hop, so under mTLS it must allow both uses (no extendedKeyUsage, or
serverAuth and clientAuth). Clients check the name they dial (``127.0.0.1`` under ``sluice serve``, a
Service's DNS name in Kubernetes) against the certificate's subjectAltName: no target-name override.

REST (the gateway): uvicorn's and vLLM's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs``.

Every file is read and checked at start-up, so a bad one stops the process with a line naming the flag and
the file (gRPC's own errors surface later, as a crash in its C core or as every handshake failing).
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["GrpcTls", "RestTls", "TlsFileError", "add_grpc_tls_args", "add_rest_tls_args", "aio_channel",
           "bind_port", "grpc_tls_flags", "grpc_tls_from_args", "rest_tls_flags", "rest_tls_from_args",
           "sync_channel"]

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKS = (b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN RSA PRIVATE KEY-----", b"-----BEGIN EC PRIVATE KEY-----",
              b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
CERT_REQS = {0: "none", 1: "optional", 2: "required"}


class TlsFileError(ValueError):
    """A TLS flag's file cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class GrpcTls:
    """The PEM files of gRPC TLS, as given (forwarded to ``sluice serve``'s children) and as read."""

    cert_path: str
    key_path: str
    ca_path: str | None
    cert: bytes
    key: bytes
    ca: bytes | None

    @property
    def mutual(self) -> bool:
        """Servers require client certificates signed by the CA (and clients present theirs)."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        # The client certificate goes only where a CA says servers ask for one.
        if self.mutual:
            return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                certificate_chain=self.cert)
        return grpc.ssl_channel_credentials()


@dataclass(frozen=True)
class RestTls:
    """uvicorn's SSL settings, checked."""

    certfile: str
    keyfile: str | None
    ca_certs: str | None
    cert_reqs: int  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED (0 / 1 / 2, as uvicorn)

    def probe_context(self) -> ssl.SSLContext:
        """For ``sluice serve``'s readiness probe of its own gateway on 127.0.0.1: liveness, not a data path, so
        the server is not verified (its certificate need not name 127.0.0.1). Where client certificates are
        required, the probe presents the gateway's own, which must then be signed by a CA in --ssl-ca-certs."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if self.cert_reqs == ssl.CERT_REQUIRED:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context


# -- flags ----------------------------------------------------------------------------------------------------
def add_grpc_tls_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gRPC TLS", "TLS on the gRPC ports this process serves and dials")
    g.add_argument("--grpc-tls-cert", default=None, metavar="PEM",
                   help="certificate chain this process presents (as a server, and as a client under mTLS); "
                        "with --grpc-tls-key: TLS on every gRPC port and channel")
    g.add_argument("--grpc-tls-key", default=None, metavar="PEM", help="private key of --grpc-tls-cert")
    g.add_argument("--grpc-tls-ca", default=None, metavar="PEM",
                   help="CA certificates: servers require client certificates signed by them (mutual TLS) and "
                        "clients verify servers against them (default: the system's roots, no client certificates)")


def add_rest_tls_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("REST TLS", "HTTPS on the gateway's port (uvicorn's and vLLM's flags)")
    g.add_argument("--ssl-certfile", default=None, metavar="PEM", help="the gateway's certificate chain: HTTPS")
    g.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                   help="its private key (default: in --ssl-certfile)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="PEM", help="CA certificates client certificates are "
                                                                       "verified against")
    g.add_argument("--ssl-cert-reqs", type=int, default=ssl.CERT_NONE, choices=sorted(CERT_REQS),
                   help="client certificates: 0 not asked for, 1 verified when sent, 2 required (default 0)")


def grpc_tls_from_args(ns: argparse.Namespace) -> GrpcTls | None:
    """The checked files of ``--grpc-tls-*``; None when they are not given. Raises TlsFileError."""
    cert_path, key_path, ca_path = ns.grpc_tls_cert, ns.grpc_tls_key, ns.grpc_tls_ca
    if cert_path is None and key_path is None:
        if ca_path is not None:
            raise TlsFileError("--grpc-tls-ca needs --grpc-tls-cert and --grpc-tls-key (mutual TLS presents one)")
        return None
    if cert_path is None or key_path is None:
        given, missing = ("--grpc-tls-cert", "--grpc-tls-key") if key_path is None else ("--grpc-tls-key",
                                                                                        "--grpc-tls-cert")
        raise TlsFileError(f"{given} needs {missing}")
    cert = _read_pem("--grpc-tls-cert", cert_path, (_CERT_MARK,), "a PEM certificate")
    key = _read_pem("--grpc-tls-key", key_path, _KEY_MARKS, "a PEM private key")
    _check_pair("--grpc-tls-cert", cert_path, "--grpc-tls-key", key_path)
    ca = None
    if ca_path is not None:
        ca = _read_pem("--grpc-tls-ca", ca_path, (_CERT_MARK,), "PEM CA certificates")
        _check_ca("--grpc-tls-ca", ca_path)
    return GrpcTls(cert_path, key_path, ca_path, cert, key, ca)


def rest_tls_from_args(ns: argparse.Namespace) -> RestTls | None:
    """The checked ``--ssl-*`` settings; None when HTTPS is off. Raises TlsFileError."""
    certfile, keyfile, ca_certs, cert_reqs = ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs, ns.ssl_cert_reqs
    if certfile is None:
        for flag, value in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
            if value is not None:
                raise TlsFileError(f"{flag} needs --ssl-certfile")
        if cert_reqs != ssl.CERT_NONE:
            raise TlsFileError("--ssl-cert-reqs needs --ssl-certfile")
        return None
    _read_pem("--ssl-certfile", certfile, (_CERT_MARK,), "a PEM certificate")
    if keyfile is not None:
        _read_pem("--ssl-keyfile", keyfile, _KEY_MARKS, "a PEM private key")
    _check_pair("--ssl-certfile", certfile, "--ssl-keyfile", keyfile)
    if ca_certs is not None:
        _read_pem("--ssl-ca-certs", ca_certs, (_CERT_MARK,), "PEM CA certificates")
        _check_ca("--ssl-ca-certs", ca_certs)
    elif cert_reqs != ssl.CERT_NONE:
        raise TlsFileError(f"--ssl-cert-reqs {cert_reqs} ({CERT_REQS[cert_reqs]} client certificates) needs "
                           "--ssl-ca-certs to verify them against")
    return RestTls(certfile, keyfile, ca_certs, cert_reqs)


def grpc_tls_flags(tls: GrpcTls | None) -> list[str]:
    """The ``--grpc-tls-*`` flags that configure a child process alike (``sluice serve``)."""
    if tls is None:
        return []
    flags = ["--grpc-tls-cert", tls.cert_path, "--grpc-tls-key", tls.key_path]
    return flags + (["--grpc-tls-ca", tls.ca_path] if tls.ca_path is not None else [])


def rest_tls_flags(tls: RestTls | None) -> list[str]:
    """The ``--ssl-*`` flags that configure a gateway alike (``sluice serve``)."""
    if tls is None:
        return []
    flags = ["--ssl-certfile", tls.certfile, "--ssl-cert-reqs", str(tls.cert_reqs)]
    flags += ["--ssl-keyfile", tls.keyfile] if tls.keyfile is not None else []
    return flags + (["--ssl-ca-certs", tls.ca_certs] if tls.ca_certs is not None else [])


# -- ports and channels -------------------------------------------------------------------------------------
def bind_port(server: grpc.aio.Server, address: str, tls: GrpcTls | None) -> int:
    """Adds a listening port; 0 when gRPC could not bind it (as ``add_*_port``)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def aio_channel(target: str, tls: GrpcTls | None,
                options: Sequence[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)


def sync_channel(target: str, tls: GrpcTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.channel_credentials())


# -- file checks ----------------------------------------------------------------------------------------------
def _read_pem(flag: str, path: str, marks: tuple[bytes, ...], what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsFileError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if not any(mark in data for mark in marks):
        raise TlsFileError(f"{flag} {path}: not {what}")
    return data


def _check_pair(cert_flag: str, cert_path: str, key_flag: str, key_path: str | None) -> None:
    """The certificate and key load together (the key matches the certificate) as OpenSSL reads them."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path)
    except ssl.SSLError as e:
        if key_path is None:
            raise TlsFileError(f"{cert_flag} {cert_path}: no private key in it and no {key_flag} "
                               f"({e.reason or e})") from None
        if e.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(f"{key_flag} {key_path} does not match the certificate in {cert_flag} "
                               f"{cert_path}") from None
        raise TlsFileError(f"{cert_flag} {cert_path} / {key_flag} {key_path}: cannot be loaded "
                           f"({e.reason or e})") from None


def _check_ca(flag: str, path: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise TlsFileError(f"{flag} {path}: cannot be loaded as CA certificates ({e.reason or e})") from None
