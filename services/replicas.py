"""What ``sluice serve`` checks and lays out per model replica before anything starts: whether the model splits
over a replica's ranks, each replica's devices, each engine's metrics port."""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import shutil
import socket
import tempfile
from contextlib import ExitStack
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError
from common.procs import free_port
from engine.config import EngineConfig, KVEventsConfig

if TYPE_CHECKING:
    from engine.models import ModelConfig


def metrics_ports(ns: argparse.Namespace) -> list[int]:
    """Each replica's engine --metrics-port: consecutive from the one given, else free ones (0: off)."""
    if ns.engine_metrics_port is None:
        return [free_port() for _ in range(ns.data_parallel_size)]
    first = int(ns.engine_metrics_port)
    return [first + r if first else 0 for r in range(ns.data_parallel_size)]


def replica_configs(config: EngineConfig, replicas: int) -> list[EngineConfig]:
    """Each replica's engine settings: its own tensor_parallel_size x pipeline_parallel_size ranks on devices of its
    own, the r-th slice of ``device_ids`` (of 0, 1, ... on an accelerator when none are named), as vLLM places its
    data-parallel ranks. On the CPU every replica shares the host's cores. Each knows its rank (KV events bind
    their ports + rank)."""
    world = config.world_size
    if replicas == 1:
        return [config]
    if config.device_ids is None and config.device == "cpu":
        return [config.with_changes(data_parallel_rank=r) for r in range(replicas)]
    ids = config.device_ids if config.device_ids is not None else tuple(range(replicas * world))
    if len(ids) < replicas * world:
        raise InvalidRequestError("--device-ids", f"{replicas} replicas of {world} ranks need {replicas * world} "
                                                  f"device ids; got {len(ids)}: {list(ids)}")
    return [config.with_changes(device_ids=ids[r * world:(r + 1) * world], data_parallel_rank=r)
            for r in range(replicas)]


def kv_events_for_routing(config: EngineConfig, replicas: int, routing: str | None) -> EngineConfig:
    """The engines' settings when the tokenizer services route by cache (``kv_aware``, the default, over several
    replicas): KV events on, with replay, on ipc sockets in a folder of this user's (replica r's names + ``_dp{r}``,
    the engine adds its rank): the events carry prompts' token ids, so they stay off the network. Kept as they
    are when
    ``--kv-events-config`` was given, with prefix caching off, or with one replica."""
    if (replicas == 1 or routing not in (None, "kv_aware") or config.kv_events_config is not None
            or not config.enable_prefix_caching):
        return config
    folder = tempfile.mkdtemp(prefix="sluice-kv-events-")   # mode 0700: this user's processes only
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return config.with_changes(kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{folder}/pub", replay_endpoint=f"ipc://{folder}/replay"))


def shared_hash_seed() -> str:
    """The ``PYTHONHASHSEED`` every child gets: a router recomputes the engines' block hashes only when it shares
    their seed (engine.core.block_hashing). This environment's, else a random one for this run."""
    return os.environ.get("PYTHONHASHSEED") or str(secrets.randbelow(2**32))


def consecutive_free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive TCP ports free on ``host`` now."""
    while True:
        first = free_port(host)
        if first + n > 65536:
            continue
        with ExitStack() as held:
            try:
                for port in range(first, first + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind((host, port))
            except OSError:
                continue
        return first


def check_model_splits(config: EngineConfig) -> None:
    """Refuses, before any process starts, a model whose config the engine cannot honour (an architecture or a
    model option it does not run: ValueError naming it) or that does not split over the ranks asked for (naming the
    sizes): the engine would refuse it at load, at every restart."""
    model = model_config(config.model_path)
    from engine.worker.model_checks import check_model_options

    check_model_options(model, config)
    if config.world_size == 1:
        return
    from engine.models import check_parallel_sizes

    check_parallel_sizes(model, config.tensor_parallel_size, config.pipeline_parallel_size,
                         config.enable_expert_parallel)


def model_config(path: str) -> ModelConfig:
    """The model's sizes from its config.json or GGUF metadata, no weights read."""
    from engine.models.loader import read_model_config

    return read_model_config(path)
