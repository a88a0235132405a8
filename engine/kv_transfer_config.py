"""``--kv-transfer-config``: prefill/decode disaggregation as vLLM takes it (a JSON object with ``kv_connector``,
``kv_role`` and ``kv_connector_extra_config``), validated once at start-up.

A *producer* (prefill) engine computes a prompt and its first token and holds the KV blocks for a decode engine; a
*consumer* (decode) engine pulls the blocks of the requests sent to it and continues them; ``kv_both`` does either.
The connector names the transport: ``SharedMemoryConnector`` (same host: the consumer maps the producer's KV cache
file and copies each block once) or ``MooncakeConnector`` (Mooncake's transfer engine over TCP, across hosts).
Connectors Sluice does not have, and keys it cannot honour, are refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.config import EngineConfig

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Connector name -> the transport it runs (``KVTransferParams.transport``).
KV_CONNECTORS = {"SharedMemoryConnector": "shm", "MooncakeConnector": "mooncake", "MooncakeConnectorV1": "mooncake"}
# Connectors of vLLM / vLLM-Ascend that Sluice cannot run, and why (the refusal names them).
_OTHER_CONNECTORS = {
    "NixlConnector": "NIXL is not part of Sluice: use MooncakeConnector across hosts, SharedMemoryConnector on one",
    "P2pNcclConnector": "NCCL transfers between GPUs are not built: use MooncakeConnector (TCP)",
    "LLMDataDistCMgrConnector": "LLMDataDist / HCCL transfers between NPUs are not built: use MooncakeConnector (TCP)",
    "LMCacheConnectorV1": "LMCache is not part of Sluice",
    "OffloadingConnector": "KV offload is --kv-offloading-size / --kv-offloading-backend",
    "SharedStorageConnector": "a storage connector is not built: use --kv-offloading-backend disk",
    "MultiConnector": "one connector at a time",
}
# kv_connector_extra_config keys, by transport (their defaults in KVTransferConfig).
_EXTRA_KEYS = {"shm": {"hold_timeout_s", "transfer_timeout_s"},
               "mooncake": {"hold_timeout_s", "transfer_timeout_s", "protocol", "metadata_server"}}
# vLLM top-level keys Sluice reads, and those it refuses (with why).
_READ_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_ip", "kv_port",
              "kv_buffer_device"}
_REFUSED_KEYS = {
    "kv_rank": "the tokenizer service pairs engines by their role (GetInfo): leave kv_rank out",
    "kv_parallel_size": "the tokenizer service pairs engines by their role (GetInfo): leave kv_parallel_size out",
    "kv_buffer_size": "blocks are read straight from the KV cache: there is no transfer buffer to size",
    "kv_connector_module_path": "connectors are Sluice's own: no module path",
}


@dataclass(frozen=True)
class KVTransferConfig:
    """One engine's part in prefill/decode disaggregation.

    ``hold_timeout_s``: how long a producer holds a finished prompt's blocks for a consumer (vLLM's NIXL abort
    timeout); ``transfer_timeout_s``: how long a consumer waits for them before it recomputes the prompt itself.
    ``kv_ip`` / ``kv_port``: where a Mooncake producer is reached (its advertised host, its transfer engine's port;
    0: any free one)."""

    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    hold_timeout_s: float = 60.0
    transfer_timeout_s: float = 10.0
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kv_connector in _OTHER_CONNECTORS:
            raise InvalidRequestError("kv_connector", f"{self.kv_connector}: {_OTHER_CONNECTORS[self.kv_connector]}")
        if self.kv_connector not in KV_CONNECTORS:
            raise InvalidRequestError("kv_connector", f"must be one of {', '.join(sorted(KV_CONNECTORS))}, got "
                                                      f"{self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise InvalidRequestError("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        for name in ("hold_timeout_s", "transfer_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidRequestError(f"kv_connector_extra_config.{name}", f"must be seconds > 0, got {value!r}")
        if self.transfer_timeout_s >= self.hold_timeout_s:
            raise InvalidRequestError("kv_connector_extra_config.transfer_timeout_s",
                                      f"must be below hold_timeout_s ({self.hold_timeout_s}): a consumer stops "
                                      "reading blocks before their producer lets them go")
        if self.protocol != "tcp":
            raise InvalidRequestError("kv_connector_extra_config.protocol",
                                      f"{self.protocol!r}: only Mooncake's tcp transport is built (rdma and the "
                                      "Ascend transport need hardware Sluice was not checked on)")
        if self.metadata_server != "P2PHANDSHAKE":
            raise InvalidRequestError("kv_connector_extra_config.metadata_server",
                                      f"{self.metadata_server!r}: engines find each other peer to peer "
                                      "(P2PHANDSHAKE); a metadata server is not used")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise InvalidRequestError("kv_port", f"must be a port number (0: any free one), got {self.kv_port!r}")

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"mooncake"``."""
        return KV_CONNECTORS[self.kv_connector]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def to_json(self) -> str:
        """The config as ``--kv-transfer-config`` takes it (what ``sluice serve`` passes its engines)."""
        extra: dict[str, object] = {"hold_timeout_s": self.hold_timeout_s,
                                    "transfer_timeout_s": self.transfer_timeout_s}
        if self.transport == "mooncake":
            extra |= {"protocol": self.protocol, "metadata_server": self.metadata_server}
        value: dict[str, object] = {"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                                    "kv_connector_extra_config": extra}
        if self.engine_id is not None:
            value["engine_id"] = self.engine_id
        if self.transport == "mooncake":
            value |= {"kv_ip": self.kv_ip, "kv_port": self.kv_port}
        return json.dumps(value)


def parse_kv_transfer_config(value: object) -> KVTransferConfig:
    """``--kv-transfer-config`` as vLLM takes it: a JSON object (or a dict). InvalidRequestError naming the key."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError("kv_transfer_config", f"is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidRequestError("kv_transfer_config", f"must be a JSON object, got {value!r}")
    for key in value:
        if key in _REFUSED_KEYS:
            raise InvalidRequestError(f"kv_transfer_config.{key}", _REFUSED_KEYS[key])
        if key not in _READ_KEYS:
            raise InvalidRequestError(f"kv_transfer_config.{key}", "is not a key Sluice reads (it takes "
                                                                   f"{', '.join(sorted(_READ_KEYS))})")
    for key in ("kv_connector", "kv_role"):
        if not isinstance(value.get(key), str):
            raise InvalidRequestError(f"kv_transfer_config.{key}", "is required (a string)")
    device = value.get("kv_buffer_device", "cpu")
    if device != "cpu":
        raise InvalidRequestError("kv_transfer_config.kv_buffer_device",
                                  f"{device!r}: blocks cross through host memory only (device-to-device NCCL / HCCL "
                                  "transfers are not built)")
    connector = str(value["kv_connector"])
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise InvalidRequestError("kv_transfer_config.kv_connector_extra_config", "must be a JSON object")
    allowed = _EXTRA_KEYS.get(KV_CONNECTORS.get(connector, ""), set())
    for key in extra:
        if key not in allowed:
            raise InvalidRequestError(f"kv_transfer_config.kv_connector_extra_config.{key}",
                                      f"is not a key {connector} takes"
                                      + (f" ({', '.join(sorted(allowed))})" if allowed else ""))
    if KV_CONNECTORS.get(connector) == "shm":
        for key in ("kv_ip", "kv_port"):
            if key in value:
                raise InvalidRequestError(f"kv_transfer_config.{key}", "is for MooncakeConnector: "
                                          "SharedMemoryConnector stays on one host")
    try:
        return KVTransferConfig(
            kv_connector=connector, kv_role=str(value["kv_role"]),
            engine_id=None if value.get("engine_id") is None else str(value["engine_id"]),
            kv_ip=str(value.get("kv_ip", "127.0.0.1")), kv_port=value.get("kv_port", 0),  # type: ignore[arg-type]
            extra=dict(extra), **{k: v for k, v in extra.items()})  # type: ignore[arg-type]
    except InvalidRequestError as e:
        raise InvalidRequestError(f"kv_transfer_config.{e.field}", e.message) from e


def check_kv_transfer(config: EngineConfig, draft_methods: tuple[str, ...]) -> None:
    """The combinations disaggregation cannot honour yet, refused at start-up naming the setting that causes them
    (``draft_methods``: the speculative methods whose proposer keeps a KV cache of its own)."""
    spec = config.speculative_config
    for ok, name, msg in (
            (config.enable_prefix_caching, "enable_prefix_caching",
             "blocks cross under their prefix-cache hashes: --kv-transfer-config needs --enable-prefix-caching"),
            (config.world_size == 1 and config.executor_backend == "uni", "tensor_parallel_size",
             "disaggregation runs on one rank per engine so far (--kv-transfer-config with tensor or pipeline "
             "parallelism, or a distributed executor)"),
            (config.device == "cpu", "device",
             f"KV blocks cross through host memory: --kv-transfer-config runs with --device cpu (not "
             f"{config.device}; NCCL / HCCL transfers between accelerators are not built)"),
            (config.kv_offloading_config is None, "kv_offloading_size",
             "one KV connector at a time: --kv-transfer-config with --kv-offloading-size is not supported"),
            (spec is None or spec.method not in draft_methods, "speculative_config.method",
             "a draft model's (or MTP layers') own KV cache does not cross: run --kv-transfer-config with n-gram "
             "speculation or none"),
            (config.async_scheduling is not True, "async_scheduling",
             "--async-scheduling does not run with --kv-transfer-config yet: leave it unset or --no-async-scheduling"),
            (config.runner != "pooling", "runner", "a pooling model has no KV cache to transfer")):
        if not ok:
            raise InvalidRequestError(name, msg)
