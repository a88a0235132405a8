"""Multi-LoRA end to end, through `sluice serve` and the official openai SDK: a tiny random Llama with the
default model's tokenizer, PEFT adapters written by peft itself; each adapter's greedy output is checked token for
token against PEFT's own ``PeftModel`` run by transformers, alone and mixed with other adapters and the base model
in one batch; adapters listed with their parent, loaded and unloaded at runtime over REST, and every refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import PreTrainedModel

from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.lora_factory import make_tiny_model, save_adapter
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 3303, 282, 1345], [1, 2093, 314, 253, 1431, 30, 9863], [1, 17, 18, 19, 20, 21, 22, 23],
           [1, 3000, 3001]]
MAX_TOKENS = 12


@dataclass
class Models:
    base_dir: Path
    base: PreTrainedModel
    adapters: dict[str, tuple[Path, torch.nn.Module]]   # name -> (folder, PeftModel)

    def text(self, ids: list[int]) -> str:
        """What the REST API answers for these output ids (special tokens skipped, its default)."""
        from tokenizers import Tokenizer

        return str(Tokenizer.from_file(str(self.base_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, default_hf_tokenizer: Any) -> Models:
    tokenizer = default_hf_tokenizer
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    tokenizer.save_pretrained(base_dir)
    base = make_tiny_model("llama", seed=0, vocab_size=len(tokenizer), max_position_embeddings=512,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    base.save_pretrained(base_dir)
    adapters = {
        "sql": save_adapter(base, root / "sql", r=8, alpha=16, targets=("q_proj", "v_proj"), seed=11),
        "chat": save_adapter(base, root / "chat", r=16, alpha=32, seed=12),
        "late": save_adapter(base, root / "late", r=16, alpha=8, use_rslora=True, seed=13,
                             targets=("o_proj", "gate_proj", "down_proj")),
    }
    return Models(base_dir, base, {name: (root / name, model) for name, model in adapters.items()})


def greedy(model: torch.nn.Module, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    """Greedy continuation by the reference model (argmax of its own float32 logits, no generation config)."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models: Models) -> Iterator[ServeStack]:
    sql, chat = models.adapters["sql"][0], models.adapters["chat"][0]
    s = ServeStack(tmp_path_factory.mktemp("serve"), "--model", str(models.base_dir), "--served-model-name", "tiny",
                   "--dtype", "float32", "--max-num-seqs", "16", "--kv-cache-memory", "128MiB",
                   "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                   "--lora-modules", f"sql={sql}", json.dumps({"name": "chat", "path": str(chat),
                                                                "base_model_name": "tiny-base"}))
    s.start()
    yield s
    s.stop()


def _client(stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model and r.usage is not None and r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


def test_models_lists_adapters_with_their_parent(stack: ServeStack) -> None:
    data = {m.id: m for m in _client(stack).models.list().data}
    assert set(data) == {"tiny", "sql", "chat"}
    assert data["sql"].model_dump()["parent"] == "tiny"
    assert data["chat"].model_dump()["parent"] == "tiny-base"
    assert data["tiny"].model_dump()["parent"] is None


def test_each_adapter_matches_peft_alone_and_mixed_in_one_batch(stack: ServeStack, models: Models) -> None:
    client = _client(stack)
    refs = {name: model for name, (_, model) in models.adapters.items() if name in ("sql", "chat")}
    refs["tiny"] = models.base
    expected = {(name, i): models.text(greedy(model, p)) for name, model in refs.items()
                for i, p in enumerate(PROMPTS)}
    # The adapters change the answer (else this test could not fail).
    assert expected[("sql", 0)] != expected[("tiny", 0)] != expected[("chat", 0)]
    for name in refs:   # alone
        assert _complete(client, name, PROMPTS[0]) == expected[(name, 0)], name
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in refs]   # mixed: 12 requests at once
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(jobs, pool.map(lambda job: _complete(client, job[0], PROMPTS[job[1]]), jobs)))
    assert got == expected
    info = stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks


def test_unknown_model_is_404_model_not_found(stack: ServeStack) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _client(stack).completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    body = e.value.response.json()["error"]
    assert body["code"] == "model_not_found" and "nope" in body["message"]


def test_public_grpc_picks_the_adapter_by_model(stack: ServeStack, models: Models) -> None:
    import grpc

    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{stack.tokenizer_port}"))
    req = generation_pb2.GenerateRequest(model="sql", token_ids=common_pb2.TokenIds(ids=PROMPTS[1]))
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = MAX_TOKENS
    req.stopping.ignore_eos = True
    ids = [t for msg in stub.Generate(req, timeout=60) for t in msg.token_ids]
    assert ids == greedy(models.adapters["sql"][1], PROMPTS[1])
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert info.lora_enabled and [a.name for a in info.lora_adapters] == ["sql", "chat"]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generation_pb2.GenerateRequest(model="nope", text="hi"), timeout=10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_load_and_unload_at_runtime(stack: ServeStack, models: Models, tmp_path: Path) -> None:
    url = f"{stack.base_url}/v1"
    late_dir, late = models.adapters["late"]
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late_dir)}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully.", r.text
    client = _client(stack)
    assert _complete(client, "late", PROMPTS[2]) == models.text(greedy(late, PROMPTS[2]))
    assert "late" in {m.id for m in client.models.list().data}
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late_dir)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "The lora adapter 'late' has already been loaded."
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)}, timeout=60)
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully.", r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late", PROMPTS[2])
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'late' cannot be found."
    # Loaded again under the same name: served again, exactly as before.
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late_dir)}, timeout=60)
    assert r.status_code == 200
    assert _complete(client, "late", PROMPTS[2]) == models.text(greedy(late, PROMPTS[2]))


def test_unloading_an_adapter_lets_its_running_request_finish(stack: ServeStack, models: Models) -> None:
    url = f"{stack.base_url}/v1"
    late_dir, late = models.adapters["late"]
    httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)   # whatever ran before
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late_dir)}, timeout=60)
    assert r.status_code == 200, r.text
    client = _client(stack)
    n = 300
    stream = client.completions.create(model="late", prompt=PROMPTS[3], max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    # Unloaded while its request runs: gone for new requests at once, the running one keeps its weights.
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    assert stack.engine_idle(timeout=0).num_running == 1   # it was unloaded under a running request
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late", PROMPTS[2])
    finish = None
    for chunk in chunks:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    assert text == models.text(greedy(late, PROMPTS[3], n))
    info = stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks and [a.name for a in info.lora_adapters] == ["sql", "chat"]


def test_the_lora_gauge_inference_gateways_read_names_the_running_adapter(stack: ServeStack) -> None:
    """vllm:lora_requests_info on the gateway's page (the engine's, federated), with the labels of the Gateway API
    Inference Extension's protocol (tests/engine/entrypoints/test_inference_gateway_protocol.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    def lora_info() -> list[Any]:
        page = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        return [s for f in text_string_to_metric_families(page) for s in f.samples
                if s.name == "vllm:lora_requests_info"]

    stream = _client(stack).completions.create(model="sql", prompt=PROMPTS[0], max_tokens=300, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)   # running now
    (running,) = lora_info()
    assert running.labels == {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
    stream.close()
    stack.engine_idle()
    (idle,) = lora_info()
    assert idle.labels["running_lora_adapters"] == "" and idle.value >= running.value
