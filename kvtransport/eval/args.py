"""Command-line values the evaluation scripts share."""

from __future__ import annotations


def parse_seeds(text: str) -> list[int]:
    """Seeds from "1-8" (a range, both ends) or "1,3,5"."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def parse_ints(text: str) -> list[int]:
    """Integers from "2,4,8" (empty items skipped)."""
    return [int(v) for v in text.split(",") if v.strip()]


def parse_floats(text: str) -> list[float]:
    """Numbers from "100,1000" (empty items skipped)."""
    return [float(v) for v in text.split(",") if v.strip()]
