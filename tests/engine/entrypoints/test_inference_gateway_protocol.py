"""What Kubernetes inference gateways read from a model server: every metric the Gateway API Inference Extension's
model-server protocol names, exported by the engine with its labels, and moving with the load. A real EngineCore
(tiny random Llama, two PEFT adapters) scraped through prometheus_client's exposition and parsed back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from engine.config import EngineConfig, LoRAConfig
from engine.core.engine_core import EngineCore
from engine.core.lora_request import LoRARequest
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.metrics import EngineMetrics
from tests.lora_factory import save_adapter, save_tiny_model


@dataclass(frozen=True)
class Required:
    kind: str                 # the Prometheus type the protocol asks for
    labels: frozenset[str]    # label names the gateway reads


# The protocol's "Metrics Reporting" and "LoRA Adapter Serving" tables, vLLM column: kubernetes-sigs/
# gateway-api-inference-extension, docs/proposals/003-model-server-protocol/README.md at commit
# 25557e290ad41bec74d2313182df35d40b2c0cda (2026-04-07). The LoRA gauge's value is the time it was last updated.
PROTOCOL = {
    "vllm:num_requests_waiting": Required("gauge", frozenset()),                     # TotalQueuedRequests
    "vllm:num_requests_running": Required("gauge", frozenset()),                     # TotalRunningRequests
    "vllm:kv_cache_usage_perc": Required("gauge", frozenset()),                      # KVCacheUtilization
    "vllm:cache_config_info": Required("gauge", frozenset({"block_size", "num_gpu_blocks"})),  # BlockSize, NumGPUBlocks
    "vllm:lora_requests_info": Required("gauge", frozenset({"max_lora", "running_lora_adapters",
                                                             "waiting_lora_adapters"})),
}
# The same document until commit a51e0742fc5e490d77711ce6b990e4dd25c08564 (2025-11-25) named KVCacheUtilization
# by vLLM's older name, which endpoint pickers released before then read by default.
PROTOCOL_BEFORE_2025_11_26 = {"vllm:gpu_cache_usage_perc": Required("gauge", frozenset())}
# vLLM's own label sets (vllm/v1/metrics/loggers.py): the LoRA gauge has exactly the protocol's three labels.
VLLM_LABELS = {"vllm:lora_requests_info": frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"})}
ENGINE_LABELS = frozenset({"model_name", "engine"})
BS = 4


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    root: Path = tmp_path_factory.mktemp("gie")
    base = save_tiny_model(root / "base")
    save_adapter(base, root / "sql", seed=11)
    save_adapter(base, root / "chat", seed=12)
    # Three seats, one adapter slot: a request for a second adapter waits although a seat is free.
    return EngineCore(EngineConfig(model=str(root / "base"), dtype="float32", block_size=BS, num_kv_blocks=64,
                                   max_num_seqs=3, lora_config=LoRAConfig(max_loras=1, max_lora_rank=8)))


def scrape(metrics: EngineMetrics) -> dict[str, tuple[str, list[Sample]]]:
    registry = CollectorRegistry()
    registry.register(metrics)
    text = generate_latest(registry).decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def one(page: dict[str, tuple[str, list[Sample]]], name: str) -> Sample:
    (sample,) = page[name][1]
    return sample


def test_every_metric_the_protocol_names_is_exported_with_its_labels(core: EngineCore) -> None:
    page = scrape(EngineMetrics(core))
    for name, required in {**PROTOCOL, **PROTOCOL_BEFORE_2025_11_26}.items():
        assert name in page, f"{name} is not exported"
        kind, samples = page[name]
        assert kind == required.kind and samples, name
        for sample in samples:
            assert sample.name == name and required.labels <= set(sample.labels), (name, sample.labels)
            assert set(sample.labels) == VLLM_LABELS.get(name, set(sample.labels)), name
            if name != "vllm:lora_requests_info":
                assert ENGINE_LABELS <= set(sample.labels), name
    info = one(page, "vllm:cache_config_info")
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == (str(BS), str(core.num_blocks))
    assert core.num_blocks == 64


def test_the_gauges_move_with_the_load_and_name_the_adapters(core: EngineCore) -> None:
    metrics = EngineMetrics(core)
    idle = scrape(metrics)
    assert [one(idle, n).value for n in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                         "vllm:kv_cache_usage_perc")] == [0, 0, 0]
    assert one(idle, "vllm:lora_requests_info").labels == {"max_lora": "1", "running_lora_adapters": "",
                                                           "waiting_lora_adapters": ""}
    sql, chat = LoRARequest("sql", 1, str(Path(core.config.model_path).parent / "sql")), \
        LoRARequest("chat", 2, str(Path(core.config.model_path).parent / "chat"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, lora in (("a", sql), ("b", sql), ("c", chat), ("d", None)):
        core.add_request(rid, list(range(3, 16)), params, lora_request=lora)
    before = time.time()
    core.step()
    busy = scrape(metrics)
    assert one(busy, "vllm:num_requests_running").value == 3   # sql, sql and the base model's
    assert one(busy, "vllm:num_requests_waiting").value == 1   # chat: no adapter slot left
    usage = one(busy, "vllm:kv_cache_usage_perc").value
    assert usage == pytest.approx(3 * 4 / 64) and one(busy, "vllm:gpu_cache_usage_perc").value == usage
    lora = one(busy, "vllm:lora_requests_info")
    assert lora.labels == {"max_lora": "1", "running_lora_adapters": "sql", "waiting_lora_adapters": "chat"}
    assert before <= lora.value <= time.time()   # the last update's time, as the protocol asks
    while core.has_unfinished_requests():
        core.step()
    done = scrape(metrics)
    assert [one(done, n).value for n in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                         "vllm:kv_cache_usage_perc")] == [0, 0, 0]
    assert one(done, "vllm:lora_requests_info").labels["running_lora_adapters"] == ""
