"""``vllm bench serve`` as compare.py's client: the benchmark most vLLM users run, so a server that its
stream parser cannot read shows up as failed requests in the comparison (it once lost SSE keep-alive
streams). One call per concurrency step with vLLM's random dataset (256 prompt tokens, 128 output tokens,
ignore_eos, temperature 1.0, as issue 25's comparison); each saved result (``--save-result``) becomes a
run of benchmarks.bench's result document, so the same table and plot read it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class VllmBench:
    binary: Path                  # the peer venv's `vllm`
    tokenizer: str                # an HF directory with the model's tokenizer (vLLM counts tokens with it)
    input_len: int = 256
    output_len: int = 128
    temperature: float = 1.0
    seed: int = 0
    endpoint: str = "completions"
    prefix_len: int = 0           # tokens of one random prefix every prompt starts with (vLLM's --random-prefix-len)

    def command(self, base_url: str, served_name: str, concurrency: int, num_prompts: int, result_dir: Path,
                result_file: str) -> list[str]:
        """The ``vllm bench serve`` command line for one concurrency step (closed loop: all requests queued,
        at most ``concurrency`` in flight)."""
        chat = self.endpoint == "chat"
        return [str(self.binary), "bench", "serve",
                "--backend", "openai-chat" if chat else "openai",
                "--base-url", base_url, "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
                "--model", self.tokenizer, "--tokenizer", self.tokenizer, "--served-model-name", served_name,
                "--dataset-name", "random", "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len),
                *(["--random-prefix-len", str(self.prefix_len)] if self.prefix_len else []),
                "--ignore-eos", "--temperature", str(self.temperature),
                "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                "--request-rate", "inf", "--seed", str(self.seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file]

    def run(self, name: str, base_url: str, steps: Sequence[tuple[str, int]], out_dir: Path) -> Path | None:
        """Every concurrency of ``steps`` against the server at ``base_url`` (``http://host:port``); returns
        the result document (None when no step produced a result; the log says why)."""
        served = served_model_name(base_url)
        parts: list[tuple[Path, list[str]]] = []
        log_path = out_dir / f"{name}.vllm-bench.log"
        with open(log_path, "ab") as log:
            for concurrencies, num_prompts in steps:
                for c in (int(x) for x in concurrencies.split(",") if x.strip()):
                    result = out_dir / f"{name}.vllm-bench.c{c}.json"
                    cmd = self.command(base_url, served, c, num_prompts, out_dir, result.name)
                    print(f"[{name}] {' '.join(cmd)}", flush=True)
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
                    if rc != 0 or not result.exists():
                        print(f"[{name}] vllm bench serve exit code {rc} (see {log_path})", flush=True)
                        continue
                    parts.append((result, cmd))
        if not parts:
            return None
        doc = doc_from_vllm_results([json.loads(p.read_text(encoding="utf-8")) for p, _ in parts], name,
                                    [" ".join(cmd) for _, cmd in parts])
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        return path


def served_model_name(base_url: str) -> str:
    """The first model the server lists (``GET /v1/models``): the name requests must use."""
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        r = client.get(f"{base_url}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


def _ms(result: dict[str, Any], metric: str, stat: str) -> float | None:
    value = result.get(f"{stat}_{metric}_ms")
    return None if value is None else float(value)


def run_from_vllm_result(result: dict[str, Any]) -> dict[str, Any]:
    """One saved ``vllm bench serve`` result (field names of vllm/benchmarks/serve.py) as a run of
    benchmarks.bench's result document."""
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    requests = [{"error": err} if err else {"ttft_ms": ttft * 1000, "e2el_ms": latency * 1000}
                for ttft, latency, err in zip(result.get("ttfts", []), result.get("latencies", []), errors)]
    return {
        "mode": "closed", "concurrency": result["max_concurrency"], "request_rate": None,
        "completed": result["completed"], "failed": result.get("failed", len(errors) - result["completed"]),
        "request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
        "ttft": {"p50_ms": _ms(result, "ttft", "p50") or _ms(result, "ttft", "median"),
                 "p99_ms": _ms(result, "ttft", "p99")},
        "tpot": {"mean_ms": _ms(result, "tpot", "mean")},
        "itl": {"p99_ms": _ms(result, "itl", "p99")},
        "e2el": {"p99_ms": _ms(result, "e2el", "p99")},
        "requests": requests,
    }


def doc_from_vllm_results(results: Sequence[dict[str, Any]], label: str, commands: Sequence[str]) -> dict[str, Any]:
    """Saved results of one system's steps as one result document, runs in concurrency order."""
    first = results[0]
    runs = sorted((run_from_vllm_result(r) for r in results), key=lambda run: run["concurrency"])
    return {"label": label, "client": "vllm bench serve", "command": " ; ".join(commands),
            "config": {"model": first.get("model_id"), "num_prompts": [r.get("num_prompts") for r in results]},
            "runs": runs}
