"""A request body, from bytes to a validated model, failing with a 400 that names the field.

The body is read with the standard JSON parser (NaN / Infinity are not JSON and
are refused), every string checked to be UTF-8 text, then validated by a model of
gateway/models.py; the model's first error becomes the OpenAI error body, its
location the ``param``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from gateway.errors import bad_request
from gateway.models import TAG_PREFIX

M = TypeVar("M", bound=BaseModel)


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


_EXPECTED = {"string_type": "a string", "int_type": "an integer", "bool_type": "a boolean", "float_type": "a number",
             "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
             "list_type": "an array"}


def param_of(loc: tuple[str | int, ...]) -> str | None:
    """``("messages", 0, "content", "@parts", 1)`` -> ``messages[0].content[1]``: union tags dropped."""
    parts = [f"[{key}]" if isinstance(key, int) else f".{key}" for key in loc
             if isinstance(key, int) or not key.startswith(TAG_PREFIX)]
    return "".join(parts).lstrip(".") or None


def _message(model: type[BaseModel], name: str, error: ErrorDetails) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing" or (value is None and kind in _EXPECTED):  # null reads as absent
        return f"`{name}` is required."
    if kind == "extra_forbidden":
        if len(error["loc"]) == 1:
            fields = ", ".join(f.alias or n for n, f in model.model_fields.items())
            return f"`{name}` is not supported here; the fields are {fields}."
        return f"`{name}` is not supported."
    if kind in _EXPECTED:
        return f"`{name}` must be {_EXPECTED[kind]}, got {json_type(value)}."
    if kind in ("invalid_union", "invalid_field"):
        return f"`{name}` {error['msg']}, got {json_type(value)}."
    message = error["msg"]
    return f"`{name}`: {message[0].lower()}{message[1:]}{'' if message.endswith('.') else '.'}"


def validate(model: type[M], body: Mapping[str, object]) -> M:
    """``body`` as ``model``, or a 400 naming the first field in error."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        error = err.errors(include_url=False)[0]
        name = param_of(error["loc"])
        if name is None:
            raise bad_request(None, f"The request body is invalid: {error['msg']}.") from None
        raise bad_request(name, _message(model, name, error)) from None
