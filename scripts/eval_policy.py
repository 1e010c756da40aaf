"""Evaluate the DDQN repair scheduler against the baselines on held-out episodes.

For every channel in {bernoulli-5, ge-light, ge-heavy, 4state-bursty} (the named
profiles: 100 Mbit/s, 5 ms, feedback over the same profile) and rho in {0.6, 0.8, 1.0,
1.2}: the mean utility recovered before the deadline, with 95 % t-intervals, of

    none, fixed:4/32 (streaming RLC), block-rs:4/32 (Reed-Solomon), arq, adaptive,
    ddqn (the shipped weights, or --weights), auto (the product's pick, below),
    oracle (clairvoyant reference)

and tail-rule (the DDQN's action 0 throughout: no proactive repair, keep admitting, the
session's tail rule and reactive repair doing the rest; a learned policy that does not
beat it is a constant), on the same episodes (common random numbers: every scheme sees
the same channel seeds). ``auto`` plays, per episode, the policy a shell picks when told
none (kvtransport.hosts.policy_choice.default_policy_for): what the product does; its share of
the clairvoyant planner is checked as the DDQN's is.

Two references per episode (``--no-references`` skips them): the genie bound
(kvtransport.sim.simulator.genie_bound: the surviving slots filled with source in utility
order; no scheme can exceed it) and the clairvoyant planner (kvtransport.sim.repair_planner: the
best of a search over clairvoyant and causal repair plans replayed on the episode's realized
losses in both directions, plus every scheme's own result there, so it is never below any
of them). Each scheme's gap to both (reference minus scheme, paired) and its share of the
planner's utility get their own table.

High-RTT cells (``--set high-rtt``, part of the default ``all``): the same held-out
episodes over long links (one-way 20, 40, 80 ms both ways: edge backhaul, cellular,
satellite) on bernoulli-5, ge-heavy and 4state-bursty at rho 0.7, 0.85, 1.0, where the
last round trip before the deadline is a large part of the transfer and feedback cannot
cover it. Cells are named ``CHANNEL+DELAYms@RHO``; their table gives the paired
differences (same episodes) of the DDQN against tail-rule and adaptive, and the oracle's
headroom over the better of the two, with 95 % t-intervals.
Episodes are held out from training (kvtransport.agents.episodes): seeds from
HELD_OUT_SEED on, block utilities measured from the real model on evaluation contexts
never used in training (at each context's own cache size, 12 KiB fp16 blocks), and
channels outside the training distribution (4-state never trained on; Gilbert-Elliott
and Bernoulli draws near these profiles are excluded from training).

``--stream handoff``: every cell's episodes send the planned handoff stream instead
(kvtransport.agents.episodes.handoff_table: the receiver computes a prefix, the rest goes in
prefix order at mixed int4/int8/fp16 precisions, so blocks differ in size and utility does
not decrease along the stream; a synthetic SmolLM2 cache of 300..1200 tokens per episode);
the policies were trained on utility-ordered streams only.

block-rs runs its parities through reedsolo (pure Python, ~1 s per MB), so it plays only
the first --block-rs-episodes episodes of each cell; the table gives each scheme's n.

Writes eval_policy.json (every utility, summaries, target checks), eval_policy.md (the
tables), eval_policy.png (original cells), eval_policy_high_rtt.png and
eval_policy_margin.png (the DDQN minus the best heuristic per cell, paired 95 % CIs) into
--out and prints the tables.

    .venv/bin/python scripts/eval_policy.py --episodes 24 --out results/eval_policy
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvtransport.eval.cells import REFERENCES, cell_key, is_high_rtt, run_cell
from kvtransport.eval.registries import (
    AUTO,
    add_prior_option,
    add_weights_option,
    make_scheme,
)
from kvtransport.eval.statistics import mean_ci, paired, significant

SCHEMES = (
    "none", "fixed:4/32", "block-rs:4/32", "arq", "adaptive", "tail-rule", "ddqn", "auto",
    "oracle",
)  # fmt: skip
CHANNELS = ("bernoulli-5", "ge-light", "ge-heavy", "4state-bursty")
RHOS = (0.6, 0.8, 1.0, 1.2)
HIGH_RTT_SCHEMES = ("tail-rule", "adaptive", "ddqn", "auto", "oracle")
HIGH_RTT_CHANNELS = ("bernoulli-5", "ge-heavy", "4state-bursty")
HIGH_RTT_DELAYS_MS = (20.0, 40.0, 80.0)
HIGH_RTT_RHOS = (0.7, 0.85, 1.0)
PAIRED = ("tail-rule", "adaptive")
"""Schemes the DDQN is compared with episode by episode in every cell's pairs table."""


def summarize(results: dict, schemes) -> dict:
    """Per cell: mean and CI per scheme, DDQN's paired margin over the best non-oracle
    scheme, and the target checks."""
    summary = {}
    for key, cell in results.items():
        s = {
            name: dict(zip(("mean", "ci95"), mean_ci(cell[name]), strict=True))
            for name in (*schemes, *REFERENCES)
            if name in cell
        }
        for name in s:
            s[name]["n"] = len(cell[name])
        if "ddqn" in cell:
            others = [m for m in schemes if m in cell and m not in ("ddqn", "oracle", AUTO)]
            if others:
                best = max(others, key=lambda m: s[m]["mean"])
                n = min(len(cell["ddqn"]), len(cell[best]))
                d = np.array(cell["ddqn"][:n]) - np.array(cell[best][:n])
                s["ddqn_minus_best_other"] = {
                    "scheme": best,
                    **dict(zip(("mean", "ci95"), mean_ci(d), strict=True)),
                }
            if "oracle" in cell:
                s["ddqn_over_oracle"] = s["ddqn"]["mean"] / s["oracle"]["mean"]
            s["ddqn_minus"] = {m: paired(cell["ddqn"], cell[m]) for m in PAIRED if m in cell}
            s["ddqn_vs"] = {m: paired(cell["ddqn"], cell[m]) for m in others}
        if "oracle" in cell and all(m in cell for m in PAIRED):
            best = max(PAIRED, key=lambda m: s[m]["mean"])
            s["oracle_headroom"] = {"over": best, **paired(cell["oracle"], cell[best])}
        if all(r in cell for r in REFERENCES):
            # each scheme's gap to both references (reference - scheme, same episodes) and
            # its share of the clairvoyant planner's utility (ratio of means)
            s["gap"] = {
                m: {r: paired(cell[r], cell[m]) for r in REFERENCES}
                | {"of_clairvoyant": s[m]["mean"] / s["clairvoyant"]["mean"]}
                for m in schemes
                if m in cell
            }
        summary[key] = s
    return summary


def targets(summary: dict) -> dict:
    """The issue's targets: DDQN >= every non-oracle scheme at rho <= 1 (means), and >= 95 %
    of the oracle on ge-heavy at rho 0.8; the DDQN and the product's pick (``auto``) each
    >= 95 % of the clairvoyant planner."""
    checks = {}
    for key, s in summary.items():
        channel, rho = key.rsplit("@", 1)
        for who in ("ddqn", AUTO):
            if who in s.get("gap", {}):
                share = s["gap"][who]["of_clairvoyant"]
                checks[f"{who} >= 95% of clairvoyant on {key}"] = {
                    "ok": share >= 0.95,
                    "ratio": share,
                }
        if is_high_rtt(key):  # does the DDQN beat both, beyond noise?
            for m, d in s.get("ddqn_minus", {}).items():
                checks[f"ddqn > {m} on {key} (paired CI)"] = {
                    "ok": d["mean"] - d["ci95"] > 0.0,
                    "margin": d["mean"],
                    "ci95": d["ci95"],
                    "high_rtt": True,
                }
            continue
        if float(rho) <= 1.0 and "ddqn_minus_best_other" in s:
            m = s["ddqn_minus_best_other"]
            checks[f"ddqn >= {m['scheme']} on {key}"] = {
                "ok": m["mean"] >= 0.0,
                "margin": m["mean"],
                "ci95": m["ci95"],
            }
        if channel == "ge-heavy" and float(rho) == 0.8 and "ddqn_over_oracle" in s:
            checks["ddqn >= 95% of oracle on ge-heavy@0.8"] = {
                "ok": s["ddqn_over_oracle"] >= 0.95,
                "ratio": s["ddqn_over_oracle"],
            }
    return checks


def markdown(summary: dict, schemes) -> str:
    head = "| channel | rho | " + " | ".join(schemes) + " | DDQN - best other | DDQN/oracle |"
    lines = [head, "|" + "---|" * (len(schemes) + 4)]
    for key, s in summary.items():
        channel, rho = key.rsplit("@", 1)
        cells = []
        for name in schemes:
            if name in s:
                m = s[name]
                cells.append(
                    f"{m['mean']:.4f} ± {m['ci95']:.4f}"
                    + (f" (n={m['n']})" if name.startswith("block-rs") else "")
                )
            else:
                cells.append("-")
        d = s.get("ddqn_minus_best_other")
        dtxt = f"{d['mean']:+.4f} ± {d['ci95']:.4f} vs {d['scheme']}" if d else "-"
        r = s.get("ddqn_over_oracle")
        lines.append(
            f"| {channel} | {rho} | "
            + " | ".join(cells)
            + f" | {dtxt} | "
            + (f"{r:.4f}" if r is not None else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


def markdown_pairs(summary: dict) -> str:
    """Per cell: the DDQN minus each of ``PAIRED`` on the same episodes, and the oracle's
    headroom over the better of them (mean ± 95 % CI; * where the CI excludes zero)."""

    def fmt(d: dict | None) -> str:
        if not d:
            return "-"
        star = "*" if abs(d["mean"]) > d["ci95"] else ""
        return f"{d['mean']:+.4f} ± {d['ci95']:.4f}{star}"

    head = "| cell | " + " | ".join(f"DDQN - {m}" for m in PAIRED) + " | oracle - best of them |"
    lines = [head, "|" + "---|" * (len(PAIRED) + 2)]
    for key, s in summary.items():
        pairs = s.get("ddqn_minus", {})
        h = s.get("oracle_headroom")
        lines.append(
            f"| {key} | "
            + " | ".join(fmt(pairs.get(m)) for m in PAIRED)
            + f" | {fmt(h)}{' (' + h['over'] + ')' if h else ''} |"
        )
    return "\n".join(lines) + "\n"


TAIL_OPTIMAL = 1e-3
"""The tail rule counts as already optimal in a cell where its mean gap to the clairvoyant
planner is below this (the constant action 0 leaves nothing a plan could add)."""


def markdown_margin(summary: dict) -> str:
    """Per cell: the DDQN minus the best heuristic (the scheme other than the DDQN and the
    oracle with the highest mean; paired, mean ± 95 % CI, * where the CI excludes zero),
    the DDQN's share of the clairvoyant planner, its significant wins and losses against
    every heuristic, and whether the constant tail rule is already optimal there. The last
    line counts them over the cells."""
    rows = [k for k, s in summary.items() if "ddqn_minus_best_other" in s]
    if not rows:
        return ""
    lines = [
        "| cell | best heuristic | DDQN - best heuristic | DDQN / clairvoyant | "
        "significant wins / losses | tail rule to clairvoyant |",
        "|---|---|---|---|---|---|",
    ]
    wins = losses = cells_lost = tail_opt = 0
    for key in rows:
        s = summary[key]
        d = s["ddqn_minus_best_other"]
        star = "*" if significant(d) else ""
        sig = {m: significant(v) for m, v in s.get("ddqn_vs", {}).items()}
        w = [m for m, v in sig.items() if v > 0]
        lo = [m for m, v in sig.items() if v < 0]
        wins += len(w)
        losses += len(lo)
        cells_lost += bool(lo)
        gap = s.get("gap", {})
        share = f"{gap['ddqn']['of_clairvoyant']:.4f}" if "ddqn" in gap else "-"
        tail = gap.get("tail-rule", {}).get("clairvoyant")
        if tail is not None:
            opt = tail["mean"] < TAIL_OPTIMAL
            tail_opt += opt
            ttxt = f"{tail['mean']:.4f}{' (optimal)' if opt else ''}"
        else:
            ttxt = "-"
        lines.append(
            f"| {key} | {d['scheme']} | {d['mean']:+.4f} ± {d['ci95']:.4f}{star} | {share} | "
            f"{len(w)} ({', '.join(w) or '-'}) / {len(lo)} ({', '.join(lo) or '-'}) | {ttxt} |"
        )
    lines.append(
        f"| {len(rows)} cells | | | | {wins} wins / {losses} losses "
        f"({cells_lost} cells with a loss) | tail rule optimal in {tail_opt} |"
    )
    return "\n".join(lines) + "\n"


def plot_margin(summary: dict, path: Path) -> None:
    """DDQN minus the best heuristic per cell, paired 95 % CI, one row per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [k for k, s in summary.items() if "ddqn_minus_best_other" in s]
    if not rows:
        return
    m = np.array([summary[k]["ddqn_minus_best_other"]["mean"] for k in rows])
    c = np.nan_to_num([summary[k]["ddqn_minus_best_other"]["ci95"] for k in rows])
    y = np.arange(len(rows))[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.22 * len(rows) + 1.2))
    colors = ["tab:green" if a - b > 0 else "tab:red" if a + b < 0 else "tab:gray"
              for a, b in zip(m, c, strict=True)]  # fmt: skip
    for xi, yi, ci, col in zip(m, y, c, colors, strict=True):
        ax.errorbar(xi, yi, xerr=ci, fmt="o", ms=3, color=col, capsize=2)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(y, [f"{k} (vs {summary[k]['ddqn_minus_best_other']['scheme']})"
                      for k in rows], fontsize=6)  # fmt: skip
    ax.set_xlabel("DDQN minus the best heuristic, same episodes (95 % CI)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_references(summary: dict, schemes) -> str:
    """Per cell: the genie bound and the clairvoyant planner (means), and for each scheme
    its gap to the planner / to the bound (reference minus scheme on the same episodes,
    mean ± 95 % CI) and its share of the planner's utility."""
    schemes = [m for m in schemes if any(m in s.get("gap", {}) for s in summary.values())]
    if not schemes:
        return ""
    head = "| cell | genie | clairvoyant | " + " | ".join(
        f"{m}: to clairvoyant / to genie (share)" for m in schemes
    )
    lines = [head + " |", "|" + "---|" * (len(schemes) + 3)]
    for key, s in summary.items():
        gap = s.get("gap")
        if not gap:
            continue
        cells = []
        for m in schemes:
            g = gap.get(m)
            cells.append(
                "-"
                if g is None
                else f"{g['clairvoyant']['mean']:.4f} ± {g['clairvoyant']['ci95']:.4f} / "
                f"{g['genie']['mean']:.4f} ± {g['genie']['ci95']:.4f} "
                f"({g['of_clairvoyant']:.3f})"
            )
        lines.append(
            f"| {key} | {s['genie']['mean']:.4f} | {s['clairvoyant']['mean']:.4f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot_high_rtt(summary: dict, schemes, path: Path) -> None:
    """High-RTT cells: one panel per (rho, channel), utility (95 % CI) against the one-way
    delay, one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = {}
    for key in summary:
        head, rho = key.rsplit("@", 1)
        if "+" not in head:
            continue
        channel, delay = head.split("+", 1)
        cells.setdefault((float(rho), channel), []).append((float(delay[:-2]), key))
    if not cells:
        return
    rhos = sorted({r for r, _ in cells})
    channels = sorted({c for _, c in cells}, key=lambda c: (
        CHANNELS.index(c) if c in CHANNELS else 99, c))  # fmt: skip
    fig, axes = plt.subplots(len(rhos), len(channels), squeeze=False,
                             figsize=(4.0 * len(channels), 3.0 * len(rhos)))  # fmt: skip
    for i, rho in enumerate(rhos):
        for j, ch in enumerate(channels):
            ax = axes[i][j]
            pts = sorted(cells.get((rho, ch), []))
            x = [d for d, _ in pts]
            for name in schemes:
                m = [summary[k][name]["mean"] if name in summary[k] else np.nan for _, k in pts]
                c = [summary[k][name]["ci95"] if name in summary[k] else np.nan for _, k in pts]
                ax.errorbar(x, m, yerr=c, marker="o", ms=3, capsize=2, label=name,
                            lw=2.2 if name == "ddqn" else 1.0)  # fmt: skip
            ax.set_title(f"{ch}, rho {rho:g}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(rhos) - 1:
                ax.set_xlabel("one-way delay (ms)")
            if j == 0:
                ax.set_ylabel("utility before deadline")
    axes[0][-1].legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(summary: dict, schemes, path: Path, results: dict | None = None) -> None:
    """Top row: mean utility with 95 % CIs per channel. Bottom row (with ``results``):
    each scheme minus the oracle on the same episodes, in thousandths, where the close
    schemes can be told apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    channels = sorted({k.rsplit("@", 1)[0] for k in summary}, key=lambda c: (
        CHANNELS.index(c) if c in CHANNELS else 99, c))  # fmt: skip
    rows = 2 if results is not None and "oracle" in schemes else 1
    fig, axes = plt.subplots(rows, len(channels), figsize=(4.2 * len(channels), 3.6 * rows),
                             squeeze=False, sharex=True)  # fmt: skip
    for col, ch in enumerate(channels):
        keys = sorted((k for k in summary if k.startswith(ch + "@")),
                      key=lambda k: float(k.rsplit("@", 1)[1]))  # fmt: skip
        rhos = [float(k.rsplit("@", 1)[1]) for k in keys]
        ax = axes[0][col]
        for name in schemes:
            m = [summary[k][name]["mean"] if name in summary[k] else np.nan for k in keys]
            c = [summary[k][name]["ci95"] if name in summary[k] else np.nan for k in keys]
            style = "-" if name in ("ddqn", "oracle", "adaptive") else "--"
            ax.errorbar(rhos, m, yerr=c, fmt=style, marker="o", ms=3, capsize=2, label=name,
                        lw=2.2 if name == "ddqn" else 1.0)  # fmt: skip
        ax.set_title(ch)
        ax.grid(alpha=0.3)
        if rows == 2:
            ax2 = axes[1][col]
            for name in schemes:
                if name == "oracle":
                    continue
                d = []
                for k in keys:
                    cell = results[k]
                    n = min(len(cell.get(name, [])), len(cell["oracle"]))
                    diff = np.array(cell.get(name, [])[:n]) - np.array(cell["oracle"][:n])
                    d.append(1e3 * diff.mean() if n else np.nan)
                style = "-" if name in ("ddqn", "adaptive", "arq") else "--"
                ax2.plot(rhos, d, style, marker="o", ms=3, label=name,
                         lw=2.2 if name == "ddqn" else 1.0)  # fmt: skip
            ax2.axhline(0.0, color="k", lw=0.8)
            ax2.set_ylim(-4.0, 2.0)
            ax2.grid(alpha=0.3)
            ax2.set_xlabel("rho (deadline / loss-free send time)")
        else:
            ax.set_xlabel("rho (deadline / loss-free send time)")
    axes[0][0].set_ylabel("utility recovered before the deadline")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    if rows == 2:
        axes[1][0].set_ylabel("minus oracle, same episodes (x 1e-3)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--episodes", type=int, default=24, help="episodes per cell (default 24)")
    p.add_argument(
        "--block-rs-episodes",
        type=int,
        default=6,
        help="episodes per cell for block-rs (slow; default 6)",
    )
    p.add_argument("--channels", default=",".join(CHANNELS), help="comma-separated profiles")
    p.add_argument("--profiles", metavar="FILE",
                   help="a profiles file (TOML or JSON, as netem/data/profiles.toml) whose "
                   "names --channels and --high-rtt-channels may use, e.g. "
                   "netem/data/held-out.toml (channels the shipped policy never trained "
                   "on)")  # fmt: skip
    p.add_argument("--rhos", default=",".join(map(str, RHOS)), help="comma-separated rhos")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes")
    p.add_argument(
        "--set",
        choices=("all", "original", "high-rtt"),
        default="all",
        help="cells: the 4 channels x 4 rho (original), the long-link cells (high-rtt) or "
        "both (default all)",
    )
    p.add_argument("--high-rtt-channels", default=",".join(HIGH_RTT_CHANNELS),
                   help="profiles of the high-RTT cells")  # fmt: skip
    p.add_argument("--high-rtt-delays", default=",".join(f"{d:g}" for d in HIGH_RTT_DELAYS_MS),
                   help="one-way delays (ms) of the high-RTT cells")  # fmt: skip
    p.add_argument("--high-rtt-rhos", default=",".join(f"{r:g}" for r in HIGH_RTT_RHOS),
                   help="rhos of the high-RTT cells")  # fmt: skip
    p.add_argument("--high-rtt-schemes", default=",".join(HIGH_RTT_SCHEMES),
                   help="schemes played in the high-RTT cells")  # fmt: skip
    p.add_argument("--high-rtt-episodes", type=int, default=40,
                   help="episodes per high-RTT cell (default 40)")  # fmt: skip
    add_weights_option(p)
    add_prior_option(p)
    p.add_argument("--no-queue-guard", action="store_true",
                   help="the senders pace at the link rate even while the path's queue "
                   "builds (kvtransport.hosts.queue_guard)")  # fmt: skip
    p.add_argument("--no-references", action="store_true",
                   help="skip the genie bound and the clairvoyant planner (the planner "
                   "plays its own search set on every episode)")  # fmt: skip
    p.add_argument(
        "--utility",
        default="measured",
        help="block utilities: measured (held-out contexts) or zipf:S, flat, linear",
    )
    p.add_argument("--stream", choices=("utility", "handoff"), default="utility",
                   help="what the episodes send: equal blocks in utility order (the default) "
                   "or the planned handoff stream (prefix order, mixed precisions; "
                   "kvtransport.agents.episodes.handoff_table)")  # fmt: skip
    p.add_argument("--out", default="results/eval_policy", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    import kvtransport.agents  # noqa: F401  (registers ddqn)
    from kvtransport.netem.profiles import ProfileError, load_profile
    from tqdm import tqdm

    def names(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    schemes = names(args.schemes)
    hi_schemes = names(args.high_rtt_schemes)
    for s in dict.fromkeys(schemes + hi_schemes):
        make_scheme("ddqn" if s == AUTO else s, args.weights)  # fail fast on a bad name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # (channel, rho, delay or None, schemes, episodes)
    cells = []
    if args.set in ("all", "original"):
        for c in names(args.channels):
            for r in names(args.rhos):
                cells.append((c, float(r), None, schemes, args.episodes))
    if args.set in ("all", "high-rtt"):
        for c in names(args.high_rtt_channels):
            for d in names(args.high_rtt_delays):
                for r in names(args.high_rtt_rhos):
                    cells.append((c, float(r), float(d), hi_schemes, args.high_rtt_episodes))
    try:  # each channel once (a bad file or name: one line, before any cell runs)
        profiles = {c: load_profile(c, args.profiles) for c in {cell[0] for cell in cells}}
    except ProfileError as exc:
        p.error(str(exc))
    results = {}
    for ch, rho, delay, sch, n in tqdm(cells, desc="eval cells", disable=args.quiet,
                                       file=sys.stderr):  # fmt: skip
        results[cell_key(ch, rho, delay)] = run_cell(
            profiles[ch], rho, sch, n, args.block_rs_episodes, args.weights, args.utility, delay,
            references=not args.no_references, prior=args.prior, stream=args.stream,
            queue_guard=not args.no_queue_guard,
        )  # fmt: skip
    all_schemes = list(dict.fromkeys(schemes + hi_schemes))
    summary = summarize(results, all_schemes)
    checks = targets(summary)
    original = {k: v for k, v in summary.items() if not is_high_rtt(k)}
    high = {k: v for k, v in summary.items() if k not in original}
    table = ""
    if original:
        table += markdown(original, schemes) + "\n" + markdown_pairs(original)
        refs = markdown_references(original, schemes)
        table += ("\nGaps to the references:\n\n" + refs) if refs else ""
    if high:
        table += ("\n" if table else "") + "High-RTT cells (one-way delay both ways):\n\n"
        table += markdown(high, hi_schemes) + "\n" + markdown_pairs(high)
        refs = markdown_references(high, hi_schemes)
        table += ("\nGaps to the references:\n\n" + refs) if refs else ""
    margin = markdown_margin(summary)
    if margin:
        table += "\nDDQN against the best heuristic, per cell:\n\n" + margin
    doc = {
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "episodes": args.episodes,
        "high_rtt_episodes": args.high_rtt_episodes,
        "block_rs_episodes": args.block_rs_episodes,
        "utility": args.utility,
        "prior": args.prior,
        "stream": args.stream,
        "queue_guard": not args.no_queue_guard,
        "weights": args.weights or "shipped",
        "wall_s": time.perf_counter() - t0,
        "summary": summary,
        "targets": checks,
        "utilities": results,
    }
    (out / "eval_policy.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "eval_policy.md").write_text(table)
    if original:
        plot(original, schemes, out / "eval_policy.png", results)
    if high:
        plot_high_rtt(high, hi_schemes, out / "eval_policy_high_rtt.png")
    if margin:
        plot_margin(summary, out / "eval_policy_margin.png")
    print(table)
    for name, c in checks.items():
        print(
            ("PASS " if c["ok"] else "MISS ")
            + name
            + "  "
            + ", ".join(f"{k}={v:+.5f}" for k, v in c.items() if k not in ("ok", "high_rtt"))
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
