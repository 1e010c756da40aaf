"""Fitting and measuring utility curves offline (what `kvtransport fit-utility` runs).

``fit_sigmoid`` fits kvtransport.scheduling.utility_model.SigmoidUtility to measured points with
scipy (multi-start, bounded least squares, R^2; the floored 4-parameter variant only when
AICc asks for it by more than FLOOR_AICC_MARGIN). ``measure_curves`` measures answer
quality with the real model: task prompts answered with only the first x of each cache
present, in utility order. The results go into the curve table
(kvtransport.scheduling.utility_model.UtilityTable) that the sender daemon reads; nothing here runs
in a daemon. scipy and the model side are imported inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvtransport.errors import UserError
from kvtransport.scheduling.utility_model import (
    MEASURES,
    MeasuredCurve,
    SigmoidUtility,
    UtilityFit,
    logistic,
)

# Below this many distinct fractions a 3-parameter sigmoid is not identifiable with any
# residual degrees of freedom left to judge the fit.
MIN_POINTS = 5
FLOOR_AICC_MARGIN = 2.0
FloorChoice = Literal["auto", "yes", "no"]


def _aicc(sse: float, sst: float, n: int, k: int) -> float:
    """AICc of a least-squares fit with k curve parameters (+1 for the noise variance).

    SSE is floored at 1e-12 SST so that exact fits compare by their parameter count
    instead of by rounding noise.
    """
    kk = k + 1
    if n - kk - 1 <= 0:
        return math.inf
    sse = max(sse, 1e-12 * sst, 1e-300)
    return n * math.log(sse / n) + 2 * kk + 2 * kk * (kk + 1) / (n - kk - 1)


def _fit_variant(x: np.ndarray, y: np.ndarray, with_floor: bool) -> tuple[np.ndarray, float]:
    """Best least-squares parameters (a, b, c[, d]) over a grid of starts; returns (p, SSE)."""
    from scipy.optimize import curve_fit

    span = float(y.max() - y.min())
    ymax, ymin = float(y.max()), float(y.min())
    scale = max(abs(ymax), abs(ymin), span, 1e-12)

    def f3(xx: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
        return a * logistic(b * (xx - c))

    def f4(xx: np.ndarray, a: float, b: float, c: float, d: float) -> np.ndarray:
        return d + a * logistic(b * (xx - c))

    def j3(xx: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
        s = logistic(b * (xx - c))
        ds = s * (1.0 - s)
        return np.stack([s, a * ds * (xx - c), -a * b * ds], axis=1)

    def j4(xx: np.ndarray, a: float, b: float, c: float, d: float) -> np.ndarray:
        return np.concatenate([j3(xx, a, b, c), np.ones((xx.size, 1))], axis=1)

    b_lo, b_hi = 1e-2, 1e3
    c_lo, c_hi = -1.0, 2.0
    func: Callable[..., np.ndarray]
    jac: Callable[..., np.ndarray]
    if with_floor:
        func, jac = f4, j4
        lower = [1e-9 * scale, b_lo, c_lo, ymin - 2.0 * scale]
        upper = [4.0 * scale, b_hi, c_hi, ymax]
    else:
        func, jac = f3, j3
        lower = [1e-9 * scale, b_lo, c_lo]
        upper = [4.0 * scale, b_hi, c_hi]

    # Starts: the midpoint where y crosses half its range (and the data's quartiles), the
    # steepness from the steepest observed rise (U'(c) = a b / 4) and a few fixed values.
    order = np.argsort(x)
    xs, ys = x[order], y[order]
    d0 = ymin if with_floor else 0.0
    a0 = max(ymax - d0, 1e-6 * scale)
    half = d0 + 0.5 * a0
    above = np.nonzero(ys >= half)[0]
    c_mid = float(xs[above[0]]) if above.size else float(np.median(xs))
    dx = np.diff(xs)
    ok = dx > 1e-12
    steep = float(np.max(np.diff(ys)[ok] / dx[ok])) if ok.any() else 1.0
    b_est = min(max(4.0 * max(steep, 1e-9) / a0, b_lo * 2), b_hi / 2)
    c_starts = {c_mid, *np.quantile(xs, [0.25, 0.5, 0.75]).tolist()}
    b_starts = {b_est, 5.0, 20.0, 80.0}

    best_p, best_sse = None, math.inf
    for c0 in sorted(c_starts):
        for b0 in sorted(b_starts):
            p0 = [a0, b0, c0] + ([d0] if with_floor else [])
            p0 = np.clip(p0, np.array(lower) + 1e-12, np.array(upper) - 1e-12)
            try:
                p, _ = curve_fit(
                    func, x, y, p0=p0, jac=jac, bounds=(lower, upper), method="trf", maxfev=4000
                )
            except (RuntimeError, ValueError):
                continue
            sse = float(np.sum((func(x, *p) - y) ** 2))
            if np.all(np.isfinite(p)) and sse < best_sse:
                best_p, best_sse = p, sse
    if best_p is None:
        raise UserError("the sigmoid fit did not converge from any starting point")
    return np.asarray(best_p, dtype=np.float64), best_sse


def fit_sigmoid(
    fractions: Sequence[float] | np.ndarray,
    accuracies: Sequence[float] | np.ndarray,
    floor: FloorChoice = "auto",
) -> UtilityFit:
    """Least-squares sigmoid through measured (fraction, accuracy) points.

    floor="auto" fits both variants and keeps the floored one only if its AICc is lower by
    more than FLOOR_AICC_MARGIN (the extra parameter must pay for itself; with fewer than 7
    points the floored variant has no degrees of freedom left and is not considered);
    "yes"/"no" force the choice.
    Raises UserError on input no sigmoid can be fitted to (too few distinct fractions,
    fractions outside [0, 1], non-finite values, constant accuracy).
    """
    x = np.asarray(fractions, dtype=np.float64).ravel()
    y = np.asarray(accuracies, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise UserError(f"{x.size} fractions but {y.size} accuracies")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise UserError("fractions and accuracies must be finite numbers")
    if x.size and (x.min() < 0.0 or x.max() > 1.0):
        raise UserError(f"fractions must lie in [0, 1] (got {x.min():g}..{x.max():g})")
    if np.unique(x).size < MIN_POINTS:
        raise UserError(
            f"need at least {MIN_POINTS} distinct fractions to fit a sigmoid "
            f"(got {np.unique(x).size})"
        )
    sst = float(np.sum((y - y.mean()) ** 2))
    if sst <= 0.0:
        raise UserError("accuracy is the same at every fraction: there is no curve to fit")
    n = int(x.size)

    variants = {"no": [False], "yes": [True], "auto": [False, True]}[floor]
    if floor == "auto" and n < 7:
        variants = [False]
    fits: dict[bool, tuple[np.ndarray, float, float]] = {}
    for with_floor in variants:
        p, sse = _fit_variant(x, y, with_floor)
        fits[with_floor] = (p, sse, _aicc(sse, sst, n, 4 if with_floor else 3))
    # The floor must pay for its parameter by more than FLOOR_AICC_MARGIN (Burnham and
    # Anderson's "substantial support"): a floor that barely helps is noise, and a spurious
    # floor shifts the curve's value at x = 0 that admission decisions rest on.
    if len(fits) == 1:
        chosen = next(iter(fits))
    else:
        chosen = fits[True][2] < fits[False][2] - FLOOR_AICC_MARGIN
    p, sse, aicc = fits[chosen]
    other = fits.get(not chosen)
    d = float(p[3]) if chosen else 0.0
    util = SigmoidUtility(a=float(p[0]), b=float(p[1]), c=float(p[2]), d=d)
    return UtilityFit(
        utility=util,
        r2=1.0 - sse / sst,
        rmse=math.sqrt(sse / n),
        n_points=n,
        floor=chosen,
        aicc=aicc,
        aicc_alternative=None if other is None else other[2],
    )


DEFAULT_FRACTIONS = (
    0.0, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2,
    0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0,
)  # fmt: skip
"""Dense below 0.2: in utility order most of the answer arrives with the first blocks."""
MEASURE_SEED = 30_000
"""First task seed of the measurement prompts: disjoint from the sensitivity calibration
(small seeds), scripts/eval_retention.py (10000+) and the utility-order tuning (20000+)."""
MAX_ANSWER_TOKENS = 40
"""Greedy answer cap: four 7-digit values (the multi-value needle task) need about 36."""


@dataclass(frozen=True)
class SampleMeasurement:
    """One prompt's quality at each delivered fraction.

    values[m][k]: measure m with the first fractions[k] of the blocks (utility order);
    answer: the full cache's answer; generated: how many fractions needed a greedy run
    (the others reproduced the full answer exactly, see :func:`measure_sample`).
    """

    task: str
    seed: int
    tokens: int
    fractions: np.ndarray
    values: dict[str, np.ndarray]
    answer: str
    generated: int


def measure_sample(
    model: Any,
    tokenizer: Any,
    sample: Any,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    block_tokens: int = 16,
    layer_weights: np.ndarray | None = None,
    max_answer_tokens: int = MAX_ANSWER_TOKENS,
    progress: Any = None,
) -> SampleMeasurement:
    """Answer quality of one task sample when only the first x of its cache arrives.

    The context is prefilled once and its blocks ordered as the sender streams them
    (kvtransport.model.utility: SnapKV attention x layer weights, sink blocks first); for each
    fraction x the first round(x * blocks) blocks are present and the rest masked per layer
    (kvtransport.model.hf, as the receiver injects a partial cache). The full cache's greedy
    answer (with its stop token) is the reference for top-1 agreement. Shortcut, exact:
    when the partial cache's teacher-forced top-1 prediction matches every reference token,
    its greedy answer *is* the reference (greedy decoding picks the top-1 token at each
    step), so only the other fractions are decoded. progress: called once per fraction.
    """
    from kvtransport.model import hf, metrics, utility

    ctx, question = sample.prompt(tokenizer)
    kv = hf.prefill(model, tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    gen = hf.greedy_generate(model, kv, question, max_new_tokens=max_answer_tokens)
    reference = list(gen.tokens)
    if gen.stopped:  # the stop token belongs to the answer: which one the model chose
        logits, _ = hf.cache_forward(model, kv, list(question) + reference, last=1)
        reference.append(int(logits[-1].argmax()))
    full_answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
    u = utility.cache_utility(kv, block_tokens, layer_weights)
    order = utility.stream_order(u, block_tokens)
    fr = np.asarray(fractions, dtype=np.float64)
    values = {m: np.zeros(fr.size) for m in MEASURES}
    generated = 0
    for k, x in enumerate(fr):
        keep = utility.kept_mask(order, u.shape, float(x))
        present = np.repeat(keep, block_tokens, axis=1)[:, : kv.num_tokens]
        if reference:
            hits = hf.teacher_forced_top1(model, kv, question, reference, present=present)
        else:  # the model stopped at once; nothing to agree with
            hits = np.ones(1, dtype=bool)
        if hits.all():
            answer = full_answer
        else:
            g = hf.greedy_generate(
                model, kv, question, present=present, max_new_tokens=max_answer_tokens
            )
            answer = tokenizer.decode(g.tokens, skip_special_tokens=True)
            generated += 1
        values["accuracy"][k] = metrics.contains_all(answer, sample.answers)
        values["f1"][k] = metrics.token_f1(answer, sample.answers)
        values["top1"][k] = float(hits.mean())
        if progress is not None:
            progress(1)
    return SampleMeasurement(
        sample.task, sample.seed, kv.num_tokens, fr, values, full_answer, generated
    )


def measure_curves(
    model: Any,
    tokenizer: Any,
    model_id: str,
    context_tokens: int,
    samples: int,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    seed: int = MEASURE_SEED,
    tasks: Sequence[str] | None = None,
    block_tokens: int = 16,
    layer_weights: np.ndarray | None = None,
    progress: Any = None,
) -> tuple[dict[str, MeasuredCurve], list[SampleMeasurement]]:
    """Mean quality vs delivered fraction over ``samples`` prompts of one context length.

    Prompts cycle through the tasks (kvtransport.model.tasks.suite: RULER-style needles and
    facts QA, seeds from ``seed``), each sized to ``context_tokens``. Returns one
    MeasuredCurve per measure (MEASURES; the mean over prompts at each fraction, with its
    standard error) and the per-prompt measurements.
    """
    from kvtransport.model import tasks as task_lib

    if samples < 1:
        raise ValueError("samples must be at least 1")
    names = tuple(tasks) if tasks else task_lib.SUITE_TASKS
    suite = task_lib.suite(
        tokenizer, n=samples, target_tokens=context_tokens, seed=seed, tasks=names
    )
    per = [
        measure_sample(
            model,
            tokenizer,
            s,
            fractions,
            block_tokens=block_tokens,
            layer_weights=layer_weights,
            progress=progress,
        )
        for s in suite
    ]
    fr = np.asarray(fractions, dtype=np.float64)
    curves = {}
    for m in MEASURES:
        y = np.stack([p.values[m] for p in per])
        se = y.std(axis=0, ddof=1) / math.sqrt(len(per)) if len(per) > 1 else np.zeros(fr.size)
        curves[m] = MeasuredCurve(
            model=model_id,
            context_tokens=int(context_tokens),
            fractions=fr.copy(),
            accuracies=y.mean(axis=0),
            source=f"measured: {len(per)} prompts ({', '.join(names)}), seeds {seed}+",
            metric=m,
            samples=len(per),
            spread=se,
        )
    return curves, per
