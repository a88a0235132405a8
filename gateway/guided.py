"""Output constraints in every spelling clients send, read into one :class:`Guided`.

OpenAI's ``response_format``, vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and vLLM's newer ``structured_outputs``
object all name the same few constraints; a request may set one of them. The
grammar engine behind them is llguidance, so ``guided_decoding_backend`` may
only name it (or leave the choice to us).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from gateway.backend import Guided, GuidedKind
from gateway.errors import bad_request
from gateway.fields import json_type, opt_object, opt_str

MAX_SPEC_BYTES = 64 * 1024  # a schema's JSON text, a regex or a grammar
MAX_CHOICES = 1024
BACKENDS = ("auto", "guidance", "llguidance")
# vLLM's structured_outputs keys Sluice honours; any other key set there is refused.
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def parse_guided(body: Mapping[str, object]) -> Guided | None:
    """The request's one constraint, or None; a second one is a 400 naming it."""
    backend = opt_str(body, "guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise bad_request("guided_decoding_backend",
                          f"`guided_decoding_backend` must be one of {', '.join(BACKENDS)} (Sluice's structured "
                          f"outputs run on llguidance), got {backend[:64]!r}.")
    found: list[tuple[str, Guided]] = []
    fmt = _response_format(body)
    if fmt is not None:
        found.append(("response_format", fmt))
    for name, kind in (("guided_json", GuidedKind.JSON_SCHEMA), ("guided_regex", GuidedKind.REGEX),
                       ("guided_choice", GuidedKind.CHOICE), ("guided_grammar", GuidedKind.GRAMMAR)):
        value = body.get(name)
        if value is not None:
            found.append((name, _constraint(name, kind, value)))
    structured = opt_object(body, "structured_outputs")
    for key, value in (structured or {}).items():
        name = f"structured_outputs.{key}"
        if value is None or (key == "json_object" and value is False):  # unset, as vLLM reads them
            continue
        if key not in _STRUCTURED_KEYS:
            raise bad_request(name, f"`{name}` is not supported; `structured_outputs` takes one of "
                                    f"{', '.join(_STRUCTURED_KEYS)}.")
        if key == "json_object":
            if value is not True:
                raise bad_request(name, f"`{name}` must be a boolean, got {json_type(value)}.")
            found.append((name, Guided(GuidedKind.JSON_OBJECT)))
        else:
            kind = {"json": GuidedKind.JSON_SCHEMA, "regex": GuidedKind.REGEX, "choice": GuidedKind.CHOICE,
                    "grammar": GuidedKind.GRAMMAR}[key]
            found.append((name, _constraint(name, kind, value)))
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad_request(second, f"`{second}` cannot be combined with `{first}`: a request takes one output "
                                  "constraint.")
    if not found:
        return None
    name, guided = found[0]
    return dataclasses.replace(guided, source=name)


def _response_format(body: Mapping[str, object]) -> Guided | None:
    fmt = opt_object(body, "response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guided(GuidedKind.JSON_OBJECT)
    if kind != "json_schema":
        raise bad_request("response_format.type", "`response_format.type` must be one of text, json_object, "
                                                  f"json_schema, got {str(kind)[:64]!r}.")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema",
                          f"`response_format.json_schema` must be an object, got {json_type(spec)}.")
    # OpenAI's label for the schema, and its strictness: checked, not needed (the output always matches).
    for key, kind in (("name", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec.get(key), kind):
            field = f"response_format.json_schema.{key}"
            raise bad_request(field, f"`{field}` must be a {'string' if kind is str else 'boolean'}, "
                                     f"got {json_type(spec.get(key))}.")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema",
                          f"`response_format.json_schema.schema` must be an object, got {json_type(schema)}.")
    return Guided(GuidedKind.JSON_SCHEMA, _schema_text("response_format.json_schema.schema", schema))


def _constraint(name: str, kind: GuidedKind, value: object) -> Guided:
    if kind is GuidedKind.JSON_SCHEMA:
        return Guided(kind, _json_schema(name, value))
    if kind is GuidedKind.CHOICE:
        return Guided(kind, choices=_choices(name, value))
    if not isinstance(value, str) or not value:
        raise bad_request(name, f"`{name}` must be a non-empty string, got {json_type(value)}.")
    _check_size(name, value)
    return Guided(kind, value)


def _json_schema(name: str, value: object) -> str:
    """vLLM takes the schema as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(name, f"`{name}` is a string that is not valid JSON.") from None
    if not isinstance(value, dict):
        raise bad_request(name, f"`{name}` must be a JSON schema object, got {json_type(value)}.")
    return _schema_text(name, value)


def _schema_text(name: str, schema: dict[str, object]) -> str:
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    _check_size(name, text)
    return text


def _choices(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise bad_request(name, f"`{name}` must be a non-empty array of strings, got {json_type(value)}.")
    if len(value) > MAX_CHOICES:
        raise bad_request(name, f"`{name}` may hold at most {MAX_CHOICES} strings, got {len(value)}.")
    for i, choice in enumerate(value):
        if not isinstance(choice, str):
            raise bad_request(f"{name}[{i}]", f"`{name}[{i}]` must be a string, got {json_type(choice)}.")
    _check_size(name, "".join(value))
    return tuple(value)


def _check_size(name: str, text: str) -> None:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise bad_request(name, f"`{name}` must be at most {MAX_SPEC_BYTES} bytes.")
