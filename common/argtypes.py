"""argparse ``type=`` readers shared by the entry points' parsers: a bad value is a one-line argparse error
naming what was expected, never a traceback."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: float, *, integer: bool = False, what: str | None = None, note: str = ""
             ) -> Callable[[str], float]:
    """A reader of numbers >= ``minimum`` (NaN refused): ints with ``integer``. ``what``: how the error names
    the expected value ("a number", "an integer" by default); ``note``: appended to the bound, e.g. " (0: off)"."""
    kind: Callable[[str], float] = int if integer else float
    expected = what or ("an integer" if integer else "a number")

    def read(value: str) -> float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {expected}: {value!r}") from None
        if not number >= minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}{note}, got {value!r}")
        return number

    return read
