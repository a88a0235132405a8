"""deploy/k8s/autoscaling agrees with the code: the model replicas scale on the engine's queue depth and KV-cache
usage (never CPU), every series a query names is one the engine exports (read from its own metrics collector),
the scaled workload is the base's Deployment, and prometheus-adapter's renaming gives the names the HPA asks for."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig, LoRAConfig
from engine.entrypoints.metrics import EngineMetrics
from tests.e2e.test_metrics import metric_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
AUTOSCALING = K8S / "autoscaling"
SCALED_OBJECT = AUTOSCALING / "keda-scaledobject.yaml"
MODEL_HPA = AUTOSCALING / "model-hpa.yaml"
ADAPTER_VALUES = AUTOSCALING / "prometheus-adapter-values.yaml"
# Every file here (tests/deploy/test_manifests.py checks that each YAML file under deploy/ is read by a test).
AUTOSCALING_FILES = frozenset({SCALED_OBJECT, MODEL_HPA, ADAPTER_VALUES})
SIGNALS = {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@functools.cache
def engine_series() -> frozenset[str]:
    """The names on the engine's /metrics page (LoRA on, so its gauge is there too), from its collector reading
    an idle core's state."""
    scheduler = SimpleNamespace(num_running=0, num_waiting=0, running=[], waiting=[],
                                block_manager=SimpleNamespace(usage=lambda: 0.0),
                                admission=SimpleNamespace(refused={"queue_full": 0, "first_token_wait": 0}),
                                kv_transfer=None)
    core = SimpleNamespace(config=EngineConfig(served_model_name="m", lora_config=LoRAConfig()), spec_stats=None,
                           max_model_len=128, num_blocks=8, executor=SimpleNamespace(kv_cache_dtype_name="float32"),
                           scheduler=scheduler, scheduler_stats=lambda: defaultdict(int))
    registry = CollectorRegistry()
    registry.register(EngineMetrics(core))  # type: ignore[arg-type]
    return frozenset(s.name for f in text_string_to_metric_families(generate_latest(registry).decode())
                     for s in f.samples)


def base_workloads() -> set[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what the base kustomization applies."""
    docs = [d for name in load(K8S / "kustomization.yaml")["resources"]
            for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {(d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in docs}


def test_the_folder_holds_exactly_the_files_read_here() -> None:
    assert set(AUTOSCALING.iterdir()) == AUTOSCALING_FILES


def test_the_optional_autoscalers_are_not_in_the_base() -> None:
    """KEDA's CRD is absent from a plain cluster, and the HPA reads metrics only prometheus-adapter serves; both
    scale the same Deployment, so at most one of them is applied, by hand."""
    listed = load(K8S / "kustomization.yaml")["resources"]
    assert not [r for r in listed if "autoscaling" in r]
    assert not any((K8S / r).name.startswith("model-hpa") for r in listed)


def test_keda_scales_the_model_deployment_on_queue_depth_and_kv_usage() -> None:
    so = load(SCALED_OBJECT)
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref.get("kind", "Deployment"), ref["name"]) in base_workloads()
    assert ref["name"] == "sluice-model"
    assert 1 <= so["spec"]["minReplicaCount"] < so["spec"]["maxReplicaCount"]
    triggers = so["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"prometheus"}   # no cpu / memory trigger
    named: set[str] = set()
    for t in triggers:
        meta = t["metadata"]
        assert all(isinstance(v, str) for v in meta.values())   # the CRD's metadata is a map of strings
        assert re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", meta["serverAddress"])
        assert t["metricType"] == "AverageValue" and float(meta["threshold"]) > 0
        names = metric_names(meta["query"])
        assert len(names) == 1, meta["query"]
        named |= names
        if names == {"vllm:kv_cache_usage_perc"}:
            assert float(meta["threshold"]) <= 1   # a fraction: 1 is a full cache
    assert named == SIGNALS and named <= engine_series()


def test_the_hpa_scales_the_model_deployment_on_the_adapters_metrics() -> None:
    hpa = load(MODEL_HPA)
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) in base_workloads() and ref["name"] == "sluice-model"
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Pods"}   # no Resource (cpu) metric
    asked = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    # What prometheus-adapter serves: each rule's series renamed as its `name` says (Go regexp, ${1} groups).
    served: dict[str, str] = {}
    for rule in load(ADAPTER_VALUES)["rules"]["custom"]:
        (series,) = metric_names(rule["seriesQuery"])
        assert series in engine_series()
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}   # per pod, as the HPA reads it
        pattern, replacement = rule["name"]["matches"], rule["name"]["as"]
        served[re.sub(pattern, re.sub(r"\$\{(\d+)\}", r"\\\1", replacement), series)] = series
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert asked == set(served) and set(served.values()) == SIGNALS
    assert all(":" not in name for name in asked)   # the custom metrics API takes none


@pytest.mark.parametrize("path", [SCALED_OBJECT, MODEL_HPA])
def test_scale_down_is_slow_for_replicas_that_take_minutes_to_load(path: Path) -> None:
    spec = load(path)["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] if "advanced" in spec \
        else spec["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]
