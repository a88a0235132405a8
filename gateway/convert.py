"""The gateway's types (``gateway/backend.py``) as ``sluice.v1.Generation`` messages and back: with
``gateway/client.py``, the only gateway module that touches protobuf."""

from __future__ import annotations

from gateway.backend import (
    BeamSearch,
    BeamStopping,
    Delta,
    FinishReason,
    GenerationParams,
    Guided,
    GuidedKind,
    LoRAAdapter,
    ModelInfo,
    Prompt,
    PromptTokenLogprob,
    TokenLogprob,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    TopLogprob,
    Usage,
)
from proto.sluice.v1 import common_pb2, generation_pb2

_FINISH = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    common_pb2.FINISH_REASON_STOP_STRING: FinishReason.STOP_STRING,
    common_pb2.FINISH_REASON_ABORTED: FinishReason.ABORTED,
    common_pb2.FINISH_REASON_TIME_LIMIT: FinishReason.TIME_LIMIT,
    common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
    common_pb2.FINISH_REASON_TOOL_CALLS: FinishReason.TOOL_CALLS,
}

_BEAM_STOPPING = {
    BeamStopping.DEFAULT: common_pb2.BEAM_STOPPING_UNSPECIFIED,
    BeamStopping.EARLY: common_pb2.BEAM_STOPPING_EARLY,
    BeamStopping.NEVER: common_pb2.BEAM_STOPPING_NEVER,
}


def chat_to_pb(prompt: Prompt) -> generation_pb2.Chat:
    chat = generation_pb2.Chat(add_generation_prompt=prompt.add_generation_prompt,
                               chat_template_kwargs=prompt.chat_template_kwargs)
    if prompt.chat_template is not None:
        chat.chat_template = prompt.chat_template
    for turn in prompt.chat or ():
        msg = chat.messages.add(role=turn.role, content=turn.content)
        if turn.name is not None:
            msg.name = turn.name
        if turn.tool_call_id is not None:
            msg.tool_call_id = turn.tool_call_id
        for call in turn.tool_calls:
            msg.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        for part in turn.parts:
            if part.image_url is not None:
                msg.parts.add(image=generation_pb2.Image(url=part.image_url))
            else:
                msg.parts.add(text=part.text or "")
    for tool in prompt.tools:
        chat.tools.add(name=tool.name, description=tool.description, parameters=tool.parameters)
    return chat


def _guided_to_pb(guided: Guided, out: common_pb2.GuidedDecoding) -> None:
    if guided.kind is GuidedKind.JSON_SCHEMA:
        out.json_schema = guided.spec
    elif guided.kind is GuidedKind.JSON_OBJECT:
        out.json_object = True
    elif guided.kind is GuidedKind.REGEX:
        out.regex = guided.spec
    elif guided.kind is GuidedKind.CHOICE:
        out.choice.choices.extend(guided.choices)
    else:
        out.grammar = guided.spec


def _tool_choice_to_pb(choice: ToolChoice, out: generation_pb2.ToolChoice) -> None:
    if choice.mode is ToolChoiceMode.NONE:
        out.none = True
    elif choice.mode is ToolChoiceMode.AUTO:
        out.auto = True
    elif choice.mode is ToolChoiceMode.REQUIRED:
        out.required = True
    else:
        out.function_name = choice.function_name


def _beam_search_to_pb(beam: BeamSearch, out: common_pb2.BeamSearch) -> None:
    out.beam_width = beam.beam_width
    if beam.length_penalty is not None:
        out.length_penalty = beam.length_penalty
    out.early_stopping = _BEAM_STOPPING[beam.early_stopping]


def generate_request_to_pb(prompt: Prompt, p: GenerationParams, request_id: str,
                           adapter: str = "") -> generation_pb2.GenerateRequest:
    """``adapter``: the LoRA adapter to run through (the request's ``model``); "" for the base model."""
    req = generation_pb2.GenerateRequest(request_id=request_id, n=p.n, model=adapter)
    if prompt.chat is not None:
        req.chat.CopyFrom(chat_to_pb(prompt))
    elif prompt.token_ids is not None:
        req.token_ids.ids.extend(prompt.token_ids)
    else:
        req.text = prompt.text or ""
    s = req.sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed"):
        value = getattr(p, name)
        if value is not None:
            setattr(s, name, value)
    for tok, bias in p.logit_bias.items():
        s.logit_bias[tok] = bias
    if p.allowed_token_ids:  # extending by nothing would still set `sampling`
        s.allowed_token_ids.extend(p.allowed_token_ids)
    st = req.stopping
    if p.max_tokens is not None:
        st.max_tokens = p.max_tokens
    st.min_tokens = p.min_tokens
    st.stop.extend(p.stop)
    st.stop_token_ids.extend(p.stop_token_ids)
    st.ignore_eos = p.ignore_eos
    st.include_stop_str_in_output = p.include_stop_str_in_output
    r = req.response
    if p.skip_special_tokens is not None:
        r.skip_special_tokens = p.skip_special_tokens
    r.logprobs = p.logprobs
    r.top_logprobs = p.top_logprobs
    r.echo = p.echo
    if p.stream_interval is not None:
        r.stream_interval = p.stream_interval
    if p.prompt_logprobs is not None:
        r.prompt_logprobs = p.prompt_logprobs
    if p.guided is not None:
        _guided_to_pb(p.guided, req.guided)
    req.priority = p.priority
    if p.best_of is not None:
        req.best_of = p.best_of
    if p.beam_search is not None:
        _beam_search_to_pb(p.beam_search, req.beam_search)
    if p.tool_choice is not None:
        _tool_choice_to_pb(p.tool_choice, req.tool_choice)
    if p.parallel_tool_calls is not None:
        req.parallel_tool_calls = p.parallel_tool_calls
    if p.thinking_token_budget is not None:
        req.thinking_token_budget = p.thinking_token_budget
    if p.truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = p.truncate_prompt_tokens
    if p.add_special_tokens is not None:
        req.add_special_tokens = p.add_special_tokens
    req.cache_salt = p.cache_salt
    req.bad_words.extend(p.bad_words)
    return req


def delta_from_pb(msg: generation_pb2.GenerateResponse) -> Delta:
    stop_kind = msg.WhichOneof("stop_reason")
    stop_reason: str | int | None = getattr(msg, stop_kind) if stop_kind else None
    logprobs = tuple(
        TokenLogprob(lp.token_id, lp.text, lp.text_bytes, lp.logprob,
                     tuple(TopLogprob(t.token_id, t.text, t.text_bytes, t.logprob) for t in lp.top_logprobs))
        for lp in msg.logprobs
    )
    return Delta(
        index=msg.index,
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        logprobs=logprobs,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens),
        finish_reason=_FINISH.get(msg.finish_reason),
        stop_reason=stop_reason,
        error_message=msg.error_message,
        tool_calls=tuple(ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in msg.tool_calls),
        reasoning_content=msg.reasoning_content,
        prompt_logprobs=tuple(
            PromptTokenLogprob(p.token_id, p.text, p.logprob if p.HasField("logprob") else None,
                               tuple(TopLogprob(t.token_id, t.text, t.text_bytes, t.logprob) for t in p.top_logprobs))
            for p in msg.prompt_logprobs
        ),
    )



def model_info_from_pb(resp: generation_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(resp.model_name, resp.max_model_len, lora_enabled=resp.lora_enabled,
                     lora_adapters=tuple(adapter_from_pb(a) for a in resp.lora_adapters))


def adapter_from_pb(adapter: common_pb2.LoRAAdapter) -> LoRAAdapter:
    return LoRAAdapter(adapter.name, adapter.base_model_name)
