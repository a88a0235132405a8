"""Issue 39's acceptance: MindIE's config.json as MindIE 1.x and 2.x ship it, walked key by key. Every key of the
file, nested ones included, has exactly one result, and each is asserted here: the settings it sets, the reason it
has no effect (its start-up log line), or why it is refused. Nothing is dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.mindie import Treatment, load_mindie_config
from services.mindie.config import ConfigFileError
from tests.services.mindie.factory import SERVABLE, install, leaf_keys, merged, shipped, tls_material, walk

E, N, R = Treatment.EFFECT, Treatment.NO_EFFECT, Treatment.REFUSED
_PD = (N, "inferMode dmi")
_PD_MODEL = (N, "prefill-decode disaggregated instances")
_LAYERWISE = (N, "layerwiseDisaggregated true")
_MULTI_NODE = (N, "only used with multiNodesInferEnabled true")
_SAME_LISTENER = (N, "served on the API's listener, under its TLS")
_STDERR = (N, "Sluice logs to standard error")

# key -> (treatment, the settings of an effect or a piece of the message); {root}: MindIE's install folder.
EXPECTED: dict[str, tuple[Treatment, dict[str, object] | str]] = {
    "Version": (N, "MindIE has only 1.0.0"),
    "EnableDynamicAdjustTimeoutConfig": (N, "the timeouts stay as ServerConfig.e2eTimeout sets them"),
    "LogConfig.logLevel": (E, {"log_level": "info"}),
    "LogConfig.logFileSize": _STDERR, "LogConfig.logFileNum": _STDERR, "LogConfig.logPath": _STDERR,
    "LogConfig.dynamicLogLevel": (N, "no temporary log level"),
    "LogConfig.dynamicLogLevelValidHours": (N, "only used with LogConfig.dynamicLogLevel"),
    "LogConfig.dynamicLogLevelValidTime": (N, "only used with LogConfig.dynamicLogLevel"),
    "ServerConfig.ipAddress": (E, {"host": "127.0.0.1"}),
    "ServerConfig.managementIpAddress": (R, "127.0.0.2 is not ipAddress (127.0.0.1): Sluice serves /health, /ready "
                                            "and /metrics on the API's listener and has no management listener of "
                                            "its own; set it to 127.0.0.1"),
    "ServerConfig.port": (E, {"port": 1025}),
    "ServerConfig.managementPort": (R, "1026 is not port (1025): Sluice serves the management interfaces (/health, "
                                       "/ready) on the API's port and has no listener of its own for them; set it "
                                       "to 1025"),
    "ServerConfig.metricsPort": (R, "1027 is not port (1025): Sluice serves the metrics (/metrics) on the API's "
                                    "port"),
    "ServerConfig.allowAllZeroIpListening": (E, "ipAddress 0.0.0.0 (every address) is refused"),
    "ServerConfig.maxLinkNum": (E, {"max_connections": 3000}),
    "ServerConfig.httpsEnabled": (E, "HTTPS on every gateway with tlsCert and tlsPk; clients must present a "
                                     "certificate signed by tlsCaFile"),
    "ServerConfig.fullTextEnabled": (N, "streams carry each event's new text"),
    "ServerConfig.tlsCaPath": (E, "tlsCaFile is read from {root}/security/ca"),
    "ServerConfig.tlsCaFile": (R, "{root}/security/ca/ca.pem: cannot read it (No such file or directory)"),
    "ServerConfig.tlsCert": (R, "{root}/security/certs/server.pem: cannot read it (No such file or directory)"),
    "ServerConfig.tlsPk": (R, "{root}/security/keys/server.key.pem: cannot read it (No such file or directory)"),
    "ServerConfig.tlsPkPwd": (N, "tlsPk is read unencrypted, so no password is needed"),
    "ServerConfig.tlsCrlPath": (N, "the folder of tlsCrlFiles"),
    "ServerConfig.tlsCrlFiles": (N, "{root}/security/certs/server_crl.pem does not exist: there is no revocation "
                                    "list to check"),
    "ServerConfig.tlsCrl": (N, "{root}/security/certs/server_crl.pem does not exist"),
    **{f"ServerConfig.{k}": _SAME_LISTENER for k in (
        "managementTlsCaFile", "managementTlsCert", "managementTlsPk", "managementTlsPkPwd", "managementTlsCrlPath",
        "managementTlsCrlFiles", "managementTlsCrl", "metricsTlsCaFile", "metricsTlsCert", "metricsTlsPk",
        "metricsTlsPkPwd", "metricsTlsCrlPath", "metricsTlsCrlFiles")},
    "ServerConfig.kmcKsfMaster": (N, "KMC key stores decrypt tlsPkPwd"),
    "ServerConfig.kmcKsfStandby": (N, "KMC key stores decrypt tlsPkPwd"),
    "ServerConfig.inferMode": (N, "Sluice's only mode"),
    **{f"ServerConfig.{k}": _PD for k in (
        "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath", "interCommTlsCaFiles", "interCommTlsCaFile",
        "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrlPath", "interCommTlsCrlFiles",
        "interCommTlsCrl")},
    "ServerConfig.openAiSupport": (N, "takes vLLM's extra fields"),
    "ServerConfig.tokenTimeout": (N, "no deadline between two tokens"),
    "ServerConfig.e2eTimeout": (E, {"request_timeout": 600.0}),
    "ServerConfig.distDPServerEnabled": (N, "the distributed DP server off"),
    "ServerConfig.layerwiseDisaggregated": (N, "layer-wise disaggregation off"),
    **{f"ServerConfig.{k}": _LAYERWISE for k in (
        "layerwiseDisaggregatedRoleType", "layerwiseDisaggregatedMasterIpAddress",
        "layerwiseDisaggregatedSlaveIpAddress", "layerwiseDisaggregatedDataPort", "layerwiseDisaggregatedCrtlPort")},
    "BackendConfig.backendName": (N, "Sluice's engine takes its place"),
    "BackendConfig.modelInstanceNumber": (E, {"data_parallel_size": 1}),
    "BackendConfig.npuDeviceIds": (E, {"device": "npu", "device_ids": (0, 1, 2, 3)}),
    "BackendConfig.tokenizerProcessNumber": (E, {"tokenizers": 8}),
    "BackendConfig.multiNodesInferEnabled": (N, "each replica on one host"),
    **{f"BackendConfig.{k}": _MULTI_NODE for k in (
        "multiNodesInferPort", "interNodeTLSEnabled", "interNodeTlsCaPath", "interNodeTlsCaFiles", "interNodeTlsCaFile",
        "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd", "interNodeTlsCrlPath", "interNodeTlsCrlFiles",
        "interNodeTlsCrl", "interNodeKmcKsfMaster", "interNodeKmcKsfStandby")},
    "BackendConfig.kvPoolConfig.backend": (N, "no KV-cache pool"),
    "BackendConfig.kvPoolConfig.configPath": (N, "only used with kvPoolConfig.backend"),
    "ModelDeployConfig.maxSeqLen": (E, {"max_model_len": 2560}),
    "ModelDeployConfig.maxInputTokenLen": (R, "a prompt limit below maxSeqLen - 1 (2559) is not implemented"),
    "ModelDeployConfig.truncation": (N, "a prompt over the limit gets an error (a 400)"),
    "ModelConfig.modelInstanceType": (N, "a real model"),
    "ModelConfig.modelName": (E, {"served_model_name": ["llama_65b"]}),
    "ModelConfig.modelWeightPath": (E, {"model": "/data/atb_testdata/weights/llama1-65b-safetensors"}),
    "ModelConfig.worldSize": (E, {"tensor_parallel_size": 4}),
    "ModelConfig.cpuMemSize": (N, "Sluice preempts by recomputation and keeps no swap space"),
    "ModelConfig.npuMemSize": (N, "the KV cache takes the device memory left by the weights"),
    "ModelConfig.backendType": (N, "Sluice's engine runs the model itself"),
    "ModelConfig.trustRemoteCode": (N, "never runs code shipped with a model"),
    "ModelConfig.async_scheduler_wait_time": (N, "never waits on a timer"),
    "ModelConfig.kv_trans_timeout": _PD_MODEL,
    "ModelConfig.kv_link_timeout": _PD_MODEL,
    "ModelConfig.models.layerwiseDisaggregatedMasterDeviceNum": _LAYERWISE,
    "ModelConfig.models.layerwiseDisaggregatedSlaveDeviceNum": _LAYERWISE,
    "ScheduleConfig.templateType": (N, "Standard's separate prefill and decode batches are not kept"),
    "ScheduleConfig.templateName": (N, "one scheduling workflow"),
    "ScheduleConfig.cacheBlockSize": (E, {"block_size": 128}),
    "ScheduleConfig.maxPrefillBatchSize": (R, "below maxBatchSize (200) is not implemented: set 0 or 200"),
    "ScheduleConfig.maxPrefillTokens": (E, {"max_num_batched_tokens": 8192}),
    "ScheduleConfig.prefillTimeMsPerReq": (N, "only weighs supportSelectBatch's choice"),
    "ScheduleConfig.prefillPolicyType": (E, {"scheduling_policy": "fcfs"}),
    "ScheduleConfig.decodeTimeMsPerReq": (N, "only weighs supportSelectBatch's choice"),
    "ScheduleConfig.decodePolicyType": (E, {"scheduling_policy": "fcfs"}),
    "ScheduleConfig.maxBatchSize": (E, {"max_num_seqs": 200}),
    "ScheduleConfig.maxIterTimes": (R, "below maxSeqLen (2560) is not implemented: set it to 2560"),
    "ScheduleConfig.maxPreemptCount": (N, "Sluice preempts by recomputation"),
    "ScheduleConfig.supportSelectBatch": (N, "there is no prefill-or-decode batch to choose"),
    "ScheduleConfig.maxQueueDelayMicroseconds": (N, "never holds a request back to fill a batch"),
    "ScheduleConfig.maxFirstTokenWaitTime": (N, "no waiting-time rule for preemption"),
}
# The 1.x file differs in values only here.
EXPECTED_1X = {"ModelConfig.cpuMemSize": (N, "keeps no swap space")}


@pytest.mark.parametrize("version", ["1.x", "2.x"])
def test_every_key_of_the_shipped_config_has_its_asserted_treatment(tmp_path: Path, version: str) -> None:
    config = shipped(version)
    walked = walk(tmp_path, config)
    names = [r.key for r in walked.results]
    assert names == list(leaf_keys(config))   # every key once, in the file's order: none dropped
    for result in walked.results:
        treatment, expected = (EXPECTED_1X if version == "1.x" else {}).get(result.key) or EXPECTED[result.key]
        assert result.treatment is treatment, (result.key, result.outcome.message)
        if isinstance(expected, dict):
            assert dict(result.outcome.settings) == expected, result.key
        else:
            assert expected.format(root=tmp_path) in result.outcome.message, result.key
            assert not result.outcome.settings, result.key


@pytest.mark.parametrize("version", ["1.x", "2.x"])
def test_the_shipped_config_stops_start_up_naming_every_refused_key(tmp_path: Path, version: str) -> None:
    """As shipped (HTTPS on, its certificates not made yet), the file is refused with every key at fault listed."""
    path = install(tmp_path, shipped(version))
    with pytest.raises(ConfigFileError) as info:
        load_mindie_config(path, environ={})
    lines = str(info.value).splitlines()
    assert lines[0] == f"{path}: 9 MindIE keys cannot be honoured:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "ServerConfig.managementIpAddress", "ServerConfig.managementPort", "ServerConfig.metricsPort",
        "ServerConfig.tlsCaFile", "ServerConfig.tlsCert", "ServerConfig.tlsPk", "ModelDeployConfig.maxInputTokenLen",
        "ScheduleConfig.maxPrefillBatchSize", "ScheduleConfig.maxIterTimes"]


def test_with_its_certificates_and_one_listener_the_shipped_config_serves_https(tmp_path: Path) -> None:
    """The 2.x config with openssl-made certificates where its TLS keys point, and what Sluice refuses set to what
    it serves: no refusal left, the gateways' HTTPS settings from the TLS keys, one log line per other key."""
    material = tls_material(tmp_path, tmp_path / "pki")
    config = load_mindie_config(install(tmp_path, merged(shipped("2.x"), SERVABLE)), environ={})
    assert config.refusals == []
    assert {k: v for k, v in config.settings.items() if k.startswith("ssl_")} == {
        "ssl_certfile": str(tmp_path / "security/certs/server.pem"),
        "ssl_keyfile": str(tmp_path / "security/keys/server.key.pem"),
        "ssl_ca_certs": str(tmp_path / "security/ca/ca.pem"), "ssl_cert_reqs": 2}
    assert material["ca"].cert.read_bytes() == (tmp_path / "security/ca/ca.pem").read_bytes()
    for key in ("ServerConfig.managementIpAddress", "ServerConfig.managementPort", "ServerConfig.metricsPort",
                "ModelDeployConfig.maxInputTokenLen", "ScheduleConfig.maxPrefillBatchSize",
                "ScheduleConfig.maxIterTimes"):
        assert config.result(key).treatment is N, key
    assert len(config.notes) == len(config.results)
    assert config.notes[config.results.index(config.result("ServerConfig.maxLinkNum"))] == (
        "MindIE ServerConfig.maxLinkNum: each gateway serves 3000 connections at once (MindIE: 1000 requests in "
        "progress and 2000 queued); the next connection's request gets 503")
    assert "MindIE ServerConfig.kmcKsfMaster: no effect (MindIE's KMC key stores decrypt tlsPkPwd files; Sluice " \
           "reads only unencrypted keys (tlsPk))" in config.notes
