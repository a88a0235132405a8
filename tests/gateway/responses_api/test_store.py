"""gateway/responses_api/store.py: a bounded LRU of finished responses."""

from __future__ import annotations

from gateway.responses_api.store import ResponseStore, StoredResponse


def _stored(text: str) -> StoredResponse:
    return StoredResponse(({"role": "user", "content": text},), {"id": text}, ())


def test_the_least_recently_used_goes_first() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", _stored("a"))
    store.put("b", _stored("b"))
    assert store.get("a") == _stored("a")  # now "b" is the least recently used
    store.put("c", _stored("c"))
    assert (store.get("b"), store.get("a") is not None, store.get("c"), len(store)) == (None, True, _stored("c"), 2)


def test_a_deleted_response_is_gone() -> None:
    store = ResponseStore()
    store.put("a", _stored("a"))
    assert store.delete("a") and store.get("a") is None and len(store) == 0
    assert not store.delete("a")
