"""Prefill/decode disaggregation end to end: `sluice serve --prefill-replicas 1 --decode-replicas 1` over a tiny
random Llama (float32), through the official openai SDK. 16 greedy prompts of mixed lengths (a few tokens to
several blocks; one asks for a single token, which ends on the prefill engine) come back, unstreamed and then
streamed, with exactly the text the same prefill engine gives them colocated (a tokenizer service of the test's own
in front of it alone, its prefix cache reset afterwards). The decode engine pulled exactly the prompts' full blocks
once (``sluice:kv_transfer_blocks_total{direction="received"}`` on the gateway's /metrics, labelled with its
``kv_role``; the streamed run finds them in its own prefix cache), computed none of them itself (no fallbacks), and
afterwards every KV block of both engines is free."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import grpc_serving
from engine.config import default_model_path
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.replicas import consecutive_free_ports
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.procs import ServeStack, tokenizer_process, wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SHORT = 5   # the prompt that asks for one token: it ends on the prefill engine, nothing is handed off
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls watch it from an old oak tree".split()


def prompt(i: int) -> str:
    """Prompt i: its number first (no two share a first block), then 0 to ~150 words."""
    words = (i * i * 7) % 151 if i else 0
    return f"Story {i}: " + " ".join(WORDS[k % len(WORDS)] for k in range(words))


def max_tokens(i: int) -> int:
    return 1 if i == SHORT else MAX_TOKENS


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    tmp = tmp_path_factory.mktemp("disagg")
    save_tiny_llama(tmp / "tiny", vocab_size=49152)   # the default model's vocabulary, for its tokenizer
    s = ServeStack(tmp, "--model", str(tmp / "tiny"), "--tokenizer", default_model_path(), "--prefill-replicas", "1",
                   "--decode-replicas", "1", "--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--num-threads",
                   "1", "--dtype", "float32", "--shutdown-timeout", "5")
    # 2 engines (prefill first), 2 tokenizer services; the metrics pages take free ports of their own (a range
    # reserved here but not yet bound could be handed to one of them)
    base = consecutive_free_ports(4)
    s.engine_port, s.tokenizer_port = base, base + 2
    s.start()
    yield s
    s.stop()


def engine_info(port: int) -> engine_pb2.GetInfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)


def colocated(stack: ServeStack) -> list[str]:
    """Each prompt's greedy text from the prefill engine alone, as a colocated engine runs it; its prefix cache is
    emptied afterwards (the disaggregated runs compute every prompt afresh)."""
    producer = f"127.0.0.1:{stack.engine_port}"
    with tokenizer_process(stack.log.parent, producer, "--tokenizer", default_model_path(),
                           "--served-model-name", "tiny") as addr, grpc.insecure_channel(addr) as channel:
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Generation"), 30, what="colocated service")
        stub = generation_pb2_grpc.GenerationStub(channel)
        texts = ["".join(r.text for r in stub.Generate(generation_pb2.GenerateRequest(
            text=prompt(i), sampling=common_pb2.SamplingParameters(temperature=0.0),
            stopping=generation_pb2.StoppingCriteria(max_tokens=max_tokens(i), ignore_eos=True)), timeout=60))
            for i in range(16)]
    with grpc.insecure_channel(producer) as channel:
        reset = engine_pb2_grpc.EngineStub(channel).ResetPrefixCache(common_pb2.ResetPrefixCacheRequest(), timeout=10)
    assert reset.ok
    return texts


def engine_metrics(stack: ServeStack) -> dict[tuple[str, str, str], float]:
    """The gateway's federated ``sluice:kv_transfer_*`` samples by (name, kv_role, direction)."""
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    return {(s.name, s.labels.get("kv_role", ""), s.labels.get("direction", "")): s.value
            for f in families for s in f.samples if s.name.startswith("sluice:kv_transfer_")
            and s.name.endswith("_total")}


def test_disaggregated_greedy_outputs_equal_the_colocated_ones_and_only_full_prompt_blocks_cross(
        stack: ServeStack) -> None:
    expected = colocated(stack)
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def unstreamed(i: int) -> tuple[str, int]:
        r = client.completions.create(model=model, prompt=prompt(i), max_tokens=max_tokens(i), temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage is not None and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == max_tokens(i)
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        assert not cached   # the decode engine's hits on the pulled blocks are not the client's
        return r.choices[0].text, r.usage.prompt_tokens

    def streamed(i: int) -> str:
        chunks = client.completions.create(model=model, prompt=prompt(i), max_tokens=max_tokens(i), temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True)
        text, reasons = "", []
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.text
                reasons += [choice.finish_reason] if choice.finish_reason else []
        assert reasons == ["length"]
        return text

    with ThreadPoolExecutor(16) as pool:
        first = list(pool.map(unstreamed, range(16)))
        second = list(pool.map(streamed, range(16)))
    assert [text for text, _ in first] == expected
    assert second == expected
    block_size = engine_info(stack.engine_port + 1).block_size
    full_blocks = sum(tokens // block_size for i, (_, tokens) in enumerate(first) if i != SHORT)
    assert full_blocks >= 40   # several blocks cross, from most prompts

    producer, consumer = engine_info(stack.engine_port), engine_info(stack.engine_port + 1)
    assert (producer.kv_role, consumer.kv_role) == ("kv_producer", "kv_consumer")
    metrics = engine_metrics(stack)
    assert metrics[("sluice:kv_transfer_blocks_total", "kv_consumer", "received")] == full_blocks
    assert metrics[("sluice:kv_transfer_fallbacks_total", "kv_consumer", "")] == 0
    assert metrics[("sluice:kv_transfer_blocks_total", "kv_producer", "received")] == 0

    def idle(port: int) -> bool:
        info = engine_info(port)
        return info.num_running == info.num_waiting == 0 and info.free_kv_blocks == info.total_kv_blocks

    for port in (stack.engine_port, stack.engine_port + 1):
        wait_until(lambda p=port: idle(p), 15, what=f"every KV block free on the engine at {port}")
    # The prefill engine counts as sent what the decode engine said it pulled (nothing, the second time: cached).
    sent = engine_metrics(stack)[("sluice:kv_transfer_blocks_total", "kv_producer", "sent")]
    assert sent == full_blocks
