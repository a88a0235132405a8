from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

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
    vllm_env = compare.build_system("vllm", compare.DEFAULT_COMMANDS["vllm"], 1, gguf="g", hf_dir="/m/hf",
                                    env={"VLLM_CPU_KVCACHE_SPACE": "4", "X": "1"})
    assert vllm_env.env == {**vllm.env, "VLLM_CPU_KVCACHE_SPACE": "4", "X": "1"}  # given values win
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


def test_step_plan_one_call_per_step_with_exact_counts_and_cap() -> None:
    assert compare.step_plan("1,8,32", "64", None) == [("1,8,32", 64)]  # one count: one call for the sweep
    assert compare.step_plan("1,8,32", "64", 10) == [("1,8,32", 10)]
    assert compare.step_plan(" 1, 8 ,64", "8,16,64", None) == [("1", 8), ("8", 16), ("64", 64)]
    assert compare.step_plan("1,8,64", "8,16,64", 12) == [("1", 8), ("8", 12), ("64", 12)]
    with pytest.raises(ValueError, match="2 counts for 3 concurrency steps"):
        compare.step_plan("1,8,32", "8,16", None)


def test_parse_name_values() -> None:
    assert compare.parse_name_values(["llamacpp=32", "sluice-t2=--num-threads 2 --x=y"], "--extra-args") == {
        "llamacpp": "32", "sluice-t2": "--num-threads 2 --x=y"}
    with pytest.raises(ValueError, match="--max-prompts expects NAME=VALUE"):
        compare.parse_name_values(["llamacpp"], "--max-prompts")
    with pytest.raises(ValueError):
        compare.parse_name_values(["=3"], "--max-prompts")


def test_variant_uses_its_base_defaults_plus_extra_args() -> None:
    assert compare.base_name("sluice-t2") == "sluice" and compare.base_name("llamacpp") == "llamacpp"
    spec = compare.build_system("sluice-t2", "{python} -m services.cli serve --port {port}", 9, gguf="g",
                                hf_dir="h", extra_args="--num-threads 2 --name 'a b'")
    assert spec.name == "sluice-t2" and spec.ready_path == "/ready"
    assert spec.command == (sys.executable, "-m", "services.cli", "serve", "--port", "9",
                            "--num-threads", "2", "--name", "a b")
    llama = compare.build_system("llamacpp-big", "srv --port {port}", 7, gguf="g", hf_dir="h")
    assert llama.command == ("srv", "--port", "7") and llama.ready_path == "/v1/models"
    assert llama.bench_args == ("--force-length-logit-bias", "0,2")


def test_main_routes_counts_caps_and_extra_args_to_each_system(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No processes: run_system is replaced, so this checks only what main hands each system."""
    calls: list[tuple[compare.SystemSpec, list[tuple[str, int]]]] = []

    def fake_run_system(spec: compare.SystemSpec, bench_argv: Sequence[str], out_dir: Path, ready_timeout_s: float,
                        steps: Sequence[tuple[str, int]] = (), vllm_bench: object = None) -> Path | None:
        calls.append((spec, list(steps)))
        return None

    monkeypatch.setattr(compare, "run_system", fake_run_system)
    rc = compare.main(["--systems", "sluice,sluice-t2,llamacpp", "--sluice-cmd", "sl --port {port}",
                       "--llamacpp-cmd", "ll --port {port}", "--gguf", "g", "--out-dir", str(tmp_path),
                       "--concurrency", "1,8,64", "--num-prompts", "8,16,64", "--max-prompts", "llamacpp=12",
                       "--max-prompts", "sluice-t2=10",
                       "--extra-args", "sluice-t2=--num-threads 2", "--env", "sluice-t2=SLUICE_AMX_LINEAR=0",
                       "--env", "sluice-t2=OMP_X=a=b", "--env", "llamacpp=LLAMA_Y="])
    assert rc == 1  # nothing produced results
    by_name = {spec.name: (spec, steps) for spec, steps in calls}
    assert list(by_name) == ["sluice", "sluice-t2", "llamacpp"]
    full = [("1", 8), ("8", 16), ("64", 64)]
    assert by_name["sluice"][1] == full  # the variant's cap is not its base system's
    assert by_name["sluice-t2"][1] == [("1", 8), ("8", 10), ("64", 10)]
    assert by_name["llamacpp"][1] == [("1", 8), ("8", 12), ("64", 12)]
    ports = {name: spec.port for name, (spec, _) in by_name.items()}
    assert by_name["sluice"][0].command == ("sl", "--port", str(ports["sluice"]))
    assert by_name["sluice-t2"][0].command == ("sl", "--port", str(ports["sluice-t2"]), "--num-threads", "2")
    assert by_name["llamacpp"][0].command == ("ll", "--port", str(ports["llamacpp"]))
    assert by_name["sluice-t2"][0].ready_path == "/ready"
    assert by_name["sluice-t2"][0].env == {"SLUICE_AMX_LINEAR": "0", "OMP_X": "a=b"}  # a value may hold "="
    assert by_name["sluice"][0].env == {} and by_name["llamacpp"][0].env == {"LLAMA_Y": ""}


def test_main_rejects_bad_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("bad options must be rejected before any system starts")

    monkeypatch.setattr(compare, "run_system", no_run)
    base = ["--gguf", "g", "--out-dir", str(tmp_path)]
    assert compare.main(["--systems", "sluice,foo-t2", *base]) == 2
    assert compare.main(["--systems", "sluice", "--concurrency", "1,8", "--num-prompts", "8,16,64", *base]) == 2
    assert compare.main(["--systems", "sluice", "--max-prompts", "sluice", *base]) == 2
    assert compare.main(["--systems", "sluice", "--max-prompts", "sluice=x", *base]) == 2
    assert compare.main(["--systems", "sluice", "--env", "sluice=NOVALUE", *base]) == 2
    assert compare.main(["--systems", "sluice", "--env", "sluice==1", *base]) == 2


def _record_bench(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """Replaces bench.main: parses each call with bench's own parser and writes a one-run result."""
    seen: list[argparse.Namespace] = []

    def fake_bench_main(argv: list[str]) -> int:
        args = compare.bench.build_parser().parse_args(argv)
        seen.append(args)
        doc = result_doc(args.label)
        doc["runs"] = [dict(doc["runs"][0], concurrency=int(c)) for c in args.concurrency.split(",")]
        doc.update(command=f"bench {len(seen)}", config={"model": "m", "num_prompts": args.num_prompts})
        Path(args.result_file).write_text(json.dumps(doc), encoding="utf-8")
        return 0

    monkeypatch.setattr(compare.bench, "main", fake_bench_main)
    monkeypatch.setattr(compare, "wait_ready", lambda proc, url, timeout_s, ca_certs=None: None)
    return seen


def _idle_spec(name: str) -> compare.SystemSpec:
    return compare.SystemSpec(name=name, command=(sys.executable, "-c", "import time; time.sleep(60)"), port=1,
                              bench_args=("--force-length-logit-bias", "0,2"))


def test_run_system_one_bench_call_per_step_with_distinct_seeds(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _record_bench(monkeypatch)
    result = compare.run_system(_idle_spec("llamacpp"), ["--output-len", "3", "--seed", "7"], tmp_path, 5.0,
                                [("1", 8), ("8", 16), ("64", 64)])
    assert result == tmp_path / "llamacpp.json"
    assert [(a.concurrency, a.num_prompts, a.seed) for a in seen] == [("1", 8, 1000), ("8", 16, 2000),
                                                                      ("64", 64, 3000)]
    assert [a.result_file for a in seen] == [str(tmp_path / f"llamacpp.step{i}.json") for i in range(3)]
    assert all(a.label == "llamacpp" and a.output_len == 3 and a.force_length_logit_bias == "0,2"
               and a.base_url == "http://127.0.0.1:1/v1" for a in seen)
    merged = json.loads(result.read_text(encoding="utf-8"))
    assert merged["config"] == {"model": "m", "num_prompts": [8, 16, 64]}
    assert [r["concurrency"] for r in merged["runs"]] == [1, 8, 64]
    assert merged["command"] == "bench 1 ; bench 2 ; bench 3" and merged["label"] == "llamacpp"


def test_run_system_single_step_is_one_call_without_a_seed(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _record_bench(monkeypatch)
    result = compare.run_system(_idle_spec("sluice"), ["--seed", "7"], tmp_path, 5.0, [("1,8", 12)])
    assert result == tmp_path / "sluice.json"
    assert [(a.concurrency, a.num_prompts, a.seed, a.result_file) for a in seen] == [
        ("1,8", 12, 7, str(result))]  # the user's seed stands
    assert json.loads(result.read_text(encoding="utf-8"))["config"]["num_prompts"] == 12
    assert not list(tmp_path.glob("*.step*.json"))


def test_an_https_variant_is_polled_and_benchmarked_over_https_with_its_ca(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen = _record_bench(monkeypatch)
    polled: list[tuple[str, str | None]] = []
    monkeypatch.setattr(compare, "wait_ready", lambda proc, url, timeout_s, ca_certs=None: polled.append(
        (url, ca_certs)))
    spec = compare.build_system("sluice-tls", compare.DEFAULT_COMMANDS["sluice"], 7, gguf="g", hf_dir="h",
                                extra_args="--ssl-certfile s.pem", ca_certs="/pki/ca.pem")
    assert spec.command[-2:] == ("--ssl-certfile", "s.pem") and spec.base_url == "https://127.0.0.1:7/v1"
    spec = compare.SystemSpec(name=spec.name, command=_idle_spec("x").command, port=7, ready_path=spec.ready_path,
                              ca_certs=spec.ca_certs)
    compare.run_system(spec, [], tmp_path, 5.0, [("32", 64)])
    assert polled == [("https://127.0.0.1:7/ready", "/pki/ca.pem")]
    assert [(a.base_url, a.ca_certs) for a in seen] == [("https://127.0.0.1:7/v1", "/pki/ca.pem")]
    assert compare.main(["--systems", "sluice-tls", "--ca-certs", "sluice-tls=ca.pem", "--client", "vllm-bench",
                         "--vllm-bin", str(tmp_path / "missing"), "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "--ca-certs works with --client bench only\n"
