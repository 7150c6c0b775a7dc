"""Comparison words computed from the numbers printed beside them (issue 37): a reason that says "above",
"under" or "<" says it of the two values as printed, so the words and the numbers cannot disagree.

Two values that differ but print alike are printed with more digits until their printed forms differ (up to
EXTRA_DIGITS more); two that still print alike are "at" / "=" each other, whatever the exact values. The
relation is always read back from the printed text, never from the exact values the caller decided on.
"""

from __future__ import annotations

import re

EXTRA_DIGITS = 6  # more digits than the format asks, at most, to tell two close values apart
_SPEC = re.compile(r"^([+ ]?)(\.(\d+))?([fg])$")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf")


def number(text: str) -> float:
    """The first number in ``text`` ("+3.5 points" -> 3.5, "inf" -> inf): how a reader reads a printed value."""
    m = _NUMBER.search(text)
    if m is None:
        raise ValueError(f"no number in {text!r}")
    return float(m.group())


def _widened(spec: str, extra: int) -> str:
    m = _SPEC.match(spec)
    if m is None or not extra:
        return spec
    sign, _, digits, kind = m.groups()
    default = 6 if digits is None else int(digits)
    return f"{sign}.{default + extra}{kind}"


def printed(a: float, b: float, spec: str) -> tuple[str, str]:
    """``a`` and ``b`` formatted with ``spec`` ("{:spec}"), with more digits where two different values would
    print alike (the comparison words read the printed values)."""
    for extra in range(EXTRA_DIGITS + 1):
        s = _widened(spec, extra)
        ta, tb = format(a, s), format(b, s)
        if a == b or number(ta) != number(tb):
            return ta, tb
    return ta, tb


def relation(a_text: str, b_text: str) -> int:
    """-1, 0 or 1: how the printed ``a_text`` compares with the printed ``b_text``."""
    a, b = number(a_text), number(b_text)
    return (a > b) - (a < b)


OPERATORS = {-1: "<", 0: "=", 1: ">"}
SIDES = {-1: "under", 0: "at", 1: "above"}


def op(a: float, b: float, spec: str) -> str:
    """"a < b", "a = b" or "a > b", printed with ``spec``."""
    ta, tb = printed(a, b, spec)
    return f"{ta} {OPERATORS[relation(ta, tb)]} {tb}"


def side(a: float, b: float, spec: str) -> tuple[str, str, str]:
    """(a as printed, "above" | "at" | "under", b as printed)."""
    ta, tb = printed(a, b, spec)
    return ta, SIDES[relation(ta, tb)], tb


def against(label: str, value: float, interval: tuple[float | None, float | None], what: str, bar: float,
            spec: str = ".3f", note: str = "") -> str:
    """"<label> <value> is above|at|under <what> <bar>[ (<note>)]", and where the value's interval reaches the
    other side of the bar, "but its interval [low, high] reaches below|above it, so not yet clear"."""
    tv, word, tb = side(value, bar, spec)
    out = f"{label} {tv} is {word} {what} {tb}" + (f" ({note})" if note else "")
    low, high = interval
    if low is None or high is None:
        return out
    tl, th = printed(low, bar, spec)[0], printed(high, bar, spec)[0]
    below, above = relation(tl, tb) < 0, relation(th, tb) > 0
    if word != "under" and below:
        return out + f" but its interval [{tl}, {th}] reaches below it, so not yet clear"
    if word != "above" and above:
        return out + f" but its interval [{tl}, {th}] reaches above it, so not yet clear"
    return out
