"""ScheduleConfig: MindIE's batching keys against Sluice's scheduler, which has one token budget per step (prefill
chunks and decodes together), ``max_num_seqs`` seats, and one policy (FCFS or priority)."""

from __future__ import annotations

from typing import Any

from services.mindie.context import Context, Handler
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

_ONE_BUDGET = ("each step runs the decodes and the prefill chunks together under one token budget "
               "(maxPrefillTokens)")


def _template_type(value: Any, ctx: Context) -> Outcome:
    kind = string(value)
    if kind not in ("Standard", "Mix"):
        raise KeyRefused(f"{kind!r} is not a MindIE template type (Standard, Mix)")
    note = ", as MindIE's Mix does" if kind == "Mix" else ": MindIE's Mix; Standard's separate prefill and decode " \
        "batches are not kept (the answers are the same)"
    return no_effect(_ONE_BUDGET + note)


def _template_name(value: Any, ctx: Context) -> Outcome:
    if string(value) != "Standard_LLM":
        raise KeyRefused(f"{value!r}: MindIE's only workflow is \"Standard_LLM\"")
    return no_effect("MindIE's one scheduling workflow")


def _block_size(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1, 128)
    if n & (n - 1):
        raise KeyRefused(f"{n}: Sluice's KV blocks hold a power-of-two number of tokens (128 on NPUs)")
    return effect(f"KV blocks of {n} tokens", block_size=n)


def _max_prefill_batch(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 0)
    seats: int | None = valid(integer, ctx.schedule.get("maxBatchSize"), 1)
    if n != 0 and seats is None:
        raise KeyRefused("is read against ScheduleConfig.maxBatchSize, which is not set: set both (or this to 0)")
    if n != 0 and seats is not None and n < seats:
        raise KeyRefused(f"a cap on the requests one step admits below maxBatchSize ({seats}) is not implemented: set "
                         f"0 or {seats}; maxPrefillTokens still bounds each step's tokens")
    return no_effect("no tighter than maxBatchSize: a step admits waiting requests while seats (maxBatchSize) and "
                     "tokens (maxPrefillTokens) last")


def _max_prefill_tokens(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1, 4194304)
    return effect(f"at most {n} tokens per step (prefill chunks and decodes together)", max_num_batched_tokens=n)


# prefillPolicyType / decodePolicyType -> Sluice's one policy
def _policy(value: Any, phase: str) -> str:
    kind = integer(value, 0, 3)
    if kind == 0 or (kind == 1 and phase == "prefill"):   # STATE orders prefills first come, first served
        return "fcfs"
    if kind == 2:
        return "priority"
    what = "1 (STATE: decodes of requests never preempted first)" if kind == 1 else \
        "3 (MLFQ: multi-level feedback queues)"
    raise KeyRefused(f"{what} is not implemented: Sluice's policies are 0 (FCFS) and 2 (PRIORITY)")


def _policy_key(phase: str, other_key: str, other_phase: str) -> Handler:
    def check(value: Any, ctx: Context) -> Outcome:
        mine = _policy(value, phase)
        other = valid(_policy, ctx.schedule.get(other_key), other_phase) if other_key in ctx.schedule else None
        if other is not None and other != mine:
            raise KeyRefused(f"{mine} differs from {other_key}'s {other}: Sluice has one policy for prefill and "
                             "decode")
        return effect(f"scheduling policy {mine}", scheduling_policy=mine)
    return check


def _max_batch(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1, 5000)
    return effect(f"at most {n} sequences run at once", max_num_seqs=n)


def _max_iter(value: Any, ctx: Context) -> Outcome:
    n = integer(value, 1)
    seq: int | None = valid(integer, ctx.deploy.get("maxSeqLen"), 1)
    if seq is None:
        raise KeyRefused("is read against ModelDeployConfig.maxSeqLen, which is not set: set it")
    if n < seq:
        raise KeyRefused(f"a server-wide cap on output tokens (MindIE: min(maxIterTimes, max_tokens)) below maxSeqLen "
                         f"({seq}) is not implemented: set it to {seq}; clients cap answers with max_tokens")
    return no_effect(f"no tighter than maxSeqLen ({seq}): an answer ends at max_tokens or when the sequence fills "
                     "maxSeqLen")


def _max_preempt(value: Any, ctx: Context) -> Outcome:
    integer(value, 0)
    return no_effect("Sluice preempts by recomputation, only when the KV cache runs out and only as many requests as "
                     "it must; MindIE's cap concerns swapping them to cpuMemSize")


def _select_batch(value: Any, ctx: Context) -> Outcome:
    boolean(value)
    return no_effect(_ONE_BUDGET + ": there is no prefill-or-decode batch to choose")


def _queue_delay(value: Any, ctx: Context) -> Outcome:
    integer(value, 0)
    return no_effect("Sluice never holds a request back to fill a batch: the next step takes it, so none waits this "
                     "long")


def _first_token_wait(value: Any, ctx: Context) -> Outcome:
    integer(value, 0)
    return no_effect("no waiting-time rule for preemption (under the priority policy a better priority preempts); "
                     "--max-expected-ttft-ms refuses a request early instead")


def _time_per_request(value: Any, ctx: Context) -> Outcome:
    integer(value, 0)
    return no_effect("only weighs supportSelectBatch's choice between a prefill and a decode batch; " + _ONE_BUDGET)


KEYS: dict[str, Handler] = {
    "templateType": _template_type,
    "templateName": _template_name,
    "cacheBlockSize": _block_size,
    "maxPrefillBatchSize": _max_prefill_batch,
    "maxPrefillTokens": _max_prefill_tokens,
    "prefillTimeMsPerReq": _time_per_request,
    "prefillPolicyType": _policy_key("prefill", "decodePolicyType", "decode"),
    "decodeTimeMsPerReq": _time_per_request,
    "decodePolicyType": _policy_key("decode", "prefillPolicyType", "prefill"),
    "maxBatchSize": _max_batch,
    "maxIterTimes": _max_iter,
    "maxPreemptCount": _max_preempt,
    "supportSelectBatch": _select_batch,
    "maxQueueDelayMicroseconds": _queue_delay,
    "maxFirstTokenWaitTime": _first_token_wait,
}
