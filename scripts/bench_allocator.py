"""Time per slot of the multi-user allocator, 2..32 transfers (issue 6).

A slot's decision is ``UtilityWaterFilling.allocate``: admission (greedy + screened local
search), nested water-filling to every deadline and value-first serving of the slot. It
runs every 10 ms in the sender daemon while more than one transfer shares the link, so it
must take a small share of that. States are drawn at random: sizes from 2 to 12 MB, the
packaged SmolLM2 accuracy curves, delivered fractions from 0 to 60 %, deadlines 0 to
500 ms ahead (``--deadlines staggered``) or all the same (``together``), a 100 Mbit/s
link. Every state is timed after a warm-up call; the table gives the median and the 90th
percentile per slot, and, measured in the same run, the equal-share baseline's time and
the ratio (the machine is noisy: compare ratios, not absolute times across runs).

    .venv/bin/python scripts/bench_allocator.py --json results/bench_allocator.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def random_state(rng: np.random.Generator, n: int, curves: list, together: bool) -> list:
    from kvtransport.scheduling.allocator import ScheduledTransfer

    out = []
    for i in range(n):
        size = float(rng.uniform(2e6, 12e6))
        deadline = 0.5 if together else float(rng.uniform(0.02, 0.5))
        cv = curves[int(rng.integers(len(curves)))]
        delivered = size * float(rng.uniform(0.0, 0.6)) * float(rng.random() < 0.7)
        out.append(ScheduledTransfer(i, size, deadline, cv.utility, 1.0, 0.0, delivered))
    return out


def time_policy(make, states: list, capacity: float, slot_s: float) -> np.ndarray:
    """Seconds per allocate() call, one per state (after one warm-up call each)."""
    times = []
    for active in states:
        pol = make()
        pol.allocate(0.0, slot_s, capacity, active)  # warm-up (numba, caches)
        pol = make()
        t0 = time.perf_counter()
        pol.allocate(0.0, slot_s, capacity, active)
        times.append(time.perf_counter() - t0)
    return np.array(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--users", default="2,4,8,16,32", help="transfers per slot (default 2..32)")
    p.add_argument("--states", type=int, default=40, help="random states per size (default 40)")
    p.add_argument("--deadlines", default="staggered,together", help="staggered and/or together")
    p.add_argument("--rate-mbps", type=float, default=100.0)
    p.add_argument("--slot-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)

    from tqdm import tqdm

    from kvtransport.scheduling.allocator import EqualShare, UtilityWaterFilling
    from kvtransport.scheduling.utility_model import UtilityTable, packaged_model_ids

    model = packaged_model_ids()[0]
    curves = list(UtilityTable.packaged(model))
    capacity = args.rate_mbps * 1e6 / 8.0
    slot_s = args.slot_ms * 1e-3
    rng = np.random.default_rng(args.seed)
    rows = []
    cells = [
        (mode, int(n))
        for mode in args.deadlines.split(",")
        for n in args.users.split(",")
        if mode.strip()
    ]
    for mode, n in tqdm(cells, desc="sizes", file=sys.stderr):
        states = [random_state(rng, n, curves, mode == "together") for _ in range(args.states)]
        wf = time_policy(UtilityWaterFilling, states, capacity, slot_s)
        eq = time_policy(EqualShare, states, capacity, slot_s)
        rows.append(
            {
                "deadlines": mode,
                "users": n,
                "states": args.states,
                "allocator_median_ms": float(np.median(wf)) * 1e3,
                "allocator_p90_ms": float(np.quantile(wf, 0.9)) * 1e3,
                "allocator_max_ms": float(wf.max()) * 1e3,
                "equal_share_median_ms": float(np.median(eq)) * 1e3,
                "ratio_to_equal_share": float(np.median(wf) / np.median(eq)),
                "share_of_slot": float(np.median(wf)) / slot_s,
            }
        )
    print(
        f"{'deadlines':<10} {'N':>3} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} "
        f"{'equal ms':>9} {'ratio':>7} {'of slot':>8}"
    )
    for r in rows:
        print(
            f"{r['deadlines']:<10} {r['users']:>3} {r['allocator_median_ms']:>10.3f} "
            f"{r['allocator_p90_ms']:>8.3f} {r['allocator_max_ms']:>8.3f} "
            f"{r['equal_share_median_ms']:>9.3f} {r['ratio_to_equal_share']:>7.1f} "
            f"{r['share_of_slot']:>8.1%}"
        )
    if args.json:
        doc = {
            "meta": {
                "model": model,
                "rate_mbps": args.rate_mbps,
                "slot_ms": args.slot_ms,
                "states": args.states,
                "seed": args.seed,
            },
            "rows": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
