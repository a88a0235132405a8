"""The ray executor on a Ray cluster of two hosts (tests/ray_cluster.py: two network namespaces joined by a veth
pair, one CPU each): a tensor-parallel replica of two ranks placed one per node answers token for token as
transformers and the one-process engine do and leaves no actor behind; an actor that dies fails the replica; what
cannot run is refused at once, naming the sizes."""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.executor.base import WorkerFailedError
from engine.executor.ray_executor import (
    NOSET_VISIBLE_DEVICES_ENV,
    RAY_RESOURCES,
    VISIBLE_DEVICES_ENV,
    RayExecutor,
    actor_device_index,
    actor_options,
    driver_device_index,
    import_ray,
    placement_bundles,
    rank_order,
)
from tests.lora_factory import save_tiny_model
from tests.ray_cluster import TwoNodeRayCluster, net_namespace, netns_available, pid_alive

PROMPTS = [[1, 5, 9, 33, 70, 12], [1, 100, 101], [1, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodeRayCluster]:
    if not netns_available():
        pytest.skip("the two-host Ray cluster needs root and `ip netns`")
    c = TwoNodeRayCluster()
    try:
        c.start()
        with pytest.MonkeyPatch.context() as env:   # this process is the engine: a driver on node a
            for name, value in c.driver_env().items():
                env.setenv(name, value)
            yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_model(path, "llama")   # GQA: 4 query heads, 2 KV heads, one of each pair per rank


def _config(path: Path, **overrides: object) -> EngineConfig:
    args: dict[str, object] = dict(model=str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
                                   num_threads=1, tensor_parallel_size=2, distributed_executor_backend="ray")
    return EngineConfig(**{**args, **overrides})  # type: ignore[arg-type]


def _greedy(core: EngineCore) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def _reference(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            out.append(int(model(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def _wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pid_alive(pid)


@pytest.mark.slow
def test_tp2_runs_one_rank_per_node_and_answers_as_one_process(
        cluster: TwoNodeRayCluster, checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, model = checkpoint
    core = EngineCore(_config(path))
    try:
        executor = core.executor
        assert isinstance(executor, RayExecutor)
        ray = import_ray()
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert [node_ip[n] for n in executor.rank_nodes] == [cluster.ip_a, cluster.ip_b]
        (rank1,) = executor.rank_pids
        assert net_namespace(rank1) == cluster.netns_b() != net_namespace(os.getpid())
        ray_tp2 = _greedy(core)
    finally:
        core.close()
    assert _wait_gone(rank1), "rank 1's actor outlived the executor's shutdown"
    assert not ray.is_initialized()   # the executor called ray.init(), so it disconnected

    uni = EngineCore(_config(path, tensor_parallel_size=1, distributed_executor_backend=None))
    assert _greedy(uni) == ray_tp2 == [_reference(model, p) for p in PROMPTS]


@pytest.mark.slow
def test_a_dead_actor_fails_the_replica(cluster: TwoNodeRayCluster, checkpoint: tuple[Path, PreTrainedModel]) -> None:
    core = EngineCore(_config(checkpoint[0]))
    try:
        executor = core.executor
        assert isinstance(executor, RayExecutor)
        (rank1,) = executor.rank_pids
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(Ray actor pid \d+ on node \w+\) ended"):
            while time.monotonic() - killed < 10:
                core.check_health()
                time.sleep(0.05)
        assert time.monotonic() - killed < 2
        core.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(WorkerFailedError):
            core.step()
    finally:
        core.close()


@pytest.mark.slow
def test_more_ranks_than_the_cluster_has_devices_is_refused_at_once(
        cluster: TwoNodeRayCluster, checkpoint: tuple[Path, PreTrainedModel]) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the Ray cluster has 2 CPU; tensor_parallel_size x "
                                           r"pipeline_parallel_size = 4 ranks need one CPU each"):
        RayExecutor(_config(checkpoint[0], pipeline_parallel_size=2))
    assert time.monotonic() - start < 15
    assert not import_ray().is_initialized()


def test_bundles_use_rays_own_accelerator_resource_names() -> None:
    from ray._private.accelerators.npu import NPUAcceleratorManager
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    assert RAY_RESOURCES["cuda"] == NvidiaGPUAcceleratorManager.get_resource_name()
    assert RAY_RESOURCES["npu"] == NPUAcceleratorManager.get_resource_name()
    assert placement_bundles("npu", 3, "10.0.0.7") == [{"NPU": 1.0, "node:10.0.0.7": 0.001}, {"NPU": 1.0},
                                                       {"NPU": 1.0}]


def test_ranks_follow_the_nodes_the_driver_s_first() -> None:
    # Ray put bundles 1..5 on nodes .2, .1 (the driver's), .3, .2, .1: ranks 1..5 go to the actors of .1, .2, .3.
    assert rank_order("10.0.0.1", ["10.0.0.2", "10.0.0.1", "10.0.0.3", "10.0.0.2", "10.0.0.1"]) == [1, 4, 0, 3, 2]


def test_the_driver_uses_the_accelerator_ray_reserved_for_it_as_this_process_numbers_it() -> None:
    assert driver_device_index("3", None) == 3
    assert driver_device_index("6", "4,6, 7") == 1
    with pytest.raises(RuntimeError, match=r"accelerator 2 .* visible devices \(0,1\)"):
        driver_device_index("2", "0,1")


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'sluice\[ray\]'"):
        import_ray()


def test_actors_get_the_drivers_collective_settings_but_not_the_per_node_ones() -> None:
    """The vLLM-Ascend guides export HCCL's settings before serving; Ray actors start from their raylet's
    environment, not the driver's, so the cluster-wide ones are passed on, and each node keeps its own address,
    interfaces and devices."""
    driver = {"HCCL_BUFFSIZE": "1024", "HCCL_CONNECT_TIMEOUT": "1200", "HCCL_OP_EXPANSION_MODE": "AIV",
              "NCCL_DEBUG": "INFO", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "TASK_QUEUE_ENABLE": "1",
              "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1", "HCCL_IF_IP": "10.0.0.1",
              "HCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0",
              "ASCEND_RT_VISIBLE_DEVICES": "0,1", "HOME": "/root", "PATH": "/usr/bin"}
    options = actor_options("npu", driver)
    assert options["resources"] == {"NPU": 1} and options["num_cpus"] == 0
    assert options["runtime_env"]["env_vars"] == {
        "HCCL_BUFFSIZE": "1024", "HCCL_CONNECT_TIMEOUT": "1200", "HCCL_OP_EXPANSION_MODE": "AIV", "NCCL_DEBUG": "INFO",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "TASK_QUEUE_ENABLE": "1",
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert "runtime_env" not in actor_options("npu", {"HOME": "/root"})


def test_an_actor_takes_its_own_device_when_ray_leaves_them_all_visible() -> None:
    assert actor_device_index("npu", "5", {"ASCEND_RT_VISIBLE_DEVICES": "5"}) == 0   # Ray narrowed it
    noset = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert actor_device_index("npu", "5", noset) == 5
    assert actor_device_index("npu", "5", {**noset, "ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}) == 1
    assert actor_device_index("cuda", "3", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}) == 3


def test_ray_itself_reads_the_noset_switch_and_sets_the_visible_devices_we_read() -> None:
    """The names are Ray's own: its Ascend accelerator manager leaves ASCEND_RT_VISIBLE_DEVICES alone under the
    switch and sets it otherwise."""
    from ray._private.accelerators.npu import NPUAcceleratorManager

    assert NPUAcceleratorManager.get_visible_accelerator_ids_env_var() == VISIBLE_DEVICES_ENV["npu"]
    names = ("ASCEND_RT_VISIBLE_DEVICES", NOSET_VISIBLE_DEVICES_ENV["npu"])
    saved = {name: os.environ.pop(name, None) for name in names}
    try:
        os.environ[NOSET_VISIBLE_DEVICES_ENV["npu"]] = "1"
        NPUAcceleratorManager.set_current_process_visible_accelerator_ids(["3"])
        assert "ASCEND_RT_VISIBLE_DEVICES" not in os.environ
        del os.environ[NOSET_VISIBLE_DEVICES_ENV["npu"]]
        NPUAcceleratorManager.set_current_process_visible_accelerator_ids(["3"])
        assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "3"
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
