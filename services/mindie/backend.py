"""BackendConfig (its devices, instances and tokenizer processes), ModelDeployConfig and its ModelConfig entry."""

from __future__ import annotations

import json
from typing import Any

from services.mindie.context import Context, Handler, constant
from services.mindie.outcome import (
    KeyRefused,
    Outcome,
    boolean,
    effect,
    integer,
    no_effect,
    string,
    valid,
)


# -- BackendConfig --------------------------------------------------------------------------------------------
def _backend_name(value: Any, ctx: Context) -> Outcome:
    if string(value) != "mindieservice_llm_engine":
        raise KeyRefused(f"{value!r}: MindIE's only backend is \"mindieservice_llm_engine\"")
    return no_effect("MindIE's one backend; Sluice's engine takes its place")


def _instances(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1, 10)
    return effect(f"{n} replica(s) of the model behind the gateways (data parallel), replica r on npuDeviceIds' "
                  "group r", data_parallel_size=n)


def _device_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeyRefused(f"device ids are integers >= 0, got {value!r}")
    return value


def _npu_device_ids(value: Any, ctx: Context) -> Outcome:
    if not isinstance(value, list) or not value:
        raise KeyRefused(f"must be a list of device-id lists, one per model instance ([[0, 1]]), got {value!r}")
    groups = [value] if not any(isinstance(g, list) for g in value) else value   # [0, 1]: one instance's
    if not all(isinstance(g, list) for g in groups):
        raise KeyRefused(f"mixes device ids and lists of them: {value!r}")
    ids = [[_device_id(i) for i in g] for g in groups]
    flat = tuple(i for g in ids for i in g)
    if len(set(flat)) != len(flat):
        raise KeyRefused(f"names a device twice: {list(flat)}")
    instances = valid(integer, ctx.backend.get("modelInstanceNumber", 1), 1) or 1
    if len(ids) != instances:
        raise KeyRefused(f"names {len(ids)} group(s) of devices; modelInstanceNumber {instances} needs one per "
                         "instance")
    world = valid(integer, ctx.model.get("worldSize", 1), 1) or 1
    for r, g in enumerate(ids):
        if len(g) != world:
            group = f"group {r} " if len(ids) > 1 else ""
            raise KeyRefused(f"{group}names {len(g)} device(s), {g}; ModelConfig.worldSize {world} needs {world}")
    return effect(f"NPUs {list(flat)} in rank order, replica r on group r (--device npu)", device="npu",
                  device_ids=flat)


def _tokenizers(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1, 32)
    return effect(f"{n} tokenizer service process(es) per replica", tokenizers=n)


def _multi_nodes(value: Any, ctx: Context) -> Outcome:
    if boolean(value):
        raise KeyRefused("multi-node inference from a rank table is not implemented: Sluice runs one replica's ranks "
                         "on several hosts as Ray actors (--distributed-executor-backend ray, docs/distributed.md)")
    return no_effect("each replica on one host, as MindIE's with false")


def _kv_pool_backend(value: Any, ctx: Context) -> Outcome:
    if string(value):
        raise KeyRefused(f"{value!r}: pooling KV-cache blocks in another store is not implemented")
    return no_effect("no KV-cache pool, as Sluice runs")


_MULTI_NODE_ONLY = no_effect("only used with multiNodesInferEnabled true, which Sluice refuses")

BACKEND_KEYS: dict[str, Handler] = {
    "backendName": _backend_name,
    "modelInstanceNumber": _instances,
    "npuDeviceIds": _npu_device_ids,
    "tokenizerProcessNumber": _tokenizers,
    "multiNodesInferEnabled": _multi_nodes,
    **{key: constant(_MULTI_NODE_ONLY) for key in (
        "multiNodesInferPort", "interNodeTLSEnabled", "interNodeTlsCaPath", "interNodeTlsCaFiles",
        "interNodeTlsCaFile", "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd", "interNodeTlsCrlPath",
        "interNodeTlsCrlFiles", "interNodeTlsCrl", "interNodeKmcKsfMaster", "interNodeKmcKsfStandby")},
}
KV_POOL_KEYS: dict[str, Handler] = {
    "backend": _kv_pool_backend,
    "configPath": constant(no_effect("only used with kvPoolConfig.backend")),
}


# -- ModelDeployConfig ----------------------------------------------------------------------------------------
def _max_seq_len(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1)
    return effect(f"context of {n} tokens (prompt and output)", max_model_len=n)


def _max_seq(ctx: Context) -> int:
    seq: int | None = valid(integer, ctx.deploy.get("maxSeqLen"), 1)
    if seq is None:
        raise KeyRefused("is read against ModelDeployConfig.maxSeqLen, which is not set: set it")
    return seq


def _max_input(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1, 4194304)
    bound = _max_seq(ctx) - 1
    if n < bound:
        raise KeyRefused(f"a prompt limit below maxSeqLen - 1 ({bound}) is not implemented (Sluice refuses a prompt "
                         f"only when it does not fit in maxSeqLen): set it to {bound} or more")
    return no_effect(f"prompts of up to {bound} tokens (min(maxInputTokenLen, maxSeqLen - 1)): the bound maxSeqLen "
                     "already sets")


def _truncation(value: Any, ctx: Context) -> Outcome:
    if boolean(value):
        raise KeyRefused("prompts are never truncated: a prompt over the limit gets a 400 naming it")
    return no_effect("a prompt over the limit gets an error (a 400), as MindIE's with false")


DEPLOY_KEYS: dict[str, Handler] = {
    "maxSeqLen": _max_seq_len,
    "maxInputTokenLen": _max_input,
    "truncation": _truncation,
}


# -- ModelConfig ----------------------------------------------------------------------------------------------
def _instance_type(value: Any, ctx: Context) -> Outcome:
    kind = string(value)
    if kind == "StandardMock":
        raise KeyRefused("\"StandardMock\": an instance that loads no model is not supported")
    if kind != "Standard":
        raise KeyRefused(f"{kind!r} is not a MindIE instance type (Standard, StandardMock)")
    return no_effect("a real model, Sluice's only kind")


def _model_name(value: Any, ctx: Context) -> Outcome:
    name = string(value, empty=False)
    return effect(f"served as {name!r}", served_model_name=[name])


def _weight_path(value: Any, ctx: Context) -> Outcome:
    path = string(value, empty=False)
    return effect(f"the model: {path}", model=path)


def _world_size(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1)
    return effect(f"tensor parallel over {n} rank(s)", tensor_parallel_size=n)


def _cpu_mem(value: Any, ctx: Context) -> Outcome:
    integer(value, 0)
    return no_effect("host memory for KV blocks swapped out by preemption: Sluice preempts by recomputation and "
                     "keeps no swap space")


def _npu_mem(value: Any, ctx: Context) -> Outcome:
    gib = integer(value, -1)
    if gib == -1:
        return no_effect("the KV cache takes the device memory left by the weights and a profiled step "
                         "(--gpu-memory-utilization of the device), as MindIE's -1 sizes it from free memory")
    if gib == 0:
        raise KeyRefused("must be -1 (sized from free memory) or a number of GiB > 0, got 0")
    raise KeyRefused(f"{gib} GiB: a fixed KV-cache size per NPU is not implemented; set -1 (Sluice sizes the cache "
                     "from the device's free memory, --gpu-memory-utilization of it)")


def _npu_mem_ratio(value: Any, ctx: Context) -> Outcome:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise KeyRefused(f"must be a share of the device's memory in (0, 1], got {value!r}")
    return effect(f"the engine uses {value} of each device's memory", device_memory_utilization=float(value))


def _backend_type(value: Any, ctx: Context) -> Outcome:
    kind = string(value)
    if kind not in ("atb", "ms"):
        raise KeyRefused(f"{kind!r} is not a MindIE backend type (atb, ms)")
    return no_effect(f"{kind!r}: Sluice's engine runs the model itself (torch-npu operators on NPUs)")


def _trust_remote_code(value: Any, ctx: Context) -> Outcome:
    boolean(value)
    return no_effect("Sluice never runs code shipped with a model (as vLLM's --trust-remote-code, accepted without "
                     "effect)")


def _plugin_params(value: Any, ctx: Context) -> Outcome:
    text = string(value)
    if not text:
        return no_effect("no plugin")
    try:
        params = json.loads(text)
    except ValueError:
        raise KeyRefused(f"is not JSON: {text!r}") from None
    if not isinstance(params, dict):
        raise KeyRefused(f"must be a JSON object, got {text!r}")
    plugin = params.pop("plugin_type", None)
    if plugin != "mtp":
        raise KeyRefused(f"plugin_type {plugin!r} is not implemented (Sluice runs \"mtp\")")
    tokens = params.pop("num_speculative_tokens", 1)
    if params:
        raise KeyRefused(f"{', '.join(sorted(params))}: not read by the mtp plugin")
    try:
        n = integer(tokens, 1)
    except KeyRefused as e:
        raise KeyRefused(f"num_speculative_tokens {e}") from None
    spec = {"method": "mtp", "num_speculative_tokens": n}
    return effect(f"the checkpoint's MTP layers propose {n} token(s) per step (--speculative-config "
                  f"{json.dumps(spec)})", speculative_config=json.dumps(spec))


_PD_ONLY = no_effect("only used between prefill-decode disaggregated instances, which Sluice does not run")
_LAYERWISE_ONLY = no_effect("only used with ServerConfig.layerwiseDisaggregated true, which Sluice does not run")

MODEL_KEYS: dict[str, Handler] = {
    "modelInstanceType": _instance_type,
    "modelName": _model_name,
    "modelWeightPath": _weight_path,
    "worldSize": _world_size,
    "cpuMemSize": _cpu_mem,
    "npuMemSize": _npu_mem,
    "npuMemSizeRatio": _npu_mem_ratio,
    "backendType": _backend_type,
    "trustRemoteCode": _trust_remote_code,
    "plugin_params": _plugin_params,
    "async_scheduler_wait_time": constant(no_effect("Sluice's asynchronous scheduling (--async-scheduling) never "
                                                     "waits on a timer")),
    "kv_trans_timeout": constant(_PD_ONLY),
    "kv_link_timeout": constant(_PD_ONLY),
}
LAYERWISE_MODEL_KEYS: dict[str, Handler] = {
    "layerwiseDisaggregatedMasterDeviceNum": constant(_LAYERWISE_ONLY),
    "layerwiseDisaggregatedSlaveDeviceNum": constant(_LAYERWISE_ONLY),
}
