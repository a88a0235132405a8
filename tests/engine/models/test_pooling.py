"""The pooling runner against sentence-transformers (PyPI) on the same tiny random checkpoints: BERT mean pooling,
XLM-RoBERTa CLS pooling, a decoder's last token, cross-encoder scores with segment ids, classifier probabilities,
Matryoshka truncation; several prompts of mixed lengths batched in one step; refusals named."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import FailedPreconditionError, InvalidRequestError
from engine.config import EngineConfig, KernelSettings
from engine.core.engine_core import EngineCore
from engine.core.pooling_params import PoolingParams
from engine.models.encoder_linear import EncoderLinear
from engine.models.pooling_config import parse_pooler_config, read_pooling_info, resolve_runner
from tests.engine.models import pooling_factory as factory

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

# The third is longer than the ModernBERT checkpoints' local window (4 positions either side).
TEXTS = ["The cat sat on the mat", "hello world", "what is the capital of france? paris is the capital.", "a"]
PAIRS = [("what is the capital of france", "paris"), ("cat", "the dog sat on the mat"), ("hello", "world")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = getattr(factory, f"save_tiny_{name}")(tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _core(path: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", num_threads=1, **kw))  # type: ignore[arg-type]


def _run(core: EngineCore, requests: list[tuple[list[int], PoolingParams, list[int] | None]]) -> list[np.ndarray]:
    """All requests added before the first step (one batch), each one's rows."""
    for i, (ids, params, types) in enumerate(requests):
        core.add_pooling_request(f"r{i}", ids, params, token_type_ids=types)
    outs = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.request_finished and out.pooled is not None
            assert out.request_id not in outs   # exactly one terminal output each
            outs[out.request_id] = out
        steps += 1
    assert steps == 1   # continuous batching: mixed lengths, one forward
    return [outs[f"r{i}"].pooled.numpy() for i in range(len(requests))]


def _st_encode(path: Path, texts: list[str], **kw: object) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = st.SentenceTransformer(str(path), device="cpu")
        return model.encode(texts, convert_to_numpy=True, **kw)


def _ids(path: Path, texts: list[str]) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    return [tok(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("name", ["bert_embedder", "xlm_roberta_embedder", "modernbert_embedder", "decoder_embedder"])
def test_embeddings_equal_sentence_transformers(checkpoints: Callable[[str], Path], name: str) -> None:
    path = checkpoints(name)
    ref = _st_encode(path, TEXTS)
    core = _core(path)
    got = _run(core, [(ids, PoolingParams(), None) for ids in _ids(path, TEXTS)])
    for g, r in zip(got, ref):
        assert g.shape == (1, r.shape[0])
        np.testing.assert_allclose(g[0], r, atol=1e-4)
    # the vectors differ from each other by far more than the tolerance: the comparison can fail
    assert np.abs(ref[0] - ref[1]).max() > 1e-2
    info = core.info()
    assert core.runner == "pooling" and info["total_kv_blocks"] > 0
    assert core.scheduler.block_manager.num_free_blocks == core.num_blocks   # nothing held after


@pytest.mark.parametrize("name", ["bert_embedder", "modernbert_embedder"])
def test_encoder_linears_on_onednn_and_on_f_linear_equal_sentence_transformers(
        checkpoints: Callable[[str], Path], name: str) -> None:
    """The CPU packs an encoder's linears for oneDNN (activation and residual add fused); with the compiled kernels
    switched off they stay ``nn.Linear`` weights through ``F.linear``: both equal the reference."""
    path = checkpoints(name)
    ref = _st_encode(path, TEXTS)
    for cpu_kernels in (True, False):
        core = _core(path, kernels=KernelSettings(cpu_kernels=cpu_kernels))
        encoder = core.executor.model.encoder
        linears = [m for m in encoder.layers.modules() if isinstance(m, EncoderLinear)]
        assert linears and all((m.packed is not None) == cpu_kernels for m in linears)
        got = _run(core, [(ids, PoolingParams(), None) for ids in _ids(path, TEXTS)])
        np.testing.assert_allclose(np.concatenate(got), ref, atol=1e-4)


def test_normalize_off_and_token_embed(checkpoints: Callable[[str], Path]) -> None:
    path = checkpoints("bert_embedder")
    ids = _ids(path, TEXTS[:2])
    ref = _st_encode(path, TEXTS[:2], output_value="token_embeddings")
    core = _core(path)
    raw, tokens = _run(core, [(ids[0], PoolingParams(normalize=False), None),
                              (ids[1], PoolingParams(task="token_embed", normalize=False), None)])
    np.testing.assert_allclose(tokens, ref[1].numpy() if isinstance(ref[1], torch.Tensor) else ref[1], atol=1e-4)
    mean = (ref[0].numpy() if isinstance(ref[0], torch.Tensor) else ref[0]).mean(axis=0)
    np.testing.assert_allclose(raw[0], mean, atol=1e-4)
    assert abs(np.linalg.norm(raw[0]) - 1) > 1e-2


def test_matryoshka_dimensions_truncate_and_renormalise(checkpoints: Callable[[str], Path]) -> None:
    path = checkpoints("matryoshka_embedder")
    ref = _st_encode(path, TEXTS, truncate_dim=16, normalize_embeddings=True)
    core = _core(path)
    got = _run(core, [(ids, PoolingParams(dimensions=16), None) for ids in _ids(path, TEXTS)])
    for g, r in zip(got, ref):
        assert g.shape == (1, 16)
        np.testing.assert_allclose(g[0], r, atol=1e-4)
    assert core.pooling is not None and core.pooling.matryoshka_dimensions == factory.MATRYOSHKA_DIMENSIONS
    with pytest.raises(InvalidRequestError) as e:
        core.add_pooling_request("bad", [2, 5, 3], PoolingParams(dimensions=12))
    assert e.value.field == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        core.add_pooling_request("big", [2, 5, 3], PoolingParams(dimensions=64))
    assert e.value.field == "dimensions"


@pytest.mark.parametrize("name", ["cross_encoder", "xlm_roberta_cross_encoder"])
def test_cross_encoder_scores_equal_sentence_transformers(checkpoints: Callable[[str], Path], name: str) -> None:
    path = checkpoints(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = st.CrossEncoder(str(path), device="cpu").predict(PAIRS)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    enc = [tok(a, b) for a, b in PAIRS]
    core = _core(path)
    assert core.pooling is not None and core.pooling.tasks == ("classify", "score")
    got = _run(core, [(e["input_ids"], PoolingParams(task="score"), e.get("token_type_ids")) for e in enc])
    np.testing.assert_allclose([g[0, 0] for g in got], ref, atol=1e-4)
    if name == "cross_encoder":   # BERT reads segment ids: all-zero ones give another score
        assert any(t == 1 for t in enc[0]["token_type_ids"])
        (zeros,) = _run(core, [(enc[0]["input_ids"], PoolingParams(task="score"), None)])
        assert abs(zeros[0, 0] - ref[0]) > 1e-4


@pytest.mark.parametrize("name", ["classifier", "modernbert_classifier", "decoder_classifier"])
def test_classifier_probs_equal_transformers(checkpoints: Callable[[str], Path], name: str) -> None:
    path = checkpoints(name)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    ids = _ids(path, TEXTS)
    with torch.no_grad():
        ref = [torch.softmax(model(torch.tensor([i])).logits[0], -1).numpy() for i in ids]
    core = _core(path)
    assert core.pooling is not None and core.pooling.labels == factory.CLASSIFIER_LABELS
    got = _run(core, [(i, PoolingParams(task="classify"), None) for i in ids])
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g[0], r, atol=1e-4)
    (raw,) = _run(core, [(ids[0], PoolingParams(task="classify", use_activation=False), None)])
    with torch.no_grad():
        np.testing.assert_allclose(raw[0], model(torch.tensor([ids[0]])).logits[0].numpy(), atol=1e-4)


def test_refusals_name_what_is_wrong(checkpoints: Callable[[str], Path], tmp_path: Path) -> None:
    core = _core(checkpoints("bert_embedder"))
    with pytest.raises(InvalidRequestError, match="'classify'") as e:
        core.add_pooling_request("c", [2, 5, 3], PoolingParams(task="classify"))
    assert e.value.field == "task"
    with pytest.raises(InvalidRequestError, match="'bogus'"):
        core.add_pooling_request("b", [2, 5, 3], PoolingParams(task="bogus"))
    with pytest.raises(InvalidRequestError) as e:
        core.add_pooling_request("d", [2, 5, 3], PoolingParams(dimensions=8))   # not a Matryoshka model
    assert e.value.field == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        core.add_pooling_request("t", [2, 5, 3], PoolingParams(), token_type_ids=[0, 1])
    assert e.value.field == "token_type_ids"
    from engine.core.sampling_params import SamplingParams

    with pytest.raises(FailedPreconditionError, match="pooling model"):
        core.add_request("g", [2, 5, 3], SamplingParams(max_tokens=2))
    assert not core.has_unfinished_requests()
    from tests.engine.core.tiny_llama import save_tiny_llama

    save_tiny_llama(tmp_path / "llama")
    gen = _core(tmp_path / "llama", kv_cache_memory=4 * 2**20)
    assert gen.runner == "generate"
    with pytest.raises(FailedPreconditionError, match="generation model"):
        gen.add_pooling_request("p", [2, 5, 3], PoolingParams())


def test_abort_ends_a_queued_pooling_request_once(checkpoints: Callable[[str], Path]) -> None:
    core = _core(checkpoints("bert_embedder"))
    core.add_pooling_request("keep", [2, 40, 3], PoolingParams())
    core.add_pooling_request("drop", [2, 41, 3], PoolingParams())
    core.abort_requests(["drop"])
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert sorted((o.request_id, o.pooled is not None) for o in outs) == [("drop", False), ("keep", True)]


def test_pooling_config_and_runner_resolution(checkpoints: Callable[[str], Path], tmp_path: Path) -> None:
    bert = str(checkpoints("bert_embedder"))
    assert resolve_runner(bert, "auto", "auto") == "pooling"
    assert resolve_runner(str(checkpoints("cross_encoder")), "auto", "auto") == "pooling"
    info = read_pooling_info(bert)
    assert (info.kind, info.pooling_type, info.normalize) == ("embed", "MEAN", True)
    over = read_pooling_info(bert, pooler_config='{"pooling_type": "CLS", "normalize": false}')
    assert (over.pooling_type, over.normalize) == ("CLS", False)
    with pytest.raises(InvalidRequestError, match="'step_tag_id'"):
        parse_pooler_config('{"step_tag_id": 3}')
    from tests.engine.core.tiny_llama import save_tiny_llama

    save_tiny_llama(tmp_path / "llama")
    assert resolve_runner(str(tmp_path / "llama"), "auto", "auto") == "generate"
    assert resolve_runner(str(tmp_path / "llama"), "auto", "embed") == "pooling"
    assert resolve_runner(str(tmp_path / "llama"), "generate", "auto") == "generate"
    factory.write_sentence_transformers(tmp_path / "llama", dim=64, pooling="lasttoken", normalize=True)
    assert resolve_runner(str(tmp_path / "llama"), "auto", "auto") == "pooling"   # a *ForCausalLM with ST files
    converted = read_pooling_info(str(tmp_path / "llama"))
    assert (converted.family, converted.pooling_type, converted.normalize) == ("decoder", "LAST", True)
    # sentence-transformers 5's one-field Pooling config, and a pooling mode that is refused by name
    st5 = factory.save_tiny_bert_embedder(tmp_path / "st5")
    (st5 / "1_Pooling" / "config.json").write_text('{"embedding_dimension": 32, "pooling_mode": "cls"}')
    assert read_pooling_info(str(st5)).pooling_type == "CLS"
    (st5 / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 32, "pooling_mode_max_tokens": true}')
    with pytest.raises(InvalidRequestError, match="pooling_mode_max_tokens"):
        read_pooling_info(str(st5))


def test_decoder_with_a_sliding_window_is_refused_as_an_embedder(tmp_path: Path) -> None:
    from tests.engine.executor.checkpoints import write_checkpoint

    write_checkpoint("mistral", tmp_path / "mistral")
    with pytest.raises(InvalidRequestError, match="sliding-window"):
        _core(tmp_path / "mistral", convert="embed")


def test_decoder_converted_to_embedder_pools_the_last_hidden_state(tmp_path: Path) -> None:
    """--convert embed on a generation checkpoint (LlamaForCausalLM): the final-norm hidden state of the last prompt
    token, normalised, as transformers computes it."""
    from tests.engine.core.tiny_llama import save_tiny_llama

    model = save_tiny_llama(tmp_path / "llama")
    ids = [[1, 5, 9, 33, 2], [1, 7]]
    core = _core(tmp_path / "llama", convert="embed")
    got = _run(core, [(i, PoolingParams(), None) for i in ids])
    with torch.no_grad():
        for g, i in zip(got, ids):
            hidden = model.model(torch.tensor([i])).last_hidden_state[0, -1]
            np.testing.assert_allclose(g[0], torch.nn.functional.normalize(hidden, dim=-1).numpy(), atol=1e-4)


