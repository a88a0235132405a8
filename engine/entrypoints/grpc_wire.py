"""The engine's wire types ↔ its domain types: requests' sampling parameters in, outputs out.

Protobuf messages are converted here and in the servicer, nowhere else (the core sees SamplingParams and token ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.errors import InvalidRequestError
from engine.core.finish_reason import FinishReason
from engine.core.kv_transfer_params import RemoteKV
from engine.core.outputs import EngineCoreOutput
from engine.core.pooling_params import PoolingParams, PoolingTasks
from engine.core.request import PromptLogprobs, SequenceId
from engine.core.sampling_params import (
    BeamSearch,
    EarlyStopping,
    ReasoningParams,
    SamplingParams,
    StructuredOutputsParams,
)
from proto.sluice.v1 import common_pb2, engine_pb2

_FINISH_TO_PB = {
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORTED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}

_EARLY_STOPPING: dict[int, EarlyStopping] = {
    common_pb2.BEAM_STOPPING_UNSPECIFIED: False,
    common_pb2.BEAM_STOPPING_EARLY: True,
    common_pb2.BEAM_STOPPING_NEVER: "never",
}


# -- wire ↔ domain --------------------------------------------------------------------------------------------
def sampling_params_from_pb(req: engine_pb2.EngineGenerateRequest,
                            defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """``defaults``: the model's default sampling parameters (``generation_config.generation_defaults``), for the
    fields the request leaves unset."""
    s, st = req.sampling, req.stopping
    defaults = dict(defaults or {})
    if req.HasField("beam_search"):   # beams take no sampling parameters: only the length default applies
        defaults = {k: v for k, v in defaults.items() if k == "max_tokens"}
    kw: dict[str, Any] = {"n": req.n or 1, **defaults}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if s.HasField(name):
            kw[name] = getattr(s, name)
    if s.HasField("top_k"):
        kw["top_k"] = s.top_k or None
    if s.HasField("seed"):
        kw["seed"] = s.seed
    if s.logit_bias:
        kw["logit_bias"] = dict(s.logit_bias)
    if s.allowed_token_ids:
        kw["allowed_token_ids"] = list(s.allowed_token_ids)
    if req.bad_words_token_ids:
        kw["bad_words_token_ids"] = [list(ids.ids) for ids in req.bad_words_token_ids]
    if st.HasField("max_tokens"):
        kw["max_tokens"] = st.max_tokens
    else:
        kw["max_tokens"] = kw.get("max_tokens")   # the model's max_new_tokens, else up to the context
    kw["min_tokens"] = st.min_tokens
    kw["stop_token_ids"] = list(st.stop_token_ids)
    kw["ignore_eos"] = st.ignore_eos
    if req.HasField("logprobs"):
        kw["logprobs"] = req.logprobs
    if req.HasField("prompt_logprobs"):
        kw["prompt_logprobs"] = req.prompt_logprobs   # above --max-logprobs: refused by the core
    if req.HasField("stream_interval"):
        kw["stream_interval"] = req.stream_interval  # 0 is refused by SamplingParams as INVALID_ARGUMENT
    if req.best_of:
        kw["best_of"] = req.best_of
    if req.HasField("beam_search"):
        kw["beam_search"] = beam_search_from_pb(req.beam_search, kw["n"])
    if req.HasField("guided"):
        kw["structured_outputs"] = structured_outputs_from_pb(req.guided)
    if req.HasField("reasoning"):
        r = req.reasoning
        kw["reasoning"] = ReasoningParams(r.end_token_id, r.thinking_token_budget
                                          if r.HasField("thinking_token_budget") else None)
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise wire_error(e) from e


# StructuredOutputsParams' fields (in errors as structured_outputs.<name>) and GuidedDecoding's on the wire.
_GUIDED_FIELDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                  "grammar": "grammar"}


def structured_outputs_from_pb(guided: common_pb2.GuidedDecoding) -> StructuredOutputsParams | None:
    """The constraint of a GuidedDecoding oneof (None when unset); InvalidRequestError naming ``guided.<kind>``."""
    kind = guided.WhichOneof("kind")
    try:
        if kind is None:
            return None
        if kind == "json_schema":
            return StructuredOutputsParams(json=guided.json_schema)
        if kind == "json_object":
            if not guided.json_object:
                raise InvalidRequestError("guided.json_object", "must be true when set")
            return StructuredOutputsParams(json_object=True)
        if kind == "regex":
            return StructuredOutputsParams(regex=guided.regex)
        if kind == "choice":
            return StructuredOutputsParams(choice=list(guided.choice.choices))
        return StructuredOutputsParams(grammar=guided.grammar)
    except InvalidRequestError as e:
        raise wire_error(e) from e


def wire_error(error: BaseException) -> BaseException:
    """A refusal naming a structured-outputs field, renamed to the field of EngineGenerateRequest.guided the
    caller sent (``structured_outputs.json`` → ``guided.json_schema``); any other error as it is."""
    if not isinstance(error, InvalidRequestError):
        return error
    prefix, _, name = error.field.partition(".")
    if prefix != "structured_outputs":
        return error
    renamed = InvalidRequestError(f"guided.{_GUIDED_FIELDS[name]}" if name in _GUIDED_FIELDS else "guided",
                                  error.message)
    renamed.__cause__ = error
    return renamed


def beam_search_from_pb(msg: common_pb2.BeamSearch, n: int) -> BeamSearch:
    if msg.early_stopping not in _EARLY_STOPPING:
        raise InvalidRequestError("beam_search.early_stopping", f"unknown value {msg.early_stopping}")
    return BeamSearch(beam_width=msg.beam_width or n,
                      length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
                      early_stopping=_EARLY_STOPPING[msg.early_stopping])


def abort_targets_from_pb(msg: engine_pb2.AbortRequest) -> list[str | SequenceId]:
    """Whole requests (their ids) and single sequences (SequenceId) to abort."""
    targets: list[str | SequenceId] = list(msg.request_ids)
    targets += [SequenceId(ref.request_id, ref.index) if ref.HasField("index") else ref.request_id
                for ref in msg.sequences]
    return targets


def kv_transfer_from_pb(msg: engine_pb2.EngineGenerateRequest) -> RemoteKV | None:
    """The request's part in prefill/decode disaggregation (None: an ordinary request)."""
    if not msg.HasField("kv_transfer"):
        return None
    kv = msg.kv_transfer
    return RemoteKV(do_remote_decode=kv.do_remote_decode, remote_engine_id=kv.remote_engine_id,
                    transport=kv.transport, remote_address=kv.remote_address,
                    remote_block_ids=tuple(kv.remote_block_ids), block_hashes=tuple(kv.block_hashes),
                    hold_s=kv.hold_s, layout=kv.layout)


def kv_transfer_to_pb(kv: RemoteKV) -> engine_pb2.KVTransferParams:
    return engine_pb2.KVTransferParams(
        remote_engine_id=kv.remote_engine_id, transport=kv.transport, remote_address=kv.remote_address,
        remote_block_ids=kv.remote_block_ids, block_hashes=kv.block_hashes, hold_s=kv.hold_s, layout=kv.layout)


def output_to_pb(out: EngineCoreOutput) -> engine_pb2.EngineGenerateResponse:
    """One output on the wire. A prefill engine's handed-off sequence has no finish reason there: it goes on."""
    handoff = out.kv_transfer is not None
    msg = engine_pb2.EngineGenerateResponse(
        index=out.index, token_ids=out.new_token_ids, prompt_tokens=out.num_prompt_tokens,
        cached_tokens=out.num_cached_tokens, request_done=out.request_finished,
        finish_reason=_FINISH_TO_PB[out.finish_reason] if out.finish_reason and not handoff
        else common_pb2.FINISH_REASON_UNSPECIFIED)
    if out.kv_transfer is not None:
        msg.kv_transfer.CopyFrom(kv_transfer_to_pb(out.kv_transfer))
    msg.kv_blocks_received = out.kv_blocks_received
    if out.cumulative_logprob is not None:
        msg.cumulative_logprob = out.cumulative_logprob
    for lp, top, _rank in out.new_logprobs or ():
        msg.logprobs.add(logprob=lp, top_logprobs=[engine_pb2.TokenIdLogprob(token_id=t, logprob=v)
                                                   for t, v in top.items()])
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(prompt_logprobs_to_pb(out.prompt_logprobs))
    return msg


def prompt_logprobs_to_pb(plp: PromptLogprobs) -> list[common_pb2.PromptTokenLogprob]:
    """One entry per prompt token, ids and numbers only (the engine has no text); the first has no logprob."""
    token_ids = plp.token_ids.tolist()
    entries = [common_pb2.PromptTokenLogprob(token_id=token_ids[0])]
    for token_id, lp, ids, lps in zip(token_ids[1:], plp.logprobs.tolist(), plp.top_ids.tolist(),
                                      plp.top_logprobs.tolist()):
        entries.append(common_pb2.PromptTokenLogprob(
            token_id=token_id, logprob=lp,
            top_logprobs=[common_pb2.PromptTopLogprob(token_id=t, logprob=v) for t, v in zip(ids, lps)]))
    return entries


# -- pooling --------------------------------------------------------------------------------------------------
def pooling_params_from_pb(req: engine_pb2.EnginePoolRequest) -> PoolingParams:
    """EnginePoolRequest's task and options (unset: the model's own)."""
    return PoolingParams(task=req.task or None,
                         normalize=req.normalize if req.HasField("normalize") else None,
                         dimensions=req.dimensions if req.HasField("dimensions") else None,
                         use_activation=req.activation if req.HasField("activation") else None)


def pool_output_to_pb(out: EngineCoreOutput) -> engine_pb2.EnginePoolResponse:
    """A pooling request's rows, flattened row by row."""
    assert out.pooled is not None
    rows = out.pooled
    return engine_pb2.EnginePoolResponse(data=rows.reshape(-1).tolist(), row_size=int(rows.shape[-1]),
                                         prompt_tokens=out.num_prompt_tokens)


def pooling_info_fields(runner: str, pooling: PoolingTasks | None) -> dict[str, Any]:
    """GetInfoResponse's fields 17-22: what the engine runs and, for a pooling model, what it serves."""
    if pooling is None:
        return {"runner": runner}
    return {"runner": runner, "pooling_tasks": list(pooling.tasks), "embedding_size": pooling.embedding_size,
            "is_matryoshka": pooling.is_matryoshka, "matryoshka_dimensions": list(pooling.matryoshka_dimensions),
            "labels": list(pooling.labels)}
