"""Embed, Score and Classify in the tokenizer service, in-process behind its public gRPC server, against a fake engine
whose ``Pool`` answers with numbers derived from the ids it got: the ids each input reaches the engine with (special
tokens, truncation, a cross-encoder's pair as transformers' tokenizer joins it), the calls of one request running at
once, usage, and the refusals (generation model, pooling model asked to generate, context length, dimensions)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from transformers import AutoTokenizer

from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.tokenizer.server import public_server
from services.tokenizer.service import GenerationServicer
from tests.engine.models.pooling_factory import save_tiny_cross_encoder

MAX_MODEL_LEN = 32
_T = TypeVar("_T")
Stub = generation_pb2_grpc.GenerationStub


class FakePoolingEngine(engine_pb2_grpc.EngineServicer):
    """A pooling engine: ``Pool`` holds each call until ``together`` calls are in (proving they were sent at once),
    then answers a row derived from the ids (embed: [len, sum, first, last] or cut to ``dimensions``; score: one
    float; classify: three scores). ``fail_on``: a token id whose request fails INVALID_ARGUMENT."""

    def __init__(self, *, runner: str = "pooling", tasks: tuple[str, ...] = ("embed",), matryoshka: bool = False,
                 together: int = 1) -> None:
        self.runner = runner
        self.tasks = tasks
        self.matryoshka = matryoshka
        self.together = together
        self.requests: list[engine_pb2.EnginePoolRequest] = []
        self.cancelled: list[str] = []
        self.generate_calls = 0
        self.fail_on: int | None = None
        self._arrived = asyncio.Event()

    async def GetInfo(self, request: Any, context: Any) -> engine_pb2.GetInfoResponse:  # noqa: N802
        pooling = self.runner == "pooling"
        return engine_pb2.GetInfoResponse(
            model_name="fake", max_model_len=MAX_MODEL_LEN, vocab_size=100, eos_token_ids=[3], block_size=16,
            runner=self.runner, pooling_tasks=self.tasks if pooling else (), embedding_size=4 if pooling else 0,
            is_matryoshka=self.matryoshka, matryoshka_dimensions=[2, 4] if self.matryoshka else [],
            labels=["negative", "neutral", "positive"] if "classify" in self.tasks else [])

    async def RegisterSharedMemory(self, request: Any, context: Any) -> engine_pb2.RegisterSharedMemoryResponse:  # noqa: N802
        return engine_pb2.RegisterSharedMemoryResponse(ok=False, error="fake")

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.generate_calls += 1
        await context.abort(grpc.StatusCode.INTERNAL, "a fake pooling engine generates nothing")
        yield engine_pb2.EngineGenerateResponse()

    async def Stream(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        self.generate_calls += 1
        await context.abort(grpc.StatusCode.INTERNAL, "a fake pooling engine generates nothing")
        yield engine_pb2.EngineStreamResponse()

    async def Pool(self, request: engine_pb2.EnginePoolRequest, context: Any) -> engine_pb2.EnginePoolResponse:  # noqa: N802
        self.requests.append(request)
        ids = list(request.prompt_token_ids.ids)
        if len(self.requests) >= self.together:
            self._arrived.set()
        try:
            await asyncio.wait_for(self._arrived.wait(), 5)
            if self.fail_on in ids:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"task: token {self.fail_on} refused")
            if self.fail_on is not None:
                await asyncio.sleep(5)  # the others run on until cancelled
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        if request.task in ("embed", "token_embed"):
            row = [float(len(ids)), float(sum(ids)), float(ids[0]), float(ids[-1])]
            if request.HasField("dimensions"):
                row = row[:request.dimensions]
            return engine_pb2.EnginePoolResponse(data=row, row_size=len(row), prompt_tokens=len(ids))
        if request.task == "score":
            return engine_pb2.EnginePoolResponse(data=[sum(ids) / 1000], row_size=1, prompt_tokens=len(ids))
        return engine_pb2.EnginePoolResponse(data=[0.1, 0.5, 0.2] if ids[1] % 2 else [0.1, 0.2, 0.7], row_size=3,
                                             prompt_tokens=len(ids))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("cross"))


@pytest.fixture(scope="module")
def bert_class_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer saved as BERT's class, whose transformers tokenizer returns token_type_ids."""
    out = tmp_path_factory.mktemp("bert-class")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "BertTokenizerFast"}))
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module", params=["tokenizers-backend", "bert-class"])
def pair_tokenizers(request: pytest.FixtureRequest, model_dir: Path, bert_class_dir: Path) -> tuple[Tokenizer, Any]:
    """Ours and transformers' on the factory's directory (no segment ids) and on BERT's class (segment ids)."""
    directory = model_dir if request.param == "tokenizers-backend" else bert_class_dir
    return Tokenizer.from_pretrained(str(directory)), AutoTokenizer.from_pretrained(str(directory))


def segments(ref: Any) -> list[int]:
    """The segment ids transformers gives the model (none, or all 0: nothing sent)."""
    type_ids = list(ref.get("token_type_ids", []))
    return type_ids if any(type_ids) else []


def served(tokenizer: Tokenizer, engine: FakePoolingEngine, body: Callable[[Stub], Awaitable[_T]]) -> _T:
    """``body(stub)`` against the tokenizer service's public server, its engine ``engine``, in a fresh loop."""
    async def main() -> _T:
        engine_server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(engine, engine_server)
        engine_port = engine_server.add_insecure_port("127.0.0.1:0")
        await engine_server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
        server, _ = public_server(tokenizer, MAX_MODEL_LEN, ())
        servicer = GenerationServicer(tokenizer, channel, served_model_name="m")
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client:
                return await body(generation_pb2_grpc.GenerationStub(client))
        finally:
            await server.stop(None)
            await servicer.prompts.aclose()
            servicer.close()
            await channel.close()
            await engine_server.stop(None)
    return asyncio.run(main())


def texts(*items: str | list[int]) -> list[generation_pb2.PoolingInput]:
    return [generation_pb2.PoolingInput(text=i) if isinstance(i, str) else
            generation_pb2.PoolingInput(token_ids=common_pb2.TokenIds(ids=i)) for i in items]


async def _error(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    raise AssertionError("the call succeeded")


def test_embed_sends_every_input_at_once_with_special_tokens_and_sums_usage(tokenizer: Tokenizer,
                                                                            hf_tokenizer: Any) -> None:
    engine = FakePoolingEngine(together=3)
    resp = served(tokenizer, engine, lambda stub: stub.Embed(generation_pb2.EmbedRequest(
        inputs=texts("the cat sat", [7, 8, 9, 10], "hello world"), priority=-2, request_id="r1"), timeout=10))
    expected = [hf_tokenizer("the cat sat")["input_ids"], [7, 8, 9, 10], hf_tokenizer("hello world")["input_ids"]]
    assert expected[0][0] == hf_tokenizer.cls_token_id  # special tokens added to text, ids used as they are
    by_key = sorted(engine.requests, key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    assert [list(r.prompt_token_ids.ids) for r in by_key] == expected
    assert {r.task for r in by_key} == {"embed"} and {r.priority for r in by_key} == {-2}
    assert {r.client_request_id for r in by_key} == {"r1"} and not any(r.token_type_ids for r in by_key)
    assert not any(r.HasField("normalize") or r.HasField("dimensions") for r in by_key)
    assert [list(e.values) for e in resp.embeddings] == [[len(x), sum(x), x[0], x[-1]] for x in expected]
    assert [e.row_size for e in resp.embeddings] == [4, 4, 4]
    assert resp.usage.prompt_tokens == sum(map(len, expected)) == sum(e.prompt_tokens for e in resp.embeddings)


def test_embed_options_reach_the_engine(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    engine = FakePoolingEngine(tasks=("embed", "token_embed"), matryoshka=True)
    resp = served(tokenizer, engine, lambda stub: stub.Embed(generation_pb2.EmbedRequest(
        inputs=texts("the dog"), add_special_tokens=False, normalize=False, dimensions=2, task="token_embed"),
        timeout=10))
    (req,) = engine.requests
    assert list(req.prompt_token_ids.ids) == hf_tokenizer("the dog", add_special_tokens=False)["input_ids"]
    assert req.task == "token_embed" and req.normalize is False and req.dimensions == 2
    assert list(resp.embeddings[0].values) == [2, sum(req.prompt_token_ids.ids)]


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_the_context_bounds_the_rest(tokenizer: Tokenizer,
                                                                                      hf_tokenizer: Any) -> None:
    long_text = " ".join(["cat"] * 40)  # 42 tokens with [CLS] and [SEP], MAX_MODEL_LEN 32
    engine = FakePoolingEngine()

    async def body(stub: Stub) -> list[Any]:
        kept = await stub.Embed(generation_pb2.EmbedRequest(inputs=texts(long_text, list(range(1, 40))),
                                                            truncate_prompt_tokens=5), timeout=10)
        too_long = await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts("a", long_text)), timeout=10))
        bad_keep = await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts("a"), truncate_prompt_tokens=33),
                                           timeout=10))
        empty = await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts([])), timeout=10))
        none = await _error(stub.Embed(generation_pb2.EmbedRequest(), timeout=10))
        bad_id = await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts([5, 100])), timeout=10))
        return [kept, too_long, bad_keep, empty, none, bad_id]

    kept, too_long, bad_keep, empty, none, bad_id = served(tokenizer, engine, body)
    assert len(engine.requests) == 2  # the refused requests reached no engine
    sent = sorted(list(r.prompt_token_ids.ids) for r in engine.requests)
    assert sent == sorted([hf_tokenizer(long_text)["input_ids"][-5:], list(range(35, 40))])
    assert kept.usage.prompt_tokens == 10
    assert too_long == (grpc.StatusCode.INVALID_ARGUMENT, "inputs[1]: has 42 tokens, more than the model's context "
                        "(max_model_len 32); shorten it or set truncate_prompt_tokens")
    assert bad_keep == (grpc.StatusCode.INVALID_ARGUMENT,
                        "truncate_prompt_tokens: must be in [1, max_model_len (32)], got 33")
    assert empty == (grpc.StatusCode.INVALID_ARGUMENT, "inputs[0]: is empty: it has no tokens")
    assert none == (grpc.StatusCode.INVALID_ARGUMENT, "inputs: at least one input is required")
    assert bad_id == (grpc.StatusCode.INVALID_ARGUMENT, "inputs[0]: token id 100 is out of range [0, 100)")


def test_a_cross_encoder_scores_each_pair_as_transformers_joins_it(pair_tokenizers: tuple[Tokenizer, Any]) -> None:
    tokenizer, hf_tokenizer = pair_tokenizers
    engine = FakePoolingEngine(tasks=("score", "classify"), together=2)
    query, docs = "what is the capital of france", ["paris", "the cat sat on the mat"]
    resp = served(tokenizer, engine, lambda stub: stub.Score(generation_pb2.ScoreRequest(
        queries=[query], documents=docs, activation=False), timeout=10))
    by_key = sorted(engine.requests, key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    for req, doc in zip(by_key, docs, strict=True):
        ref = hf_tokenizer(query, doc)
        assert list(req.prompt_token_ids.ids) == ref["input_ids"]
        assert list(req.token_type_ids) == segments(ref)
        assert req.task == "score" and req.activation is False
    assert list(resp.scores) == pytest.approx([sum(hf_tokenizer(query, d)["input_ids"]) / 1000 for d in docs])
    assert list(resp.prompt_tokens) == [len(hf_tokenizer(query, d)["input_ids"]) for d in docs]
    assert resp.usage.prompt_tokens == sum(resp.prompt_tokens)


def test_pairs_are_truncated_from_the_left_with_their_segments(bert_class_dir: Path) -> None:
    tokenizer, hf_tokenizer = Tokenizer.from_pretrained(str(bert_class_dir)), AutoTokenizer.from_pretrained(
        str(bert_class_dir))
    engine = FakePoolingEngine(tasks=("score",))
    served(tokenizer, engine, lambda stub: stub.Score(generation_pb2.ScoreRequest(
        queries=["the cat"], documents=["sat on the mat"], truncate_prompt_tokens=4), timeout=10))
    ref = hf_tokenizer("the cat", "sat on the mat")
    (req,) = engine.requests
    assert list(req.prompt_token_ids.ids) == ref["input_ids"][-4:]
    assert list(req.token_type_ids) == ref["token_type_ids"][-4:] == [1, 1, 1, 1]


def test_an_embedding_model_scores_by_cosine_embedding_each_text_once(tokenizer: Tokenizer,
                                                                      hf_tokenizer: Any) -> None:
    engine = FakePoolingEngine(tasks=("embed", "token_embed"))
    queries, docs = ["the cat", "the dog"], ["the mat", "the cat"]
    resp = served(tokenizer, engine, lambda stub: stub.Score(generation_pb2.ScoreRequest(
        queries=queries, documents=docs), timeout=10))
    assert sorted(list(r.prompt_token_ids.ids) for r in engine.requests) == sorted(
        hf_tokenizer(t)["input_ids"] for t in ("the cat", "the dog", "the mat"))  # "the cat" once
    assert {r.task for r in engine.requests} == {"embed"}

    def vec(text: str) -> np.ndarray:
        ids = hf_tokenizer(text)["input_ids"]
        return np.array([len(ids), sum(ids), ids[0], ids[-1]], dtype=np.float64)

    expected = [vec(q) @ vec(d) / np.linalg.norm(vec(q)) / np.linalg.norm(vec(d)) for q, d in zip(queries, docs)]
    assert list(resp.scores) == pytest.approx(expected, abs=1e-6)
    assert resp.scores[1] == pytest.approx(vec("the dog") @ vec("the cat") / np.linalg.norm(vec("the dog"))
                                           / np.linalg.norm(vec("the cat")))
    lens = {t: len(hf_tokenizer(t)["input_ids"]) for t in ("the cat", "the dog", "the mat")}
    assert list(resp.prompt_tokens) == [lens["the cat"] + lens["the mat"], lens["the dog"] + lens["the cat"]]


def test_score_refuses_mismatched_queries(tokenizer: Tokenizer) -> None:
    engine = FakePoolingEngine(tasks=("score",))

    async def body(stub: Stub) -> list[Any]:
        return [await _error(stub.Score(generation_pb2.ScoreRequest(queries=["a", "b"], documents=["c", "d", "e"]),
                                        timeout=10)),
                await _error(stub.Score(generation_pb2.ScoreRequest(queries=["a"]), timeout=10))]

    assert served(tokenizer, engine, body) == [
        (grpc.StatusCode.INVALID_ARGUMENT, "queries: must be one query or as many as the documents (3), got 2"),
        (grpc.StatusCode.INVALID_ARGUMENT, "documents: at least one document is required")]
    assert not engine.requests


def test_classify_names_the_top_label(tokenizer: Tokenizer) -> None:
    engine = FakePoolingEngine(tasks=("classify",), together=2)
    resp = served(tokenizer, engine, lambda stub: stub.Classify(generation_pb2.ClassifyRequest(
        inputs=texts([2, 5, 3], [2, 6, 3]), activation=True), timeout=10))
    assert [r.label for r in resp.results] == ["neutral", "positive"]
    assert list(resp.results[1].scores) == pytest.approx([0.1, 0.2, 0.7])
    assert {r.task for r in engine.requests} == {"classify"} and all(r.activation for r in engine.requests)
    assert resp.usage.prompt_tokens == 6


def test_dimensions_only_for_matryoshka_sizes(tokenizer: Tokenizer) -> None:
    async def body(stub: Stub) -> list[Any]:
        return [await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts("a"), dimensions=d), timeout=10))
                for d in (3, 5)]

    plain = served(tokenizer, FakePoolingEngine(), body)
    assert plain[0] == (grpc.StatusCode.INVALID_ARGUMENT, "dimensions: the model `m` is not a Matryoshka model: its "
                                                          "4-dimension embeddings cannot be shortened")
    trained = served(tokenizer, FakePoolingEngine(matryoshka=True), body)
    assert trained == [(grpc.StatusCode.INVALID_ARGUMENT, "dimensions: the model `m` was trained for the sizes 2, 4, "
                                                          "not 3"),
                       (grpc.StatusCode.INVALID_ARGUMENT, "dimensions: must be in [1, 4], got 5")]


def test_the_runner_decides_what_a_model_serves(tokenizer: Tokenizer) -> None:
    generation = FakePoolingEngine(runner="generate")

    async def pool_calls(stub: Stub) -> list[Any]:
        return [await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts("a")), timeout=10)),
                await _error(stub.Score(generation_pb2.ScoreRequest(queries=["a"], documents=["b"]), timeout=10)),
                await _error(stub.Classify(generation_pb2.ClassifyRequest(inputs=texts("a")), timeout=10))]

    errors = served(tokenizer, generation, pool_calls)
    assert [code for code, _ in errors] == [grpc.StatusCode.FAILED_PRECONDITION] * 3
    assert errors[0][1] == ("The model `m` is a generation model, not a pooling model: it cannot embed. It serves "
                            "completions (REST: /v1/completions, /v1/chat/completions; gRPC: Generate).")
    assert "it cannot classify" in errors[2][1] and not generation.requests

    embedder = FakePoolingEngine()

    async def generate(stub: Stub) -> list[Any]:
        async def run() -> None:
            async for _ in stub.Generate(generation_pb2.GenerateRequest(text="the cat"), timeout=10):
                pass
        return [await _error(run()), await _error(stub.Classify(generation_pb2.ClassifyRequest(inputs=texts("a")),
                                                                timeout=10))]

    (code, message), classify = served(tokenizer, embedder, generate)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and embedder.generate_calls == 0
    assert message.startswith("The model `m` is a pooling model (an embedding model), not a generation model: it "
                              "cannot generate text.")
    assert classify == (grpc.StatusCode.FAILED_PRECONDITION,
                        "The model `m` is an embedding model: it cannot classify (its tasks: embed).")


def test_one_failed_input_fails_the_call_and_cancels_the_others(tokenizer: Tokenizer) -> None:
    engine = FakePoolingEngine(together=3)
    engine.fail_on = 66

    async def body(stub: Stub) -> tuple[Any, int]:
        error = await _error(stub.Embed(generation_pb2.EmbedRequest(inputs=texts([5], [66], [7])), timeout=10))
        await asyncio.sleep(0.5)
        return error, len(engine.cancelled)  # while the engine still runs: cancelled by the service, not by its stop

    error, cancelled = served(tokenizer, engine, body)
    assert error == (grpc.StatusCode.INVALID_ARGUMENT, "task: token 66 refused")
    assert cancelled == 2


def test_model_info_carries_the_pooling_fields(tokenizer: Tokenizer) -> None:
    info = served(tokenizer, FakePoolingEngine(tasks=("embed", "token_embed"), matryoshka=True),
                  lambda stub: stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10))
    assert (info.runner, list(info.pooling_tasks), info.embedding_size) == ("pooling", ["embed", "token_embed"], 4)
    assert info.is_matryoshka and list(info.matryoshka_dimensions) == [2, 4]
