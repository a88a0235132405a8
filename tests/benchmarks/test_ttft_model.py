"""benchmarks.ttft_model: the real Scheduler against the model of vLLM v1's FCFS policy, request by request."""

from __future__ import annotations

from benchmarks.ttft_model import StepCost, Workload, sluice, summary, vllm


def test_sluice_prefills_each_request_when_vllms_policy_does() -> None:
    # A closed loop with chunked prompts (40 tokens, budget 64: a prompt split across steps behind decodes),
    # the seat cap binding (max_num_seqs 3 < 4 clients): every request's first token in the same step.
    w = Workload(concurrency=4, num_requests=12, prompt_len=40, output_len=5, budget=64, max_num_seqs=3)
    cost = StepCost(fixed_s=1.0, per_token_s=0.01, per_decode_s=0.1)
    ours, theirs = sluice(w, cost), vllm(w, cost)
    assert sorted(ours) == list(range(12))
    assert ours == theirs
    assert summary(ours)["max_s"] > summary(ours)["median_s"]   # the cap makes some wait: not a trivial loop


def test_step_cost_counts_tokens_and_decodes() -> None:
    assert StepCost(fixed_s=1.0, per_token_s=0.5, per_decode_s=2.0)(4, 3) == 1.0 + 2.0 + 6.0
