"""Value types for the commands' argparse parsers: one message per kind of bad value.

Torch-free and importing only the config layer's byte-size syntax, so every command (the
registry's and the router's included) can use them. Each raises ``argparse.ArgumentTypeError``,
which argparse turns into ``<prog>: error: argument --flag: <message>`` and exit status 2.
"""

from __future__ import annotations

import argparse
import math

from loraplex.config.values import parse_byte_size


def byte_size(text: str) -> int:
    """A size of at least one byte: '4096', '512MiB', '2GiB', '1G'."""
    try:
        n = parse_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1 byte, got {text!r}")
    return n


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1: '8,16,64'."""
    return [positive_int(t.strip()) for t in text.split(",") if t.strip()]


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (seconds, rates)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def fraction(text: str) -> float:
    """A number in [0, 1] (a traffic share)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return v
