"""MindIE install folders made for the tests: ``conf/config.json`` (the shipped configs of tests/services/data,
changed where a test says) and the TLS material where MindIE's defaults put it, made with openssl."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from services.mindie import MindieConfig, read_mindie_config
from tests.tls_factory import CertFiles, make_ca, make_cert

DATA = Path(__file__).resolve().parent.parent / "data"
SHIPPED = {"1.x": "mindie_config_1x.json", "2.x": "mindie_config_2x.json"}

# The shipped 2.x config with what Sluice refuses in it changed to what it serves: one listener for the API, the
# management interfaces and the metrics; no prompt or output caps below maxSeqLen; no prefill request cap.
SERVABLE = {
    "ServerConfig": {"managementIpAddress": "127.0.0.1", "managementPort": 1025, "metricsPort": 1025},
    "BackendConfig": {"ModelDeployConfig": {"maxInputTokenLen": 2559},
                      "ScheduleConfig": {"maxPrefillBatchSize": 0, "maxIterTimes": 2560}},
}


def shipped(version: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DATA / SHIPPED[version]).read_text())
    return loaded


def merged(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` written into it, nested objects merged; a value None removes the key."""
    out = copy.deepcopy(dict(base))
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def install(root: Path, config: Mapping[str, Any]) -> Path:
    """``config`` written as ``root/conf/config.json`` (MindIE's place for it); its path."""
    (root / "conf").mkdir(parents=True, exist_ok=True)
    path = root / "conf" / "config.json"
    path.write_text(json.dumps(config, indent=4))
    return path


def walk(root: Path, config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> MindieConfig:
    return read_mindie_config(install(root, config), environ={} if environ is None else environ)


def tls_material(root: Path, pki: Path) -> dict[str, CertFiles]:
    """A CA and a server certificate (for 127.0.0.1, both uses) where the shipped config's TLS keys point under
    ``root``: security/ca/ca.pem, security/certs/server.pem, security/keys/server.key.pem; and a client's."""
    pki.mkdir(parents=True, exist_ok=True)
    ca = make_ca(pki)
    server, client = make_cert(pki, ca, "server"), make_cert(pki, ca, "client")
    for src, dst in ((ca.cert, "security/ca/ca.pem"), (server.cert, "security/certs/server.pem"),
                     (server.key, "security/keys/server.key.pem")):
        (root / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / dst)
    return {"ca": ca, "server": server, "client": client}


def leaf_keys(config: Mapping[str, Any], label: str = "") -> Iterator[str]:
    """The name of every key of a MindIE config that is not a section, as the walk names it (the documented
    section and the key; ModelConfig's one entry as "ModelConfig")."""
    sections = {"ServerConfig": "ServerConfig", "BackendConfig": "BackendConfig", "LogConfig": "LogConfig",
                "ModelDeployConfig": "ModelDeployConfig", "ScheduleConfig": "ScheduleConfig",
                "kvPoolConfig": "BackendConfig.kvPoolConfig", "models": "ModelConfig.models"}
    for key, value in config.items():
        if key == "ModelConfig":
            yield from leaf_keys(value[0], "ModelConfig")
        elif key in sections and isinstance(value, dict):
            yield from leaf_keys(value, sections[key])
        else:
            yield f"{label}.{key}" if label else key
