"""`kvtransport fit-utility`: fit accuracy-vs-delivered-fraction sigmoids for the daemon.

Where the points come from is one function, ``collect_curves``: today a points file
(CSV or JSON). The real-model measurement (answer quality with the first x of the cache
in utility order, with kvtransport.hf and kvtransport.tasks) will be a second branch
there returning the same ``MeasuredCurve`` objects; fitting, the table file, the
printout and the plot stay as they are.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

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
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--points",
        required=True,
        metavar="FILE",
        help="measured (fraction, accuracy) points, .csv or .json (see above)",
    )
    parser.add_argument("--model", help="model id for points that do not name one")
    parser.add_argument(
        "--context-tokens",
        type=int,
        metavar="N",
        help="context length for points that do not give one",
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
                    "fraction": _num(f, "fraction", pw),
                    "accuracy": _num(a, "accuracy", pw),
                    "where": pw,
                }
            )
    return rows


def read_points_file(
    path: str | Path, model: str | None = None, context_tokens: int | None = None
) -> list[Any]:
    """MeasuredCurve per (model, context length) found in a CSV or JSON points file."""
    import numpy as np

    from kvtransport.utility_model import MeasuredCurve

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
        )
        for (m, c), rs in sorted(groups.items())
    ]


def collect_curves(args: argparse.Namespace) -> list[Any]:
    """The measured curves to fit.

    Extension point: a real-model measurement mode (e.g. ``--measure`` with a model and
    task from kvtransport.hf / kvtransport.tasks, evaluating accuracy with the first x of
    the cache in utility order for a grid of x) goes here and returns MeasuredCurve
    objects like the file reader does.
    """
    if args.context_tokens is not None and args.context_tokens <= 0:
        raise UserError("--context-tokens must be a positive integer")
    return read_points_file(args.points, args.model, args.context_tokens)


# ------------------------------------------------------------------------ the command


def _plot(path: str, curves: list[Any], fits: list[Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = np.linspace(0.0, 1.0, 400)
    for k, (cv, fit) in enumerate(zip(curves, fits, strict=True)):
        color = f"C{k % 10}"
        label = f"{cv.model} @ {cv.context_tokens} tok (R²={fit.r2:.3f})"
        ax.plot(cv.fractions, cv.accuracies, "o", color=color, ms=4, alpha=0.7)
        ax.plot(xs, fit.utility(xs), "-", color=color, label=label)
        ax.axvline(fit.concave_start, color=color, ls=":", lw=1)
    ax.set_xlabel("fraction of the KV cache delivered (utility order)")
    ax.set_ylabel("answer accuracy")
    ax.set_xlim(0, 1)
    ax.set_title("Accuracy vs delivered cache; dotted: start of the concave region")
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
    from kvtransport.utility_model import (
        DEFAULT_TABLE_PATH,
        UtilityCurve,
        UtilityTable,
        fit_sigmoid,
    )

    curves = collect_curves(args)
    fits = []
    for cv in curves:
        try:
            fits.append(fit_sigmoid(cv.fractions, cv.accuracies, floor=args.floor))
        except UserError as exc:
            raise UserError(f"{cv.model} @ {cv.context_tokens} tokens: {exc}") from None
    out = Path(args.out or DEFAULT_TABLE_PATH)
    table = UtilityTable.load(out) if out.exists() else UtilityTable()
    rows = [UtilityCurve.from_fit(cv, fit) for cv, fit in zip(curves, fits, strict=True)]
    for row in rows:
        table.put(row)
    if args.plot:
        _plot(args.plot, curves, fits)
    try:
        table.save(out)
    except OSError as exc:
        raise UserError(f"{out}: cannot write the utility table ({exc.strerror or exc})") from None

    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    head = f"{'model':<32} {'ctx':>6} {'a':>7} {'b':>7} {'c':>6} {'d':>6} {'R^2':>7} {'concave':>8}"
    print(head)
    for r in rows:
        u = r.utility
        print(
            f"{r.model[-32:]:<32} {r.context_tokens:>6} {u.a:>7.4f} {u.b:>7.2f} {u.c:>6.3f} "
            f"{u.d:>6.3f} {r.r2:>7.4f} {r.concave_start:>8.3f}"
        )
    low = [r for r in rows if r.r2 < 0.99]
    if low:
        names = ", ".join(f"{r.model}@{r.context_tokens}" for r in low)
        print(f"note: R^2 below 0.99 for {names}: the sigmoid describes these data loosely")
    print(f"wrote {len(rows)} curve(s) to {out} ({len(table)} in the table)")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
