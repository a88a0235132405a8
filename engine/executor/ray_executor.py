"""The ``ray`` executor: ranks 1..N-1 of the replica as Ray actors in a placement group, on any node of a cluster.

Rank 0, the driver, runs in the engine process, and everything after start-up (the process group, the step
messages, the watch for a dead rank) is :class:`~engine.executor.multiproc.DistributedExecutor`'s, as under ``mp``;
this module places, starts, watches and stops the other ranks. Ray manages the cluster: ``ray.init()`` joins the
cluster ``RAY_ADDRESS`` names, else the one ``ray start`` began on this machine, else starts a local one (Ray's own
rule, as under vLLM). The engine process must run on a node of the cluster: rank 0 joins the collectives from it.

Placement: one bundle per rank, ``{"CPU": 1}`` on CPU, ``{"GPU": 1}`` on CUDA, ``{"NPU": 1}`` on NPU (the resource
Ray's Ascend support and vLLM-Ascend use); bundle 0 is pinned to the driver's node by its ``node:<ip>`` resource and
the group is ``PACK``ed, as vLLM does: ranks fill the driver's node first and go to other nodes only when it has no
room, so collectives stay inside a host when they can, and a cluster of one-device nodes gets one rank per node.
Ranks follow the nodes (:func:`rank_order`), not the bundles' numbers.
On an accelerator Ray gives each actor its bundle's device (the only one it sees, index 0; with
``RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES`` / ``..._CUDA_...`` set where Ray runs, it sees them all and
takes the one Ray reserved for it), and the driver uses the device Ray reserved for bundle 0, so no two ranks of a
node share one. The driver's HCCL / NCCL settings (and the few others the vLLM-Ascend guides export) are given to
every actor; the per-node ones (``HCCL_IF_IP``, the ``*_SOCKET_IFNAME`` interfaces) stay each node's own.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.executor.multiproc import DistributedExecutor

if TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger(__name__)

RAY_RESOURCES = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}
# What Ray sets for an actor given an accelerator, and what narrows the engine process's own view of them.
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# Set where Ray runs (the vLLM-Ascend guides set it before `ray start`): Ray then leaves every device visible to an
# actor, which takes the one Ray reserved for it by its id.
NOSET_VISIBLE_DEVICES_ENV = {device: f"RAY_EXPERIMENTAL_NOSET_{var}" for device, var in VISIBLE_DEVICES_ENV.items()}
# The collective libraries' settings every rank needs alike, which the guides export before serving: the driver's
# are given to each actor. Those naming this node's own address or interface stay each node's (from the environment
# `ray start` ran in there), as do the visible devices.
FORWARDED_ENV_PREFIXES = ("HCCL_", "NCCL_")
FORWARDED_ENV = ("PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF", "ASCEND_LAUNCH_BLOCKING",
                 *NOSET_VISIBLE_DEVICES_ENV.values())
PER_NODE_ENV = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
PLACEMENT_STRATEGY = "PACK"
PLACEMENT_TIMEOUT_S = 120.0   # a cluster busy with other work may free the resources; a missing node never will
STOP_WAIT_S = 5.0             # how long the actors get to leave after Shutdown before they are killed


def import_ray() -> ModuleType:
    """The ``ray`` package, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("--distributed-executor-backend ray needs the ray package: pip install 'sluice[ray]'") \
            from e
    return ray


def placement_bundles(device: str, world_size: int, driver_ip: str) -> list[dict[str, float]]:
    """One bundle of ``device``'s Ray resource per rank; bundle 0 (the driver) on the node at ``driver_ip``."""
    resource = RAY_RESOURCES[device]
    bundles: list[dict[str, float]] = [{resource: 1.0} for _ in range(world_size)]
    bundles[0][f"node:{driver_ip}"] = 0.001
    return bundles


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` (the driver's) each actor is given: ``FORWARDED_ENV`` and the ``HCCL_`` /
    ``NCCL_`` settings, less the per-node ones."""
    return {name: value for name, value in environ.items()
            if (name.startswith(FORWARDED_ENV_PREFIXES) or name in FORWARDED_ENV) and name not in PER_NODE_ENV}


def actor_options(device: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a rank's actor takes from its bundle: the CPU, or the accelerator (then no CPU: its bundle has none);
    with ``environ`` (the driver's), the variables ``forwarded_env`` picks, in its runtime environment."""
    options: dict[str, Any]
    if device == "cpu":
        options = {"num_cpus": 1}
    elif device == "cuda":
        options = {"num_cpus": 0, "num_gpus": 1}
    else:
        options = {"num_cpus": 0, "resources": {RAY_RESOURCES[device]: 1}}
    env = forwarded_env(environ) if environ is not None else {}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def actor_device_index(device: str, ray_id: str, environ: Mapping[str, str]) -> int:
    """The index of its accelerator as an actor's process numbers it: 0 when Ray narrowed its visible devices to
    that one, else (``RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES`` set) Ray's id through the visible list."""
    noset = environ.get(NOSET_VISIBLE_DEVICES_ENV[device], "").lower() in ("1", "true")
    return driver_device_index(ray_id, environ.get(VISIBLE_DEVICES_ENV[device])) if noset else 0


def rank_order(driver_ip: str, actor_ips: list[str]) -> list[int]:
    """The actors (by index) in the order they take ranks 1, 2, ...: those on the driver's node first, then node
    by node, as vLLM orders its workers, so that a node's ranks are consecutive and a tensor-parallel group
    (consecutive ranks) stays inside one node when the sizes allow, whichever bundles Ray put together."""
    return sorted(range(len(actor_ips)), key=lambda i: (actor_ips[i] != driver_ip, actor_ips[i]))


class RankActor:
    """One rank (1..N-1) in a Ray worker process."""

    def where(self) -> tuple[str, str, int]:
        """This actor's Ray node id, node address and pid."""
        ray = import_ray()
        return str(ray.get_runtime_context().get_node_id()), str(ray.util.get_node_ip_address()), os.getpid()

    def run(self, config_json: str, rank: int, init_method: str) -> None:
        """Runs the rank until the driver's Shutdown; the call's result (or error) is the rank's end."""
        from common.logs import configure_logging
        from engine.executor.message import decode_config, encode_config
        from engine.executor.worker_main import run_worker

        configure_logging("info", "text", f"engine-rank{rank}")
        config = decode_config(config_json)
        if config.device != "cpu" and config.device_ids is not None:
            index = actor_device_index(config.device, _accelerator_id(RAY_RESOURCES[config.device]), os.environ)
            ids = list(config.device_ids)
            if ids[rank] != index:
                ids[rank] = index
                config_json = encode_config(config.with_changes(device_ids=tuple(ids)))
        run_worker(config_json, rank, init_method)


def _accelerator_id(resource: str) -> str:
    """The id of the accelerator Ray gave the calling task (run in bundle 0 to learn the driver's device)."""
    ray = import_ray()
    return str(ray.get_runtime_context().get_accelerator_ids()[resource][0])


def driver_device_index(ray_id: str, visible: str | None) -> int:
    """The driver's index of the accelerator Ray calls ``ray_id``: Ray numbers a node's accelerators as its
    ``*_VISIBLE_DEVICES`` lists them, and so does the engine process when it has the same list."""
    if not visible:
        return int(ray_id)
    ids = [i.strip() for i in visible.split(",")]
    if ray_id not in ids:
        raise RuntimeError(f"Ray reserved accelerator {ray_id} of this node for rank 0, which this process's "
                           f"visible devices ({visible}) do not include: start the engine with the devices Ray sees")
    return ids.index(ray_id)


class RayExecutor(DistributedExecutor):
    """Ranks 1..N-1 as Ray actors placed by a placement group. ``rank_nodes``: the Ray node id of each rank, in
    rank order (rank 0: the driver's node); ``rank_pids``: the pids of ranks 1..N-1."""

    def __init__(self, config: EngineConfig) -> None:
        if config.device != "cpu" and config.device_ids is not None:
            raise InvalidRequestError("device_ids", "the ray executor takes each rank's device from Ray (its "
                                                    "placement group's bundles): leave device ids (MindIE "
                                                    "npuDeviceIds) unset, or use the mp executor")
        self._ray = import_ray()
        self._called_init = not self._ray.is_initialized()
        if self._called_init:
            self._ray.init()
        self._placement_group: Any = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self.rank_nodes: list[str] = []
        self.rank_pids: list[int] = []
        try:
            driver_device = self._place(config)
            if driver_device is not None:   # each actor sees one device, its own: index 0 (or finds its own)
                config = config.with_changes(device_ids=(driver_device, *[0] * (config.world_size - 1)))
            super().__init__(config)
        except BaseException:
            self._release()
            raise

    def _place(self, config: EngineConfig) -> int | None:
        """Reserves one bundle per rank; returns the device Ray reserved for the driver on an accelerator."""
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world, resource = config.world_size, RAY_RESOURCES[config.device]
        have = ray.cluster_resources().get(resource, 0.0)
        if have < world:
            raise RuntimeError(f"the Ray cluster has {have:g} {resource}; tensor_parallel_size x "
                               f"pipeline_parallel_size = {world} ranks need one {resource} each")
        bundles = placement_bundles(config.device, world, self._driver_host())
        self._placement_group = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        ready, _ = ray.wait([self._placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"Ray could not place {world} bundles of {resource}, the first on this node "
                               f"({self._driver_host()}), within {PLACEMENT_TIMEOUT_S:g} s; available now: "
                               f"{ray.available_resources()}")
        if config.device == "cpu":
            return None
        probe = ray.remote(_accelerator_id).options(**actor_options(config.device), scheduling_strategy=(
            PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=0)))
        return driver_device_index(ray.get(probe.remote(resource), timeout=PLACEMENT_TIMEOUT_S),
                                   os.environ.get(VISIBLE_DEVICES_ENV[config.device]))

    def _driver_host(self) -> str:
        return str(self._ray.util.get_node_ip_address())

    def _start_workers(self, config_json: str, init_method: str) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(RankActor)
        self._actors = [remote.options(**actor_options(self.config.device, os.environ),
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           self._placement_group, placement_group_bundle_index=rank)).remote()
                        for rank in range(1, self.config.world_size)]
        where = ray.get([a.where.remote() for a in self._actors], timeout=PLACEMENT_TIMEOUT_S)
        order = rank_order(self._driver_host(), [ip for _, ip, _ in where])
        self._actors = [self._actors[i] for i in order]
        where = [(str(ray.get_runtime_context().get_node_id()), self._driver_host(), os.getpid()),
                 *(where[i] for i in order)]
        self.rank_nodes = [node for node, _, _ in where]
        self.rank_pids = [pid for _, _, pid in where[1:]]
        logger.info("ray executor: %d ranks in a %s placement group: %s", self.config.world_size, PLACEMENT_STRATEGY,
                    ", ".join(f"rank {r} on node {node[:12]} ({ip}) pid {pid}"
                              for r, (node, ip, pid) in enumerate(where)))
        self._runs = [a.run.remote(config_json, rank, init_method) for rank, a in enumerate(self._actors, 1)]

    def _dead_worker(self) -> str | None:
        runs = self._runs   # this list, even if a shutdown replaces it meanwhile
        if not runs:
            return None
        ended, _ = self._ray.wait(runs, num_returns=len(runs), timeout=0)
        if not ended:
            return None
        rank = runs.index(ended[0]) + 1
        try:
            self._ray.get(ended[0], timeout=0)
            why = "returned"
        except Exception as e:   # the actor's death or the rank's exception, as Ray reports it
            lines = str(e).strip().splitlines()
            why = f"{type(e).__name__}: {lines[0] if lines else ''}"
        return f"rank {rank} (Ray actor pid {self.rank_pids[rank - 1]} on node {self.rank_nodes[rank][:12]}) " \
               f"ended: {why}"

    def _kill_workers(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)

    def _stop_workers(self) -> None:
        if self._runs:
            _, running = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_WAIT_S)
            if running:
                logger.warning("%d Ray actor(s) did not leave within %.0f s: killed", len(running), STOP_WAIT_S)
        self._release()

    def _release(self) -> None:
        """Kills the actors, removes the placement group and leaves Ray (stopping the local cluster
        ``ray.init()`` started, if it did); idempotent."""
        ray = self._ray
        self._kill_workers()
        self._actors, self._runs = [], []
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._called_init and ray.is_initialized():
            ray.shutdown()
        self._called_init = False
