"""Gateway CPU per request body: the typed parser (pydantic v2 models) against the hand parser it replaced.

Each parser takes the raw body bytes to the gateway's GenerationRequest (or the 400 it raises), as a route
does: JSON parse, the UTF-8 check of every string, validation, the cross-field checks and the conversion.
The hand parser is the one at ``--legacy-rev`` (gateway/{fields,schemas,guided,tools}.py read from git and
loaded beside the current ones), so both run in one process, interleaved, on the same bodies.

Bodies: a chat request with a few messages, two tools and a response_format; a completions request with a
long prompt (64 KiB of text); and the error path (the chat body with a bad role in its last message).

    python -m benchmarks.gateway_parse [--repeats 7] [--number 2000] [--legacy-rev e7f075e]

msgspec, the other candidate, is reported as absent when it is not installed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import timeit
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway import schemas
from gateway.errors import ApiError
from gateway.fields import parse_json_object

ROOT = Path(__file__).resolve().parents[1]
LEGACY_MODULES = ("fields", "tools", "guided", "schemas")  # in import order
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
          "required": ["city"]}
CHAT: dict[str, Any] = {
    "model": "sluice", "temperature": 0.7, "top_p": 0.9, "max_tokens": 256, "stream": True,
    "stream_options": {"include_usage": True}, "seed": 7, "stop": ["\n\n", "END"],
    "messages": [
        {"role": "system", "content": "You are a weather assistant. Answer briefly."},
        {"role": "user", "content": "What is the weather in Paris for the next three days?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "forecast",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24C; cloudy, 19C; rain, 15C."},
        {"role": "user", "content": [{"type": "text", "text": "And in Lyon?"}]},
    ],
    "tools": [{"type": "function", "function": {"name": "forecast", "description": "Daily forecast",
                                                "parameters": SCHEMA}},
              {"type": "function", "function": {"name": "now", "description": "Current time",
                                                "parameters": {"type": "object", "properties": {}}}}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
}
COMPLETION = {"model": "sluice", "prompt": "The quick brown fox jumps over the lazy dog. " * 1456,
              "max_tokens": 128, "temperature": 0.0, "logprobs": 2, "stop": "\n"}
ERROR = {**CHAT, "messages": [*CHAT["messages"][:4], {"role": "wizard", "content": "x"}]}
BODIES = {"chat": (True, json.dumps(CHAT).encode()), "completion (64 KiB prompt)": (False,
                                                                                     json.dumps(COMPLETION).encode()),
          "error (bad role)": (True, json.dumps(ERROR).encode())}
MAX_N = 16


def load_legacy(rev: str) -> types.ModuleType:
    """The hand parser at ``rev``, as a package ``legacy_gateway`` whose modules import each other there."""
    package = types.ModuleType("legacy_gateway")
    package.__path__ = []
    sys.modules["legacy_gateway"] = package
    for name in LEGACY_MODULES:
        source = subprocess.run(["git", "show", f"{rev}:gateway/{name}.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        for other in LEGACY_MODULES:
            source = source.replace(f"from gateway.{other} import", f"from legacy_gateway.{other} import")
        spec = importlib.util.spec_from_loader(f"legacy_gateway.{name}", loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        exec(compile(source, f"{rev}:gateway/{name}.py", "exec"), module.__dict__)  # noqa: S102 - our own source
        setattr(package, name, module)
    return package


Parse = Callable[[bool, bytes], object]


def parser(parse_json: Callable[[bytes], dict[str, object]], module: types.ModuleType) -> Parse:
    def parse(is_chat: bool, raw: bytes) -> object:
        try:
            body = parse_json(raw)
            return module.parse_chat(body, MAX_N) if is_chat else module.parse_completion(body, MAX_N)
        except ApiError as err:
            return err.param
    return parse


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000, help="parses per timing")
    ap.add_argument("--legacy-rev", default="e7f075e", help="the git revision of the hand parser")
    ns = ap.parse_args(argv)
    legacy = load_legacy(ns.legacy_rev)
    parsers = {"hand (json + fields.py)": parser(legacy.fields.parse_json_object, legacy.schemas),
               "pydantic v2 models": parser(parse_json_object, schemas)}
    if importlib.util.find_spec("msgspec") is None:
        print("msgspec: not installed, not measured")
    for label, (is_chat, raw) in BODIES.items():
        results = [p(is_chat, raw) for p in parsers.values()]
        if "error" in label:
            assert results[0] == results[1] == "messages[4].role", results
        else:
            assert vars(results[0]) == vars(results[1]), f"{label}: the parsers disagree"  # classes of two modules
        times: dict[str, list[float]] = {name: [] for name in parsers}
        for _ in range(ns.repeats):  # interleaved, so drift on a shared machine hits both
            for name, p in parsers.items():
                seconds = timeit.timeit(functools.partial(p, is_chat, raw), number=ns.number)
                times[name].append(seconds / ns.number * 1e6)
        print(f"{label} ({len(raw)} bytes)")
        base = statistics.median(times[next(iter(parsers))])
        for name, values in times.items():
            med = statistics.median(values)
            print(f"  {name:26s} {med:8.1f} us/request  (min {min(values):.1f}, max {max(values):.1f})  "
                  f"x{med / base:.2f}")


if __name__ == "__main__":
    main()
