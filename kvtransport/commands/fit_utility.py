"""`kvtransport fit-utility`: fit accuracy-vs-delivered-fraction sigmoids for the daemon.

Where the points come from is one function, ``collect_curves``: a points file (CSV or
JSON), or ``--measure``: the real model answers RULER-style needle and facts-QA prompts
with only the first x of each cache (utility order) present
(kvtransport.model.utility_fit.measure_curves). Fitting, the table file, the printout and the
plot are the same for both.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

from kvtransport.bounds import int_arg
from kvtransport.errors import UserError

NAME = "fit-utility"
HELP = "fit accuracy-vs-delivered-fraction sigmoids and write the daemon's utility table"
DESCRIPTION = """\
Fit U(x) = d + a / (1 + exp(-b (x - c))) to answer accuracy measured against the
fraction x of the KV cache (in utility order) that arrived, for each (model, context
length), and store the parameters in the small JSON table the sender daemon reads to
share a backhaul among concurrent transfers. The floor d is kept only when the data
ask for it (AICc; --floor to force). Prints R^2 per curve and where its concave region
begins (x = c): from there on every further byte is worth less than the one before.

Points file, CSV: a header with columns `fraction` and `accuracy` (both in [0, 1]) and
optionally `model` and `context_tokens` (one curve per distinct pair); lines starting
with # are comments. JSON: an object or a list of objects, each
{"model": ..., "context_tokens": ..., "points": [[fraction, accuracy], ...]} (points may
also be {"fraction": f, "accuracy": a} objects, or the object may hold parallel
"fraction" and "accuracy" lists). --model / --context-tokens fill in what the file
leaves out. An existing table is updated in place: curves for other (model, context)
pairs are kept.

--measure measures the points instead, with the real model: for each context length,
--samples prompts (cycling through needle-in-a-haystack single/multi-key/multi-value and
facts QA) are prefilled, their blocks ordered by utility, and answered with only the
first x of the blocks present (the rest masked per layer, as the receiver injects a
partial cache), for x on a grid. Three measures are fitted: accuracy (RULER string
match: the share of gold answers in the answer), f1 (token F1) and top1 (teacher-forced
top-1 agreement with the full cache's answer); --metric picks the one written to the
table. Each row records the command that produced it. On a busy 2-core CPU the packaged
table (20 prompts at 256 and at 512 tokens, 17 fractions) took an hour; a prompt costs
one prefill, one teacher-forced pass per fraction and a greedy answer for each fraction
whose top-1 predictions differ from the full cache's answer.

examples:
  kvtransport fit-utility --points measured.csv --out utility_curves.json --plot fit.png
  kvtransport fit-utility --measure --context-tokens 256,512 --samples 16 --plot fit.png
"""

DEFAULT_MEASURE_CONTEXTS = (256, 512)
DEFAULT_SAMPLES = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--points",
        metavar="FILE",
        help="measured (fraction, accuracy) points, .csv or .json (see above)",
    )
    src.add_argument(
        "--measure",
        action="store_true",
        help="measure the points with the real model instead (see above)",
    )
    parser.add_argument(
        "--model",
        help="with --points: model id for points that do not name one; with --measure: "
        "the model (HuggingFace directory, .gguf, or 'smollm2', the default)",
    )
    parser.add_argument(
        "--context-tokens",
        metavar="N[,N...]",
        help="with --points: context length for points that do not give one; with "
        "--measure: the context lengths to measure (default: "
        + ",".join(map(str, DEFAULT_MEASURE_CONTEXTS))
        + ")",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        metavar="N",
        help=f"--measure: prompts per context length (default {DEFAULT_SAMPLES})",
    )
    parser.add_argument(
        "--fractions",
        metavar="X[,X...]",
        help="--measure: delivered fractions to measure at (default: 17 points, dense below 0.2)",
    )
    parser.add_argument(
        "--metric",
        choices=["accuracy", "f1", "top1"],
        default="accuracy",
        help="--measure: the measure written to the table (default accuracy; all are printed)",
    )
    parser.add_argument(
        "--seed",
        type=int_arg(0, 2**32 - 1),
        default=None,
        metavar="S",
        help="--measure: first prompt seed",
    )
    parser.add_argument(
        "--save-points",
        metavar="FILE",
        help="--measure: also write every measure's mean points as JSON (re-fit with --points)",
    )
    parser.add_argument(
        "--threads",
        type=int_arg(1, 1024),
        default=1,
        metavar="N",
        help="--measure: torch threads (default 1)",
    )
    parser.add_argument(
        "--floor",
        choices=["auto", "yes", "no"],
        default="auto",
        help="fit the floor d: when it pays for itself by AICc (auto, default), always, never",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="utility table to create or update (default: utility_curves.json)",
    )
    parser.add_argument("--plot", metavar="PNG", help="also draw the points and fitted curves")
    parser.add_argument(
        "--json", action="store_true", help="print the fitted curves as JSON instead of a table"
    )


# ------------------------------------------------------------------- reading points


def _num(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool):
        raise UserError(f"{where}: {what} must be a number (got {value!r})")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: {what} must be a number (got {value!r})") from None
    if not math.isfinite(v):
        raise UserError(f"{where}: {what} must be finite (got {value!r})")
    return v


def _ctx(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise UserError(f"{where}: context_tokens must be a positive integer (got {value!r})")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"{where}: context_tokens must be a positive integer (got {value!r})"
        ) from None
    if not v.is_integer() or v <= 0:
        raise UserError(f"{where}: context_tokens must be a positive integer (got {value!r})")
    return int(v)


def _read_csv(path: Path, text: str) -> list[dict[str, Any]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise UserError(f"{path}: no data (expected a header with fraction,accuracy)")
    reader = csv.DictReader(lines)
    cols = [c.strip() for c in (reader.fieldnames or [])]
    for need in ("fraction", "accuracy"):
        if need not in cols:
            raise UserError(f"{path}: CSV header lacks a '{need}' column (has: {', '.join(cols)})")
    rows = []
    for lineno, raw in enumerate(reader, start=2):
        row = {(k or "").strip(): (v.strip() if isinstance(v, str) else v) for k, v in raw.items()}
        where = f"{path}: row {lineno}"
        if None in raw or any(row.get(c) in (None, "") for c in ("fraction", "accuracy")):
            raise UserError(f"{where}: wrong number of fields")
        rows.append(
            {
                "model": row.get("model") or None,
                "context_tokens": row.get("context_tokens") or None,
                "fraction": _num(row["fraction"], "fraction", where),
                "accuracy": _num(row["accuracy"], "accuracy", where),
                "where": where,
            }
        )
    return rows


def _read_json(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    groups = doc if isinstance(doc, list) else [doc]
    rows = []
    for gi, group in enumerate(groups):
        where = f"{path}: entry {gi}"
        if not isinstance(group, dict):
            raise UserError(f"{where}: expected an object with 'points'")
        if "points" in group:
            pts = group["points"]
            if not isinstance(pts, list):
                raise UserError(f"{where}: 'points' must be a list")
        elif "fraction" in group and "accuracy" in group:
            fr, ac = group["fraction"], group["accuracy"]
            if not isinstance(fr, list) or not isinstance(ac, list) or len(fr) != len(ac):
                raise UserError(f"{where}: 'fraction' and 'accuracy' must be lists of one length")
            pts = [[f, a] for f, a in zip(fr, ac, strict=True)]
        else:
            raise UserError(f"{where}: expected 'points' or 'fraction' and 'accuracy' lists")
        for pi, p in enumerate(pts):
            pw = f"{where}, point {pi}"
            if isinstance(p, dict):
                if "fraction" not in p or "accuracy" not in p:
                    raise UserError(f"{pw}: needs 'fraction' and 'accuracy'")
                f, a = p["fraction"], p["accuracy"]
            elif isinstance(p, list) and len(p) == 2:
                f, a = p
            else:
                raise UserError(f"{pw}: expected [fraction, accuracy]")
            rows.append(
                {
                    "model": group.get("model"),
                    "context_tokens": group.get("context_tokens"),
                    "metric": group.get("metric"),
                    "fraction": _num(f, "fraction", pw),
                    "accuracy": _num(a, "accuracy", pw),
                    "where": pw,
                }
            )
    return rows


def read_points_file(
    path: str | Path,
    model: str | None = None,
    context_tokens: int | None = None,
    metric: str | None = None,
) -> list[Any]:
    """MeasuredCurve per (model, context length) found in a CSV or JSON points file.

    JSON entries may name their measure ("metric", as ``--save-points`` writes them);
    given ``metric``, entries naming another measure are skipped.
    """
    import numpy as np

    from kvtransport.scheduling.utility_model import MeasuredCurve

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such points file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    is_json = path.suffix.lower() == ".json" or text.lstrip()[:1] in ("{", "[")
    rows = _read_json(path, text) if is_json else _read_csv(path, text)
    if not rows:
        raise UserError(f"{path}: no points")
    if metric is not None:
        rows = [r for r in rows if r.get("metric") in (None, metric)]
        if not rows:
            raise UserError(f"{path}: no points for the {metric!r} measure")
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        m = r["model"] if r["model"] is not None else model
        c = r["context_tokens"] if r["context_tokens"] is not None else context_tokens
        if not m or not isinstance(m, str):
            raise UserError(f"{r['where']}: no model (add a model column/field or --model)")
        if c is None:
            raise UserError(
                f"{r['where']}: no context length (add context_tokens or --context-tokens)"
            )
        c = _ctx(c, r["where"])
        for what in ("fraction", "accuracy"):
            if not 0.0 <= r[what] <= 1.0:
                hint = " (divide percentages by 100)" if what == "accuracy" else ""
                raise UserError(f"{r['where']}: {what} {r[what]:g} is outside [0, 1]{hint}")
        groups.setdefault((m, c), []).append(r)
    return [
        MeasuredCurve(
            model=m,
            context_tokens=c,
            fractions=np.array([r["fraction"] for r in rs]),
            accuracies=np.array([r["accuracy"] for r in rs]),
            source=str(path),
            metric=str(rs[0].get("metric") or ""),
        )
        for (m, c), rs in sorted(groups.items())
    ]


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{what} must be positive integers separated by commas") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{what} must be positive integers separated by commas")
    return sorted(set(vals))


def _fraction_list(text: str) -> list[float]:
    from kvtransport.model.utility_fit import MIN_POINTS

    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError("--fractions must be numbers in [0, 1] separated by commas") from None
    if any(not (0.0 <= v <= 1.0) for v in vals):
        raise UserError("--fractions must be numbers in [0, 1] separated by commas")
    vals = sorted(set(vals))
    if len(vals) < MIN_POINTS:
        raise UserError(f"--fractions needs at least {MIN_POINTS} distinct values to fit a sigmoid")
    return vals


def recorded_command(args: argparse.Namespace) -> str:
    """The canonical command line of this run, recorded in each table row it writes."""
    import shlex

    from kvtransport.model.utility_fit import MEASURE_SEED

    parts = ["kvtransport", "fit-utility"]
    if args.measure:
        parts.append("--measure")
        if args.model:
            parts += ["--model", args.model]
        parts += ["--context-tokens", ",".join(map(str, _measure_contexts(args)))]
        parts += ["--samples", str(args.samples)]
        if args.fractions:
            parts += ["--fractions", ",".join(f"{v:g}" for v in _fraction_list(args.fractions))]
        parts += ["--seed", str(MEASURE_SEED if args.seed is None else args.seed)]
    else:
        parts += ["--points", args.points]
        if args.model:
            parts += ["--model", args.model]
        if args.context_tokens:
            parts += ["--context-tokens", args.context_tokens]
    parts += ["--metric", args.metric]
    if args.floor != "auto":
        parts += ["--floor", args.floor]
    if args.out:
        parts += ["--out", args.out]
    return shlex.join(parts)


def _measure_contexts(args: argparse.Namespace) -> list[int]:
    if args.context_tokens is None:
        return list(DEFAULT_MEASURE_CONTEXTS)
    return _int_list(args.context_tokens, "--context-tokens")


def measure(args: argparse.Namespace) -> list[Any]:
    """--measure: MeasuredCurve per (context length, measure), with the real model."""
    import sys

    from tqdm import tqdm

    from kvtransport.model import utility
    from kvtransport.model.loader import load_model
    from kvtransport.model.utility_fit import DEFAULT_FRACTIONS, MEASURE_SEED, measure_curves

    contexts = _measure_contexts(args)
    fractions = _fraction_list(args.fractions) if args.fractions else list(DEFAULT_FRACTIONS)
    if args.samples < 1:
        raise UserError("--samples must be at least 1")
    if args.threads < 1:
        raise UserError("--threads must be at least 1")
    lm = load_model(args.model, threads=args.threads)
    weights = utility.default_layer_weights(lm.model_id, lm.num_layers)
    seed = MEASURE_SEED if args.seed is None else args.seed
    curves: list[Any] = []
    total = len(contexts) * args.samples * len(fractions)
    with tqdm(total=total, desc="measuring", unit="answer", file=sys.stderr) as bar:
        for ctx in contexts:
            bar.set_postfix_str(f"{ctx} tokens")
            try:
                by_metric, _ = measure_curves(
                    lm.model,
                    lm.tokenizer,
                    lm.model_id,
                    ctx,
                    args.samples,
                    fractions,
                    seed=seed,
                    layer_weights=weights,
                    progress=bar.update,
                )
            except ValueError as exc:  # e.g. a context too short for any prompt
                raise UserError(f"{ctx} tokens: {exc}") from None
            curves.extend(by_metric.values())
    return curves


def collect_curves(args: argparse.Namespace) -> list[Any]:
    """The measured curves to fit: from the points file, or measured (``--measure``)."""
    if args.measure:
        return measure(args)
    ctx = None
    if args.context_tokens is not None:
        vals = _int_list(args.context_tokens, "--context-tokens")
        if len(vals) != 1:
            raise UserError("with --points, --context-tokens takes one length")
        ctx = vals[0]
    return read_points_file(args.points, args.model, ctx, args.metric)


def save_points(path: str, curves: list[Any]) -> None:
    """Write measured curves as a points JSON that ``--points`` reads back."""
    rows = [
        {
            "model": cv.model,
            "context_tokens": cv.context_tokens,
            "metric": cv.metric,
            "samples": cv.samples,
            "points": [
                [float(f), float(a)] for f, a in zip(cv.fractions, cv.accuracies, strict=True)
            ],
            "stderr": [float(v) for v in cv.spread],
            "source": cv.source,
        }
        for cv in curves
    ]
    try:
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot write the points ({exc.strerror or exc})") from None


# ------------------------------------------------------------------------ the command


def _plot(path: str, curves: list[Any], fits: list[Any]) -> None:
    """Points and fitted curves; one panel per measure when several were measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = sorted({cv.metric for cv in curves}, key=lambda m: (m != "accuracy", m))
    contexts = sorted({(cv.model, cv.context_tokens) for cv in curves})
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.2 * len(metrics), 4.5), squeeze=False)
    xs = np.linspace(0.0, 1.0, 400)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for cv, fit in zip(curves, fits, strict=True):
            if cv.metric != metric:
                continue
            k = contexts.index((cv.model, cv.context_tokens))
            color = f"C{k % 10}"
            label = f"{cv.model} @ {cv.context_tokens} tok (R²={fit.r2:.3f})"
            if cv.spread.size == cv.fractions.size and cv.samples > 1:
                ax.errorbar(
                    cv.fractions, cv.accuracies, yerr=cv.spread, fmt="o", color=color, ms=4,
                    alpha=0.7, capsize=2,
                )  # fmt: skip
            else:
                ax.plot(cv.fractions, cv.accuracies, "o", color=color, ms=4, alpha=0.7)
            ax.plot(xs, fit.utility(xs), "-", color=color, label=label)
            ax.axvline(fit.concave_start, color=color, ls=":", lw=1)
        ax.set_xlabel("fraction of the KV cache delivered (utility order)")
        ax.set_ylabel({"": "answer accuracy", "top1": "teacher-forced top-1 agreement"}.get(
            metric, f"answer {metric}"))  # fmt: skip
        ax.set_xlim(0, 1)
        ax.set_title(f"{metric or 'accuracy'}: fitted sigmoid; dotted: concave from here")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UserError(f"{path}: cannot write the plot ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from kvtransport.model.utility_fit import fit_sigmoid
    from kvtransport.scheduling.utility_model import (
        DEFAULT_TABLE_PATH,
        UtilityCurve,
        UtilityTable,
    )

    out = Path(args.out or DEFAULT_TABLE_PATH)
    # Read an existing table first: a corrupt one should fail before a long measurement.
    table = UtilityTable.load(out) if out.exists() else UtilityTable()
    curves = collect_curves(args)
    fits = []
    for cv in curves:
        try:
            fits.append(fit_sigmoid(cv.fractions, cv.accuracies, floor=args.floor))
        except UserError as exc:
            what = f" ({cv.metric})" if cv.metric else ""
            raise UserError(f"{cv.model} @ {cv.context_tokens} tokens{what}: {exc}") from None
    command = recorded_command(args)
    rows = [UtilityCurve.from_fit(cv, fit, command) for cv, fit in zip(curves, fits, strict=True)]
    chosen = [r for r in rows if not args.measure or r.metric == args.metric]
    for row in chosen:
        table.put(row)
    if args.save_points:
        save_points(args.save_points, curves)
    if args.plot:
        _plot(args.plot, curves, fits)
    try:
        table.save(out)
    except OSError as exc:
        raise UserError(f"{out}: cannot write the utility table ({exc.strerror or exc})") from None

    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    head = (
        f"{'model':<28} {'ctx':>6} {'measure':>8} {'a':>7} {'b':>7} {'c':>6} {'d':>6} "
        f"{'R^2':>7} {'concave':>8} {'U(1)':>6}"
    )
    print(head)
    for r in rows:
        u = r.utility
        mark = " *" if args.measure and r.metric == args.metric else ""
        print(
            f"{r.model[-28:]:<28} {r.context_tokens:>6} {r.metric or '-':>8} {u.a:>7.4f} "
            f"{u.b:>7.2f} {u.c:>6.3f} {u.d:>6.3f} {r.r2:>7.4f} {r.concave_start:>8.3f} "
            f"{r.ceiling:>6.3f}{mark}"
        )
    low = [r for r in rows if r.r2 < 0.99]
    if low:
        names = ", ".join(
            f"{r.model}@{r.context_tokens}" + (f" ({r.metric})" if r.metric else "") for r in low
        )
        print(f"note: R^2 below 0.99 for {names}: the sigmoid describes these data loosely")
    if args.measure:
        print(f"* written to the table (--metric {args.metric})")
    print(f"wrote {len(chosen)} curve(s) to {out} ({len(table)} in the table)")
    if args.save_points:
        print(f"points: {args.save_points}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
