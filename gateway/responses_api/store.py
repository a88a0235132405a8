"""Finished responses, kept for ``previous_response_id``: a bounded LRU in the gateway process's memory.

Each gateway process has its own store, and nothing survives a restart: behind several gateway replicas a
``previous_response_id`` only resolves on the replica that answered it (route a conversation to one replica,
or send the whole history as ``input``)."""

from __future__ import annotations

from collections import OrderedDict

ChatMessages = tuple[dict[str, object], ...]

MAX_STORED_RESPONSES = 1024  # conversations a process remembers; the least recently used is dropped first


class ResponseStore:
    """Response id → the chat conversation it ended (its input messages, then its output as assistant/tool turns).

    ``instructions`` are not kept: as OpenAI's, a later request's own ``instructions`` replace them."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, ChatMessages] = OrderedDict()

    def put(self, response_id: str, messages: ChatMessages) -> None:
        self._entries[response_id] = messages
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> ChatMessages | None:
        messages = self._entries.get(response_id)
        if messages is not None:
            self._entries.move_to_end(response_id)
        return messages

    def __len__(self) -> int:
        return len(self._entries)
