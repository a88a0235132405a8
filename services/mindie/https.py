"""``httpsEnabled`` and MindIE's TLS material, mapped onto the gateways' HTTPS (``--ssl-*``).

As MindIE's endpoint does, HTTPS requires a client certificate signed by the CA in ``tlsCaFile``
(``SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT`` in MindIE's ``http_ssl.cpp``): ``--ssl-cert-reqs 2``.
Files are relative to MindIE's install folder (the parent of ``conf/config.json``). The key must be unencrypted:
``tlsPkPwd`` is a password file encrypted with MindIE's KMC key stores, which Sluice cannot decrypt, so an
encrypted key is refused naming both keys. Revocation lists are not checked by the gateway, so an existing
one is refused rather than ignored. Any file missing or wrong stops start-up naming its key: HTTPS asked for
never falls back to plain HTTP.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.mindie.context import Context, Handler, constant
from services.mindie.outcome import (
    KeyRefused,
    KeyResult,
    Outcome,
    boolean,
    effect,
    no_effect,
    refused,
    string,
    strings,
)

_CERT = b"-----BEGIN CERTIFICATE-----"
_KEY = b"PRIVATE KEY-----"
_ENCRYPTED = (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")
_REQUIRED = ("tlsCert", "tlsPk", "tlsCaFile")
_OFF = no_effect("httpsEnabled is false, and MindIE ignores it then too")


def https_on(ctx: Context) -> bool:
    return ctx.server.get("httpsEnabled") is True


def _https_enabled(value: Any, ctx: Context) -> Outcome:
    if boolean(value):
        return effect("HTTPS on every gateway with tlsCert and tlsPk; clients must present a certificate signed by "
                      "tlsCaFile, as MindIE requires")
    return effect("plain HTTP, as MindIE's with false (the TLS keys are not used)")


def _read(path: Path, mark: bytes, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KeyRefused(f"{path}: cannot read it ({e.strerror or e})") from None
    if mark not in data:
        raise KeyRefused(f"{path} is not {what}")
    return data


def _cert_path(ctx: Context) -> Path | None:
    value = ctx.server.get("tlsCert")
    return ctx.path(value) if isinstance(value, str) else None


def _tls_cert(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    path = ctx.path(string(value, empty=False))
    _read(path, _CERT, "a PEM certificate")
    return effect(f"the gateways' certificate: {path}", ssl_certfile=str(path))


def _tls_pk(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    path = ctx.path(string(value, empty=False))
    data = _read(path, _KEY, "a PEM private key")
    if any(mark in data for mark in _ENCRYPTED):
        raise KeyRefused(f"{path} is encrypted, and its password (tlsPkPwd) is a file encrypted with MindIE's KMC key "
                         "stores, which Sluice cannot decrypt: give the key unencrypted, mode 0600 (openssl pkey -in "
                         f"{path} -out server.key.pem)")
    cert = _cert_path(ctx)
    if cert is not None and cert.is_file():
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, path, password=b"")
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise KeyRefused(f"{path} does not match the certificate in tlsCert ({cert})") from None
            raise KeyRefused(f"{path} cannot be loaded with tlsCert {cert} ({e.reason or e})") from None
    return effect(f"the gateways' private key: {path}", ssl_keyfile=str(path))


def _tls_pk_pwd(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    string(value)
    return no_effect("tlsPk is read unencrypted, so no password is needed (an encrypted key is refused)")


def _ca_dir(ctx: Context) -> Path:
    value = ctx.server.get("tlsCaPath", "")
    return ctx.path(value if isinstance(value, str) else "")


def _tls_ca_path(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    string(value)
    return effect(f"tlsCaFile is read from {_ca_dir(ctx)}")


def _tls_ca_file(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    names = strings(value)
    if len(names) != 1:
        raise KeyRefused(f"names {len(names)} files: the gateway reads one CA file; put the certificates in one PEM "
                         "file and name it alone")
    path = _ca_dir(ctx) / names[0]
    _read(path, _CERT, "PEM CA certificates")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise KeyRefused(f"{path} cannot be loaded as CA certificates ({e.reason or e})") from None
    return effect(f"clients must present a certificate signed by {path}", ssl_ca_certs=str(path),
                  ssl_cert_reqs=int(ssl.CERT_REQUIRED))


def _revocation_lists(ctx: Context, paths: list[Path]) -> Outcome:
    if not https_on(ctx):
        return _OFF
    present = [p for p in paths if p.exists()]
    if present:
        raise KeyRefused(f"{present[0]}: the gateway does not check certificate revocation lists, so a revoked "
                         "client certificate would be accepted; remove the key (or the file)")
    return no_effect(f"{', '.join(map(str, paths))} does not exist: there is no revocation list to check")


def _crl_dir(ctx: Context) -> Path:
    value = ctx.server.get("tlsCrlPath", "")
    return ctx.path(value if isinstance(value, str) else "")


def _tls_crl_path(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    string(value)
    return no_effect("the folder of tlsCrlFiles, which the gateway does not read")


def _tls_crl_files(value: Any, ctx: Context) -> Outcome:
    return _revocation_lists(ctx, [_crl_dir(ctx) / name for name in strings(value)])


def _tls_crl(value: Any, ctx: Context) -> Outcome:   # MindIE 1.x: one file
    return _revocation_lists(ctx, [ctx.path(string(value, empty=False))])


def _other_listener(value: Any, ctx: Context) -> Outcome:
    if not https_on(ctx):
        return _OFF
    return no_effect("the management interfaces and the metrics are served on the API's listener, under its TLS "
                     "(tlsCert, tlsPk, tlsCaFile)")


def missing(ctx: Context) -> Iterator[KeyResult]:
    """With httpsEnabled true: a refusal for each file key MindIE requires that is not there."""
    if https_on(ctx):
        for key in _REQUIRED:
            if key not in ctx.server:
                yield KeyResult(f"ServerConfig.{key}", refused("required with httpsEnabled true (MindIE requires it "
                                                                "too): HTTPS is never served without it"))


_KMC = no_effect("MindIE's KMC key stores decrypt tlsPkPwd files; Sluice reads only unencrypted keys (tlsPk)")

KEYS: dict[str, Handler] = {
    "httpsEnabled": _https_enabled,
    "tlsCaPath": _tls_ca_path,
    "tlsCaFile": _tls_ca_file,
    "tlsCert": _tls_cert,
    "tlsPk": _tls_pk,
    "tlsPkPwd": _tls_pk_pwd,
    "tlsCrlPath": _tls_crl_path,
    "tlsCrlFiles": _tls_crl_files,
    "tlsCrl": _tls_crl,
    "kmcKsfMaster": constant(_KMC),
    "kmcKsfStandby": constant(_KMC),
    **{key: _other_listener for key in (
        "managementTlsCaFile", "managementTlsCert", "managementTlsPk", "managementTlsPkPwd", "managementTlsCrlPath",
        "managementTlsCrlFiles", "managementTlsCrl", "metricsTlsCaFile", "metricsTlsCert", "metricsTlsPk",
        "metricsTlsPkPwd", "metricsTlsCrlPath", "metricsTlsCrlFiles")},
}
