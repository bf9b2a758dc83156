"""argparse value types shared by the subcommands: each rejects a bad value with a message
naming it and what was expected (argparse adds the option name)."""

from __future__ import annotations

import argparse
import math
from typing import Any


def _number(text: str, kind: type, lo: float | None, lo_open: bool, hi: float | None,
            what: str) -> Any:
    try:
        v = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, 1, False, None, "an integer >= 1")


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, 0, False, None, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _number(text, float, 0, True, None, "a number > 0")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, float, 0, False, None, "a number >= 0")


def probability(text: str) -> float:
    """A number in (0, 1]."""
    return _number(text, float, 0, True, 1, "a number in (0, 1]")


def _list(text: str, one, what: str) -> tuple:
    """Comma-separated items: at least one, each valid, none twice (a repeated seed,
    run or budget is a typo, never a request to do the same work again)."""
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"{text!r} is empty; expected {what}")
    try:
        values = tuple(one(t) for t in items if t)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} lists {', '.join(repeated)} more than once; "
                                         f"expected {what}, each once")
    return values


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 0 (``0,1,2``)."""
    return _list(text, nonnegative_int, "comma-separated integers >= 0 (e.g. 0,1,2)")


def positive_float_list(text: str) -> tuple[float, ...]:
    """Comma-separated numbers > 0 (``4.5,5,6``)."""
    return _list(text, positive_float, "comma-separated numbers > 0 (e.g. 4.5,5,6)")


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names (``bf16,nvfp4``); which names exist is the command's check."""
    return _list(text, str, "comma-separated names")


def refuse_unused(*cases: tuple[bool, str, str]) -> None:
    """Each case is ``(given, option, why)``: an option the user gave in a combination
    that ignores it. Raise a ``ValueError`` naming the first one and why; a command never
    drops an option silently."""
    for given, option, why in cases:
        if given:
            raise ValueError(f"{option} has no effect {why}; drop it")
