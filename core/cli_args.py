"""argparse types for numeric arguments: a value out of range is argparse's own error (exit 2,
naming the option) before any work starts, the same way in every subcommand."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def bounded(
    kind: type, low: float | None = None, high: float | None = None, above: float | None = None
) -> Callable[[str], int | float]:
    """A converter to `kind` that accepts low <= value <= high, or value > above (any bound may be None)."""
    noun = "an integer" if kind is int else "a number"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if (
            not math.isfinite(value)
            or (low is not None and value < low)
            or (high is not None and value > high)
            or (above is not None and value <= above)
        ):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {noun} {_range(low, high, above)}")
        return value

    return convert


def _range(low, high, above) -> str:
    if above is not None:
        return f"> {above:g}" + (f" and <= {high:g}" if high is not None else "")
    if low is not None and high is not None:
        return f"from {low:g} to {high:g}"
    return f">= {low:g}" if low is not None else f"<= {high:g}"


positive_int = bounded(int, low=1)
non_negative_int = bounded(int, low=0)
positive_float = bounded(float, above=0)
