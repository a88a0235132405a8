"""OpenAI response bodies and stream chunks, built from the backend's deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.backend import Delta, FinishReason, PromptTokenLogprob, TokenLogprob, ToolCallDelta, Usage
from gateway.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs


def usage_json(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class ToolCallSoFar:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def json(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # a reasoning model's thinking
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[PromptTokenLogprob, ...] = ()
    tool_calls: dict[int, ToolCallSoFar] = field(default_factory=dict)  # by the calls' index
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error_message: str = ""
    text_length: int = 0  # characters so far, for the legacy logprobs' text_offset


class UsageSum:
    """Usage over a request's calls: each call's is cumulative, so keep the latest per call."""

    def __init__(self, num_calls: int) -> None:
        self._latest = [Usage()] * num_calls

    def update(self, prompt_index: int, usage: Usage) -> None:
        self._latest[prompt_index] = usage

    def total(self) -> Usage:
        return Usage(sum(u.prompt_tokens for u in self._latest), sum(u.completion_tokens for u in self._latest),
                     sum(u.cached_tokens for u in self._latest))


class ResponseBuilder:
    """The shapes of one request's response: completions or chat, whole or chunked."""

    def __init__(self, *, is_chat: bool, request_id: str, created: int, model: str, num_choices: int,
                 logprobs: bool, prompt_logprobs: bool = False, echo: bool = False, echo_prefix: str = "",
                 include_reasoning: bool = True) -> None:
        self.is_chat = is_chat
        self.id = f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}"
        self.created = created
        self.model = model
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs asked for
        self.echo = echo  # completions: the prompt's tokens lead the logprobs
        self.echo_prefix = echo_prefix  # chat: the gateway's own echo
        self.include_reasoning = include_reasoning  # vLLM's include_reasoning: False drops the thinking
        self.choices = [Choice() for _ in range(num_choices)]

    def _head(self, obj: str) -> dict[str, object]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, index: int, delta: Delta) -> int:
        """Record a delta; return the length of the choice's text before it (its text offset)."""
        choice = self.choices[index]
        offset = choice.text_length
        choice.text.append(delta.text)
        choice.text_length += len(delta.text)
        if delta.reasoning_content and self.include_reasoning:
            choice.reasoning.append(delta.reasoning_content)
        choice.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            choice.prompt_logprobs = delta.prompt_logprobs
        for call in delta.tool_calls:
            so_far = choice.tool_calls.setdefault(call.index, ToolCallSoFar(call.id, call.name))
            so_far.arguments.append(call.arguments)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
            choice.error_message = delta.error_message
        return offset

    # -- whole responses -------------------------------------------------

    def full(self, usage: Usage) -> dict[str, object]:
        out = self._head("chat.completion" if self.is_chat else "text_completion")
        choices = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.text)
            item: dict[str, object]
            if self.is_chat:
                item = {"index": index, "message": self._message(self.echo_prefix + text, choice),
                        "logprobs": chat_logprobs(choice.logprobs) if self.logprobs else None}
            else:
                logprobs = completion_logprobs(choice.logprobs, 0, self._echoed(choice.prompt_logprobs)) \
                    if self.logprobs else None
                item = {"index": index, "text": text, "logprobs": logprobs}
                if self.prompt_logprobs:
                    item["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs)
            item["finish_reason"] = choice.finish_reason.openai if choice.finish_reason else None
            item["stop_reason"] = choice.stop_reason
            choices.append(item)
        out["choices"] = choices
        if self.is_chat and self.prompt_logprobs:
            # vLLM puts chat's on the response: every choice has the same prompt.
            out["prompt_logprobs"] = vllm_prompt_logprobs(self.choices[0].prompt_logprobs if self.choices else ())
        out["usage"] = usage_json(usage)
        return out

    def _echoed(self, prompt: tuple[PromptTokenLogprob, ...]) -> tuple[PromptTokenLogprob, ...]:
        return prompt if self.echo else ()

    @staticmethod
    def _message(text: str, choice: Choice) -> dict[str, object]:
        message: dict[str, object] = {"role": "assistant", "content": text}
        if choice.reasoning:   # as vLLM: a thinking with no answer after it has null content
            message["content"] = text or None
            message["reasoning_content"] = "".join(choice.reasoning)
        if choice.tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [choice.tool_calls[i].json() for i in sorted(choice.tool_calls)]
        return message

    # -- stream chunks ---------------------------------------------------

    def role_chunks(self) -> list[dict[str, object]]:
        """Chat streams open each choice with the assistant role (as OpenAI and vLLM do), then the
        echoed last message (vLLM's chat echo)."""
        if not self.is_chat:
            return []
        chunks = [self._chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None})
                  for i in range(len(self.choices))]
        if self.echo_prefix:
            chunks += [self._chunk(i, {"delta": {"content": self.echo_prefix}, "logprobs": None})
                       for i in range(len(self.choices))]
        return chunks

    def delta_chunk(self, index: int, delta: Delta, text_offset: int) -> dict[str, object] | None:
        """The chunk of one delta (already :meth:`add`-ed), or None when it carries nothing."""
        reasoning = delta.reasoning_content if self.include_reasoning else ""
        if (not delta.text and not reasoning and not delta.logprobs and not delta.tool_calls
                and delta.finish_reason is None):
            return None  # text held back by the detokenizer (or thinking left out): nothing to tell the client
        body: dict[str, object]
        if self.is_chat:
            message: dict[str, object] = {"reasoning_content": reasoning} if reasoning else {}
            if delta.text:
                message["content"] = delta.text
            if delta.tool_calls:
                message["tool_calls"] = [_tool_call_chunk(c) for c in delta.tool_calls]
            body = {"delta": message, "logprobs": chat_logprobs(delta.logprobs) if self.logprobs else None}
        else:
            logprobs = completion_logprobs(delta.logprobs, text_offset, self._echoed(delta.prompt_logprobs)) \
                if self.logprobs else None
            body = {"text": delta.text, "logprobs": logprobs}
        if delta.finish_reason is not None:
            body["stop_reason"] = delta.stop_reason
        return self._chunk(index, body, delta.finish_reason)

    def usage_chunk(self, usage: Usage) -> dict[str, object]:
        out = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out

    def _chunk(self, index: int, body: dict[str, object], finish: FinishReason | None = None) -> dict[str, object]:
        out = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        out["choices"] = [{"index": index, **body, "finish_reason": finish.openai if finish else None}]
        return out


def _tool_call_chunk(call: ToolCallDelta) -> dict[str, object]:
    """OpenAI's streamed call: id, type and name on a call's first delta, then argument fragments."""
    if call.id or call.name:
        return {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, "function": {"arguments": call.arguments}}
