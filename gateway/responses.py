"""OpenAI response bodies and stream chunks, built from the backend's deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.backend import Delta, FinishReason, TokenLogprob, Usage


def usage_json(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
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
                 logprobs: bool) -> None:
        self.is_chat = is_chat
        self.id = f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}"
        self.created = created
        self.model = model
        self.logprobs = logprobs
        self.choices = [Choice() for _ in range(num_choices)]

    def _head(self, obj: str) -> dict[str, object]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, index: int, delta: Delta) -> int:
        """Record a delta; return the length of the choice's text before it (its text offset)."""
        choice = self.choices[index]
        offset = choice.text_length
        choice.text.append(delta.text)
        choice.text_length += len(delta.text)
        choice.logprobs.extend(delta.logprobs)
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
            logprobs = self._logprobs(choice.logprobs, 0) if self.logprobs else None
            item: dict[str, object]
            if self.is_chat:
                item = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
            else:
                item = {"index": index, "text": text, "logprobs": logprobs}
            item["finish_reason"] = choice.finish_reason.openai if choice.finish_reason else None
            item["stop_reason"] = choice.stop_reason
            choices.append(item)
        out["choices"] = choices
        out["usage"] = usage_json(usage)
        return out

    # -- stream chunks ---------------------------------------------------

    def role_chunks(self) -> list[dict[str, object]]:
        """Chat streams open each choice with the assistant role (as OpenAI and vLLM do)."""
        if not self.is_chat:
            return []
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None})
                for i in range(len(self.choices))]

    def delta_chunk(self, index: int, delta: Delta, text_offset: int) -> dict[str, object] | None:
        """The chunk of one delta (already :meth:`add`-ed), or None when it carries nothing."""
        if not delta.text and not delta.logprobs and delta.finish_reason is None:
            return None  # text held back by the detokenizer: nothing to tell the client yet
        logprobs = self._logprobs(list(delta.logprobs), text_offset) if self.logprobs else None
        if self.is_chat:
            body: dict[str, object] = {"delta": {"content": delta.text} if delta.text else {}, "logprobs": logprobs}
        else:
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

    # -- logprobs --------------------------------------------------------

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int) -> dict[str, object]:
        if self.is_chat:
            return {"content": [
                {"token": e.text, "logprob": e.logprob, "bytes": list(e.text_bytes),
                 "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text_bytes)}
                                  for t in e.top]}
                for e in entries
            ]}
        # The legacy completions format: parallel lists; top_logprobs maps text to logprob.
        offsets = []
        for e in entries:
            offsets.append(text_offset)
            text_offset += len(e.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{e.text: e.logprob, **{t.text: t.logprob for t in e.top}} for e in entries],
            "text_offset": offsets,
        }
