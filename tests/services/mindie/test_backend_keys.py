"""services/mindie/backend.py: devices, instances, tokenizer processes, the model's keys and the length limits,
value by value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.mindie import Treatment
from tests.services.mindie.factory import walk

E, N, R = Treatment.EFFECT, Treatment.NO_EFFECT, Treatment.REFUSED


def one(tmp_path: Path, config: dict[str, Any], key: str) -> tuple[Treatment, str, dict[str, Any]]:
    result = walk(tmp_path, config).result(key)
    return result.treatment, result.outcome.message, dict(result.outcome.settings)


def backend(model: dict[str, Any] | None = None, deploy: dict[str, Any] | None = None,
            schedule: dict[str, Any] | None = None, **keys: Any) -> dict[str, Any]:
    section: dict[str, Any] = dict(keys)
    if model is not None or deploy is not None:
        section["ModelDeployConfig"] = {**(deploy or {}), **({"ModelConfig": [model]} if model is not None else {})}
    if schedule is not None:
        section["ScheduleConfig"] = schedule
    return {"BackendConfig": section}


def test_instances_are_data_parallel_replicas_each_on_its_group_of_npus(tmp_path: Path) -> None:
    config = walk(tmp_path, backend({"worldSize": 2}, modelInstanceNumber=2, npuDeviceIds=[[0, 1], [2, 3]]))
    assert config.refusals == []
    assert config.settings == {"data_parallel_size": 2, "device": "npu", "device_ids": (0, 1, 2, 3),
                               "tensor_parallel_size": 2}


@pytest.mark.parametrize(("instances", "world", "ids", "message"), [
    (1, 2, [[0]], "names 1 device(s), [0]; ModelConfig.worldSize 2 needs 2"),
    (1, 2, [[0, 1, 2]], "names 3 device(s), [0, 1, 2]; ModelConfig.worldSize 2 needs 2"),
    (2, 1, [[0], [1, 2]], "group 1 names 2 device(s), [1, 2]; ModelConfig.worldSize 1 needs 1"),
    (2, 1, [[0]], "names 1 group(s) of devices; modelInstanceNumber 2 needs one per instance"),
    (1, 2, [[0, 0]], "names a device twice: [0, 0]"),
    (1, 1, [["0"]], "device ids are integers >= 0, got '0'"),
    (1, 1, [], "must be a list of device-id lists, one per model instance ([[0, 1]]), got []"),
])
def test_device_ids_that_do_not_fit_the_instances_are_refused(tmp_path: Path, instances: int, world: int,
                                                              ids: list[Any], message: str) -> None:
    config = backend({"worldSize": world}, modelInstanceNumber=instances, npuDeviceIds=ids)
    assert one(tmp_path, config, "BackendConfig.npuDeviceIds") == (R, message, {})


def test_a_flat_list_of_ids_is_one_instances(tmp_path: Path) -> None:
    assert one(tmp_path, backend({"worldSize": 2}, npuDeviceIds=[4, 5]), "BackendConfig.npuDeviceIds")[::2] == (
        E, {"device": "npu", "device_ids": (4, 5)})


def test_tokenizer_processes_are_tokenizer_services_per_replica(tmp_path: Path) -> None:
    assert one(tmp_path, backend(tokenizerProcessNumber=3), "BackendConfig.tokenizerProcessNumber") == (
        E, "3 tokenizer service process(es) per replica", {"tokenizers": 3})
    assert one(tmp_path, backend(tokenizerProcessNumber=33), "BackendConfig.tokenizerProcessNumber")[0] is R


@pytest.mark.parametrize(("keys", "key", "message"), [
    ({"multiNodesInferEnabled": True}, "BackendConfig.multiNodesInferEnabled",
     "multi-node inference from a rank table is not implemented: Sluice runs one replica's ranks on several hosts as "
     "Ray actors (--distributed-executor-backend ray, docs/distributed.md)"),
    ({"backendName": "other_engine"}, "BackendConfig.backendName",
     "'other_engine': MindIE's only backend is \"mindieservice_llm_engine\""),
    ({"kvPoolConfig": {"backend": "mooncake"}}, "BackendConfig.kvPoolConfig.backend",
     "'mooncake': pooling KV-cache blocks in another store is not implemented"),
])
def test_backends_sluice_does_not_run_are_refused(tmp_path: Path, keys: dict[str, Any], key: str, message: str
                                                  ) -> None:
    assert one(tmp_path, backend(**keys), key) == (R, message, {})


def test_the_prompt_limit_is_honoured_when_it_is_maxseqlens(tmp_path: Path) -> None:
    fits = backend(deploy={"maxSeqLen": 4096, "maxInputTokenLen": 4095, "truncation": False})
    config = walk(tmp_path, fits)
    assert config.refusals == [] and config.settings == {"max_model_len": 4096}
    assert config.result("ModelDeployConfig.maxInputTokenLen").outcome.message == (
        "prompts of up to 4095 tokens (min(maxInputTokenLen, maxSeqLen - 1)): the bound maxSeqLen already sets")
    assert one(tmp_path, backend(deploy={"maxSeqLen": 4096, "maxInputTokenLen": 2048}),
               "ModelDeployConfig.maxInputTokenLen")[:2] == (
        R, "a prompt limit below maxSeqLen - 1 (4095) is not implemented (Sluice refuses a prompt only when it does "
           "not fit in maxSeqLen): set it to 4095 or more")
    assert one(tmp_path, backend(deploy={"maxInputTokenLen": 2048}), "ModelDeployConfig.maxInputTokenLen")[:2] == (
        R, "is read against ModelDeployConfig.maxSeqLen, which is not set: set it")
    assert one(tmp_path, backend(deploy={"truncation": True}), "ModelDeployConfig.truncation")[:2] == (
        R, "prompts are never truncated: a prompt over the limit gets a 400 naming it")


def test_the_models_keys(tmp_path: Path) -> None:
    model = {"modelName": "qwen", "modelWeightPath": "/models/qwen", "worldSize": 8, "npuMemSizeRatio": 0.8}
    assert walk(tmp_path, backend(model)).settings == {
        "served_model_name": ["qwen"], "model": "/models/qwen", "tensor_parallel_size": 8,
        "device_memory_utilization": 0.8}


@pytest.mark.parametrize(("key", "value", "message"), [
    ("modelInstanceType", "StandardMock", "\"StandardMock\": an instance that loads no model is not supported"),
    ("npuMemSize", 16, "16 GiB: a fixed KV-cache size per NPU is not implemented; set -1 (Sluice sizes the cache from "
                       "the device's free memory, --gpu-memory-utilization of it)"),
    ("npuMemSize", 0, "must be -1 (sized from free memory) or a number of GiB > 0, got 0"),
    ("npuMemSizeRatio", 1.5, "must be a share of the device's memory in (0, 1], got 1.5"),
    ("backendType", "trt", "'trt' is not a MindIE backend type (atb, ms)"),
    ("worldSize", 0, "must be an integer >= 1, got 0"),
    ("modelName", "", "must be a non-empty string, got ''"),
])
def test_model_values_sluice_cannot_honour_are_refused(tmp_path: Path, key: str, value: Any, message: str) -> None:
    assert one(tmp_path, backend({key: value}), f"ModelConfig.{key}") == (R, message, {})


def test_the_mtp_plugin_is_speculative_decoding_with_the_checkpoints_mtp_layers(tmp_path: Path) -> None:
    mtp = json.dumps({"plugin_type": "mtp", "num_speculative_tokens": 1})
    assert one(tmp_path, backend({"plugin_params": mtp}), "ModelConfig.plugin_params")[::2] == (
        E, {"speculative_config": '{"method": "mtp", "num_speculative_tokens": 1}'})
    assert one(tmp_path, backend({"plugin_params": ""}), "ModelConfig.plugin_params")[:2] == (N, "no plugin")
    for params, message in (('{"plugin_type": "la"}', "plugin_type 'la' is not implemented (Sluice runs \"mtp\")"),
                            ('{"plugin_type": "mtp", "level": 4}', "level: not read by the mtp plugin"),
                            ("mtp", "is not JSON: 'mtp'")):
        assert one(tmp_path, backend({"plugin_params": params}), "ModelConfig.plugin_params")[:2] == (R, message)
