#!/usr/bin/env python3
"""What a receiver's hole list costs per feedback (kvtransport.core.feedback.loss_ranges).

A receiver's window of --window ESIs with --holes lost symbols spread over it; the list the
feedback carries (at most MAX_FEEDBACK_RANGES ranges) is built leaving out the holes that
pending equations are pivoted on, for 0 to the decoder's ``max_pending`` (2,048) pivots.
Best of --rounds, microseconds per feedback. While losses come a receiver sends one up to
every millisecond (MIN_FEEDBACK_GAP), so 100 us is then a tenth of a core.

    .venv/bin/python scripts/bench_feedback.py           # a few seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvtransport.core.feedback import loss_ranges
from kvtransport.core.wire import MAX_FEEDBACK_RANGES
from kvtransport.eval.statistics import best_seconds

PIVOTS = (0, 20, 256, 2048)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--window", type=int, default=32768, help="ESIs in the window")
    p.add_argument("--holes", type=int, default=3000, help="lost symbols in it")
    p.add_argument("--rounds", type=int, default=50, help="rounds (best kept)")
    p.add_argument("--out", default="results/bench_feedback.json", help="JSON file to write")
    args = p.parse_args(argv)
    if not 1 <= args.holes <= args.window or max(PIVOTS) > args.holes or args.rounds < 1:
        p.error(f"need {max(PIVOTS)} <= --holes <= --window and --rounds >= 1")
    rng = np.random.default_rng(0)
    known = bytearray(b"\x01") * args.window
    holes = rng.choice(args.window, args.holes, replace=False)
    for h in holes.tolist():
        known[h] = 0
    rows = {}
    print(f"hole list per feedback, us ({args.holes} holes in {args.window} ESIs)")
    for n in PIVOTS:
        pivots = np.sort(rng.choice(holes, n, replace=False))
        rows[n] = 1e6 * best_seconds(
            lambda p=pivots: loss_ranges(known, 0, args.window, MAX_FEEDBACK_RANGES, p),
            args.rounds,
        )
        print(f"  {n:5d} pivots  {rows[n]:7.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "us": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
