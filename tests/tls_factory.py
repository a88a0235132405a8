"""Test certificates made with the openssl command: a CA, and certificates it signs for 127.0.0.1 / localhost
(usable as server and as client certificates, as ``sluice serve``'s processes use them), or for a client."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str = "ca") -> CertFiles:
    files = CertFiles(directory / f"{name}.pem", directory / f"{name}-key.pem")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN=Sluice test {name}", "-keyout", files.key, "-out", files.cert,
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)
    return files


def make_cert(directory: Path, ca: CertFiles, name: str,
              san: str = "IP:127.0.0.1,DNS:localhost") -> CertFiles:
    """A certificate signed by ``ca`` for ``san``, with serverAuth and clientAuth."""
    files = CertFiles(directory / f"{name}.pem", directory / f"{name}-key.pem")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", files.key, "-out", csr, cwd=directory)
    _openssl("x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial", "-days", "2",
             "-extfile", ext, "-out", files.cert, cwd=directory)
    return files
