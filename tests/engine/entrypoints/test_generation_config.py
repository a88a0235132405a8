"""--generation-config (vLLM's, default auto): the model's generation_config.json gives the default sampling
parameters of requests that set none — over the engine's gRPC wire and the offline API — and ``vllm`` uses vLLM's
own. A checkpoint whose generation_config.json sets ``top_k: 1`` answers six unseeded requests alike."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.entrypoints.generation_config import generation_defaults
from engine.entrypoints.grpc_wire import sampling_params_from_pb
from proto.sluice.v1 import common_pb2, engine_pb2
from tests.engine.executor.checkpoints import write_checkpoint

PROMPT = {"prompt_token_ids": [5, 9, 33, 71, 12]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint("llama", tmp_path_factory.mktemp("genconf"))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "top_k": 1, "temperature": 0.7, "top_p": 1.0, "max_new_tokens": 9,
         "repetition_penalty": 1.0, "do_sample": True}))
    return path


def test_only_the_values_the_model_chose_are_read(checkpoint: Path, tmp_path: Path) -> None:
    # top_p 1.0 and repetition_penalty 1.0 are transformers' own defaults, not the model's choice
    assert generation_defaults("auto", str(checkpoint)) == {"top_k": 1, "temperature": 0.7, "max_tokens": 9}
    assert generation_defaults("vllm", str(checkpoint)) == {}
    assert generation_defaults(str(checkpoint), "/elsewhere") == {"top_k": 1, "temperature": 0.7, "max_tokens": 9}
    with pytest.raises(InvalidRequestError, match="generation_config: .* holds no generation_config.json"):
        generation_defaults(str(tmp_path), str(checkpoint))


def test_the_wire_applies_defaults_to_unset_fields_only(checkpoint: Path) -> None:
    defaults = generation_defaults("auto", str(checkpoint))
    unset = engine_pb2.EngineGenerateRequest(request_id="a")
    params = sampling_params_from_pb(unset, defaults)
    assert (params.top_k, params.temperature, params.max_tokens) == (1, 0.7, 9)
    explicit = engine_pb2.EngineGenerateRequest(request_id="b", sampling=common_pb2.SamplingParameters(temperature=0.2,
                                                                                                   top_k=5))
    explicit.stopping.max_tokens = 3
    params = sampling_params_from_pb(explicit, defaults)
    assert (params.top_k, params.temperature, params.max_tokens) == (5, pytest.approx(0.2), 3)
    beams = engine_pb2.EngineGenerateRequest(request_id="c", n=2, beam_search=common_pb2.BeamSearch())
    params = sampling_params_from_pb(beams, defaults)   # beams take no sampling defaults, only the length
    assert params.temperature != 0.7 and params.top_k != 1 and params.max_tokens == 9


def test_unseeded_requests_agree_under_the_models_top_k_and_not_under_vllms(checkpoint: Path) -> None:
    auto = LLM(str(checkpoint), dtype="float32", num_kv_blocks=64)
    assert auto.get_default_sampling_params().top_k == 1
    answers = {tuple(o.outputs[0].token_ids) for o in auto.generate([PROMPT] * 6)}
    assert len(answers) == 1 and 0 < len(next(iter(answers))) <= 9   # max_new_tokens 9 bounds the default length
    plain = LLM(str(checkpoint), dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    sampled = {tuple(o.outputs[0].token_ids) for o in
               plain.generate([PROMPT] * 6, SamplingParams(max_tokens=9, ignore_eos=True))}
    assert len(sampled) > 1
