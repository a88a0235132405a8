"""gateway/responses_api/store.py: a bounded LRU of conversations."""

from __future__ import annotations

from gateway.responses_api.store import ResponseStore


def test_the_least_recently_used_goes_first() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", ({"role": "user", "content": "a"},))
    store.put("b", ())
    assert store.get("a") == ({"role": "user", "content": "a"},)  # now "b" is the least recently used
    store.put("c", ())
    assert (store.get("b"), store.get("a") is not None, store.get("c"), len(store)) == (None, True, (), 2)
