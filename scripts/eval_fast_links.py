#!/usr/bin/env python3
"""Repair schemes on fast and long links, side by side, paired over seeds.

Each scheme plays the same simulated transfers (`kvtransport simulate`'s: a synthetic
stream of --size-mb with zipf block utilities, feedback over an independent draw of the
same channel) on a grid of channels x link rates x one-way delays x rhos, seeds 1..--seeds.
Per cell: each scheme's mean utility recovered before the deadline, and every scheme's
paired difference against --against (same seed, same channel draws) with a 95 %
t-interval. ``auto`` is what a shell picks when told no policy
(kvtransport.hosts.policy_choice.default_policy_for with the link's rate, the deadline and
--prior: adaptive where the link's bandwidth-delay product exceeds the shipped DDQN's
training, or 24 Mbit with a prior, or the deadline is under two round trips of a long
link, else the DDQN).
docs/results.md quotes these figures for links faster than the DDQN's training.

    .venv/bin/python scripts/eval_fast_links.py --out results/fast_links

Writes eval_fast_links.json and eval_fast_links.md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from kvtransport.eval.figures import md_table
from kvtransport.eval.registries import (
    AUTO,
    add_prior_option,
    add_weights_option,
    check_schemes,
    make_scheme,
)
from kvtransport.eval.statistics import mean_ci


def _play(job: tuple[str, str, float, float, float, int, float, str | None, str]) -> float:
    """Utility one scheme recovers on one cell and seed (a worker process's job); the
    ``ddqn`` scheme (also where ``auto`` picks it) plays ``weights`` if given; the sender
    starts from the loss prior of kind ``prior`` (agents.episodes.episode_prior)."""
    scheme, channel, rate_mbps, delay_ms, rho, seed, size_mb, weights, prior = job
    from kvtransport.agents.episodes import episode_prior
    from kvtransport.netem.profiles import load_profile

    from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE
    from kvtransport.core.wire import full_send_time
    from kvtransport.hosts.policy_choice import default_policy_for
    from kvtransport.sim.simulator import simulate

    prior_loss = episode_prior(prior, load_profile(channel), seed)
    if scheme == AUTO:
        send_s = full_send_time(int(size_mb * 1e6), rate_mbps * 1e6, DEFAULT_SYMBOL_SIZE)
        scheme = default_policy_for(
            delay_ms * 1e-3, False, rate_mbps * 1e6, rho * send_s, prior_loss is not None
        )
    return simulate(
        channel=channel, rate_mbps=rate_mbps, delay_ms=delay_ms, rho=rho,
        size_bytes=int(size_mb * 1e6), policy=make_scheme(scheme, weights), seed=seed,
        record=False, prior_loss=prior_loss,
    ).utility_recovered  # fmt: skip


def cell_key(channel: str, rate_mbps: float, delay_ms: float, rho: float) -> str:
    return f"{channel} {rate_mbps:g}Mbps+{delay_ms:g}ms@{rho:g}"


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``a - b`` per seed and the half-width of its 95 % t-interval (eval_policy's
    ``mean_ci``; nan with one seed)."""
    return mean_ci(np.subtract(a, b))


def markdown(cells: dict, schemes: list[str], against: str) -> str:
    others = [s for s in schemes if s != against]
    head = ["cell", *schemes, *(f"{s} - {against}" for s in others)]
    rows = []
    for key, c in cells.items():
        row = [key, *(f"{c['mean'][s]:.4f}" for s in schemes)]
        for s in others:
            m, ci = c["vs"][s]
            row.append(f"{m:+.4f} ± {ci:.4f}" + (" *" if abs(m) > ci else ""))
        rows.append(row)
    return md_table(head, rows) + "\n(* the 95 % interval excludes 0; paired over seeds)\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--channels", default="ge-heavy,ge-light,bernoulli-5,loss 2%",
                   help="comma-separated profiles or netem loss strings")  # fmt: skip
    p.add_argument("--rates", default="400,1000", help="link rates, Mbit/s")
    p.add_argument("--delays", default="40,80", help="one-way delays, ms")
    p.add_argument("--rhos", default="1,2", help="deadline / loss-free send time")
    p.add_argument("--seeds", type=int, default=4, help="seeds 1..N per cell (default 4)")
    p.add_argument("--size-mb", type=float, default=20.0, help="stream size (default 20)")
    p.add_argument("--schemes", default="adaptive,ddqn,auto", help="schemes (auto: the pick)")
    p.add_argument("--against", default="adaptive", help="the scheme differences are against")
    p.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    add_weights_option(p)
    add_prior_option(p)
    p.add_argument("--out", default="results/fast_links", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def floats(text: str, what: str) -> list[float]:
        try:
            return [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            p.error(f"{what} must be comma-separated numbers, not {text!r}")

    channels = [c.strip() for c in args.channels.split(",") if c.strip()]
    rates, delays = floats(args.rates, "--rates"), floats(args.delays, "--delays")
    rhos = floats(args.rhos, "--rhos")
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if args.against not in schemes:
        p.error(f"--against {args.against!r} is not among --schemes")
    if args.seeds < 1 or args.workers < 1 or not args.size_mb > 0:
        p.error("--seeds and --workers must be at least 1, --size-mb positive")
    from kvtransport.netem.profiles import ProfileError, load_profile

    from kvtransport.errors import UserError

    try:
        check_schemes(schemes, args.weights)
        for c in channels:
            load_profile(c)
    except (UserError, ProfileError) as exc:
        p.error(str(exc))
    grid = [(c, r, d, rho) for c in channels for r in rates for d in delays for rho in rhos]
    jobs = [(s, *g, seed, args.size_mb, args.weights, args.prior) for g in grid
            for seed in range(1, args.seeds + 1) for s in schemes]  # fmt: skip
    from tqdm import tqdm

    try:
        with ProcessPoolExecutor(args.workers) as pool:
            got = list(tqdm(pool.map(_play, jobs), total=len(jobs), disable=args.quiet,
                            desc="transfers", file=sys.stderr))  # fmt: skip
    except UserError as exc:  # a cell the sender refuses (its deadline is shorter than the path)
        p.error(f"{exc} (a larger --size-mb or --rhos, or shorter --delays)")
    utilities: dict[str, dict[str, list[float]]] = {}
    for (s, c, r, d, rho, *_), u in zip(jobs, got, strict=True):
        utilities.setdefault(cell_key(c, r, d, rho), {}).setdefault(s, []).append(u)
    cells = {
        key: {
            "utilities": u,
            "mean": {s: sum(v) / len(v) for s, v in u.items()},
            "vs": {s: paired(u[s], u[args.against]) for s in schemes if s != args.against},
        }
        for key, u in utilities.items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "args": vars(args), "cells": cells}
    (out / "eval_fast_links.json").write_text(json.dumps(record, indent=1))
    table = markdown(cells, schemes, args.against)
    (out / "eval_fast_links.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
