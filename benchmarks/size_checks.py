"""What the input bounds cost per request (issue 26): the gateway's UTF-8 walk over every string of a body
(``gateway.fields.parse_json_object``, against plain ``json.loads``) and the tokenizer service's length checks
(``services.tokenizer.limits``), on a chat body and on a long completion prompt. Medians of repeated runs, in µs.

    python -m benchmarks.size_checks
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from gateway.fields import parse_json_object
from proto.sluice.v1 import generation_pb2
from services.tokenizer.limits import check_chat, check_text

CHAT: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": [
    {"role": "system", "content": "You are a helpful assistant. " * 8},
    {"role": "user", "content": "Plan a three-day trip to Kyoto with temples, food and a day trip. " * 4},
    {"role": "assistant", "content": "Day 1: Fushimi Inari at dawn, then Gion. " * 6},
    {"role": "user", "content": "Make day two less walking, and add a tea ceremony — 茶道. " * 3}],
    "tools": [{"type": "function", "function": {"name": f"tool_{i}", "description": "Looks things up. " * 4,
                                                "parameters": {"type": "object", "properties": {
                                                    "q": {"type": "string"}}}}} for i in range(3)]}
COMPLETION: dict[str, Any] = {"model": "m", "max_tokens": 64,
                              "prompt": "The quick brown fox jumps over the lazy dog. " * 1500}


def median_us(fn: Callable[[], object], repeat: int, number: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t) / number * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--number", type=int, default=2000)
    args = p.parse_args(argv)
    max_chars = 8192 * 81
    chat_pb = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role=m["role"], content=m["content"])
                                            for m in CHAT["messages"]])
    print("| body | json.loads (µs) | + UTF-8 walk (µs) | walk cost (µs) | tokenizer length checks (µs) |")
    print("|---|---:|---:|---:|---:|")
    cases: list[tuple[str, dict[str, Any], Callable[[], object]]] = [
        ("chat, 4 messages + 3 tools", CHAT, lambda: check_chat(chat_pb, max_chars)),
        ("completion, 66 KB prompt", COMPLETION, lambda: check_text("prompt", COMPLETION["prompt"], max_chars))]
    for name, body, check in cases:
        raw = json.dumps(body).encode()
        plain = median_us(lambda: json.loads(raw), args.repeat, args.number)  # noqa: B023 — called at once
        walked = median_us(lambda: parse_json_object(raw), args.repeat, args.number)  # noqa: B023
        checks = median_us(check, args.repeat, args.number)
        print(f"| {name} | {plain:.1f} | {walked:.1f} | {walked - plain:.1f} | {checks:.2f} |")


if __name__ == "__main__":
    main()
