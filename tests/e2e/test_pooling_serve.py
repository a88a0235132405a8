"""`sluice serve` of a tiny BERT embedder (mean pooling, Normalize, Matryoshka sizes in its config) and of a tiny
BERT cross-encoder, against ``sentence-transformers`` (PyPI) on the very same directories: ``/v1/embeddings`` through
the official ``openai`` SDK (base64 by default, and floats), ``dimensions`` as ``truncate_dim`` + normalisation,
``/score``, ``/rerank`` and ``/classify``, the public gRPC ``Embed`` and ``Score`` called directly, and the 400s of a
request the model does not serve."""
from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.engine.models.pooling_factory import save_tiny_bert_embedder, save_tiny_cross_encoder
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

EMBEDDER, RERANKER = "tiny-embedder", "tiny-reranker"
TEXTS = ["the cat sat on the mat", "hello world", "what is the capital of france?", "a dog, a cat: 42 mats!"]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "hello world", "a dog"]
MATRYOSHKA = [8, 16, 32]
TOL = 1e-4


def _serve(tmp: Path, model: Path, name: str) -> ServeStack:
    return ServeStack(tmp, str(model), "--served-model-name", name, "--dtype", "float32", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_tiny_bert_embedder(tmp_path_factory.mktemp("embedder"))
    config = json.loads((path / "config.json").read_text())
    config.update(is_matryoshka=True, matryoshka_dimensions=MATRYOSHKA)  # where vLLM reads them
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def embedder(embedder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    stack = _serve(tmp_path_factory.mktemp("serve-embedder"), embedder_dir, EMBEDDER)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("cross"))


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    stack = _serve(tmp_path_factory.mktemp("serve-reranker"), reranker_dir, RERANKER)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reference(embedder_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(embedder_dir), device="cpu")


def sdk(stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def post(stack: ServeStack, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)


def test_embeddings_through_the_openai_sdk_equal_sentence_transformers(embedder: ServeStack, embedder_dir: Path,
                                                                       reference: SentenceTransformer) -> None:
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    client = sdk(embedder)
    default = client.embeddings.create(model=EMBEDDER, input=TEXTS)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    for answer in (default, floats):
        got = np.array([d.embedding for d in sorted(answer.data, key=lambda d: d.index)])
        assert got.shape == expected.shape and np.abs(got - expected).max() < TOL
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]  # the same float32 values
    tokenizer = AutoTokenizer.from_pretrained(str(embedder_dir))
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert (default.usage.prompt_tokens, default.usage.total_tokens, default.model) == (tokens, tokens, EMBEDDER)


def prompt_tokens_total(stack: ServeStack) -> float:
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    (sample,) = [s for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == "vllm:prompt_tokens_total"]
    return sample.value


def test_embedded_prompts_count_in_the_prompt_tokens_counter(embedder: ServeStack) -> None:
    before = prompt_tokens_total(embedder)
    usage = post(embedder, "/v1/embeddings", {"input": TEXTS[:3]}).json()["usage"]["prompt_tokens"]
    assert usage > 0 and prompt_tokens_total(embedder) - before == usage


def test_base64_is_little_endian_float32_of_the_same_floats(embedder: ServeStack) -> None:
    as_b64 = post(embedder, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    as_floats = post(embedder, "/v1/embeddings", {"input": TEXTS[0]}).json()
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == as_floats["data"][0]["embedding"]


@pytest.mark.parametrize("dimensions", [8, 16])
def test_dimensions_truncate_and_renormalise_as_sentence_transformers(embedder: ServeStack, embedder_dir: Path,
                                                                      dimensions: int) -> None:
    short = SentenceTransformer(str(embedder_dir), device="cpu", truncate_dim=dimensions)
    expected = short.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    answer = sdk(embedder).embeddings.create(model=EMBEDDER, input=TEXTS, dimensions=dimensions)
    got = np.array([d.embedding for d in answer.data])
    assert got.shape == (len(TEXTS), dimensions) and np.abs(got - expected).max() < TOL
    refused = post(embedder, "/v1/embeddings", {"input": "x", "dimensions": 12})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def test_token_ids_and_truncation(embedder: ServeStack, embedder_dir: Path, reference: SentenceTransformer) -> None:
    ids = AutoTokenizer.from_pretrained(str(embedder_dir))(TEXTS[2])["input_ids"]
    by_ids = post(embedder, "/v1/embeddings", {"input": [ids, ids[-5:]]}).json()
    kept = post(embedder, "/v1/embeddings", {"input": TEXTS[2], "truncate_prompt_tokens": 5}).json()
    assert np.abs(np.array(by_ids["data"][0]["embedding"]) - reference.encode(TEXTS[2])).max() < TOL
    assert np.abs(np.array(kept["data"][0]["embedding"]) - np.array(by_ids["data"][1]["embedding"])).max() < TOL
    assert kept["usage"]["prompt_tokens"] == 5
    too_long = post(embedder, "/v1/embeddings", {"input": ["hello", "cat " * 200]})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input[1]"


def test_score_on_an_embedding_model_is_the_cosine(embedder: ServeStack, reference: SentenceTransformer) -> None:
    answer = post(embedder, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    vectors = reference.encode([QUERY, *DOCUMENTS], convert_to_tensor=True)
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    assert [d["score"] for d in answer["data"]] == pytest.approx(expected, abs=TOL)


def test_a_pooling_model_does_not_generate(embedder: ServeStack) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi", "stream": True})):
        r = post(embedder, path, body)
        assert r.status_code == 400 and "is a pooling model" in r.json()["error"]["message"], r.text


def test_the_public_grpc_api_embeds(embedder: ServeStack, reference: SentenceTransformer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{embedder.tokenizer_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        resp = stub.Embed(generation_pb2.EmbedRequest(inputs=[generation_pb2.PoolingInput(text=t) for t in TEXTS]),
                          timeout=60)
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    got = np.array([list(e.values) for e in resp.embeddings])
    assert np.abs(got - reference.encode(TEXTS)).max() < TOL
    assert (info.runner, "embed" in info.pooling_tasks, info.embedding_size) == ("pooling", True, 32)
    assert info.is_matryoshka and list(info.matryoshka_dimensions) == MATRYOSHKA


def test_score_and_rerank_equal_the_cross_encoder(reranker: ServeStack, reranker_dir: Path) -> None:
    expected = CrossEncoder(str(reranker_dir), device="cpu").predict([(QUERY, d) for d in DOCUMENTS]).tolist()
    scored = post(reranker, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=TOL)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(reranker, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in ranked["results"]] == order[:3]
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[i] for i in order[:3]],
                                                                                   abs=TOL)
        assert [r["document"]["text"] for r in ranked["results"]] == [DOCUMENTS[i] for i in order[:3]]
    with grpc.insecure_channel(f"127.0.0.1:{reranker.tokenizer_port}") as channel:
        resp = generation_pb2_grpc.GenerationStub(channel).Score(
            generation_pb2.ScoreRequest(queries=[QUERY], documents=DOCUMENTS), timeout=60)
    assert list(resp.scores) == pytest.approx(expected, abs=TOL) and resp.usage.prompt_tokens == sum(resp.prompt_tokens)


def test_classify_applies_the_models_sigmoid(reranker: ServeStack, reranker_dir: Path) -> None:
    model = AutoModelForSequenceClassification.from_pretrained(str(reranker_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(reranker_dir))
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tokenizer(t, return_tensors="pt")).logits)[0].tolist() for t in TEXTS]
    answer = post(reranker, "/classify", {"input": TEXTS}).json()
    assert [d["probs"] for d in answer["data"]] == [pytest.approx(e, abs=TOL) for e in expected]
    assert {d["num_classes"] for d in answer["data"]} == {1}
    refused = post(reranker, "/v1/embeddings", {"input": "x"})
    assert refused.status_code == 400 and "cannot embed" in refused.json()["error"]["message"]


def test_a_generation_model_does_not_embed(shared_stack: ServeStack) -> None:
    r = post(shared_stack, "/v1/embeddings", {"input": "hi"})
    assert r.status_code == 400 and "is a generation model" in r.json()["error"]["message"], r.text
    with grpc.insecure_channel(f"127.0.0.1:{shared_stack.tokenizer_port}") as channel:
        with pytest.raises(grpc.RpcError) as error:
            generation_pb2_grpc.GenerationStub(channel).Embed(generation_pb2.EmbedRequest(
                inputs=[generation_pb2.PoolingInput(token_ids=common_pb2.TokenIds(ids=[1, 2]))]), timeout=30)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
