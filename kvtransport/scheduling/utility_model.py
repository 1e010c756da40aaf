"""Answer quality as a sigmoid of the fraction of the KV cache that arrives.

The sender streams a cache in utility order, so the first bytes carry the most value.
Measured answer accuracy against the delivered fraction x in [0, 1] follows an S-curve

    U(x) = d + a / (1 + exp(-b (x - c)))          (a > 0, b > 0; floor d, often 0)

convex below the midpoint c and concave above it: U''(x) = a b^2 s (1 - s)(1 - 2 s) with
s = sigmoid(b (x - c)) is negative exactly when x > c. A floor d shifts U without changing
its shape, so the concave region starts at c for both variants (clipped to [0, 1]).

This module holds what runs: the curve (``SigmoidUtility``), the measured points and fit
records it is made from, and the small JSON file of fitted curves per (model, context
length) that the sender daemon reads (``UtilityTable``; written by ``kvtransport
fit-utility``, shipped for the default model as kvtransport/data/<model>-utility.json,
``UtilityTable.packaged``). Fitting and measuring with the real model are offline work:
kvtransport.model.utility_fit. How well the shipped curves fit is in docs/results.md.

The multi-user allocator (kvtransport.scheduling.allocator) needs two closed forms from the curve:
the inverse of U' on its concave branch (water-filling) and the tangent from a point
below the midpoint to the curve (the concave envelope, i.e. the best utility per byte a
user can get before it is useful). Both live here as the reference implementation; the
allocator's numba kernels repeat them and are tested against these.

Only numpy is imported (the daemon's data plane reads this file).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.atomic import atomic_write
from kvtransport.errors import UserError

TABLE_FORMAT = "kvtransport.utility/1"
DEFAULT_TABLE_PATH = "utility_curves.json"


def logistic(z: np.ndarray | float) -> np.ndarray:
    """Overflow-free logistic function 1 / (1 + exp(-z)), elementwise."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@dataclass(frozen=True)
class SigmoidUtility:
    """U(x) = d + a / (1 + exp(-b (x - c))) of the delivered fraction x.

    a: amplitude (> 0); b: steepness (> 0); c: midpoint, where the curve turns from convex
    to concave; d: floor (accuracy with nothing delivered, up to the tail of the sigmoid).
    """

    a: float
    b: float
    c: float
    d: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"sigmoid parameter {name}={v!r} must be a finite number")
        if self.a <= 0 or self.b <= 0:
            raise ValueError(f"sigmoid needs a > 0 and b > 0 (got a={self.a}, b={self.b})")

    def value(self, x: np.ndarray | float) -> np.ndarray:
        """U(x)."""
        return self.d + self.a * logistic(self.b * (np.asarray(x, dtype=np.float64) - self.c))

    __call__ = value

    def derivative(self, x: np.ndarray | float) -> np.ndarray:
        """U'(x) = a b s (1 - s), largest (a b / 4) at x = c.

        Written as a b e / (1 + e)^2 with e = exp(-|b (x - c)|): s (1 - s) would lose
        the tail's relative precision to the cancellation in 1 - s.
        """
        e = np.exp(-np.abs(self.b * (np.asarray(x, dtype=np.float64) - self.c)))
        return self.a * self.b * e / (1.0 + e) ** 2

    def second_derivative(self, x: np.ndarray | float) -> np.ndarray:
        """U''(x) = a b^2 s (1 - s)(1 - 2 s): negative exactly where x > c."""
        s = logistic(self.b * (np.asarray(x, dtype=np.float64) - self.c))
        return self.a * self.b**2 * s * (1.0 - s) * (1.0 - 2.0 * s)

    @property
    def concave_start(self) -> float:
        """Smallest fraction in [0, 1] from which U is concave (c clipped to [0, 1])."""
        return float(min(max(self.c, 0.0), 1.0))

    @property
    def max_slope(self) -> float:
        """max_x U'(x) = a b / 4, reached at x = c."""
        return self.a * self.b / 4.0

    def inverse_derivative(self, slope: np.ndarray | float) -> np.ndarray:
        """The x >= c with U'(x) = slope (the concave branch), for 0 < slope <= a b / 4.

        With g = slope / (a b) = s (1 - s) the branch s >= 1/2 is s = (1 + q) / 2 with
        q = sqrt(1 - 4 g), and 1 - s = 2 g / (1 + q) (written so that it does not cancel
        when g is tiny); x = c + logit(s) / b = c + (2 ln(1 + q) - ln(4 g)) / b.
        Slopes <= 0 map to +inf, slopes above the maximum to c.
        """
        m = np.asarray(slope, dtype=np.float64)
        g = m / (self.a * self.b)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.sqrt(np.clip(1.0 - 4.0 * g, 0.0, 1.0))
            x = self.c + (2.0 * np.log1p(q) - np.log(4.0 * g)) / self.b
        x = np.where(g >= 0.25, self.c, x)
        return np.where(g <= 0.0, np.inf, x)

    def tangent_from(self, x0: float) -> tuple[float, float]:
        """The concave envelope's kink for a user now at fraction x0: (x_t, slope).

        Over [x0, 1] the least concave majorant of U is the straight line from (x0, U(x0))
        to the tangent point x_t, then U itself. The slope (U(x_t) - U(x0)) / (x_t - x0) is
        the best average utility per unit of fraction the user can get from where it is:
        the number admission ranks users by. x_t solves h(x) = U'(x)(x - x0) - U(x) + U(x0)
        = 0 on [max(c, x0), 1]; h is decreasing there (h' = U''(x)(x - x0) < 0) and
        h(c) >= 0 by the mean value theorem, so bisection finds the unique root; if h(1) > 0
        the tangent lies beyond the cache and the chord to x = 1 is the envelope.
        From x0 >= c the curve is already concave: x_t = x0, slope U'(x0).
        """
        x0 = float(x0)
        if x0 >= 1.0:
            return 1.0, float(self.derivative(1.0))
        if x0 >= self.c:
            return x0, float(self.derivative(x0))
        u0 = float(self.value(x0))

        def h(x: float) -> float:
            return float(self.derivative(x)) * (x - x0) - float(self.value(x)) + u0

        lo, hi = max(self.c, x0), 1.0
        if h(hi) >= 0.0:
            return 1.0, (float(self.value(1.0)) - u0) / (1.0 - x0)
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi:
                break
            if h(mid) > 0.0:
                lo = mid
            else:
                hi = mid
        xt = 0.5 * (lo + hi)
        return xt, (float(self.value(xt)) - u0) / (xt - x0)

    def to_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d}


# ----------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class UtilityFit:
    """A fitted curve and how well it fits.

    r2: 1 - SSE / SST over the points; rmse: root mean squared residual (accuracy units);
    floor: whether the floored (4-parameter) variant was chosen; aicc / aicc_alternative:
    corrected Akaike criteria of the chosen and the other variant (None when not fitted).
    """

    utility: SigmoidUtility
    r2: float
    rmse: float
    n_points: int
    floor: bool
    aicc: float
    aicc_alternative: float | None

    @property
    def concave_start(self) -> float:
        return self.utility.concave_start


# ----------------------------------------------------------------------- measured data


@dataclass
class MeasuredCurve:
    """Accuracy measured at several delivered fractions for one (model, context length).

    This is what `kvtransport fit-utility` fits, read from a points file or measured with
    the real model (kvtransport.model.utility_fit.measure_curves). metric: which quality
    measure (MEASURES; "" when a points file does not say); samples: prompts averaged per
    point (0: unknown);
    spread: the standard error of each point's mean over the prompts (empty: unknown).
    """

    model: str
    context_tokens: int
    fractions: np.ndarray
    accuracies: np.ndarray
    source: str = ""
    metric: str = ""
    samples: int = 0
    spread: np.ndarray = field(default_factory=lambda: np.zeros(0))


# ------------------------------------------------------------ real-model measurement

MEASURES = ("accuracy", "f1", "top1")
"""Quality measures of an answer given the first x of the cache (kvtransport.model.metrics):
accuracy: RULER's string match, the fraction of the gold answers found in the generated
answer (``contains_all``; plain containment for single-answer tasks); f1: SQuAD token
F1 against the best gold answer; top1: teacher-forced top-1 agreement with the full
cache's own greedy answer (1 at x = 1 by construction)."""
# --------------------------------------------------------------------- the curve table


@dataclass(frozen=True)
class UtilityCurve:
    """One row of the table: a fitted curve for (model, context_tokens) and its quality.

    Provenance (optional, for people and re-fits; the daemon needs only the curve):
    metric: the quality measure fitted (MEASURES); samples: prompts per point; points:
    the measured (fraction, accuracy) pairs the curve was fitted to; command: the
    command line that produced the row.
    """

    model: str
    context_tokens: int
    utility: SigmoidUtility
    r2: float
    n_points: int
    floor: bool
    rmse: float = float("nan")
    source: str = ""
    metric: str = ""
    samples: int = 0
    points: tuple[tuple[float, float], ...] = ()
    command: str = ""

    @property
    def concave_start(self) -> float:
        return self.utility.concave_start

    @property
    def ceiling(self) -> float:
        """U(1): the quality with the whole cache delivered."""
        return float(self.utility(1.0))

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "model": self.model,
            "context_tokens": self.context_tokens,
            **self.utility.to_dict(),
            "r2": self.r2,
            "rmse": self.rmse,
            "n_points": self.n_points,
            "floor": self.floor,
            "concave_start": self.concave_start,
            "source": self.source,
        }
        if self.metric:
            row["metric"] = self.metric
        if self.samples:
            row["samples"] = self.samples
        if self.points:
            row["points"] = [[round(f, 6), round(a, 6)] for f, a in self.points]
        if self.command:
            row["command"] = self.command
        return row

    @classmethod
    def from_fit(cls, curve: MeasuredCurve, fit: UtilityFit, command: str = "") -> UtilityCurve:
        return cls(
            model=curve.model,
            context_tokens=curve.context_tokens,
            utility=fit.utility,
            r2=fit.r2,
            n_points=fit.n_points,
            floor=fit.floor,
            rmse=fit.rmse,
            source=curve.source,
            metric=curve.metric,
            samples=curve.samples,
            points=tuple(
                (float(f), float(a)) for f, a in zip(curve.fractions, curve.accuracies, strict=True)
            ),
            command=command,
        )


def _points_from(row: dict[str, Any], where: str) -> tuple[tuple[float, float], ...]:
    pts = row.get("points", [])
    ok = isinstance(pts, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in p)
        for p in pts
    )
    if not ok:
        raise UserError(f"{where}: points must be a list of [fraction, accuracy] pairs")
    return tuple((float(f), float(a)) for f, a in pts)


def _curve_from_dict(row: Any, where: str) -> UtilityCurve:
    if not isinstance(row, dict):
        raise UserError(f"{where}: each curve must be a JSON object")
    missing = [k for k in ("model", "context_tokens", "a", "b", "c") if k not in row]
    if missing:
        raise UserError(f"{where}: curve lacks {', '.join(missing)}")
    model = row["model"]
    if not isinstance(model, str) or not model:
        raise UserError(f"{where}: model must be a non-empty string")
    ctx = row["context_tokens"]
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx <= 0:
        raise UserError(f"{where}: context_tokens must be a positive integer (got {ctx!r})")
    nums = {}
    for k in ("a", "b", "c", "d", "r2", "rmse"):
        v = row.get(k, 0.0 if k == "d" else float("nan") if k in ("r2", "rmse") else None)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise UserError(f"{where}: {k} must be a number (got {v!r})")
        nums[k] = float(v)
    try:
        util = SigmoidUtility(a=nums["a"], b=nums["b"], c=nums["c"], d=nums["d"])
    except ValueError as exc:
        raise UserError(f"{where}: {exc}") from None
    counts = {}
    for k in ("n_points", "samples"):
        v = row.get(k, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UserError(f"{where}: {k} must be a non-negative integer")
        counts[k] = v
    return UtilityCurve(
        model=model,
        context_tokens=ctx,
        utility=util,
        r2=nums["r2"],
        n_points=counts["n_points"],
        floor=bool(row.get("floor", nums["d"] != 0.0)),
        rmse=nums["rmse"],
        source=str(row.get("source", "")),
        metric=str(row.get("metric", "")),
        samples=counts["samples"],
        points=_points_from(row, where),
        command=str(row.get("command", "")),
    )


def packaged_table_name(model_id: str) -> str:
    """File name of a model's shipped utility table in kvtransport/data/."""
    return f"{model_id}-utility.json"


def packaged_model_ids() -> list[str]:
    """Models that ship a utility table as package data."""
    from importlib import resources

    suffix = packaged_table_name("")
    data = resources.files("kvtransport") / "data"
    return sorted(f.name[: -len(suffix)] for f in data.iterdir() if f.name.endswith(suffix))


@dataclass
class UtilityTable:
    """Fitted utility curves keyed by (model, context length); the file the daemon reads.

    File layout (JSON): {"format": "kvtransport.utility/1", "curves": [{"model": ...,
    "context_tokens": ..., "a": ..., "b": ..., "c": ..., "d": ..., "r2": ...,
    "concave_start": ..., ...}, ...]}. ``concave_start`` is written for people reading the
    file; loading recomputes it from c.
    """

    curves: dict[tuple[str, int], UtilityCurve] = field(default_factory=dict)

    def put(self, curve: UtilityCurve) -> None:
        self.curves[(curve.model, curve.context_tokens)] = curve

    def get(self, model: str, context_tokens: int) -> UtilityCurve:
        """The curve fitted for exactly this model and context length (KeyError if none)."""
        return self.curves[(model, context_tokens)]

    def lookup(self, model: str, context_tokens: int) -> UtilityCurve:
        """The model's curve whose context length is nearest on a log scale.

        A transfer rarely has exactly a measured context length; the curve of the
        nearest measured length (ratio-wise: 3000 is nearer 4096 than 2048) stands in.
        Raises KeyError if the model has no curve at all.
        """
        rows = [cv for (m, _), cv in self.curves.items() if m == model]
        if not rows:
            known = sorted({m for m, _ in self.curves})
            raise KeyError(f"no utility curve for model {model!r} (have: {known})")
        target = math.log(max(int(context_tokens), 1))
        return min(
            rows, key=lambda cv: (abs(math.log(cv.context_tokens) - target), cv.context_tokens)
        )

    def to_dict(self) -> dict[str, Any]:
        rows = [self.curves[k].to_dict() for k in sorted(self.curves)]
        return {"format": TABLE_FORMAT, "curves": rows}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (kvtransport.atomic): a reader never sees half a table."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> UtilityTable:
        """Read and validate a table; any problem is a one-line UserError naming the file."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise UserError(f"{path}: no such utility table") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: cannot read ({exc})") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
            raise UserError(f"{path}: not a utility table (expected format {TABLE_FORMAT!r})")
        rows = doc.get("curves")
        if not isinstance(rows, list):
            raise UserError(f"{path}: 'curves' must be a list")
        table = cls()
        for i, row in enumerate(rows):
            table.put(_curve_from_dict(row, f"{path}: curve {i}"))
        return table

    def __len__(self) -> int:
        return len(self.curves)

    def __iter__(self) -> Iterator[UtilityCurve]:
        return iter(self.curves[k] for k in sorted(self.curves))

    @classmethod
    def packaged(cls, model_id: str) -> UtilityTable | None:
        """The table shipped as package data for ``model_id`` (None if there is none).

        Written by ``kvtransport fit-utility --measure`` (each curve records the command);
        the sender daemon and scripts/eval_multiuser.py read it when given no table.
        """
        from importlib import resources

        ref = resources.files("kvtransport") / "data" / packaged_table_name(model_id)
        if not ref.is_file():
            return None
        with resources.as_file(ref) as p:
            return cls.load(p)
