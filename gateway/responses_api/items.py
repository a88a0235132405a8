"""A response's input items as ``GET /v1/responses/{id}/input_items`` lists them: each with an id and a status,
in OpenAI's item shapes (text given as a string becomes one ``input_text`` part), and the list paged as OpenAI
pages it (``order`` desc by default, ``after`` an item id, ``limit`` 1 to 100, default 20)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.errors import ApiError, bad_request
from gateway.models import JsonObject

Item = dict[str, object]

_DEFAULT_LIMIT = 20
_MAX_LIMIT = 100


def input_items(given: str | list[JsonObject], response_id: str) -> tuple[Item, ...]:
    """The request's ``input`` (already validated by parse_responses) as stored items; an item without an id gets
    one made from the response's (``msg_<hex>_in<i>``)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    suffix = response_id.removeprefix("resp_")
    items: list[Item] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}.get(
            str(kind), "item")
        out: Item = {**item, "id": item.get("id") or f"{prefix}_{suffix}_in{i}", "type": kind}
        if kind == "message":
            out["content"] = _parts(item.get("content"), str(item.get("role")))
        if kind != "reasoning":
            out.setdefault("status", "completed")
        items.append(out)
    return tuple(items)


def _parts(content: object, role: str) -> object:
    if not isinstance(content, str):
        return content
    if role == "assistant":
        return [{"type": "output_text", "text": content, "annotations": []}]
    return [{"type": "input_text", "text": content}]


def item_page(items: Sequence[Item], query: Mapping[str, str]) -> dict[str, object]:
    """One page of ``items`` as OpenAI's list object, read from the query's ``order``, ``after`` and ``limit``."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order", '`order` must be "asc" or "desc".')
    raw_limit = query.get("limit", str(_DEFAULT_LIMIT))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= _MAX_LIMIT:
        raise bad_request("limit", f"`limit` must be an integer from 1 to {_MAX_LIMIT}.")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ApiError(404, f"Item with id '{after[:100]}' not found.", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:int(raw_limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page)}
