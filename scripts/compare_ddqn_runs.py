"""Compare a candidate DDQN with the shipped one, paired, from two eval_policy.py runs.

    python scripts/compare_ddqn_runs.py CANDIDATE.json BASELINE.json [--out FILE.md]

``BASELINE.json``: an ``eval_policy.py`` run with the shipped weights and the heuristics
(and, for shares of the clairvoyant planner, without ``--no-references``).
``CANDIDATE.json``: the same cells, episode counts, stream, utility and prior with
``--weights NEW`` (``--schemes ddqn --high-rtt-schemes ddqn --no-references`` is enough).
``--candidate-scheme auto`` compares the candidate run's ``auto`` scheme (the product's default
choice, eval_policy.py) instead of its ``ddqn``. ``--episodes FROM:TO`` compares episodes
FROM..TO-1 of every cell only: with runs of more episodes than a candidate was chosen on,
the ones no choice saw.
Evaluation episodes are fixed by their index (``kvtransport.agents.episodes.eval_spec``),
so the two runs play the same held-out episodes and every difference is paired.

Per cell: both DDQNs' means, the candidate minus the shipped DDQN and minus the best
heuristic of the baseline run (the non-DDQN, non-oracle scheme with the highest mean), as
paired means with 95 % t-intervals (``*``: the interval excludes zero), and, where the
baseline has the clairvoyant planner, each one's share of it. The planner is the best of
its search and of every scheme it was shown; the candidate was not among them, so its
reference is the per-episode maximum of the two, which is what the planner returns when
shown the candidate too. The last lines count the significant losses the shipping rule
forbids, and warn when a heuristic both runs played differs between them (the code changed:
the heuristic columns are then the baseline code's, not the candidate's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvtransport.eval.cells import is_high_rtt
from kvtransport.eval.statistics import paired, significant

NOT_HEURISTICS = ("ddqn", "auto", "oracle", "clairvoyant", "genie", "clairvoyant_best")
SETTINGS = ("stream", "utility", "prior")


def _load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
        doc["utilities"]  # noqa: B018 - an eval_policy.json has it
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path}: not an eval_policy.py result ({exc})") from None
    return doc


def _fmt(d: dict) -> str:
    return f"{d['mean']:+.4f} ± {d['ci95']:.4f}{'*' if significant(d) else ''}"


def episode_range(doc: dict, first: int, stop: int) -> dict:
    """``doc`` with every cell's per-episode lists cut to episodes ``first``..``stop``-1;
    a scheme that played none of them (block RS plays a few per cell) is left out."""
    cells = {
        key: {name: u[first:stop] for name, u in cell.items() if len(u) > first}
        for key, cell in doc["utilities"].items()
    }
    return {**doc, "utilities": cells}


def _range(text: str) -> tuple[int, int]:
    first, sep, stop = text.partition(":")
    try:
        lo, hi = int(first), int(stop)
    except ValueError:
        lo = hi = -1
    if not sep or lo < 0 or hi <= lo + 1:
        raise argparse.ArgumentTypeError(f"expected FROM:TO with 0 <= FROM < TO - 1, not {text!r}")
    return lo, hi


def compare(cand: dict, base: dict, scheme: str = "ddqn") -> tuple[list[dict], list[str]]:
    """Per cell of the candidate run: its ``scheme``'s paired comparisons (see the module
    docstring)."""
    for k in SETTINGS:
        if cand.get(k) != base.get(k):
            raise SystemExit(f"the runs differ in {k}: {cand.get(k)!r} vs {base.get(k)!r}")
    rows, problems = [], []
    for key, c in cand["utilities"].items():
        b = base["utilities"].get(key)
        if b is None or "ddqn" not in b or scheme not in c:
            problems.append(f"{key}: not in both runs with a ddqn (candidate: {scheme})")
            continue
        new, old = c[scheme], b["ddqn"]
        if len(new) != len(old):
            problems.append(f"{key}: {len(new)} vs {len(old)} episodes")
            continue
        heur = [m for m in b if m not in NOT_HEURISTICS]
        best = max(heur, key=lambda m: float(np.mean(b[m]))) if heur else None
        row = {
            "cell": key,
            "n": len(new),
            "new": float(np.mean(new)),
            "shipped": float(np.mean(old)),
            "new_minus_shipped": paired(new, old),
            "best": best,
        }
        if best is not None:
            row["best_mean"] = float(np.mean(b[best]))
            row["new_minus_best"] = paired(new, b[best])
            row["shipped_minus_best"] = paired(old, b[best])
        if "adaptive" in b:  # the heuristic the product falls back to (issue 16's target)
            row["new_minus_adaptive"] = paired(new, b["adaptive"])
            row["shipped_minus_adaptive"] = paired(old, b["adaptive"])
        if "clairvoyant" in b:
            ref = np.maximum(np.array(b["clairvoyant"]), np.array(new))
            row["share"] = {
                name: float(np.mean(x) / ref.mean())
                for name, x in (("new", new), ("shipped", old), ("best", b.get(best, [])))
                if len(x)
            }
        rows.append(row)
    return rows, problems


def heuristics_differ(cand: dict, base: dict) -> list[str]:
    """The cells where a heuristic that both runs played recovered differently on some
    episode: the code changed between the runs, so this comparison's "best heuristic" and
    "adaptive" (the baseline's) are not what the candidate's code plays; as
    ``CELL: SCHEME, ...``."""
    out = []
    for key, c in cand["utilities"].items():
        b = base["utilities"].get(key, {})
        moved = [m for m in c if m not in NOT_HEURISTICS and m in b and c[m] != b[m]]
        if moved:
            out.append(f"{key}: {', '.join(moved)}")
    return out


def markdown(rows: list[dict], new: str = "new DDQN") -> str:
    """The rows as a table; ``new`` names the candidate in its head."""
    shares = any("share" in r for r in rows)
    head = (
        f"| cell | n | {new} | shipped DDQN | new - shipped | best heuristic | "
        "new - best heuristic | shipped - best heuristic |"
    )
    head += " share of clairvoyant (new / shipped / best heuristic) |" if shares else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    lost_old = [r["cell"] for r in rows if significant(r["new_minus_shipped"]) < 0]
    won_old = [r["cell"] for r in rows if significant(r["new_minus_shipped"]) > 0]
    lost_best = [r["cell"] for r in rows if "best" in r and significant(r["new_minus_best"]) < 0]
    for r in rows:
        line = (
            f"| {r['cell']} | {r['n']} | {r['new']:.4f} | {r['shipped']:.4f} | "
            f"{_fmt(r['new_minus_shipped'])} | {r['best'] or '-'} | "
            + (f"{_fmt(r['new_minus_best'])} | {_fmt(r['shipped_minus_best'])} |"
               if r["best"] else "- | - |")
        )  # fmt: skip
        if shares:
            s = r.get("share", {})
            line += " " + " / ".join(f"{s[k]:.3f}" for k in ("new", "shipped", "best") if k in s)
            line += " |"
        lines.append(line)
    lines.append("")
    lines.append(
        f"{len(rows)} cells: new significantly above the shipped DDQN in {len(won_old)}"
        f" ({', '.join(won_old) or '-'}), below it in {len(lost_old)}"
        f" ({', '.join(lost_old) or '-'}); significantly below the best heuristic in "
        f"{len(lost_best)} ({', '.join(lost_best) or '-'})."
    )
    lines.extend(_adaptive_line(rows))
    return "\n".join(lines) + "\n"


def _adaptive_line(rows: list[dict]) -> list[str]:
    """The long-link cells (``eval_policy.is_high_rtt``, like ``ge-heavy+80ms@0.7``) where
    each DDQN is significantly above adaptive; nothing if the baseline has no adaptive."""
    long = [r for r in rows if "new_minus_adaptive" in r and is_high_rtt(r["cell"])]
    if not long:
        return []
    new, old = (
        sum(significant(r[f"{who}_minus_adaptive"]) > 0 for r in long) for who in ("new", "shipped")
    )
    return [
        f"Long-link cells significantly above adaptive: new {new}, shipped {old} (of {len(long)})."
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("candidate", help="eval_policy.json of the candidate weights")
    p.add_argument("baseline", help="eval_policy.json of the shipped weights and heuristics")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--candidate-scheme", default="ddqn", choices=("ddqn", "auto"),
                   help="the candidate run's scheme to compare (default ddqn; auto: the "
                   "product's default choice)")  # fmt: skip
    p.add_argument("--episodes", type=_range, metavar="FROM:TO",
                   help="compare episodes FROM..TO-1 of each cell only (default: all)")  # fmt: skip
    args = p.parse_args(argv)
    cand, base = _load(args.candidate), _load(args.baseline)
    if args.episodes is not None:
        cand, base = (episode_range(doc, *args.episodes) for doc in (cand, base))
    rows, problems = compare(cand, base, args.candidate_scheme)
    for msg in problems:
        print(f"skipped {msg}", file=sys.stderr)
    if not rows:
        raise SystemExit("no cell in common (same cells, episodes and settings needed)")
    table = markdown(rows, "new DDQN" if args.candidate_scheme == "ddqn" else "auto")
    moved = heuristics_differ(cand, base)
    if moved:
        warning = (
            f"Warning: the two runs' heuristics differ in {len(moved)} cells ({moved[0]}"
            f"{', ...' if len(moved) > 1 else ''}): the code changed between them, and the "
            "heuristic columns are the baseline's; compare against heuristics within one run "
            "(its eval_policy.json targets)."
        )
        print(warning, file=sys.stderr)
        table += "\n" + warning + "\n"
    if args.out:
        Path(args.out).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
