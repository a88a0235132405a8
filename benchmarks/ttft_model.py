"""Which request is prefilled when: closed-loop TTFT under Sluice's Scheduler and under vLLM v1's policy, no model.

    python -m benchmarks.ttft_model --concurrency 8,32,128 --prompt 256 --output 128

``c`` clients each send their next request when the previous one ends (what ``vllm bench serve
--max-concurrency`` does); a step costs ``a + b * tokens + d * decode rows`` seconds. ``sluice`` drives the real
``Scheduler`` (a fake runner samples token 7 for each row); ``vllm`` is vLLM v1's FCFS rule (vllm/v1/core/sched/
scheduler.py): running requests first, each taking what it still needs of the budget, then waiting ones in
arrival order while the budget and max_num_seqs allow, chunked. Both with the API server defaults vLLM uses on
CPU (vllm/engine/arg_utils.py: max_num_batched_tokens 2048, max_num_seqs 128) and Sluice's own. Equal TTFTs
say a tail that differs in a served run comes from step cost or from outside the scheduler.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


@dataclass(frozen=True)
class Workload:
    concurrency: int
    num_requests: int
    prompt_len: int
    output_len: int
    budget: int = 2048
    max_num_seqs: int = 128


@dataclass(frozen=True)
class StepCost:
    fixed_s: float = 0.03
    per_token_s: float = 0.45e-3
    per_decode_s: float = 0.3e-3

    def __call__(self, tokens: int, decodes: int) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_decode_s * decodes


class _Clients:
    """The closed loop: request i is sent when a client is free; ``ttft`` and ``sent`` in model seconds."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.sent: list[float] = []
        self.ttft: dict[int, float] = {}
        self.queue: list[int] = []   # sent, not yet handed to the scheduler
        for _ in range(w.concurrency):
            self.send(0.0)

    def send(self, now: float) -> None:
        if len(self.sent) < self.w.num_requests:
            self.queue.append(len(self.sent))
            self.sent.append(now)

    def take(self) -> list[int]:
        taken, self.queue = self.queue, []
        return taken

    def first_token(self, rid: int, now: float) -> None:
        self.ttft.setdefault(rid, now - self.sent[rid])


def sluice(w: Workload, cost: StepCost) -> dict[int, float]:
    sched = Scheduler(EngineConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.budget),
                      w.num_requests * (w.prompt_len + w.output_len) // 16 + 16, eos_token_ids={2}, max_model_len=8192)
    clients, now = _Clients(w), 0.0
    while clients.queue or sched.has_unfinished_requests():
        for rid in clients.take():
            prompt = [1000 + (rid * 131 + j) % 30000 for j in range(w.prompt_len)]
            sched.add_request(Request(str(rid), prompt, SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                                      arrival_time=now))
        out = sched.schedule()
        decodes = sum(1 for s in out.scheduled if s.start >= s.request.num_prompt_tokens)
        now += cost(out.num_batched_tokens, decodes)
        sampled = {seq_id: [7] for s in out.scheduled for seq_id in s.sample_seq_ids}
        for o in sched.update_from_output(out, sampled):
            clients.first_token(int(o.request_id), now)
            if o.request_finished:
                clients.send(now)
    return clients.ttft


@dataclass
class _Req:
    rid: int
    computed: int = 0
    outputs: int = 0


def vllm(w: Workload, cost: StepCost) -> dict[int, float]:
    clients, now = _Clients(w), 0.0
    running: list[_Req] = []
    waiting: list[_Req] = []
    while clients.queue or running or waiting:
        waiting += [_Req(rid) for rid in clients.take()]
        budget, step = w.budget, []
        for r in running:
            if budget <= 0:
                break
            n = min(w.prompt_len + r.outputs - r.computed, budget)
            step.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < w.max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            n = min(w.prompt_len - r.computed, budget)
            step.append((r, n))
            budget -= n
        now += cost(w.budget - budget, sum(1 for r, _ in step if r.computed >= w.prompt_len))
        for r, n in step:
            r.computed += n
            if r.computed >= w.prompt_len + r.outputs:   # the row sampled
                r.outputs += 1
                clients.first_token(r.rid, now)
                if r.outputs >= w.output_len:
                    running.remove(r)
                    clients.send(now)
    return clients.ttft


def summary(ttft: dict[int, float]) -> dict[str, float]:
    v = sorted(ttft.values())
    return {"median_s": round(statistics.median(v), 3), "p99_s": round(v[min(len(v) - 1, int(0.99 * len(v)))], 3),
            "max_s": round(v[-1], 3)}


POLICIES: dict[str, Callable[[Workload, StepCost], dict[int, float]]] = {"sluice": sluice, "vllm": vllm}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ttft_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="8,32,128")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    ns = p.parse_args(argv)
    for c in (int(x) for x in ns.concurrency.split(",")):
        w = Workload(c, c * ns.requests_per_client, ns.prompt, ns.output, ns.budget, ns.max_num_seqs)
        for name, policy in POLICIES.items():
            print(json.dumps({"concurrency": c, "policy": name, **summary(policy(w, StepCost()))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
