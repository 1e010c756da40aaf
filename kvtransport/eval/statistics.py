"""Statistics of the evaluations: 95 % t-intervals, paired differences, table cells and
the benchmarks' best of N."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtransport.extras import require


def mean_ci(x: Any) -> tuple[float, float]:
    """Mean and half-width of the 95 % t-interval of ``x`` (NaN half-width below two
    samples, NaN mean for none). Needs scipy (the ``eval`` extra)."""
    stats = require("scipy.stats")
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        return float(x.mean()) if x.size else float("nan"), float("nan")
    return float(x.mean()), float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Mean and 95 % half-width of a - b over the episodes both played (same seeds), their
    number and how many were equal."""
    n = min(len(a), len(b))
    d = np.array(a[:n]) - np.array(b[:n])
    m, c = mean_ci(d)
    return {"mean": m, "ci95": c, "n": n, "equal": int((d == 0).sum())}


def significant(d: dict[str, Any]) -> int:
    """+1 / -1 where a :func:`paired` interval lies above / below zero, else 0."""
    if not d["ci95"] == d["ci95"]:  # nan: fewer than two episodes
        return 0
    return 1 if d["mean"] - d["ci95"] > 0 else (-1 if d["mean"] + d["ci95"] < 0 else 0)


def summary(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """{"mean", "ci95" (half-width), "n"} of a sample."""
    m, h = mean_ci(np.asarray(values, dtype=np.float64))
    return {"mean": m, "ci95": h, "n": int(len(values))}


def fmt_ci(mean: float, half: float, digits: int = 3) -> str:
    """'0.961 ± 0.006' ('0.961' when the interval is undefined, n < 2)."""
    if half != half:  # NaN: one sample
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def ci_cell(stat: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    """A table cell from a :func:`summary` ('mean ± half-width')."""
    return fmt_ci(scale * stat["mean"], scale * stat["ci95"], digits)


def best_seconds(
    fn: Callable[[], object], rounds: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The shortest of ``rounds`` timed calls of ``fn`` (after one untimed call that
    compiles and warms it), in seconds of ``clock`` (the benchmarks' "best of N")."""
    fn()
    best = math.inf
    for _ in range(rounds):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best
