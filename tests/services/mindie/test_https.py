"""services/mindie/https.py: httpsEnabled true maps MindIE's TLS files onto the gateways' --ssl-* settings (client
certificates required, as MindIE's endpoint requires them); a file missing or unusable refuses its key, so HTTPS
asked for never turns into plain HTTP; with httpsEnabled false the TLS keys are not used."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.mindie import Treatment
from tests.services.mindie.factory import tls_material, walk

TLS = {"httpsEnabled": True, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
       "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem",
       "tlsPkPwd": "security/pass/key_pwd.txt", "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"]}


def server(**changes: Any) -> dict[str, Any]:
    return {"ServerConfig": {k: v for k, v in {**TLS, **changes}.items() if v is not None}}


def refusal(tmp_path: Path, config: dict[str, Any], key: str) -> str:
    result = walk(tmp_path, config).result(key)
    assert result.treatment is Treatment.REFUSED, result
    return result.outcome.message


def test_the_tls_files_become_the_gateways_https_settings(tmp_path: Path) -> None:
    tls_material(tmp_path, tmp_path / "pki")
    config = walk(tmp_path, server())
    assert config.refusals == []
    assert config.settings == {"ssl_certfile": str(tmp_path / "security/certs/server.pem"),
                               "ssl_keyfile": str(tmp_path / "security/keys/server.key.pem"),
                               "ssl_ca_certs": str(tmp_path / "security/ca/ca.pem"), "ssl_cert_reqs": 2}


def test_absolute_paths_are_used_as_they_are(tmp_path: Path) -> None:
    tls_material(tmp_path / "elsewhere", tmp_path / "pki")
    base = tmp_path / "elsewhere"
    config = walk(tmp_path / "install", server(tlsCaPath=str(base / "security/ca"),
                                               tlsCert=str(base / "security/certs/server.pem"),
                                               tlsPk=str(base / "security/keys/server.key.pem")))
    assert config.refusals == []
    assert config.settings["ssl_certfile"] == str(base / "security/certs/server.pem")


@pytest.mark.parametrize("key", ["tlsCert", "tlsPk", "tlsCaFile"])
def test_a_missing_file_refuses_its_key(tmp_path: Path, key: str) -> None:
    tls_material(tmp_path, tmp_path / "pki")
    path = {"tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem",
            "tlsCaFile": "security/ca/ca.pem"}[key]
    (tmp_path / path).unlink()
    assert refusal(tmp_path, server(), f"ServerConfig.{key}") == (
        f"{tmp_path / path}: cannot read it (No such file or directory)")


@pytest.mark.parametrize("key", ["tlsCert", "tlsPk", "tlsCaFile"])
def test_a_missing_key_is_refused_when_https_is_on(tmp_path: Path, key: str) -> None:
    tls_material(tmp_path, tmp_path / "pki")
    config = walk(tmp_path, server(**{key: None}))
    assert [r.key for r in config.refusals] == [f"ServerConfig.{key}"]
    assert config.refusals[0].outcome.message.startswith("required with httpsEnabled true")


def test_a_file_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    tls_material(tmp_path, tmp_path / "pki")
    (tmp_path / "security/certs/server.pem").write_text("not a certificate\n")
    assert refusal(tmp_path, server(), "ServerConfig.tlsCert").endswith("server.pem is not a PEM certificate")


def test_a_key_that_does_not_match_the_certificate_is_refused(tmp_path: Path) -> None:
    material = tls_material(tmp_path, tmp_path / "pki")
    (tmp_path / "security/keys/server.key.pem").write_bytes(material["client"].key.read_bytes())
    assert refusal(tmp_path, server(), "ServerConfig.tlsPk") == (
        f"{tmp_path / 'security/keys/server.key.pem'} does not match the certificate in tlsCert "
        f"({tmp_path / 'security/certs/server.pem'})")


def test_an_encrypted_key_is_refused_naming_its_password_file(tmp_path: Path) -> None:
    """MindIE's tlsPkPwd is encrypted with its KMC key stores: Sluice cannot use it, and says so (never a prompt)."""
    tls_material(tmp_path, tmp_path / "pki")
    key = tmp_path / "security/keys/server.key.pem"
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:Secret-123", "-out", encrypted],
                   check=True, capture_output=True)
    encrypted.replace(key)
    assert b"ENCRYPTED" in key.read_bytes()
    message = refusal(tmp_path, server(), "ServerConfig.tlsPk")
    assert message.startswith(f"{key} is encrypted, and its password (tlsPkPwd) is a file encrypted with MindIE's KMC "
                              "key stores, which Sluice cannot decrypt: give the key unencrypted")


def test_more_than_one_ca_file_is_refused(tmp_path: Path) -> None:
    tls_material(tmp_path, tmp_path / "pki")
    assert refusal(tmp_path, server(tlsCaFile=["ca.pem", "other_ca.pem"]), "ServerConfig.tlsCaFile").startswith(
        "names 2 files: the gateway reads one CA file")


@pytest.mark.parametrize(("key", "value"), [("tlsCrlFiles", ["server_crl.pem"]),
                                            ("tlsCrl", "security/certs/server_crl.pem")])
def test_a_revocation_list_that_exists_is_refused_not_ignored(tmp_path: Path, key: str, value: Any) -> None:
    path = "security/certs/server_crl.pem"
    tls_material(tmp_path, tmp_path / "pki")
    (tmp_path / path).write_text("-----BEGIN X509 CRL-----\n")
    assert refusal(tmp_path, server(**{key: value}), f"ServerConfig.{key}") == (
        f"{tmp_path / path}: the gateway does not check certificate revocation lists, so a revoked client "
        "certificate would be accepted; remove the key (or the file)")


def test_with_https_off_the_tls_keys_are_not_used(tmp_path: Path) -> None:
    config = walk(tmp_path, server(httpsEnabled=False, managementTlsCert="security/certs/management/server.pem",
                                   kmcKsfMaster="tools/pmt/master/ksfa"))
    assert config.refusals == [] and config.settings == {}
    assert config.result("ServerConfig.httpsEnabled").outcome.message.startswith("plain HTTP")
    for result in config.results[1:]:
        assert result.treatment is Treatment.NO_EFFECT, result.key
    assert config.result("ServerConfig.tlsCert").outcome.message == "httpsEnabled is false, and MindIE ignores it " \
                                                                    "then too"
