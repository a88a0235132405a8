"""What Sluice does with one key of a MindIE config.json, and the checks of its value.

Every key ends in exactly one of three treatments: an effect (Sluice settings, or a behaviour the message
names), accepted without effect (the message says why: Sluice already behaves so, or the key only matters
with another that is off), or refused (start-up stops; the message says why and what to set instead).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Treatment(enum.Enum):
    EFFECT = "effect"
    NO_EFFECT = "no effect"
    REFUSED = "refused"


@dataclass(frozen=True)
class Outcome:
    treatment: Treatment
    message: str
    # serve's settings (its argparse dests) the key sets; only an effect sets any
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KeyResult:
    key: str        # the documented section and the key: "ServerConfig.maxLinkNum", "ModelConfig.worldSize"
    outcome: Outcome

    @property
    def treatment(self) -> Treatment:
        return self.outcome.treatment

    @property
    def line(self) -> str:
        """The start-up log line of an accepted key (effects and keys without one alike)."""
        if self.treatment is Treatment.NO_EFFECT:
            return f"MindIE {self.key}: no effect ({self.outcome.message})"
        return f"MindIE {self.key}: {self.outcome.message}"


class KeyRefused(ValueError):
    """Raised by a key's handler: the key is refused for the reason in the message."""


def effect(message: str, **settings: Any) -> Outcome:
    return Outcome(Treatment.EFFECT, message, settings)


def no_effect(message: str) -> Outcome:
    return Outcome(Treatment.NO_EFFECT, message)


def refused(message: str) -> Outcome:
    return Outcome(Treatment.REFUSED, message)


# -- value checks: each raises KeyRefused saying what the value must be -----------------------------------------
def integer(value: Any, lo: int | None = None, hi: int | None = None) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (lo is None or value >= lo) and (hi is None or value <= hi):
        return int(value)
    bound = f" in [{lo}, {hi}]" if lo is not None and hi is not None else f" >= {lo}" if lo is not None else ""
    raise KeyRefused(f"must be an integer{bound}, got {value!r}")


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise KeyRefused(f"must be true or false, got {value!r}")


def string(value: Any, *, empty: bool = True) -> str:
    if isinstance(value, str) and (empty or value):
        return value
    raise KeyRefused(f"must be a{'' if empty else ' non-empty'} string, got {value!r}")


def strings(value: Any) -> list[str]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise KeyRefused(f"must be a list of strings, got {value!r}")


def valid(check: Any, value: Any, *args: Any) -> Any:
    """``check(value, *args)``, or None where the value does not pass (another key's handler refuses it)."""
    try:
        return check(value, *args)
    except KeyRefused:
        return None
