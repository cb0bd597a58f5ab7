"""Quantities as the command lines take them: sizes, counts, link rates, durations, lists.

One meaning per unit in ``python -m gradcomp`` and the bench scripts alike:

* a size (bytes or elements) takes binary prefixes: ``64K``, ``64KiB``, ``1.5M``, ``4096``;
* a count of parameters takes decimal ones: ``350M`` is 350,000,000 (``B`` or ``G``: billions);
* a rate is a link's, in bits per second each way, as ``tc`` and NIC specifications
  write it: ``100mbit``, ``10gbit``, ``7.2tbit``;
* a duration: ``20us``, ``5ms``, ``1s``.

Each parser raises ``ValueError`` naming the form it expects; :func:`argument` makes
one an ``argparse`` type, as :func:`at_least` and :func:`positive_number` are;
:func:`format_rate` writes a rate for people. Compressor specs (``int8``, ``topk@0.01``,
``int4:block=128``) are :func:`gradcomp.planner.from_spec`'s; :func:`split_list`
splits a list of them.

Example:
    >>> parse_size("64KiB"), parse_count("350M"), parse_rate("10gbit"), parse_duration("5ms")
    (65536, 350000000, 10000000000.0, 0.005)
    >>> split_list(["int8,topk:ratio=0.1,exact=true"])
    ['int8', 'topk:ratio=0.1,exact=true']
    >>> format_rate(5e8), format_rate(2.25e9)
    ('500 Mbit/s', '2.2 Gbit/s')
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence

BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
DECIMAL = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}
BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _number_and_unit(text: str, units: dict, what: str, example: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in units:
        raise ValueError(
            f"{what}: expected a number with one of {sorted(units)} (e.g. {example}), got {text!r}"
        )
    return float(match.group(1)) * units[match.group(2)]


def parse_size(text: str) -> int:
    """Bytes or elements from ``"64KiB"``, ``"64K"``, ``"1M"`` or ``"4096"`` (binary prefixes)."""
    match = re.fullmatch(r"\s*([0-9.]+\s*[kmgt]?)(?:i?b)?\s*", str(text).lower())
    return int(_number_and_unit(match.group(1) if match else text, BINARY, "size", "64KiB or 1M"))


def parse_count(text: str) -> int:
    """A count from ``"350M"`` or ``"1.3B"`` (decimal prefixes: 350M is 350,000,000)."""
    return int(_number_and_unit(text, DECIMAL, "count", "350M"))


def parse_rate(text: str) -> float:
    """A link's bits per second, each way, from a ``tc`` rate: ``"10gbit"``, ``"100mbit"``."""
    return _number_and_unit(text, BITS, "rate", "10gbit or 100mbit")


def parse_duration(text: str) -> float:
    """Seconds from ``"20us"``, ``"5ms"`` or ``"1s"``."""
    return _number_and_unit(text, SECONDS, "duration", "20us")


def format_size(count: float) -> str:
    """``65536`` -> ``"64K"``, ``1.5 * 2**20`` -> ``"1.5M"`` (binary prefixes; what
    :func:`parse_size` reads back)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(count) < 1024 or unit == "T":
            text = f"{count:.1f}" if unit and count != int(count) else f"{count:.0f}"
            return f"{text.removesuffix('.0')}{unit}"
        count /= 1024
    raise AssertionError("unreachable")


def format_rate(bits_per_second: float) -> str:
    """A link's rate for people, two significant digits or more: ``5e8`` -> ``"500 Mbit/s"``,
    ``2.25e9`` -> ``"2.2 Gbit/s"``, ``1e10`` -> ``"10 Gbit/s"``."""
    if not 0 < bits_per_second < math.inf:
        return f"{bits_per_second:g} bit/s"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale or unit == "kbit/s":
            value = bits_per_second / scale
            return f"{value:.2g} {unit}" if value < 10 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def split_list(values: Sequence[str] | str) -> list[str]:
    """Items of a list option given space- or comma-separated (``int8 fp16`` or ``int8,fp16``).

    A comma followed by ``key=`` continues a compressor spec's options
    (``topk:ratio=0.1,exact=true`` is one item).
    """
    items = []
    for value in [values] if isinstance(values, str) else values:
        items += [piece.strip() for piece in re.split(r",(?![^,:=]*=)", value) if piece.strip()]
    return items


def argument(parse: Callable[[str], object], positive: bool = True) -> Callable[[str], object]:
    """``parse`` as an ``argparse`` type: its ``ValueError`` becomes the option's error
    message; with ``positive``, zero is refused too."""

    def parsed(text: str):
        try:
            value = parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if positive and not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value

    parsed.__name__ = parse.__name__.removeprefix("parse_")
    return parsed


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer of at least ``minimum``."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return integer


def positive_number(text: str) -> float:
    """An ``argparse`` type: a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value
