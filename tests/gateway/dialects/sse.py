"""Reading a dialect's server-sent events in the tests."""

from __future__ import annotations

import json
from typing import Any

KEEPALIVE = ": keep-alive"


def events(body: str) -> list[Any]:
    """The JSON of each ``data:`` event (keep-alive comments dropped), checking the framing; no ``[DONE]``."""
    assert body.endswith("\n\n"), body
    out = []
    for frame in body.split("\n\n")[:-1]:
        if frame == KEEPALIVE:
            continue
        assert frame.startswith("data: "), frame
        out.append(json.loads(frame[len("data: "):]))
    return out
