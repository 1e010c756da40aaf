"""Bounded numbers from untrusted places: control requests, manifests, command lines.

Every number a user or a peer hands the daemons passes through here before it sizes an
allocation or a timer: it must be the right kind (an ``int`` is not a ``float`` with a
fraction, a ``bool`` is neither), finite, and inside the range its field allows. A value
that is not raises :class:`~kvtransport.errors.UserError` with a one-line message naming
the field, so a daemon answers ``ok: false`` and a command exits with status 2.

The argparse types :func:`float_arg` and :func:`int_arg` apply the same checks on the
command line (argparse turns their ``ArgumentTypeError`` into a one-line usage error).

Kept free of numpy: the command modules import it to build their parsers.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from kvtransport.errors import UserError


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that exits with a one-line error (status 2) and a hint to --help."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


MAX_DEADLINE_S = 3600.0
"""The longest deadline a transfer may have (a submit, the manifest a receiver trusts):
an hour is far beyond any time-to-first-token budget, and keeps every timer finite."""

MIN_DEADLINE_S = 1e-4
"""The shortest (a tenth of a millisecond: below it nothing can be sent)."""

MAX_INITIAL_RTT_S = 10.0
"""The longest round-trip time a sender may be told to assume before feedback."""

MAX_RHO = 1e4
"""The largest deadline / loss-free send time ratio a request may give."""

MAX_WEIGHT = 1e6
"""The largest scheduling weight of a transfer."""


def _range_text(lo: float, hi: float) -> str:
    return f"{lo:g}..{hi:g}"


def number(value: object, what: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a float in [lo, hi] (``lo_open``: (lo, hi]); UserError otherwise.

    Accepts ints and floats (not bools, not strings): JSON gives numbers as such."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{what} must be a number, not {_show(value)}")
    try:
        x = float(value)
    except OverflowError:  # an int beyond a double's range
        raise UserError(f"{what} must be in {_range_text(lo, hi)}") from None
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
        side = "(" if lo_open else "["
        raise UserError(f"{what} must be in {side}{lo:g}, {hi:g}], not {_show(value)}")
    return x


def whole(value: object, what: str, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi]: a JSON integer (a float with no fraction is not
    accepted either: ids and counts are written as integers); UserError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{what} must be an integer, not {_show(value)}")
    if not lo <= value <= hi:
        raise UserError(f"{what} must be in {lo}..{hi}, not {_show(value)}")
    return value


def text(value: object, what: str, max_len: int) -> str:
    """``value`` as a string of at most ``max_len`` characters; UserError otherwise."""
    if not isinstance(value, str):
        raise UserError(f"{what} must be a string, not {_show(value)}")
    if len(value) > max_len:
        raise UserError(f"{what} is longer than {max_len} characters")
    return value


def _show(value: object) -> str:
    """A short, one-line rendering of an offending value for an error message."""
    s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."


def _arg_type(parse: Callable[[str], Any], check: Callable[[Any], Any], name: str) -> Callable:
    def convert(s: str) -> Any:
        try:
            v = parse(s)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"invalid {name} value: {s!r}") from None
        try:
            return check(v)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in its messages
    return convert


def float_arg(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite float in [lo, hi] (``lo_open``: (lo, hi])."""
    return _arg_type(float, lambda v: number(v, "the value", lo, hi, lo_open=lo_open), "float")


def int_arg(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi]."""
    return _arg_type(int, lambda v: whole(v, "the value", lo, hi), "int")
