"""Output constraints in every spelling clients send, read into one :class:`Guided`.

OpenAI's ``response_format``, vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` and vLLM's newer ``structured_outputs``
object all name the same few constraints; a request may set one of them. The
grammar engine behind them is llguidance, so ``guided_decoding_backend`` may
only name it (or leave the choice to us: the model's Literal).
"""

from __future__ import annotations

import dataclasses
import json

from gateway.backend import Guided, GuidedKind
from gateway.errors import bad_request
from gateway.fields import json_type
from gateway.models import ResponseFormat, SamplingFields, SchemaArg, StructuredOutputs

MAX_SPEC_BYTES = 64 * 1024  # a schema's JSON text, a regex or a grammar
MAX_CHOICES = 1024
_KINDS = {"json": GuidedKind.JSON_SCHEMA, "regex": GuidedKind.REGEX, "choice": GuidedKind.CHOICE,
          "grammar": GuidedKind.GRAMMAR}


def to_guided(req: SamplingFields) -> Guided | None:
    """The request's one constraint, or None; a second one is a 400 naming it."""
    found: list[tuple[str, Guided]] = []
    fmt = _response_format(req.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    for key, value in (("json", req.guided_json), ("regex", req.guided_regex), ("choice", req.guided_choice),
                       ("grammar", req.guided_grammar)):
        if value is not None:
            found.append((f"guided_{key}", _constraint(f"guided_{key}", _KINDS[key], value)))
    found += _structured(req.structured_outputs)
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad_request(second, f"`{second}` cannot be combined with `{first}`: a request takes one output "
                                  "constraint.")
    if not found:
        return None
    name, guided = found[0]
    return dataclasses.replace(guided, source=name)


def _structured(outputs: StructuredOutputs | None) -> list[tuple[str, Guided]]:
    if outputs is None:
        return []
    found = []
    for key, value in (("json", outputs.json_), ("regex", outputs.regex), ("choice", outputs.choice),
                       ("grammar", outputs.grammar)):
        if value is not None:
            name = f"structured_outputs.{key}"
            found.append((name, _constraint(name, _KINDS[key], value)))
    if outputs.json_object:  # false is unset, as vLLM reads it
        found.append(("structured_outputs.json_object", Guided(GuidedKind.JSON_OBJECT)))
    return found


def _response_format(fmt: ResponseFormat | None) -> Guided | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Guided(GuidedKind.JSON_OBJECT)
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema",
                          "`response_format.json_schema` is required when `response_format.type` is json_schema.")
    # OpenAI's label for the schema (name) and its strictness: checked by the model, not needed (the output
    # always matches).
    return Guided(GuidedKind.JSON_SCHEMA, _schema_text("response_format.json_schema.schema", fmt.json_schema.schema_))


def _constraint(name: str, kind: GuidedKind, value: SchemaArg | list[str] | str) -> Guided:
    if kind is GuidedKind.JSON_SCHEMA:
        assert isinstance(value, (dict, str))
        return Guided(kind, _json_schema(name, value))
    if kind is GuidedKind.CHOICE:
        assert isinstance(value, list)
        return Guided(kind, choices=_choices(name, value))
    assert isinstance(value, str)
    if not value:
        raise bad_request(name, f"`{name}` must be a non-empty string.")
    _check_size(name, value)
    return Guided(kind, value)


def _json_schema(name: str, value: SchemaArg) -> str:
    """vLLM takes the schema as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise bad_request(name, f"`{name}` is a string that is not valid JSON.") from None
        if not isinstance(value, dict):
            raise bad_request(name, f"`{name}` must be a JSON schema object, got {json_type(value)}.")
    return _schema_text(name, value)


def _schema_text(name: str, schema: dict[str, object]) -> str:
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    _check_size(name, text)
    return text


def _choices(name: str, value: list[str]) -> tuple[str, ...]:
    if not value:
        raise bad_request(name, f"`{name}` must be a non-empty array of strings.")
    if len(value) > MAX_CHOICES:
        raise bad_request(name, f"`{name}` may hold at most {MAX_CHOICES} strings, got {len(value)}.")
    _check_size(name, "".join(value))
    return tuple(value)


def _check_size(name: str, text: str) -> None:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise bad_request(name, f"`{name}` must be at most {MAX_SPEC_BYTES} bytes.")
