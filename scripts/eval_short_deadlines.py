#!/usr/bin/env python3
"""Repair schemes on long links with short deadlines, in bands of round trips, paired.

For each band LO-HI of deadlines (in round trips of the link), --episodes episodes drawn
as ``kvtransport train --eval-hard`` draws its validation episodes
(kvtransport.agents.training.hard_validation_specs: long links only, one way 20-90 ms, rates
in the upper half of --rate-range on a log scale, synthetic utilities sized so that the
deadline falls in the band, Gilbert-Elliott or Bernoulli loss outside the held-out
neighbourhoods, no loss prior), but with draws and seeds of their own (--draw-seed), so that
no training run validated on them. Every scheme plays the same episodes; per band: each
scheme's mean utility recovered before the deadline, its paired difference against
--against with a 95 % t-interval, and the worst single episode. ``auto`` plays what a
shell picks for the episode when told none (kvtransport.hosts.policy_choice.default_policy_for).
docs/results.md quotes these figures (issue 16: the short-deadline rule).

    .venv/bin/python scripts/eval_short_deadlines.py --out results/short_deadlines

Writes eval_short_deadlines.json and eval_short_deadlines.md under --out.
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
    add_weights_option,
    check_schemes,
    make_scheme,
    product_choice,
)
from kvtransport.eval.statistics import mean_ci


def _play(job: tuple) -> float:
    """Utility one scheme recovers on one episode (a worker process's job); the ``ddqn``
    scheme (also where ``auto`` picks it) plays ``weights`` if given."""
    scheme, spec, weights = job
    import kvtransport.agents  # noqa: F401  (registers ddqn)
    from kvtransport.agents.training import play

    return play(spec, make_scheme(product_choice(spec) if scheme == AUTO else scheme, weights))


def _bands(text: str) -> list[tuple[float, float]]:
    bands = []
    for part in text.split(":"):
        lo, hi = (float(x) for x in part.split(","))
        if not 0 < lo < hi:
            raise ValueError(part)
        bands.append((lo, hi))
    return bands


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--bands", default="1,1.5:1.5,2:2,2.5:2,3:3,5:5,10",
                   help="deadline bands in round trips, LO,HI:LO,HI:...")  # fmt: skip
    p.add_argument("--episodes", type=int, default=80, help="episodes per band (default 80)")
    p.add_argument("--rate-range", default=None,
                   help="the trained rate range, Mbit/s, LO,HI (default: the shipped "
                        "network's, from its sidecar)")  # fmt: skip
    p.add_argument("--schemes", default="adaptive,tail-rule,ddqn,auto", help="schemes")
    p.add_argument("--against", default="adaptive", help="the scheme differences are against")
    p.add_argument("--draw-seed", type=int, default=7, help="seed of the episode draws")
    add_weights_option(p, also=" and the default rate range")
    p.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    p.add_argument("--out", default="results/short_deadlines", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.rate_range is None:
        from kvtransport.policies.ddqn import shipped_distribution

        rates = (shipped_distribution() or {}).get("rate_range_mbps")
        if not isinstance(rates, list):
            p.error("the shipped network's sidecar names no rate range: give --rate-range LO,HI")
        args.rate_range = ",".join(f"{r:g}" for r in rates)
    try:
        bands = _bands(args.bands)
        lo, hi = (float(x) for x in args.rate_range.split(","))
    except ValueError:
        p.error("--bands must be LO,HI:LO,HI with 0 < LO < HI, --rate-range LO,HI")
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if args.against not in schemes:
        p.error(f"--against {args.against!r} is not among --schemes")
    if args.episodes < 2 or args.workers < 1:
        p.error("--episodes must be at least 2, --workers at least 1")
    import kvtransport.agents  # noqa: F401  (registers ddqn)
    from kvtransport.agents.training import HARD_VALIDATION_SEED, TrainConfig, hard_validation_specs
    from tqdm import tqdm

    from kvtransport.errors import UserError

    try:
        check_schemes(schemes, args.weights)
    except UserError as exc:
        p.error(str(exc))
    cfg = TrainConfig(distribution={"rate_range_mbps": (lo, hi), "prior_weights": {"none": 1.0}})
    first = HARD_VALIDATION_SEED + (1 << 28)  # apart from any validation's seeds
    specs = {
        band: hard_validation_specs(cfg, args.episodes, band, args.draw_seed + i, first)
        for i, band in enumerate(bands)
    }
    jobs = [(s, spec, args.weights) for band in bands for spec in specs[band] for s in schemes]
    with ProcessPoolExecutor(args.workers) as pool:
        got = list(tqdm(pool.map(_play, jobs, chunksize=4), total=len(jobs),
                        disable=args.quiet, desc="episodes", file=sys.stderr))  # fmt: skip
    it = iter(got)
    table: dict[str, dict] = {}
    for band in bands:
        u = {s: [] for s in schemes}
        for _spec in specs[band]:
            for s in schemes:
                u[s].append(next(it))
        base = np.array(u[args.against])
        key = f"{band[0]:g}-{band[1]:g}"
        table[key] = {
            "utilities": u,
            "mean": {s: float(np.mean(v)) for s, v in u.items()},
            "vs": {s: mean_ci(np.array(v) - base) for s, v in u.items() if s != args.against},
            "worst": {
                s: float(np.min(np.array(v) - base)) for s, v in u.items() if s != args.against
            },  # fmt: skip
        }
    others = [s for s in schemes if s != args.against]
    head = ["deadline, round trips", *(f"{s} - {args.against}" for s in others),
            *(f"{s}: worst episode" for s in others)]  # fmt: skip
    rows = []
    for key, c in table.items():
        rows.append([key, *(f"{c['vs'][s][0]:+.4f} ± {c['vs'][s][1]:.4f}" for s in others),
                     *(f"{c['worst'][s]:+.3f}" for s in others)])  # fmt: skip
    md = md_table(head, rows) + f"\n({args.episodes} episodes per band, paired, 95 % t-interval)\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "args": vars(args), "bands": table}
    (out / "eval_short_deadlines.json").write_text(json.dumps(record, indent=1))
    (out / "eval_short_deadlines.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
