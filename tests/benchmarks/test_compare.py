from __future__ import annotations

import socket
import sys
from pathlib import Path

from benchmarks import compare
from tests.benchmarks.test_plot import result_doc


def test_build_system_fills_the_template() -> None:
    spec = compare.build_system("llamacpp", compare.DEFAULT_COMMANDS["llamacpp"], 8123, gguf="/m/x.gguf",
                                hf_dir="/m/hf")
    assert spec.command[0] == str(compare.PEERS_DIR / "venv-llama" / "bin" / "python")
    assert spec.command[1:5] == ("-m", "llama_cpp.server", "--model", "/m/x.gguf")
    assert "--interrupt_requests" in spec.command and spec.command[spec.command.index("--port") + 1] == "8123"
    assert spec.bench_args == ("--force-length-logit-bias", "0,2")
    assert spec.base_url == "http://127.0.0.1:8123/v1"
    vllm = compare.build_system("vllm", compare.DEFAULT_COMMANDS["vllm"], 1, gguf="g", hf_dir="/m/hf")
    assert "/m/hf" in vllm.command and vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and vllm.bench_args == ()
    sluice = compare.build_system("sluice", "{python} -m services.cli serve --port {port}", 9, gguf="g", hf_dir="h")
    assert sluice.command == (sys.executable, "-m", "services.cli", "serve", "--port", "9")
    assert sluice.ready_path == "/ready"


def test_markdown_table() -> None:
    doc = result_doc("sluice")
    for run in doc["runs"]:
        run.update(request_throughput=2.0, completed=3, failed=1, tpot={"mean_ms": 12.34},
                   itl={"p99_ms": 5.0}, e2el={"p99_ms": 700.4})
    lines = compare.markdown_table([doc]).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| sluice | c=1 | 2.00 | 10.0 | 1 / 100 | 12.3 | 5.0 | 700 | 3 / 1 |"
    assert lines[3] == "| sluice | c=8 | 2.00 | 50.0 | 1 / - | 12.3 | 5.0 | 700 | 3 / 1 |"


def test_compare_starts_benchmarks_and_stops_a_system(tmp_path: Path) -> None:
    """The fake server stands in for Sluice: started as a process, polled on /ready, stopped after."""
    out = tmp_path / "cmp"
    rc = compare.main(["--systems", "sluice", "--sluice-cmd", "{python} -m tests.benchmarks.fake_server --port {port}",
                       "--gguf", "unused.gguf", "--out-dir", str(out), "--concurrency", "1,2", "--num-prompts", "2",
                       "--warmup", "0", "--output-len", "3", "--ready-timeout", "30",
                       "--bench-args=--disable-tqdm"])
    assert rc == 0
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert "| sluice | c=1 |" in summary and "| sluice | c=2 |" in summary and "| 2 / 0 |" in summary
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    doc = compare.plot.load_results([out / "sluice.json"])[0]
    assert doc["label"] == "sluice" and doc["config"]["model"] == "fake-model"
    port = int(doc["config"]["base_url"].split(":")[2].split("/")[0])
    with socket.socket() as s:  # the server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_missing_peer_is_skipped(tmp_path: Path) -> None:
    rc = compare.main(["--systems", "llamacpp", "--llamacpp-cmd", "/nonexistent/python -m x --port {port}",
                       "--gguf", "g", "--out-dir", str(tmp_path)])
    assert rc == 1 and not (tmp_path / "summary.md").exists()
