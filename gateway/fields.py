"""Typed readers of JSON request fields that fail with a 400 naming the field.

JSON ``null`` reads as "absent", as OpenAI and vLLM do. Booleans are never
accepted as numbers, and every number must be finite.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from gateway.errors import ApiError, bad_request

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, object]:
    """The request body as a JSON object; NaN / Infinity are not JSON and are refused."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise bad_request(None, "The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise bad_request(None, f"The request body must be a JSON object, got {json_type(data)}.")
    _check_encodable(data)
    return data


# A parent's path and this element's key (a name or a list index); None at the body's root.
_Path = tuple["_Path | None", "str | int"] | None


def _path_name(path: _Path) -> str | None:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".") or None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_encodable(body: dict[str, object]) -> None:
    """Every string of the body, names included, must be UTF-8 text: JSON's ``\\ud800`` escape (and raw
    surrogate bytes, which ``json.loads`` lets through) makes a lone surrogate, which no gRPC message, log
    line or response body can carry. Checked once here, for all fields, with an explicit stack: the body
    may nest as deep as the JSON parser allows."""
    stack: list[tuple[object, _Path]] = [(body, None)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                name = _path_name(path)
                raise bad_request(name, f"`{name}` is not valid UTF-8 text: it holds a lone UTF-16 surrogate "
                                        "(such as \\ud800).")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    name = _path_name(path)
                    where = f"`{name}`" if name else "The request body"
                    raise bad_request(name, f"{where} has a field name that is not valid UTF-8 text: it holds a "
                                            "lone UTF-16 surrogate.")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (path, key)))
        elif isinstance(value, list):  # numbers are skipped: a long list of token ids costs little
            stack.extend((item, (path, i)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


def _type_error(name: str, expected: str, value: object) -> ApiError:
    return bad_request(name, f"`{name}` must be {expected}, got {json_type(value)}.")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def opt_bool(body: Mapping[str, object], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _type_error(name, "a boolean", value)


def opt_str(body: Mapping[str, object], name: str) -> str | None:
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise _type_error(name, "a string", value)


def opt_int(body: Mapping[str, object], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is an integer in JSON's eyes
    if not is_int(value):
        raise _type_error(name, "an integer", value)
    assert isinstance(value, int)
    if not lo <= value <= hi:
        raise bad_request(name, f"`{name}` must be in [{lo}, {hi}], got {value}.")
    return value


def opt_float(body: Mapping[str, object], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number", value)
    number = float(value)
    below = number <= lo if lo_open else number < lo
    if not math.isfinite(number) or below or number > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad_request(name, f"`{name}` must be in {interval}, got {value}.")
    return number


def opt_object(body: Mapping[str, object], name: str) -> dict[str, object] | None:
    value = body.get(name)
    if value is None or isinstance(value, dict):
        return value
    raise _type_error(name, "an object", value)


def token_ids(value: object, name: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    """A JSON array of token ids (uint32)."""
    if not isinstance(value, list):
        raise _type_error(name, "an array of token ids", value)
    if not value and not allow_empty:
        raise bad_request(name, f"`{name}` must not be empty.")
    for i, tok in enumerate(value):
        if not is_int(tok):
            raise _type_error(f"{name}[{i}]", "an integer token id", tok)
        if not 0 <= tok <= UINT32_MAX:
            raise bad_request(f"{name}[{i}]", f"`{name}[{i}]` must be a token id >= 0, got {tok}.")
    return tuple(value)
