"""services/mindie/schedule.py: ScheduleConfig's batching and policy keys against Sluice's scheduler, value by
value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.mindie import Treatment
from tests.services.mindie.factory import walk
from tests.services.mindie.test_backend_keys import backend, one

N = Treatment.NO_EFFECT
R = Treatment.REFUSED


def schedule(**keys: Any) -> dict[str, Any]:
    return backend(deploy={"maxSeqLen": 2048}, schedule=keys)


@pytest.mark.parametrize(("prefill", "decode", "policy"), [(0, 0, "fcfs"), (1, 0, "fcfs"), (2, 2, "priority")])
def test_the_two_policies_are_sluices_one(tmp_path: Path, prefill: int, decode: int, policy: str) -> None:
    config = walk(tmp_path, schedule(prefillPolicyType=prefill, decodePolicyType=decode))
    assert config.refusals == [] and config.settings == {"max_model_len": 2048, "scheduling_policy": policy}


@pytest.mark.parametrize(("prefill", "decode", "refused"), [
    (0, 1, {"ScheduleConfig.decodePolicyType": "1 (STATE: decodes of requests never preempted first) is not "
                                               "implemented: Sluice's policies are 0 (FCFS) and 2 (PRIORITY)"}),
    (3, 0, {"ScheduleConfig.prefillPolicyType": "3 (MLFQ: multi-level feedback queues) is not implemented: Sluice's "
                                                "policies are 0 (FCFS) and 2 (PRIORITY)"}),
    (0, 2, {"ScheduleConfig.prefillPolicyType": "fcfs differs from decodePolicyType's priority: Sluice has one "
                                                "policy for prefill and decode",
            "ScheduleConfig.decodePolicyType": "priority differs from prefillPolicyType's fcfs: Sluice has one policy "
                                               "for prefill and decode"}),
])
def test_policies_sluice_cannot_run_are_refused(tmp_path: Path, prefill: int, decode: int,
                                                refused: dict[str, str]) -> None:
    config = walk(tmp_path, schedule(prefillPolicyType=prefill, decodePolicyType=decode))
    assert {r.key: r.outcome.message for r in config.refusals} == refused


def test_batching_caps_are_honoured_where_sluices_scheduler_has_them(tmp_path: Path) -> None:
    config = walk(tmp_path, schedule(cacheBlockSize=16, maxBatchSize=64, maxPrefillBatchSize=64, maxPrefillTokens=4096,
                                     maxIterTimes=2048))
    assert config.refusals == []
    assert config.settings == {"max_model_len": 2048, "block_size": 16, "max_num_seqs": 64,
                               "max_num_batched_tokens": 4096}
    assert one(tmp_path, schedule(maxPrefillBatchSize=0), "ScheduleConfig.maxPrefillBatchSize")[0] is N


@pytest.mark.parametrize(("keys", "key", "message"), [
    ({"cacheBlockSize": 48}, "cacheBlockSize", "48: Sluice's KV blocks hold a power-of-two number of tokens (128 on "
                                               "NPUs)"),
    ({"cacheBlockSize": 256}, "cacheBlockSize", "must be an integer in [1, 128], got 256"),
    ({"maxPrefillBatchSize": 8}, "maxPrefillBatchSize", "is read against ScheduleConfig.maxBatchSize, which is not "
                                                        "set: set both (or this to 0)"),
    ({"maxIterTimes": 512}, "maxIterTimes", "a server-wide cap on output tokens (MindIE: min(maxIterTimes, "
                                            "max_tokens)) below maxSeqLen (2048) is not implemented: set it to 2048; "
                                            "clients cap answers with max_tokens"),
    ({"templateType": "Fast"}, "templateType", "'Fast' is not a MindIE template type (Standard, Mix)"),
    ({"templateName": "Other"}, "templateName", "'Other': MindIE's only workflow is \"Standard_LLM\""),
])
def test_schedule_values_sluice_cannot_honour_are_refused(tmp_path: Path, keys: dict[str, Any], key: str,
                                                          message: str) -> None:
    assert one(tmp_path, schedule(**keys), f"ScheduleConfig.{key}") == (R, message, {})
