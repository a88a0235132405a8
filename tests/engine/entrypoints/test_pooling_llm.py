"""The offline API of pooling models in vLLM's shapes (``LLM.embed``, ``LLM.score``, ``LLM.classify``,
``LLM.encode``), against sentence-transformers and transformers (PyPI) on the same tiny checkpoints."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import FailedPreconditionError, InvalidRequestError
from engine.core.pooling_params import PoolingParams
from engine.entrypoints.llm import LLM
from tests.engine.models import pooling_factory as factory

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

TEXTS = ["The cat sat on the mat", "hello world", "what is the capital of france?"]




@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return factory.save_tiny_matryoshka_embedder(tmp_path_factory.mktemp("emb"))


def test_embed_and_cosine_score_equal_sentence_transformers(embedder: Path) -> None:
    llm = LLM(str(embedder), dtype="float32", num_threads=1)
    outs = llm.embed(TEXTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = st.SentenceTransformer(str(embedder), device="cpu")
        ref = ref_model.encode(TEXTS)
        short = ref_model.encode(TEXTS, truncate_dim=8, normalize_embeddings=True)
    assert [type(o).__name__ for o in outs] == ["EmbeddingRequestOutput"] * 3
    np.testing.assert_allclose([o.outputs.embedding for o in outs], ref, atol=1e-4)
    assert outs[1].prompt_token_ids == llm.get_tokenizer().encode(TEXTS[1])
    dims = llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=8))
    np.testing.assert_allclose([o.outputs.embedding for o in dims], short, atol=1e-4)
    scores = llm.score(TEXTS[0], TEXTS[1:])
    expected = [float(np.dot(ref[0], r) / np.linalg.norm(ref[0]) / np.linalg.norm(r)) for r in ref[1:]]
    np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=1e-4)
    (tokens,) = llm.encode(TEXTS[:1], pooling_task="token_embed")
    assert tokens.outputs.data.shape == (len(outs[0].prompt_token_ids), 32)
    with pytest.raises(InvalidRequestError, match="'classify'"):
        llm.classify(TEXTS)
    with pytest.raises(FailedPreconditionError):
        llm.generate(TEXTS[0])
    assert not llm.engine.has_unfinished_requests()


def test_cross_encoder_score_and_classifier_probs(tmp_path: Path) -> None:
    cross = factory.save_tiny_cross_encoder(tmp_path / "cross")
    llm = LLM(str(cross), dtype="float32", num_threads=1)
    docs = ["paris is the capital", "the cat sat", "hello world"]
    got = llm.score("what is the capital of france", docs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st.CrossEncoder(str(cross), device="cpu").predict([("what is the capital of france", d) for d in docs])
    assert [type(o).__name__ for o in got] == ["ScoringRequestOutput"] * 3
    np.testing.assert_allclose([o.outputs.score for o in got], ref, atol=1e-4)
    llm.close()

    clf = factory.save_tiny_classifier(tmp_path / "clf")
    llm = LLM(str(clf), dtype="float32", num_threads=1)
    outs = llm.classify(TEXTS)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(clf)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(clf))
    with torch.no_grad():
        ref = torch.softmax(model(**tok(TEXTS, padding=True, return_tensors="pt")).logits, -1).numpy()
    assert [type(o).__name__ for o in outs] == ["ClassificationRequestOutput"] * 3
    assert outs[0].outputs.num_classes == len(factory.CLASSIFIER_LABELS)
    np.testing.assert_allclose([o.outputs.probs for o in outs], ref, atol=1e-4)


def test_decoder_runner_pooling_convert_embed(tmp_path: Path) -> None:
    """``LLM(model, runner="pooling", convert="embed")`` as vLLM: a decoder checkpoint as an embedder, last token."""
    path = factory.save_tiny_decoder_embedder(tmp_path / "dec")
    llm = LLM(str(path), runner="pooling", convert="embed", dtype="float32", num_threads=1)
    outs = llm.embed(TEXTS, truncate_prompt_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = st.SentenceTransformer(str(path), device="cpu")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for out, text in zip(outs, TEXTS):
        ids = tok(text)["input_ids"][-4:]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            mask = torch.ones(1, len(ids), dtype=torch.long)
            feats = model[0]({"input_ids": torch.tensor([ids]), "attention_mask": mask})
        ref = torch.nn.functional.normalize(feats["token_embeddings"][0, -1], dim=-1).numpy()
        np.testing.assert_allclose(out.outputs.embedding, ref, atol=1e-4)
