"""Finished responses (``store`` true), kept for ``previous_response_id`` and for ``GET`` / ``DELETE
/v1/responses/{id}``: a bounded LRU in the gateway process's memory.

Each gateway process has its own store, and nothing survives a restart: behind several gateway replicas a
stored response only resolves on the replica that answered it (route a conversation to one replica, or send the
whole history as ``input``)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ChatMessages = tuple[dict[str, object], ...]

MAX_STORED_RESPONSES = 1024  # responses a process remembers; the least recently used is dropped first


@dataclass(frozen=True)
class StoredResponse:
    """What a finished response leaves behind.

    ``conversation``: the chat conversation it ended (its input messages, then its output as assistant/tool
    turns), which a later ``previous_response_id`` continues; ``instructions`` are not in it: as OpenAI's, a later
    request's own ``instructions`` replace them. ``response``: the response object as it was returned.
    ``input_items``: the request's own input items with their ids (``GET /v1/responses/{id}/input_items``)."""

    conversation: ChatMessages
    response: dict[str, object]
    input_items: tuple[dict[str, object], ...]


class ResponseStore:
    """Response id → :class:`StoredResponse`, the least recently used dropped past ``capacity``."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored (or already dropped)."""
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
