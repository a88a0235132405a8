"""common/tls.py: each bad file stops start-up with a line naming the flag and the file; the secure port and
channels it builds speak TLS and, with a CA, require a client certificate."""

from __future__ import annotations

import argparse
import asyncio
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import health_probe
from common.grpc_server import MAX_MESSAGE_BYTES, bind, new_server
from common.procs import grpc_serving
from common.tls import (
    TlsFileError,
    add_grpc_tls_args,
    add_rest_tls_args,
    grpc_tls_flags,
    grpc_tls_from_args,
    rest_tls_flags,
    rest_tls_from_args,
)
from tests.tls_factory import CertFiles, make_ca, make_cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    other_ca = make_ca(d, "other-ca")
    return {"ca": ca, "server": make_cert(d, ca, "server"), "client": make_cert(d, ca, "client"),
            "stranger": make_cert(d, other_ca, "stranger")}


def _grpc(*argv: str | Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_grpc_tls_args(p)
    return p.parse_args([str(a) for a in argv])


def _rest(*argv: str | Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_rest_tls_args(p)
    return p.parse_args([str(a) for a in argv])


def _grpc_error(*argv: str | Path) -> str:
    with pytest.raises(TlsFileError) as e:
        grpc_tls_from_args(_grpc(*argv))
    return str(e.value)


# -- errors -----------------------------------------------------------------------------------------------------
def test_no_flags_no_tls() -> None:
    assert grpc_tls_from_args(_grpc()) is None
    assert rest_tls_from_args(_rest()) is None


def test_missing_file_names_flag_and_file(pki: dict[str, CertFiles], tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    assert _grpc_error("--grpc-tls-cert", missing, "--grpc-tls-key", pki["server"].key) == (
        f"--grpc-tls-cert {missing}: cannot read it (No such file or directory)")
    assert _grpc_error("--grpc-tls-cert", pki["server"].cert, "--grpc-tls-key", tmp_path) == (
        f"--grpc-tls-key {tmp_path}: cannot read it (Is a directory)")


def test_not_pem_names_flag_and_file(pki: dict[str, CertFiles], tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"\x30\x82\x01\x0a not PEM at all")
    assert _grpc_error("--grpc-tls-cert", junk, "--grpc-tls-key", pki["server"].key) == (
        f"--grpc-tls-cert {junk}: not a PEM certificate")
    # A certificate where the key belongs.
    assert _grpc_error("--grpc-tls-cert", pki["server"].cert, "--grpc-tls-key", pki["server"].cert) == (
        f"--grpc-tls-key {pki['server'].cert}: not a PEM private key")
    assert _grpc_error("--grpc-tls-cert", pki["server"].cert, "--grpc-tls-key", pki["server"].key,
                       "--grpc-tls-ca", junk) == f"--grpc-tls-ca {junk}: not PEM CA certificates"


def test_broken_pem_names_flag_and_file(pki: dict[str, CertFiles], tmp_path: Path) -> None:
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    message = _grpc_error("--grpc-tls-cert", pki["server"].cert, "--grpc-tls-key", pki["server"].key,
                          "--grpc-tls-ca", broken)
    assert message.startswith(f"--grpc-tls-ca {broken}: cannot be loaded as CA certificates (")
    message = _grpc_error("--grpc-tls-cert", broken, "--grpc-tls-key", pki["server"].key)
    assert message.startswith(f"--grpc-tls-cert {broken} / --grpc-tls-key {pki['server'].key}: cannot be loaded (")


def test_key_not_matching_the_certificate(pki: dict[str, CertFiles]) -> None:
    assert _grpc_error("--grpc-tls-cert", pki["server"].cert, "--grpc-tls-key", pki["client"].key) == (
        f"--grpc-tls-key {pki['client'].key} does not match the certificate in --grpc-tls-cert {pki['server'].cert}")
    with pytest.raises(TlsFileError, match="^--ssl-keyfile .* does not match the certificate in --ssl-certfile"):
        rest_tls_from_args(_rest("--ssl-certfile", pki["server"].cert, "--ssl-keyfile", pki["client"].key))


def test_flags_that_need_another(pki: dict[str, CertFiles]) -> None:
    assert _grpc_error("--grpc-tls-cert", pki["server"].cert) == "--grpc-tls-cert needs --grpc-tls-key"
    assert _grpc_error("--grpc-tls-key", pki["server"].key) == "--grpc-tls-key needs --grpc-tls-cert"
    assert _grpc_error("--grpc-tls-ca", pki["ca"].cert).startswith("--grpc-tls-ca needs --grpc-tls-cert and")
    for argv, message in ((("--ssl-keyfile", pki["server"].key), "--ssl-keyfile needs --ssl-certfile"),
                          (("--ssl-cert-reqs", "2"), "--ssl-cert-reqs needs --ssl-certfile"),
                          (("--ssl-certfile", pki["server"].cert, "--ssl-keyfile", pki["server"].key,
                            "--ssl-cert-reqs", "2"),
                           "--ssl-cert-reqs 2 (required client certificates) needs --ssl-ca-certs to verify them "
                           "against")):
        with pytest.raises(TlsFileError) as e:
            rest_tls_from_args(_rest(*argv))
        assert str(e.value) == message
    # A certificate file without its key, and no --ssl-keyfile.
    with pytest.raises(TlsFileError, match=f"^--ssl-certfile {pki['server'].cert}: no private key in it and no "
                                           "--ssl-keyfile"):
        rest_tls_from_args(_rest("--ssl-certfile", pki["server"].cert))


def test_flags_round_trip_for_children(pki: dict[str, CertFiles]) -> None:
    argv = ["--grpc-tls-cert", str(pki["server"].cert), "--grpc-tls-key", str(pki["server"].key),
            "--grpc-tls-ca", str(pki["ca"].cert)]
    tls = grpc_tls_from_args(_grpc(*argv))
    assert tls is not None and tls.mutual and grpc_tls_flags(tls) == argv
    assert tls.cert == pki["server"].cert.read_bytes()
    rest = ["--ssl-certfile", str(pki["server"].cert), "--ssl-cert-reqs", "1", "--ssl-keyfile",
            str(pki["server"].key), "--ssl-ca-certs", str(pki["ca"].cert)]
    rest_tls = rest_tls_from_args(_rest(*rest))
    assert rest_tls is not None and rest_tls.cert_reqs == ssl.CERT_OPTIONAL and rest_tls_flags(rest_tls) == rest


def test_cli_reports_a_bad_file_without_a_traceback(pki: dict[str, CertFiles], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import main as gateway_main
    from services.supervisor import main as serve_main

    missing = tmp_path / "missing.pem"
    with pytest.raises(SystemExit) as e:
        gateway_main(["--ssl-certfile", str(missing)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--ssl-certfile {missing}: cannot read it" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        serve_main(["--grpc-tls-cert", str(pki["server"].cert), "--grpc-tls-key", str(pki["client"].key)])
    assert e.value.code == (f"sluice serve: --grpc-tls-key {pki['client'].key} does not match the certificate "
                            f"in --grpc-tls-cert {pki['server'].cert}")


# -- the wire ---------------------------------------------------------------------------------------------------
def _tls(files: CertFiles, ca: CertFiles | None) -> argparse.Namespace:
    return _grpc("--grpc-tls-cert", files.cert, "--grpc-tls-key", files.key,
                 *(("--grpc-tls-ca", ca.cert) if ca is not None else ()))


def test_mutual_tls_port_refuses_clients_without_a_trusted_certificate(pki: dict[str, CertFiles]) -> None:
    server_tls = grpc_tls_from_args(_tls(pki["server"], pki["ca"]))
    client_tls = grpc_tls_from_args(_tls(pki["client"], pki["ca"]))
    stranger_tls = grpc_tls_from_args(_tls(pki["stranger"], pki["ca"]))

    async def main() -> None:
        server, health = new_server("sluice.v1.Test", max_receive_bytes=MAX_MESSAGE_BYTES)
        port = bind(server, "127.0.0.1", 0, server_tls)
        await server.start()
        await health.set_serving(True)
        addr = f"127.0.0.1:{port}"
        try:
            probes = await asyncio.gather(*(asyncio.to_thread(grpc_serving, addr, "sluice.v1.Test", tls)
                                            for tls in (client_tls, None, stranger_tls)))
            assert probes == [True, False, False]
            # The exec probe of the Kubernetes manifests: the same answer as its exit code.
            flags = ["--grpc-tls-cert", str(pki["client"].cert), "--grpc-tls-key", str(pki["client"].key),
                     "--grpc-tls-ca", str(pki["ca"].cert)]
            assert await asyncio.to_thread(health_probe.main, [addr, "sluice.v1.Test", *flags]) == 0
            assert await asyncio.to_thread(health_probe.main, [addr, "sluice.v1.Test"]) == 1
            # No client certificate at all (TLS, the server verified): the handshake is refused.
            no_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
            with grpc.secure_channel(addr, no_cert) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_client_verifies_the_server_against_the_ca(pki: dict[str, CertFiles]) -> None:
    """A server whose certificate another CA signed is not trusted, and a name the certificate does not cover
    is refused (the client checks what it dials)."""
    client_tls = grpc_tls_from_args(_tls(pki["client"], pki["ca"]))

    async def main() -> None:
        server, health = new_server("sluice.v1.Test", max_receive_bytes=MAX_MESSAGE_BYTES)
        port = bind(server, "127.0.0.1", 0, grpc_tls_from_args(_tls(pki["stranger"], None)))
        await server.start()
        await health.set_serving(True)
        try:
            assert not await asyncio.to_thread(grpc_serving, f"127.0.0.1:{port}", "", client_tls)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_gateway_channels_reach_several_tokenizers_over_mutual_tls(pki: dict[str, CertFiles]) -> None:
    """Both gateway channels — the unary one to a static ipv4: list, and one mux channel per address —
    handshake against a certificate for 127.0.0.1 / localhost."""
    from gateway.client import GrpcBackend

    server_tls = grpc_tls_from_args(_tls(pki["server"], pki["ca"]))
    client_tls = grpc_tls_from_args(_tls(pki["client"], pki["ca"]))

    async def main() -> None:
        servers = []
        for _ in range(2):
            server, health = new_server("sluice.v1.Generation", max_receive_bytes=MAX_MESSAGE_BYTES)
            servers.append((server, bind(server, "127.0.0.1", 0, server_tls)))
            await server.start()
            await health.set_serving(True)
        addrs = [f"127.0.0.1:{port}" for _, port in servers]
        backend = GrpcBackend.connect(addrs, mux=True, tls=client_tls)
        try:
            for channel in (backend._channel, *backend._mux_channels):  # noqa: SLF001
                stub = health_pb2_grpc.HealthStub(channel)
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await backend.close()
            for server, _ in servers:
                await server.stop(None)

    asyncio.run(main())


def test_listed_tokenizers_over_tls_share_one_host_name() -> None:
    from gateway.targets import tls_authority

    assert tls_authority(["127.0.0.1:50061", "127.0.0.1:50062"]) == "127.0.0.1"
    assert tls_authority(["dns:///sluice-tokenizer:50061"]) is None
    with pytest.raises(ValueError, match="must share one host name"):
        tls_authority(["10.0.0.1:50061", "10.0.0.2:50061"])
