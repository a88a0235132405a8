"""Read a MindIE Service ``config.json`` as is and map its keys onto Sluice's settings.

Only keys with a Sluice counterpart are used; the rest are reported once and
ignored. Explicit command-line flags override what the file says. ``worldSize``
is the tensor-parallel size; ``npuDeviceIds`` names the NPUs the ranks use, in
rank order, and so the device too (``--device`` given on the command line wins).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# (section path, MindIE key) → Sluice setting. ModelDeployConfig and ScheduleConfig keys are looked up in
# both places: MindIE versions moved them between the two.
_SERVER = {"ipAddress": "host", "port": "port", "maxLinkNum": "max_queued_requests"}
_DEPLOY = {"maxSeqLen": "max_model_len", "maxBatchSize": "max_num_seqs", "maxPrefillTokens": "max_num_batched_tokens",
           "cacheBlockSize": "block_size"}
_MODEL = {"modelName": "served_model_name", "modelWeightPath": "model", "worldSize": "tensor_parallel_size",
          "npuMemSizeRatio": "device_memory_utilization"}


class ConfigFileError(ValueError):
    pass


def load_mindie_config(path: str | Path) -> dict[str, Any]:
    """Settings (Sluice names) from a MindIE config.json; raises ConfigFileError with the key at fault."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigFileError(f"cannot read MindIE config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigFileError(f"{path}: the top level must be a JSON object")
    out: dict[str, Any] = {}
    server = _section(raw, "ServerConfig")
    for key, name in _SERVER.items():
        if key in server:
            out[name] = _int_or_str(server[key], f"ServerConfig.{key}", name)
    backend = _section(raw, "BackendConfig")
    deploy = _section(backend, "ModelDeployConfig")
    schedule = _section(backend, "ScheduleConfig")
    for section_name, section in (("ModelDeployConfig", deploy), ("ScheduleConfig", schedule)):
        for key, name in _DEPLOY.items():
            if key in section:
                out[name] = _positive_int(section[key], f"{section_name}.{key}")
    models = deploy.get("ModelConfig", [])
    if isinstance(models, dict):
        models = [models]
    if len(models) > 1:
        raise ConfigFileError("ModelDeployConfig.ModelConfig: one model per Sluice replica; got "
                              f"{len(models)}")
    for model in models:
        for key, name in _MODEL.items():
            if key in model:
                value = model[key]
                if name == "tensor_parallel_size":
                    value = _positive_int(value, f"ModelConfig.{key}")
                elif name == "device_memory_utilization":
                    value = float(value)
                out[name] = value
    device_ids = backend.get("npuDeviceIds")
    if device_ids:
        ids = tuple(_device_id(i) for group in _list(device_ids, "BackendConfig.npuDeviceIds")
                    for i in (group if isinstance(group, list) else [group]))
        if len(set(ids)) != len(ids):
            raise ConfigFileError(f"BackendConfig.npuDeviceIds names a device twice: {list(ids)}")
        world = out.get("tensor_parallel_size", 1)
        if len(ids) < world:
            raise ConfigFileError(f"BackendConfig.npuDeviceIds names {len(ids)} device(s), {list(ids)}; "
                                  f"ModelConfig.worldSize {world} needs {world}")
        out["device_ids"] = ids
        out["device"] = "npu"
    used = {"ServerConfig": set(_SERVER), "ModelDeployConfig": set(_DEPLOY) | {"ModelConfig"},
            "ScheduleConfig": set(_DEPLOY)}
    ignored = sorted(f"{sec}.{k}" for sec, keys in _iter_keys(raw) for k in keys if k not in used.get(sec, set()))
    if ignored:
        logger.info("MindIE config keys without a Sluice counterpart (ignored): %s", ", ".join(ignored))
    return out


def _iter_keys(raw: dict[str, Any]) -> Iterator[tuple[str, list[str]]]:
    server = raw.get("ServerConfig")
    if isinstance(server, dict):
        yield "ServerConfig", list(server)
    backend = raw.get("BackendConfig")
    if isinstance(backend, dict):
        for sec in ("ModelDeployConfig", "ScheduleConfig"):
            if isinstance(backend.get(sec), dict):
                yield sec, list(backend[sec])


def _section(parent: dict[str, Any], name: str) -> dict[str, Any]:
    value = parent.get(name, {})
    if not isinstance(value, dict):
        raise ConfigFileError(f"{name} must be a JSON object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigFileError(f"{where} must be a list, got {value!r}")
    return value


def _device_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigFileError(f"BackendConfig.npuDeviceIds: device ids are integers >= 0, got {value!r}")
    return value


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigFileError(f"{where} must be a positive integer, got {value!r}")
    return value


def _int_or_str(value: Any, where: str, name: str) -> Any:
    if name == "host":
        if not isinstance(value, str):
            raise ConfigFileError(f"{where} must be a string")
        return value
    return _positive_int(value, where)
