"""benchmarks/vllm_bench.py: the `vllm bench serve` command compare.py runs, and its saved results read into
the comparison table."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

from benchmarks import compare
from benchmarks.vllm_bench import VllmBench, doc_from_vllm_results, run_from_vllm_result


def vllm_result(concurrency: int, completed: int = 3, failed: int = 1) -> dict[str, Any]:
    """A result as `vllm bench serve --save-result` writes it: the header fields (date, backend, model_id, ...)
    and the metrics of vllm/benchmarks/serve.py (durations in seconds, *_ms statistics)."""
    return {
        "date": "20260101-000000", "endpoint_type": "openai", "backend": "openai", "label": None,
        "model_id": "/peers/smollm2-hf", "tokenizer_id": "/peers/smollm2-hf", "num_prompts": completed + failed,
        "request_rate": "inf", "burstiness": 1.0, "max_concurrency": concurrency,
        "duration": 2.0, "completed": completed, "failed": failed, "total_input_tokens": 768,
        "total_output_tokens": 384, "request_throughput": 1.5, "request_goodput": None,
        "output_throughput": 192.0, "total_token_throughput": 576.0,
        "input_lens": [256] * 4, "output_lens": [128, 128, 128, 0],
        "ttfts": [0.1, 0.2, 0.3, 0.0], "itls": [[0.01], [0.01], [0.01], []],
        "latencies": [1.0, 1.1, 1.2, 0.0], "start_times": [0, 0, 0, 0], "queue_times": [0, 0, 0, 0],
        "generated_texts": ["a", "b", "c", ""], "errors": ["", "", "", "Never received a valid chunk"],
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "std_ttft_ms": 80.0, "p50_ttft_ms": 200.0,
        "p99_ttft_ms": 298.0, "mean_tpot_ms": 7.5, "median_tpot_ms": 7.5, "std_tpot_ms": 0.1, "p50_tpot_ms": 7.5,
        "p99_tpot_ms": 7.9, "mean_itl_ms": 10.0, "median_itl_ms": 10.0, "std_itl_ms": 0.0, "p50_itl_ms": 10.0,
        "p99_itl_ms": 12.5, "mean_e2el_ms": 1100.0, "median_e2el_ms": 1100.0, "std_e2el_ms": 80.0,
        "p50_e2el_ms": 1100.0, "p99_e2el_ms": 1198.0,
    }


def test_the_command_is_vllm_bench_serve_with_the_issues_random_workload(tmp_path: Path) -> None:
    client = VllmBench(Path("/peers/venv-vllm/bin/vllm"), "/peers/smollm2-hf")
    cmd = client.command("http://127.0.0.1:8123", "smollm2", 8, 64, tmp_path, "sluice.c8.json")
    assert cmd[:3] == ["/peers/venv-vllm/bin/vllm", "bench", "serve"]
    options = dict(zip(cmd[3::1], cmd[4::1]))
    assert {k: options[k] for k in ("--backend", "--base-url", "--endpoint", "--served-model-name", "--tokenizer",
                                    "--dataset-name", "--random-input-len", "--random-output-len", "--temperature",
                                    "--num-prompts", "--max-concurrency", "--request-rate", "--result-dir",
                                    "--result-filename")} == {
        "--backend": "openai", "--base-url": "http://127.0.0.1:8123", "--endpoint": "/v1/completions",
        "--served-model-name": "smollm2", "--tokenizer": "/peers/smollm2-hf", "--dataset-name": "random",
        "--random-input-len": "256", "--random-output-len": "128", "--temperature": "1.0", "--num-prompts": "64",
        "--max-concurrency": "8", "--request-rate": "inf", "--result-dir": str(tmp_path),
        "--result-filename": "sluice.c8.json"}
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    chat = VllmBench(Path("vllm"), "tok", endpoint="chat").command("http://h:1", "m", 1, 2, tmp_path, "r.json")
    assert chat[chat.index("--backend") + 1] == "openai-chat"
    assert chat[chat.index("--endpoint") + 1] == "/v1/chat/completions"
    assert "--random-prefix-len" not in cmd
    shared = VllmBench(Path("vllm"), "tok", 128, 64, prefix_len=1024).command("http://h:1", "m", 32, 64, tmp_path,
                                                                             "r.json")
    assert shared[shared.index("--random-prefix-len") + 1] == "1024"
    assert shared[shared.index("--random-input-len") + 1] == "128"


def test_a_saved_result_becomes_a_run_of_the_table() -> None:
    run = run_from_vllm_result(vllm_result(8))
    assert run["concurrency"] == 8 and (run["completed"], run["failed"]) == (3, 1)
    assert run["ttft"] == {"p50_ms": 200.0, "p99_ms": 298.0} and run["tpot"] == {"mean_ms": 7.5}
    assert run["itl"] == {"p99_ms": 12.5} and run["e2el"] == {"p99_ms": 1198.0}
    assert run["requests"] == [{"ttft_ms": 100.0, "e2el_ms": 1000.0}, {"ttft_ms": 200.0, "e2el_ms": 1100.0},
                               {"ttft_ms": 300.0, "e2el_ms": 1200.0}, {"error": "Never received a valid chunk"}]
    doc = doc_from_vllm_results([vllm_result(8), vllm_result(1, 4, 0)], "sluice", ["a", "b"])
    assert [r["concurrency"] for r in doc["runs"]] == [1, 8]
    assert compare.markdown_table([doc]).splitlines()[3] == (
        "| sluice | c=8 | 1.50 | 192.0 | 200 / 298 | 7.5 | 12.5 | 1198 | 3 / 1 |")


FAKE_VLLM = '''#!{python}
"""Stands in for `vllm bench serve`: checks the server answers, then saves a result as vLLM does."""
import json, sys, urllib.request
args = sys.argv[1:]
assert args[:2] == ["bench", "serve"], args
opt = dict(zip(args, args[1:]))
with urllib.request.urlopen(opt["--base-url"] + "/v1/models") as r:
    assert json.load(r)["data"][0]["id"] == opt["--served-model-name"]
result = json.loads({result!r})
result["max_concurrency"] = int(opt["--max-concurrency"])
with open(opt["--result-dir"] + "/" + opt["--result-filename"], "w") as f:
    json.dump(result, f)
'''


def test_compare_drives_each_system_with_vllm_bench(tmp_path: Path) -> None:
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, result=json.dumps(vllm_result(0))), encoding="utf-8")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "cmp"
    rc = compare.main(["--systems", "sluice", "--sluice-cmd", "{python} -m tests.benchmarks.fake_server --port {port}",
                       "--client", "vllm-bench", "--vllm-bin", str(fake), "--hf-dir", "/peers/smollm2-hf",
                       "--gguf", "unused.gguf", "--out-dir", str(out), "--concurrency", "1,8", "--num-prompts", "4",
                       "--ready-timeout", "30"])
    assert rc == 0, (out / "sluice.vllm-bench.log").read_text()
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert "| sluice | c=1 |" in summary and "| sluice | c=8 |" in summary and "| 3 / 1 |" in summary
    assert "client `vllm bench serve`" in summary
    assert sorted(p.name for p in out.glob("sluice.vllm-bench.c*.json")) == ["sluice.vllm-bench.c1.json",
                                                                            "sluice.vllm-bench.c8.json"]
