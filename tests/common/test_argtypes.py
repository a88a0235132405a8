"""common/argtypes.py: bounded numbers for the parsers, refused with a line naming what was expected."""

from __future__ import annotations

import argparse

import pytest

from common.argtypes import at_least


def test_at_least_reads_numbers_and_refuses_what_is_below_or_not_a_number() -> None:
    seconds = at_least(0, what="a number of seconds", note=" (0: off)")
    assert seconds("2.5") == 2.5 and seconds("0") == 0
    count = at_least(1, integer=True)
    assert count("3") == 3 and isinstance(count("3"), int)
    for reader, value, message in ((seconds, "-1", "must be >= 0 (0: off), got '-1'"),
                                   (seconds, "nan", "must be >= 0 (0: off), got 'nan'"),
                                   (seconds, "soon", "not a number of seconds: 'soon'"),
                                   (count, "0", "must be >= 1, got '0'"),
                                   (count, "1.5", "not an integer: '1.5'")):
        with pytest.raises(argparse.ArgumentTypeError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            reader(value)
