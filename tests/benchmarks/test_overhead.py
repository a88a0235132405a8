"""benchmarks/overhead.py's arithmetic: ratios per served side, which side the target is judged on."""

from __future__ import annotations

import pytest

from benchmarks.overhead import RunResult, markdown, summarize


def _run(side: str, round_: int, tok_s: float) -> RunResult:
    return RunResult(side, round_, 0, wall_s=1000 / tok_s, prompt_tokens=4064, output_tokens=1000)


def test_summary_judges_the_full_stack_when_it_ran() -> None:
    results = [_run("rest", 0, 90), _run("grpc", 0, 95), _run("in-process", 0, 100),
               _run("in-process", 1, 120), _run("rest", 1, 110), _run("grpc", 1, 118),
               _run("grpc", 2, 97), _run("in-process", 2, 100), _run("rest", 2, 96)]
    s = summarize(results)
    # medians: rest 96, grpc 97, in-process 100; best: 110, 118, 120
    assert s["judged"] == "rest"
    assert s["ratio"] == pytest.approx(0.96) and s["sides"]["grpc"]["ratio"] == pytest.approx(0.97)
    assert s["ratio_best"] == pytest.approx(110 / 120)
    assert s["ratio_per_round"] == pytest.approx([0.9, 110 / 120, 0.96])
    assert s["met"] is True and s["in_process_tok_s_median"] == pytest.approx(100)
    table = markdown(results, s)
    assert "full stack (REST) / in-process, medians: **0.960**" in table
    assert "gRPC (no gateway) / in-process, medians: **0.970**" in table
    assert "(medians, full stack (REST)): met" in table


def test_summary_without_the_gateway_judges_grpc_and_can_fail() -> None:
    s = summarize([_run("grpc", 0, 90), _run("in-process", 0, 100)])
    assert s["judged"] == "grpc" and s["ratio"] == pytest.approx(0.9) and s["met"] is False
    assert "NOT met" in markdown([_run("grpc", 0, 90), _run("in-process", 0, 100)], s)
    with pytest.raises(ValueError, match="in-process"):
        summarize([_run("grpc", 0, 90), _run("rest", 0, 100)])


def test_stream_interval_side_is_reported_but_the_target_stays_on_rest() -> None:
    results = [_run("rest", 0, 90), _run("rest-si", 0, 98), _run("in-process", 0, 100)]
    s = summarize(results)
    assert s["judged"] == "rest" and s["ratio"] == pytest.approx(0.9) and s["met"] is False
    assert s["sides"]["rest-si"]["ratio"] == pytest.approx(0.98)
    assert "requests with stream_interval / in-process, medians: **0.980**" in markdown(results, s)
    only = summarize([_run("rest-si", 0, 98), _run("in-process", 0, 100)])
    assert only["judged"] == "rest-si" and only["met"] is True


def test_per_request_calls_side_is_reported_beside_rest_with_cpu_per_process() -> None:
    from dataclasses import replace

    cpu = {"engine": 20.0, "tokenizer": 0.2, "gateway": 0.4, "client": 0.1}
    results = [replace(_run("rest", 0, 96), cpu_s=cpu), replace(_run("rest", 1, 97), cpu_s=dict(cpu, tokenizer=0.4)),
               replace(_run("rest-calls", 0, 91), cpu_s=dict(cpu, tokenizer=0.5)), _run("in-process", 0, 100),
               _run("in-process", 1, 100)]
    s = summarize(results)
    assert s["judged"] == "rest" and s["met"] is True
    assert s["sides"]["rest-calls"]["ratio"] == pytest.approx(0.91)
    # 1000 output tokens a run: the medians of the seconds themselves
    assert s["sides"]["rest"]["cpu_s_per_1k_tokens"] == pytest.approx(
        {"engine": 20.0, "tokenizer": 0.3, "gateway": 0.4, "client": 0.1})
    assert "cpu_s_per_1k_tokens" not in s["sides"].get("grpc", {})
    table = markdown(results, s)
    assert "a Generate call per request (--no-tokenizer-mux) / in-process, medians: **0.910**" in table
    assert ("CPU s per 1000 output tokens (medians): engine 20.000, tokenizer 0.500, gateway 0.400, client 0.100."
            in table)
    assert "| 96.0 | 20.00 / 0.20 / 0.40 / 0.10 |" in table and "| 100.0 | – |" in table


def test_final_usage_reads_the_last_data_event() -> None:
    from benchmarks.overhead import _final_usage

    tail = (b'data: {"choices":[{"text":"x"}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":64,"total_tokens":71}}\n\n'
            b"data: [DONE]\n\n")
    assert _final_usage(tail) == {"prompt_tokens": 7, "completion_tokens": 64}
    assert _final_usage(tail.replace(b"\n", b"\r\n")) == {"prompt_tokens": 7, "completion_tokens": 64}
    with pytest.raises(RuntimeError, match="usage"):
        _final_usage(b'data: {"error":{"message":"boom"}}\n\ndata: [DONE]\n\n')
    with pytest.raises(RuntimeError, match="no data event"):
        _final_usage(b": keep-alive\n\n")


def test_rest_side_drives_a_streaming_server_and_counts_from_usage() -> None:
    import asyncio

    from benchmarks.overhead import Workload, _rest_workload, run_rest
    from tests.benchmarks.fake_server import FakeBehaviour, FakeServer

    behaviour = FakeBehaviour(first_token_delay_s=0.01, token_delay_s=0.0)
    with FakeServer(behaviour) as server:
        workload = Workload(prompts=5, output_tokens=6, concurrency=2)
        run = run_rest(server.base_url, "fake-model", [f"p{i}" for i in range(5)], workload, 1, 0, timeout=30)
        # the fake server reports 7 prompt tokens a request
        assert (run.side, run.round, run.repeat, run.prompt_tokens, run.output_tokens) == ("rest", 1, 0, 5 * 7, 5 * 6)
        assert len(behaviour.bodies) == 5
        assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 6 and b["model"] == "fake-model"
                   and b["stream_options"] == {"include_usage": True} for b in behaviour.bodies)
        with pytest.raises(RuntimeError, match="HTTP 500"):
            asyncio.run(_rest_workload(server.base_url, "fake-model", ["FAIL me"], 6, 1, 30))
        si = run_rest(server.base_url, "fake-model", ["q0", "q1"], Workload(prompts=2, output_tokens=6, concurrency=2),
                      2, 1, timeout=30, stream_interval=4)
        assert si.side == "rest-si" and [b["stream_interval"] for b in behaviour.bodies[-2:]] == [4, 4]
        assert all("stream_interval" not in b for b in behaviour.bodies[:-2])
        behaviour.send_usage = False
        with pytest.raises(RuntimeError, match="usage"):
            asyncio.run(_rest_workload(server.base_url, "fake-model", ["p"], 6, 1, 30))


def test_stack_cpu_counts_each_role_of_a_process_tree() -> None:
    import subprocess
    import sys
    import time

    from benchmarks.overhead import stack_cpu_s

    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('ok', flush=True)\ntime.sleep(60)")
    root_code = (
        "import subprocess, sys, time\n"
        f"burn = {burn!r}\n"
        "kids = [subprocess.Popen([sys.executable, '-c', burn, '-m', role], stdout=sys.stdout)"
        " for role in ('engine', 'gateway', 'gateway')]\n"
        "time.sleep(60)\n")
    root = subprocess.Popen([sys.executable, "-c", root_code], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert root.stdout is not None and root.stdout.readline().strip() == "ok"
        time.sleep(0.1)
        cpu = stack_cpu_s(root.pid)
        assert set(cpu) == {"engine", "gateway"}  # the root itself has no role; nothing else is counted
        assert 0.25 <= cpu["engine"] < 2 and 0.5 <= cpu["gateway"] < 4  # two gateways summed
        assert stack_cpu_s(2**22 + 7) == {}  # no such process: no descendants
    finally:
        subprocess.run(["pkill", "-P", str(root.pid)], check=False)
        root.kill()
        root.wait()
