"""A Responses API response, whole or as its stream of events, built from the backend's deltas.

Output items come in the order the model produced them: its thinking (a ``reasoning`` item, with a reasoning
parser), its answer (a ``message``), its calls (a ``function_call`` each). A stream sends, as OpenAI's does:
``response.created``, ``response.in_progress``; per item ``response.output_item.added``, then for text
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done`` (for thinking the same with ``reasoning_text``), for a call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``; then
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it). Every event has the next ``sequence_number``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.backend import Delta, FinishReason, Usage
from gateway.responses_api.request import ResponsesCall
from gateway.responses_api.store import ChatMessages

Event = dict[str, object]


@dataclass
class _Item:
    """One output item being built: kind "reasoning", "message" or "function_call"."""

    kind: str
    id: str
    parts: list[str] = field(default_factory=list)  # text, thinking or arguments so far
    call_id: str = ""
    name: str = ""
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def json(self) -> dict[str, object]:
        status = "completed" if self.done else "in_progress"
        if self.kind == "reasoning":
            thinking: list[dict[str, object]] = [{"type": "reasoning_text", "text": self.text}] if self.done else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": thinking, "status": status}
        if self.kind == "message":
            content = [_text_part(self.text)] if self.done else []
            return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text if self.done else "", "status": status}


def _text_part(text: str) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """The items of one response as deltas arrive; with :meth:`add`'s events, its stream."""

    def __init__(self, call: ResponsesCall, response_id: str, model: str) -> None:
        self.call = call
        self.id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # by the backend's call index
        self.finish_reason: FinishReason | None = None
        self.usage = Usage()
        self._sequence = 0

    # -- events --------------------------------------------------------------------------------------------

    def event(self, type_: str, **fields: object) -> Event:
        out: Event = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return out

    def opening(self) -> list[Event]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def add(self, delta: Delta) -> list[Event]:
        """Record a delta of the response's one sequence; return the events it makes."""
        events: list[Event] = []
        if delta.reasoning_content:
            item = self._current("reasoning", events)
            item.parts.append(delta.reasoning_content)
            events.append(self.event("response.reasoning_text.delta", item_id=item.id,
                                      output_index=self.items.index(item), content_index=0,
                                      delta=delta.reasoning_content))
        if delta.text:
            item = self._current("message", events)
            item.parts.append(delta.text)
            events.append(self.event("response.output_text.delta", item_id=item.id,
                                      output_index=self.items.index(item), content_index=0, delta=delta.text,
                                      logprobs=[]))
        for call in delta.tool_calls:
            called = self.calls.get(call.index)
            if called is None:
                events += self._close_open()
                called = _Item("function_call", f"fc_{self.id[5:]}_{call.index}",
                               call_id=call.id or f"call_{call.index}", name=call.name)
                self.calls[call.index] = called
                events += self._open(called)
            if call.arguments:
                called.parts.append(call.arguments)
                events.append(self.event("response.function_call_arguments.delta", item_id=called.id,
                                         output_index=self.items.index(called), delta=call.arguments))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        return events

    def closing(self, usage: Usage) -> list[Event]:
        """``usage``: the call's, as the route summed it."""
        self.usage = usage
        events = self._close_open()
        status = self.status
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self.event(kind, response=self.response(status)))
        return events

    def _current(self, kind: str, events: list[Event]) -> _Item:
        """The open item of ``kind``, else a new one (closing the item before it)."""
        last = self.items[-1] if self.items else None
        if last is not None and last.kind == kind and not last.done:
            return last
        events += self._close_open()
        prefix = "rs" if kind == "reasoning" else "msg"
        item = _Item(kind, f"{prefix}_{self.id[5:]}_{len(self.items)}")
        events += self._open(item)
        return item

    def _open(self, item: _Item) -> list[Event]:
        index = len(self.items)
        self.items.append(item)
        events = [self.event("response.output_item.added", output_index=index, item=item.json())]
        if item.kind != "function_call":
            part = _text_part("") if item.kind == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=index,
                                      content_index=0, part=part))
        return events

    def _close_open(self) -> list[Event]:
        last = self.items[-1] if self.items else None
        if last is None or last.done:
            return []
        last.done = True
        index = len(self.items) - 1
        events = []
        if last.kind == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=last.id, output_index=index,
                                      arguments=last.text))
        else:
            kind, part = (("output_text", _text_part(last.text)) if last.kind == "message"
                          else ("reasoning_text", {"type": "reasoning_text", "text": last.text}))
            events.append(self.event(f"response.{kind}.done", item_id=last.id, output_index=index, content_index=0,
                                      text=last.text, **({"logprobs": []} if last.kind == "message" else {})))
            events.append(self.event("response.content_part.done", item_id=last.id, output_index=index,
                                      content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=last.json()))
        return events

    # -- the response object -------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        if self.finish_reason in (FinishReason.LENGTH, FinishReason.TIME_LIMIT):
            return "incomplete"
        return "completed"

    def finish(self, usage: Usage) -> dict[str, object]:
        """The whole response, every item closed (a response not streamed)."""
        self.usage = usage
        self._close_open()
        return self.response(self.status)

    def response(self, status: str) -> dict[str, object]:
        req = self.call.request
        done = status != "in_progress"
        chat_tools = self.call.chat_body.get("tools") or []
        assert isinstance(chat_tools, list)
        out: dict[str, object] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": [i.json() for i in self.items] if done else [],
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "tools": [{"type": "function", "name": t["function"]["name"],
                       "description": t["function"].get("description"),
                       "parameters": t["function"].get("parameters"), "strict": t["function"].get("strict")}
                      for t in chat_tools],
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "user": req.user, "store": self.call.store, "background": False,
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": _usage(self.usage) if done else None,
        }
        if done:
            out["completed_at"] = int(time.time())
        return out

    def conversation(self) -> ChatMessages:
        """The chat conversation this response ended: its input, then its output as chat turns."""
        text = "".join(i.text for i in self.items if i.kind == "message")
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.text}}
                 for i in self.items if i.kind == "function_call"]
        turn: dict[str, object] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        return (*self.call.new_messages, turn)


def _usage(usage: Usage) -> dict[str, object]:
    # The backend does not count thinking tokens apart from the answer's: reasoning_tokens is 0.
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
