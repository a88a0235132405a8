"""One sequence's engine messages turned into public deltas: text (stop strings held back), the model's thinking
apart from its answer, tool calls in the answer, log probabilities with their text, the echoed prompt, and the
finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.text import IncrementalDetokenizer, Tokenizer
from engine.text.reasoning import ReasoningStream
from engine.text.tool_parsers import StreamDelta, ToolCallStream
from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2

_ENGINE_FINISH = {
    common_pb2.FINISH_REASON_EOS: common_pb2.FINISH_REASON_EOS,
    common_pb2.FINISH_REASON_STOP: common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORTED: common_pb2.FINISH_REASON_ABORTED,
    common_pb2.FINISH_REASON_ERROR: common_pb2.FINISH_REASON_ERROR,
}
# The output ended on a token: eos, or one of stop_token_ids.
_STOPPED_BY_TOKEN = frozenset({common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_STOP})
# The model ended its turn (not cut short): when it made calls, the turn's reason is that.
_TURN_ENDS = frozenset({common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_STOP,
                        common_pb2.FINISH_REASON_STOP_STRING})


@dataclass
class Usage:
    prompt: int
    cached: int = 0
    per_seq: dict[int, int] = field(default_factory=dict)

    def pb(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.prompt, completion_tokens=sum(self.per_seq.values()),
                                cached_tokens=self.cached)


class SequenceOutput:
    """Detokenization, reasoning and tool-call state of one of a request's n sequences. ``reasoning`` splits the
    text into thinking and answer first; ``tools`` reads calls out of the answer."""

    def __init__(self, index: int, tokenizer: Tokenizer, detok: IncrementalDetokenizer, *,
                 tools: ToolCallStream | None = None, echo: str | None = None,
                 reasoning: ReasoningStream | None = None, drop_final_special: bool = False) -> None:
        """``drop_final_special``: a special token that ends the output (eos) is not decoded into the text (special
        tokens are kept in it for a tool parser whose markers are special)."""
        self.index = index
        self.drop_final_special = drop_final_special
        self.tokenizer = tokenizer
        self.detok = detok
        self.tools = tools
        self.reasoning = reasoning
        self.echo = echo  # the prompt text, until the first message carries it
        self.completion_tokens = 0
        self.finished = False

    def delta(self, request_id: str, msg: engine_pb2.EngineGenerateResponse, usage: Usage,
              options: generation_pb2.ResponseOptions) -> generation_pb2.GenerateResponse | None:
        ids = list(msg.token_ids)
        before = self.detok.num_output_tokens
        shown = ids
        if (self.drop_final_special and msg.finish_reason in _STOPPED_BY_TOKEN and ids
                and ids[-1] in self.tokenizer.all_special_ids):
            shown = ids[:-1]   # the end-of-sequence token: kept in the ids, not in the text
        delta = self.detok.add_tokens(shown) if shown else None
        # Under a stream interval a message holds several tokens: those after a stop string are not
        # generated as far as the client is concerned (not returned, not counted).
        consumed = self.detok.num_output_tokens - before
        del ids[consumed if consumed < len(shown) else len(ids):]
        self.completion_tokens += len(ids)
        usage.per_seq[self.index] = self.completion_tokens
        out = generation_pb2.GenerateResponse(request_id=request_id, index=self.index, token_ids=ids,
                                              usage=usage.pb())
        self._text(out, delta.text if delta else "")
        if options.logprobs:
            self._logprobs(out, ids, msg, options.top_logprobs)
        for entry in msg.prompt_logprobs:
            self._prompt_logprob(out.prompt_logprobs.add(), entry)
        if msg.HasField("cumulative_logprob"):
            out.cumulative_logprob = msg.cumulative_logprob
        if delta is not None and delta.stop_string is not None:
            out.stop_string = delta.stop_string
            return self._finish(out, common_pb2.FINISH_REASON_STOP_STRING)
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._text(out, self.detok.finish())
            if self.detok.stop_string is not None:
                out.stop_string = self.detok.stop_string
                return self._finish(out, common_pb2.FINISH_REASON_STOP_STRING)
            reason = _ENGINE_FINISH.get(msg.finish_reason, common_pb2.FINISH_REASON_ERROR)
            if reason == common_pb2.FINISH_REASON_STOP and ids:
                out.stop_token_id = ids[-1]
            if reason == common_pb2.FINISH_REASON_ERROR:
                out.error_message = msg.error_message or "the engine failed while generating"
            return self._finish(out, reason)
        if out.text or out.reasoning_content or ids or out.tool_calls or out.prompt_logprobs:
            return self._echoed(out)
        return None

    def final(self, request_id: str, usage: Usage, reason: common_pb2.FinishReason
              ) -> generation_pb2.GenerateResponse:
        """The last message of a sequence ended here (a time limit), not by the engine."""
        out = generation_pb2.GenerateResponse(request_id=request_id, index=self.index, usage=usage.pb())
        self._text(out, self.detok.finish())
        return self._finish(out, reason)

    def _finish(self, out: generation_pb2.GenerateResponse, reason: common_pb2.FinishReason
                ) -> generation_pb2.GenerateResponse:
        self.finished = True
        if self.reasoning is not None:
            rest = self.reasoning.finish()
            out.reasoning_content += rest.reasoning
            self._answer(out, rest.content)
        if self.tools is not None:
            self._add(out, self.tools.finish())
            # As vLLM: calls made end the turn, even past max_tokens when each call was whole.
            cut_after_calls = reason == common_pb2.FINISH_REASON_LENGTH and self.tools.calls_whole
            if self.tools.calls_made and (reason in _TURN_ENDS or cut_after_calls):
                reason = common_pb2.FINISH_REASON_TOOL_CALLS
                out.ClearField("stop_reason")
        out.finish_reason = reason
        return self._echoed(out)

    def _echoed(self, out: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
        if self.echo is not None:
            out.text = self.echo + out.text
            self.echo = None
        return out

    def _text(self, out: generation_pb2.GenerateResponse, text: str) -> None:
        if self.reasoning is not None and text:
            split = self.reasoning.feed(text)
            out.reasoning_content += split.reasoning
            text = split.content
        self._answer(out, text)

    def _answer(self, out: generation_pb2.GenerateResponse, text: str) -> None:
        if self.tools is None:
            out.text += text
        elif text:
            self._add(out, self.tools.feed(text))

    @staticmethod
    def _add(out: generation_pb2.GenerateResponse, delta: StreamDelta) -> None:
        out.text += delta.content
        for call in delta.calls:
            out.tool_calls.add(index=call.index, id=call.id, name=call.name, arguments=call.arguments)

    def _logprobs(self, out: generation_pb2.GenerateResponse, ids: list[int], msg: engine_pb2.EngineGenerateResponse,
                  top: int) -> None:
        for tok, lp in zip(ids, msg.logprobs):
            entry = out.logprobs.add(token_id=tok, logprob=lp.logprob, text=self._token_text(tok),
                                     text_bytes=self.tokenizer.token_to_bytes(tok))
            for t in sorted(lp.top_logprobs, key=lambda t: -t.logprob)[:top]:
                entry.top_logprobs.add(token_id=t.token_id, logprob=t.logprob, text=self._token_text(t.token_id),
                                       text_bytes=self.tokenizer.token_to_bytes(t.token_id))

    def _prompt_logprob(self, out: common_pb2.PromptTokenLogprob, entry: common_pb2.PromptTokenLogprob) -> None:
        out.CopyFrom(entry)
        out.text, out.text_bytes = self._token_text(entry.token_id), self.tokenizer.token_to_bytes(entry.token_id)
        for top in out.top_logprobs:
            top.text, top.text_bytes = self._token_text(top.token_id), self.tokenizer.token_to_bytes(top.token_id)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_to_bytes(token_id).decode("utf-8", errors="replace")
