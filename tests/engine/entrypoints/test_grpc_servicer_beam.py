"""The engine servicer's conversion of best_of and beam search, and of the cumulative logprob it sends back."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import InvalidRequestError
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import BeamSearch
from engine.entrypoints.grpc_servicer import output_to_pb, sampling_params_from_pb
from proto.sluice.v1 import common_pb2, engine_pb2


def _request(**kw: Any) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(request_id="r", **kw)


def test_best_of_zero_is_unset_and_a_value_is_kept() -> None:
    assert sampling_params_from_pb(_request(n=2)).best_of is None
    params = sampling_params_from_pb(_request(n=2, best_of=5))
    assert (params.n, params.best_of, params.holds_outputs) == (2, 5, True)


def test_best_of_below_n_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_pb(_request(n=3, best_of=2))
    assert e.value.field == "best_of"


@pytest.mark.parametrize("msg, expected", [
    (common_pb2.BeamSearch(), BeamSearch(3, 1.0, False)),   # width 0 = n, length penalty unset = 1.0
    (common_pb2.BeamSearch(beam_width=4, length_penalty=0.0, early_stopping=common_pb2.BEAM_STOPPING_EARLY),
     BeamSearch(4, 0.0, True)),
    (common_pb2.BeamSearch(beam_width=5, length_penalty=2.5, early_stopping=common_pb2.BEAM_STOPPING_NEVER),
     BeamSearch(5, 2.5, "never")),
])
def test_beam_search_is_converted(msg: common_pb2.BeamSearch, expected: BeamSearch) -> None:
    params = sampling_params_from_pb(_request(n=3, beam_search=msg))
    assert params.beam_search == expected
    assert (params.n, params.num_forked, params.holds_outputs) == (3, 1, True)


def test_an_unset_beam_search_is_sampling() -> None:
    assert sampling_params_from_pb(_request(n=2)).beam_search is None


@pytest.mark.parametrize("kw, field", [
    (dict(n=3, beam_search=common_pb2.BeamSearch(beam_width=2)), "n"),
    (dict(beam_search=common_pb2.BeamSearch(early_stopping=7)), "beam_search.early_stopping"),
    (dict(beam_search=common_pb2.BeamSearch(), logprobs=1), "logprobs"),
    (dict(beam_search=common_pb2.BeamSearch(), best_of=2), "best_of"),
    (dict(beam_search=common_pb2.BeamSearch(), sampling=common_pb2.SamplingParameters(repetition_penalty=1.2)),
     "repetition_penalty"),
    (dict(beam_search=common_pb2.BeamSearch(), sampling=common_pb2.SamplingParameters(logit_bias={5: 1.0})),
     "logit_bias"),
])
def test_what_beam_search_cannot_honour_is_refused_naming_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_pb(_request(**kw))
    assert e.value.field == field


def test_cumulative_logprob_is_sent_only_when_set() -> None:
    last = output_to_pb(EngineCoreOutput("r", [4, 2], finish_reason=FinishReason.EOS, index=1,
                                         request_finished=True, cumulative_logprob=-1.5))
    assert (last.index, list(last.token_ids), last.request_done, last.cumulative_logprob) == (1, [4, 2], True, -1.5)
    assert last.HasField("cumulative_logprob")
    assert not output_to_pb(EngineCoreOutput("r", [4])).HasField("cumulative_logprob")
