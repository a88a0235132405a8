"""The pooling routes in front of a fake tokenizer service (gRPC, through the gateway's real client): each route's
request fields as the service receives them, the answers' shapes (OpenAI's embeddings through the ``openai`` SDK,
vLLM's score / rerank / classify / pooling), base64 bytes, the refusals naming their field, and vLLM's own field
lists walked so that a field added there without a handler here fails."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest

from gateway.app import create_app
from gateway.client import GrpcBackend
from gateway.pooling_schemas import (
    CLASSIFY_REFUSED,
    EMBEDDING_REFUSED,
    RERANK_REFUSED,
    SCORE_REFUSED,
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from gateway.request_fields import declared
from gateway.settings import GatewaySettings
from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.anyio

SERVED = "pool-test"
VECTORS = {"the cat": [0.5, -0.25, 1 / 3, 1e-8], "the dog": [0.1, 0.2, 0.3, 0.4]}

# vLLM's request models, field by field: vllm/entrypoints/openai/protocol.py at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e
# (EmbeddingCompletionRequest, EmbeddingChatRequest, ScoreRequest, RerankRequest, ClassificationRequest) and the names
# its later vllm/entrypoints/pooling/*/protocol.py added (PoolingBasicRequestMixin, EncodingRequestMixin,
# EmbedRequestMixin, ClassifyRequestMixin, PoolingCompletionRequest, Score*Request).
_BASIC = ("model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "request_id", "priority",
          "mm_processor_kwargs", "cache_salt")
_CHAT = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
         "chat_template_kwargs", "media_io_kwargs")
VLLM_EMBEDDING = (*_BASIC, *_CHAT, "input", "encoding_format", "dimensions", "normalize", "use_activation",
                  "embed_dtype", "endianness")
VLLM_POOLING = (*VLLM_EMBEDDING, "task")
VLLM_SCORE = (*_BASIC, "text_1", "text_2", "queries", "documents", "items", "data_1", "data_2", "activation",
              "use_activation")
VLLM_RERANK = (*_BASIC, "query", "documents", "top_n", "activation", "use_activation")
VLLM_CLASSIFY = (*_BASIC, *_CHAT, "input", "activation", "use_activation")
# Jina's and Cohere's rerank bodies (their API references): return_documents works, the rest is refused.
RERANK_DIALECTS = ("return_documents", "max_tokens_per_doc", "rank_fields", "max_chunks_per_doc")


class FakePooling(generation_pb2_grpc.GenerationServicer):
    """Answers Embed with ``VECTORS`` (by text; token ids: [len, sum]), Score with 0.1 × the document's length,
    Classify with two probabilities; records every request. ``error``: the status the next call fails with."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.tasks = ["embed"]
        self.error: tuple[grpc.StatusCode, str] | None = None

    async def _check(self, request: Any, context: Any) -> None:
        self.requests.append(request)
        if self.error is not None:
            code, message = self.error
            await context.abort(code, message)

    async def GetModelInfo(self, request: Any, context: Any) -> generation_pb2.GetModelInfoResponse:  # noqa: N802
        return generation_pb2.GetModelInfoResponse(model_name=SERVED, max_model_len=512, runner="pooling",
                                                   pooling_tasks=self.tasks, embedding_size=4)

    async def Embed(self, request: generation_pb2.EmbedRequest, context: Any) -> generation_pb2.EmbedResponse:  # noqa: N802
        await self._check(request, context)
        out = []
        for item in request.inputs:
            if item.WhichOneof("input") == "text":
                values = VECTORS[item.text] * (2 if request.task == "token_embed" else 1)
                out.append(generation_pb2.Embedding(values=values, row_size=4, prompt_tokens=4))
            else:
                ids = list(item.token_ids.ids)
                out.append(generation_pb2.Embedding(values=[len(ids), sum(ids)], row_size=2, prompt_tokens=len(ids)))
        return generation_pb2.EmbedResponse(embeddings=out, usage=common_pb2.Usage(
            prompt_tokens=sum(e.prompt_tokens for e in out)))

    async def Score(self, request: generation_pb2.ScoreRequest, context: Any) -> generation_pb2.ScoreResponse:  # noqa: N802
        await self._check(request, context)
        scores = [0.1 * len(d) for d in request.documents]
        return generation_pb2.ScoreResponse(scores=scores, prompt_tokens=[3] * len(scores),
                                            usage=common_pb2.Usage(prompt_tokens=3 * len(scores)))

    async def Classify(self, request: generation_pb2.ClassifyRequest, context: Any  # noqa: N802
                       ) -> generation_pb2.ClassifyResponse:
        await self._check(request, context)
        results = [generation_pb2.Classification(scores=[0.25, 0.75], label="yes", prompt_tokens=2)
                   for _ in request.inputs]
        return generation_pb2.ClassifyResponse(results=results, usage=common_pb2.Usage(prompt_tokens=2 * len(results)))


@contextlib.asynccontextmanager
async def _gateway(fake: FakePooling) -> AsyncIterator[httpx.AsyncClient]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    settings = GatewaySettings(tokenizer_addresses=(f"127.0.0.1:{port}",), served_model_names=(SERVED,))
    backend = GrpcBackend.connect(settings.tokenizer_addresses)
    app = create_app(settings, backend)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway.test") as client:
            yield client
    finally:
        await backend.close()
        await server.stop(0)


@pytest.fixture
async def fake(one_event_loop: None) -> FakePooling:
    return FakePooling()


@pytest.fixture
async def client(fake: FakePooling) -> AsyncIterator[httpx.AsyncClient]:
    async with _gateway(fake) as c:
        yield c


def inputs_of(request: Any) -> list[str | list[int]]:
    return [i.text if i.WhichOneof("input") == "text" else list(i.token_ids.ids) for i in request.inputs]


async def test_the_openai_sdk_reads_embeddings_as_floats_and_as_base64(client: httpx.AsyncClient,
                                                                      fake: FakePooling) -> None:
    sdk = openai.AsyncOpenAI(api_key="none", base_url="http://gateway.test/v1", http_client=client)
    default = await sdk.embeddings.create(model=SERVED, input=["the cat", "the dog"])  # the SDK asks for base64
    floats = await sdk.embeddings.create(model=SERVED, input="the cat", encoding_format="float", dimensions=4,
                                         user="u1")
    assert [d.embedding for d in default.data] == [list(np.float32(VECTORS[t]).astype(float)) for t in
                                                   ("the cat", "the dog")]
    assert floats.data[0].embedding == list(np.float32(VECTORS["the cat"]).astype(float))
    assert (default.model, default.usage.prompt_tokens, default.usage.total_tokens) == (SERVED, 8, 8)
    assert [inputs_of(r) for r in fake.requests] == [["the cat", "the dog"], ["the cat"]]
    assert fake.requests[1].dimensions == 4 and not fake.requests[0].HasField("dimensions")
    assert fake.requests[0].task == "embed"


async def test_embeddings_take_token_ids_and_the_vllm_options(client: httpx.AsyncClient, fake: FakePooling) -> None:
    r1 = await client.post("/v1/embeddings", json={"input": [5, 6, 7], "truncate_prompt_tokens": 2,
                                                   "add_special_tokens": False, "priority": -3, "normalize": False})
    r2 = await client.post("/v1/embeddings", json={"input": [[1, 2], [3]], "truncate_prompt_tokens": -1,
                                                   "use_activation": True})
    assert r1.status_code == r2.status_code == 200
    body = r1.json()
    assert body["object"] == "list" and body["id"].startswith("embd-") and body["model"] == SERVED
    assert body["data"] == [{"object": "embedding", "index": 0, "embedding": [3.0, 18.0]}]
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    first, second = fake.requests
    assert inputs_of(first) == [[5, 6, 7]] and inputs_of(second) == [[1, 2], [3]]
    assert (first.truncate_prompt_tokens, first.add_special_tokens, first.priority, first.normalize) == (2, False, -3,
                                                                                                         False)
    assert second.truncate_prompt_tokens == 512 and second.normalize is True  # -1: the context length
    assert not second.HasField("add_special_tokens")


@pytest.mark.parametrize(("dtype", "endianness", "numpy_type"), [
    ("float32", "little", "<f4"), ("float32", "big", ">f4"), ("float16", "little", "<f2"), ("float16", "big", ">f2")])
async def test_base64_holds_the_vector_in_the_asked_type_and_byte_order(client: httpx.AsyncClient, dtype: str,
                                                                        endianness: str, numpy_type: str) -> None:
    r = await client.post("/v1/embeddings", json={"input": "the cat", "encoding_format": "base64",
                                                  "embed_dtype": dtype, "endianness": endianness})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert raw == np.asarray(VECTORS["the cat"], dtype=np.float32).astype(numpy_type).tobytes()


async def test_bfloat16_base64_rounds_as_torch_does(client: httpx.AsyncClient) -> None:
    torch = pytest.importorskip("torch")
    r = await client.post("/v1/embeddings", json={"input": "the cat", "encoding_format": "base64",
                                                  "embed_dtype": "bfloat16", "endianness": "little"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    expected = torch.tensor(VECTORS["the cat"], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy()
    assert raw == expected.astype("<i2").tobytes()


async def test_pooling_returns_the_models_output_for_its_task(client: httpx.AsyncClient, fake: FakePooling) -> None:
    plain = (await client.post("/pooling", json={"input": "the cat"})).json()
    tokens = (await client.post("/pooling", json={"input": "the dog", "task": "token_embed"})).json()
    fake.tasks = ["classify"]
    classes = (await client.post("/pooling", json={"input": ["the cat"]})).json()
    assert plain["data"] == [{"index": 0, "object": "pooling", "data": list(np.float32(VECTORS["the cat"]).astype(
        float))}] and plain["id"].startswith("pool-")
    assert np.allclose(tokens["data"][0]["data"], [VECTORS["the dog"]] * 2)
    assert classes["data"][0]["data"] == [0.25, 0.75]
    assert [type(r).__name__ for r in fake.requests] == ["EmbedRequest", "EmbedRequest", "ClassifyRequest"]
    assert [getattr(r, "task", None) for r in fake.requests[:2]] == ["embed", "token_embed"]


async def test_score_takes_every_vllm_naming(client: httpx.AsyncClient, fake: FakePooling) -> None:
    bodies = [{"text_1": "q", "text_2": ["ab", "abcd"]}, {"queries": ["q1", "q2"], "documents": ["ab", "abcd"]},
              {"data_1": "q", "data_2": "abc", "use_activation": False}, {"queries": "q", "items": ["a"]}]
    answers = [(await client.post(path, json=b)).json() for b, path in zip(bodies, ("/score", "/v1/score") * 2)]
    assert answers[0]["data"] == [{"index": 0, "object": "score", "score": pytest.approx(0.2)},
                                  {"index": 1, "object": "score", "score": pytest.approx(0.4)}]
    assert answers[0]["usage"] == {"prompt_tokens": 6, "total_tokens": 6} and answers[0]["object"] == "list"
    assert [(list(r.queries), list(r.documents)) for r in fake.requests] == [
        (["q"], ["ab", "abcd"]), (["q1", "q2"], ["ab", "abcd"]), (["q"], ["abc"]), (["q"], ["a"])]
    assert fake.requests[2].activation is False and not fake.requests[0].HasField("activation")


async def test_rerank_sorts_cuts_and_shows_documents_as_jina_and_cohere_ask(client: httpx.AsyncClient,
                                                                           fake: FakePooling) -> None:
    docs = ["a", {"text": "abc"}, "ab"]
    full = (await client.post("/rerank", json={"query": "q", "documents": docs})).json()
    top = (await client.post("/v2/rerank", json={"query": "q", "documents": docs, "top_n": 2,
                                                 "return_documents": False})).json()
    assert [(r["index"], r["document"]["text"]) for r in full["results"]] == [(1, "abc"), (2, "ab"), (0, "a")]
    assert [r["relevance_score"] for r in full["results"]] == pytest.approx([0.3, 0.2, 0.1])
    assert full["usage"] == {"prompt_tokens": 9, "total_tokens": 9} and full["model"] == SERVED
    assert top["results"] == [{"index": 1, "relevance_score": pytest.approx(0.3)},
                              {"index": 2, "relevance_score": pytest.approx(0.2)}]
    assert list(fake.requests[0].documents) == ["a", "abc", "ab"] and list(fake.requests[0].queries) == ["q"]


async def test_classify_answers_vllms_shape(client: httpx.AsyncClient, fake: FakePooling) -> None:
    body = (await client.post("/classify", json={"input": ["the cat", "the dog"], "activation": False})).json()
    assert body["data"] == [{"index": i, "label": "yes", "probs": [0.25, 0.75], "num_classes": 2} for i in (0, 1)]
    assert body["id"].startswith("classify-") and body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert fake.requests[0].activation is False


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/v1/embeddings", {"input": "x", "cache_salt": "s"}, "cache_salt"),
    ("/v1/embeddings", {"input": "x", "truncation_side": "right"}, "truncation_side"),
    ("/v1/embeddings", {"input": "x", "padding": "max_length"}, "padding"),
    ("/v1/embeddings", {"input": "x", "request_id": "r"}, "request_id"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "embed_dtype": "fp8_e4m3"}, "embed_dtype"),
    ("/v1/embeddings", {"input": "x", "normalize": True, "use_activation": False}, "use_activation"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": [1.5]}, "input[0]"),
    ("/v1/embeddings", {}, "input"),
    ("/pooling", {"input": "x", "task": "plugin"}, "task"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": "a"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": {"content": []}}, "text_2"),
    ("/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 10}, "max_tokens_per_doc"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/classify", {"input": "x", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
])
async def test_refused_fields_are_400s_naming_them(client: httpx.AsyncClient, fake: FakePooling, path: str,
                                                   body: dict[str, Any], param: str) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert not fake.requests


async def test_the_services_refusals_come_back_as_400s_named_by_the_routes_fields(client: httpx.AsyncClient,
                                                                                  fake: FakePooling) -> None:
    fake.error = (grpc.StatusCode.FAILED_PRECONDITION, "The model `m` is a generation model, not a pooling model: "
                                                       "it cannot embed.")
    generation = await client.post("/v1/embeddings", json={"input": "x"})
    fake.error = (grpc.StatusCode.INVALID_ARGUMENT, "inputs[1]: has 600 tokens, more than the model's context")
    too_long = await client.post("/v1/embeddings", json={"input": ["x", "y"]})
    fake.error = (grpc.StatusCode.INVALID_ARGUMENT, "queries[0]: is 9 characters")
    query = await client.post("/rerank", json={"query": "q", "documents": ["a"]})
    assert (generation.status_code, generation.json()["error"]["message"]) == (
        400, "The model `m` is a generation model, not a pooling model: it cannot embed.")
    assert too_long.status_code == 400 and too_long.json()["error"] == {
        "message": "input[1]: has 600 tokens, more than the model's context", "type": "invalid_request_error",
        "param": "input[1]", "code": None}
    assert query.json()["error"]["param"] == "query[0]"


@pytest.mark.parametrize(("fields", "model", "refused", "extra"), [
    (VLLM_EMBEDDING, EmbeddingRequest, EMBEDDING_REFUSED, ()),
    (VLLM_POOLING, PoolingRequest, EMBEDDING_REFUSED, ()),
    (VLLM_SCORE, ScoreRequest, SCORE_REFUSED, ()),
    (VLLM_RERANK, RerankRequest, RERANK_REFUSED, RERANK_DIALECTS),
    (VLLM_CLASSIFY, ClassificationRequest, CLASSIFY_REFUSED, ()),
], ids=["embeddings", "pooling", "score", "rerank", "classify"])
def test_every_vllm_field_is_handled_or_refused(fields: tuple[str, ...], model: Any, refused: dict[str, Any],
                                                extra: tuple[str, ...]) -> None:
    handled = declared(model)
    for name in (*fields, *extra):
        assert (name in handled) != (name in refused), name
    assert handled >= {"model", "user", "truncate_prompt_tokens", "priority"}
