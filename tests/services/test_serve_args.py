"""``sluice serve`` takes vLLM's command lines: the vLLM-Ascend guides' ``vllm serve`` commands and vLLM's common
flags either parse (with their effect, or a logged line saying why there is none) or stop with exit 2 and a
one-line reason naming the flag — never argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.auth import api_keys
from engine.entrypoints import vllm_compat
from engine.entrypoints.args import add_engine_args, config_from_args
from services import serve_args, supervisor
from services.child_flags import engine_flags

# The `vllm serve` command lines of vLLM-Ascend's guides, as written there.
GUIDE_COMMANDS: list[tuple[str, str, str | None]] = [
    # (source, command line, the flag refused or None when it parses)
    # https://github.com/vllm-project/vllm-ascend/blob/main/docs/source/quick_start.md
    ("quickstart", "vllm serve Qwen/Qwen2.5-0.5B-Instruct", None),
    # https://github.com/vllm-project/vllm-ascend/blob/main/docs/source/tutorials/single_npu.md (graph, eager)
    ("single NPU", "vllm serve Qwen/Qwen3-8B --max_model_len 26240", None),
    ("single NPU, eager", "vllm serve Qwen/Qwen3-8B --max_model_len 26240 --enforce-eager", None),
    # https://github.com/vllm-project/vllm-ascend/blob/main/docs/source/tutorials/Qwen2.5-7B.md
    ("Qwen2.5-7B", "vllm serve Qwen/Qwen2.5-7B-Instruct --host 0.0.0.0 --port 8000 "
                   "--served-model-name qwen-2.5-7b-instruct --trust-remote-code --max-model-len 32768", None),
    # https://github.com/vllm-project/vllm-ascend/blob/main/docs/source/tutorials/single_node_300i.md
    ("300I, 1 card", "vllm serve Qwen/Qwen3-0.6B --tensor-parallel-size 1 --enforce-eager --dtype float16 "
                     "--compilation-config '{\"custom_ops\":[\"none\", \"+rms_norm\", \"+rotary_embedding\"]}'",
     None),
    ("300I, 2 cards", "vllm serve Qwen/Qwen2.5-7B-Instruct --tensor-parallel-size 2 --enforce-eager "
                      "--dtype float16 --compilation-config '{\"custom_ops\":[\"none\", \"+rms_norm\"]}'", None),
    ("300I, Pangu MoE", "vllm serve /home/pangu-pro-moe-mode/ --tensor-parallel-size 4 --enable-expert-parallel "
                        "--dtype float16 --trust-remote-code --enforce-eager", None),
    # https://docs.vllm.ai/projects/ascend/en/v0.9.1/tutorials/multi_npu.html
    ("multi NPU, QwQ", "vllm serve Qwen/QwQ-32B --max-model-len 4096 --port 8000 -tp 4", None),
    # https://docs.vllm.ai/projects/ascend/en/v0.9.1/tutorials/multi_npu_qwen3_moe.html
    ("multi NPU, Qwen3 MoE", "vllm serve Qwen/Qwen3-30B-A3B --tensor-parallel-size 4 --enable-expert-parallel", None),
    # https://github.com/vllm-project/vllm-ascend/blob/main/docs/source/tutorials/multi_npu_quantization.md
    ("multi NPU, W8A8", "vllm serve /home/models/QwQ-32B-w8a8 --tensor-parallel-size 1 --served-model-name "
                        "qwq-32b-w8a8 --max-model-len 4096 --quantization ascend", None),
]

# vLLM's common `serve` flags (vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py) that Sluice has under
# the same name: each changes the setting of that name.
SAME_NAME: list[tuple[str, str, object]] = [
    ("--served-model-name m", "served_model_name", "m"),
    ("--max-model-len 1024", "max_model_len", 1024),
    ("--max-num-seqs 8", "max_num_seqs", 8),
    ("--max-num-batched-tokens 512", "max_num_batched_tokens", 512),
    ("--block-size 32", "block_size", 32),
    ("--gpu-memory-utilization 0.5", "device_memory_utilization", 0.5),
    ("--dtype float16", "dtype", "float16"),
    ("--kv-cache-dtype float16", "kv_cache_dtype", "float16"),
    ("--seed 7", "seed", 7),
    ("--enable-expert-parallel", "enable_expert_parallel", True),
    ("--disable-sliding-window", "disable_sliding_window", True),
    ("--generation-config vllm", "generation_config", "vllm"),
    ("--no-enable-prefix-caching", "enable_prefix_caching", False),
    ("--tokenizer /m/tok", "tokenizer", "/m/tok"),
    ("--max-logprobs 5", "max_logprobs", 5),
    ("--disable-log-stats", "disable_log_stats", True),
    ("--scheduling-policy priority", "scheduling_policy", "priority"),
    ("--stream-interval 4", "stream_interval", 4),
    ("--tensor-parallel-size 1", "tensor_parallel_size", 1),
    ("--tensor-parallel-size 2", "tensor_parallel_size", 2),
    ("-tp 4", "tensor_parallel_size", 4),
    ("--pipeline-parallel-size 2", "pipeline_parallel_size", 2),
    ("-pp 3", "pipeline_parallel_size", 3),
    ("--distributed-executor-backend ray", "distributed_executor_backend", "ray"),
    ("--distributed-executor-backend mp", "distributed_executor_backend", "mp"),
    ("--distributed-executor-backend uni", "distributed_executor_backend", "uni"),
    ("--num-gpu-blocks-override 96", "num_kv_blocks", 96),   # vLLM's name for --num-kv-blocks
    ("--enforce-eager", "enforce_eager", True),
    ("--max-seq-len-to-capture 4096", "max_seq_len_to_capture", 4096),
    ("--cuda-graph-sizes 1 2 4", "cuda_graph_sizes", (1, 2, 4)),
    ("--async-scheduling", "async_scheduling", True),
    ("--no-async-scheduling", "async_scheduling", False),
    ("--num-scheduler-steps 8", "num_scheduler_steps", 8),
    ("--multi-step-stream-outputs false", "multi_step_stream_outputs", False),
    ("--multi-step-stream-outputs", "multi_step_stream_outputs", True),
]

# Every flag of the compatibility tables, with a command line fragment and what must happen.
REFUSED = [
    "--revision main", "--code-revision v1", "--tokenizer-revision v1", "--load-format pt",
    "--quantization fp8", "--tokenizer-mode slow", "--no-enable-chunked-prefill", "--preemption-mode swap",
    "--cpu-offload-gb 4", "--distributed-executor-backend external_launcher",
    "--speculative-model m",
    "--num-speculative-tokens 3", "--ngram-prompt-lookup-max 4", "--ngram-prompt-lookup-min 1",
    "--override-generation-config {}", "--hf-overrides {}", "--rope-scaling {}", "--rope-theta 1e6",
    "--task embed", "--kv-transfer-config {}", "--enable-sleep-mode",
    "--skip-tokenizer-init", "--root-path /api", "--middleware m.M", "--response-role bot",
    "--return-tokens-as-token-ids", "--api-server-count 2", "--enable-reasoning", "--reasoning-parser granite",
    "--headless",
]
NO_EFFECT = [
    "--trust-remote-code", "--download-dir /d", "--hf-token t", "--load-format auto", "--load-format gguf",
    "--quantization gguf", "--tokenizer-mode auto", "--enable-chunked-prefill", "--swap-space 4",
    "--preemption-mode recompute", "--cpu-offload-gb 0", "--disable-async-output-proc",
    "--use-v2-block-manager", "--disable-custom-all-reduce",
    "--compilation-config 3", "--additional-config {}",
    "--max-parallel-loading-workers 2", "--tokenizer-pool-size 4",
    "--task generate", "--response-role assistant", "--api-server-count 1",
    "--disable-frontend-multiprocessing", "--enable-reasoning --reasoning-parser deepseek_r1",
]
IMPLEMENTED = ["--num-gpu-blocks-override", "--uvicorn-log-level", "--reasoning-parser",
               "--limit-mm-per-prompt"]   # effects tested below


def resolve(command: str) -> tuple[argparse.Namespace, list[str]]:
    notes: list[str] = []
    return supervisor.resolve_settings(shlex.split(command), notes), notes


def refusal(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The error line of a refused command line (exit 2, as argparse's own errors)."""
    with pytest.raises(SystemExit) as info:
        resolve(command)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unrecognized arguments" not in err
    return err


@pytest.mark.parametrize(("source", "command", "refused"), GUIDE_COMMANDS, ids=[g[0] for g in GUIDE_COMMANDS])
def test_guide_command_lines_run_as_written_or_stop_with_a_reason(
        source: str, command: str, refused: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = command.removeprefix("vllm serve ")
    if refused is None:
        ns, _ = resolve(argv)
        assert ns.model == shlex.split(argv)[0]
        config_from_args(ns)   # and the engine settings are valid
    else:
        err = refusal(argv, capsys)
        assert err.startswith(f"sluice serve: error: {refused}: ") and "not" in err


@pytest.mark.parametrize(("flag", "field", "value"), SAME_NAME, ids=[s[0].split()[0] for s in SAME_NAME])
def test_vllm_flags_set_the_setting_of_their_name(flag: str, field: str, value: object) -> None:
    ns, notes = resolve(flag)
    assert getattr(config_from_args(ns), field) == value and notes == []


@pytest.mark.parametrize("fragment", REFUSED)
def test_flags_sluice_cannot_honour_are_refused_naming_the_flag(fragment: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(fragment, capsys)
    prefix = f"sluice serve: error: {fragment.split()[0]}: "
    assert err.startswith(prefix) and len(err) > len(prefix) + 20   # a reason, not just the name


@pytest.mark.parametrize("fragment", NO_EFFECT)
def test_flags_accepted_without_effect_log_why(fragment: str) -> None:
    ns, notes = resolve(fragment)
    flag = fragment.split()[0]
    assert len(notes) == 1 and notes[0].startswith(f"{flag} has no effect: ")
    assert config_from_args(ns) == config_from_args(resolve("")[0])   # nothing changed


def test_every_compat_flag_is_covered_here() -> None:
    tested = {f.split()[0] for f in REFUSED + NO_EFFECT} | set(IMPLEMENTED)
    declared = {flag.names[0] for flag in (*vllm_compat.ENGINE_FLAGS, *serve_args.SERVE_FLAGS)}
    assert declared - tested == set()


def test_the_notes_are_logged_once_each_at_start(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(supervisor.Supervisor, "run", lambda self: 0)
    with pytest.raises(SystemExit) as info:   # the logging set up by main writes to (captured) stderr
        supervisor.main(["--trust-remote-code", "--swap-space", "4", "--disable-log-stats"])
    assert info.value.code == 0
    lines = [line.split(" serve: ", 1)[1] for line in capsys.readouterr().err.splitlines() if "has no effect" in line]
    assert [line.split()[0] for line in lines] == ["--trust-remote-code", "--swap-space"]


def test_positional_model_is_the_model_everywhere() -> None:
    ns, _ = resolve("/models/qwen --served-model-name q")
    sup = supervisor.Supervisor(ns, config_from_args(ns))
    assert sup.engine.argv[sup.engine.argv.index("--model") + 1] == "/models/qwen"
    assert all(t.argv[t.argv.index("--model") + 1] == "/models/qwen" for t in sup.tokenizers)
    assert resolve("--max-num-seqs 4 /models/qwen")[0].model == "/models/qwen"   # after the flags too
    assert resolve("/models/qwen --model /models/qwen")[0].model == "/models/qwen"
    assert resolve("")[0].model is None and config_from_args(resolve("")[0]).model is None   # the default model


def test_model_given_twice_differently_names_both(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal("/models/a --model /models/b", capsys)
    assert "--model" in err and "/models/a" in err and "/models/b" in err


def test_underscore_spelling_as_vllm_accepts_it() -> None:
    ns, _ = resolve("--max_model_len=512 --max_num_seqs 3 --enable_prefix_caching --chat-template /t/a_b.jinja")
    assert (ns.max_model_len, ns.max_num_seqs, ns.chat_template) == (512, 3, "/t/a_b.jinja")


def test_num_gpu_blocks_override_reaches_the_engine_as_num_kv_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    ns, _ = resolve("--num-gpu-blocks-override 96")
    flags = engine_flags(config_from_args(ns))
    assert flags[flags.index("--num-kv-blocks") + 1] == "96"
    with pytest.raises(ValueError, match="--num-gpu-blocks-override: 96 contradicts --num-kv-blocks 64"):
        config_from_args(resolve("--num-gpu-blocks-override 96 --num-kv-blocks 64")[0])


def test_uvicorn_log_level_is_the_gateways_log_level() -> None:
    ns, _ = resolve("--uvicorn-log-level warning")
    gateway = supervisor.Supervisor(ns, config_from_args(ns)).gateways[0].argv
    assert gateway[gateway.index("--log-level") + 1] == "warning"
    engine = supervisor.Supervisor(ns, config_from_args(ns)).engine.argv
    assert engine[engine.index("--log-level") + 1] == "info"


def test_reasoning_parser_reaches_every_tokenizer_service(capsys: pytest.CaptureFixture[str]) -> None:
    ns, notes = resolve("--reasoning-parser qwen3 --tokenizers 2")
    assert notes == []
    for tokenizer in supervisor.Supervisor(ns, config_from_args(ns)).tokenizers:
        assert tokenizer.argv[tokenizer.argv.index("--reasoning-parser") + 1] == "qwen3"
    ns, _ = resolve("")
    assert "--reasoning-parser" not in supervisor.Supervisor(ns, config_from_args(ns)).tokenizers[0].argv
    err = refusal("--reasoning-parser granite", capsys)
    assert err.endswith("is not a reasoning parser Sluice has: it has deepseek_r1, qwen3")


def test_image_flags_reach_the_engine_and_every_tokenizer_service(capsys: pytest.CaptureFixture[str]) -> None:
    ns, notes = resolve("""--limit-mm-per-prompt '{"image": 2}' --allowed-media-domains a.example b.example """
                        "--tokenizers 2")
    assert notes == []
    stack = supervisor.Supervisor(ns, config_from_args(ns))
    assert stack.engine.argv[stack.engine.argv.index("--limit-mm-per-prompt") + 1] == '{"image": 2}'
    for tokenizer in stack.tokenizers:
        argv = tokenizer.argv
        assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image": 2}'
        assert argv[argv.index("--allowed-media-domains") + 1:][:2] == ["a.example", "b.example"]
    ns, _ = resolve("")
    assert "--allowed-media-domains" not in supervisor.Supervisor(ns, config_from_args(ns)).tokenizers[0].argv
    with pytest.raises(ValueError, match="limit_mm_per_prompt: must be a JSON object"):
        config_from_args(resolve("--limit-mm-per-prompt image=2")[0])


def test_keepalive_is_off_unless_asked_and_forwarded_when_asked() -> None:
    def gateway_value(command: str) -> float:
        ns, _ = resolve(command)
        argv = supervisor.Supervisor(ns, config_from_args(ns)).gateways[0].argv
        return float(argv[argv.index("--keepalive-interval") + 1])

    assert gateway_value("") == 0.0   # the gateway reads 0 as off
    assert gateway_value("--keepalive-interval 15") == 15.0


def test_vllm_api_key_variable_as_vllm_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    assert api_keys(resolve("")[0]) == ("vk",)
    monkeypatch.setenv("SLUICE_API_KEY", "sk")
    assert api_keys(resolve("")[0]) == ("sk",)


def test_the_engine_cli_takes_the_same_engine_flags() -> None:
    """``sluice engine`` (what runs under sluice serve, or alone) parses and refuses them the same way."""
    parser = argparse.ArgumentParser(prog="sluice engine")
    add_engine_args(parser)
    ns = parser.parse_args(vllm_compat.normalize_flag_spelling(["--swap_space", "4", "--trust-remote-code"]))
    assert [n.split()[0] for n in vllm_compat.check_vllm_compat(ns)] == ["--trust-remote-code", "--swap-space"]


@pytest.mark.parametrize(("command", "line"), [
    (["services.cli", "serve", "-tp", "2"],   # the default model, checked before any process starts
     "sluice serve: error: the model's 9 attention heads do not divide over tensor_parallel_size 2"),
    (["services.cli", "serve", "--reasoning-parser", "qwen3"],   # the default model does not think
     "sluice serve: error: --reasoning-parser qwen3: the model's vocabulary has no token '<think>'"),
    (["engine", "-dp", "2"],
     "sluice engine: error: --data-parallel-size: one engine is one replica: `sluice serve --data-parallel-size N` "
     "runs N engines behind its gateways"),
    (["engine", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'],
     "sluice engine: error: --speculative-config.method: 'eagle' is not supported: Sluice speculates with ngram, "
     "draft_model, mtp or deepseek_mtp"),
    (["services.cli", "serve", "--speculative-config", '{"model": "/nonexistent/draft", "num_speculative_tokens": 2}'],
     "sluice serve: error: --speculative-config.model: '/nonexistent/draft' does not exist"),
    (["engine", "--speculative-config", '{"model": "/nonexistent/draft", "num_speculative_tokens": 2}'],
     "sluice engine: error: --speculative-config.model: '/nonexistent/draft' does not exist"),
])
def test_a_refusal_is_one_line_and_exit_2_from_the_real_command(command: list[str], line: str) -> None:
    done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(line) and "Traceback" not in done.stderr


def test_speculative_config_reaches_the_engine_as_it_reads_it() -> None:
    """vLLM's --speculative-config, whole or by its keys, is passed on as the JSON the engine CLI reads back to
    the same settings."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for command in ('--speculative-config \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                    '"prompt_lookup_min": 2}\'',
                    "--speculative-config.method ngram --speculative_config.num_speculative_tokens=3",
                    '/m/target --speculative-config \'{"model": "/m/draft", "num_speculative_tokens": 2}\''):
        ns, notes = resolve(command)
        config = config_from_args(ns)
        assert config.speculative_config is not None and notes == []
        flags = engine_flags(config)
        assert " ".join(flags) in " ".join(supervisor.Supervisor(ns, config).engine.argv)
        assert config_from_args(parser.parse_args(flags)).speculative_config == config.speculative_config, command
    assert "--speculative-config" not in engine_flags(config_from_args(resolve("")[0]))


def test_a_speculative_method_sluice_lacks_stops_serve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        supervisor.main(["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "sluice serve: error: --speculative-config.method: 'medusa' is not supported: Sluice speculates with ngram, "
        "draft_model, mtp or deepseek_mtp")


def test_v0_speculative_flags_name_their_replacement(capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal("--speculative-model /m/draft --num-speculative-tokens 3", capsys) == (
        "sluice serve: error: --speculative-model: is vLLM v0's flag; give --speculative-config "
        "'{\"model\": ..., \"num_speculative_tokens\": ...}' instead")


def test_tls_flags_reach_every_child(tmp_path: Path) -> None:
    """vLLM's --ssl-* go to every gateway as given, --grpc-tls-* to every process; the URL printed is https."""
    from common.tls import grpc_tls_from_args, rest_tls_from_args
    from tests.tls_factory import make_ca, make_cert

    ca = make_ca(tmp_path)
    cert = make_cert(tmp_path, ca, "server")
    ns, _ = resolve(f"--gateways 2 --tokenizers 2 --ssl-certfile {cert.cert} --ssl-keyfile {cert.key} "
                    f"--ssl-ca-certs {ca.cert} --ssl-cert-reqs 1 --grpc-tls-cert {cert.cert} "
                    f"--grpc-tls-key {cert.key} --grpc-tls-ca {ca.cert}")
    stack = supervisor.Supervisor(ns, supervisor.config_from_args(ns), grpc_tls=grpc_tls_from_args(ns),
                                  rest_tls=rest_tls_from_args(ns))
    grpc_flags = f"--grpc-tls-cert {cert.cert} --grpc-tls-key {cert.key} --grpc-tls-ca {ca.cert}"
    for child in stack.children:
        assert grpc_flags in " ".join(child.argv), child.name
    for gateway in stack.gateways:
        assert (f"--ssl-certfile {cert.cert} --ssl-cert-reqs 1 --ssl-keyfile {cert.key} --ssl-ca-certs {ca.cert}"
                in " ".join(gateway.argv))
    assert stack.scheme == "https"
    plain, _ = resolve("--gateways 2")
    stack = supervisor.Supervisor(plain, supervisor.config_from_args(plain))
    assert stack.scheme == "http" and not any("tls" in " ".join(c.argv) or "--ssl" in " ".join(c.argv)
                                              for c in stack.children)
