"""The allocator before and after a change, paired, in one run of the multi-user grid.

Runs eval_multiuser's scenarios (same handovers, same channel seeds) under the three
baselines, the allocator as a git revision has it (``--before``, default ``main``: its
kvtransport/scheduling/allocator.py loaded as a module of its own) and the allocator of this
tree, and prints per cell the mean accuracy of each, the ratios to one clairvoyant bound
(fed the best efficiency of all five, so both allocators are measured against the same
bound), and paired differences over the seeds with 95 % t intervals:

    after - before, after - best baseline (per seed), before - best baseline.

The simulator runs on a virtual clock, so every figure is deterministic per seed.

    .venv/bin/python scripts/compare_allocators.py --channel bernoulli-5 \\
        --users 3,6,12 --rates 200,1000 --seeds 8 --out results/compare_allocators
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.eval.args import parse_floats, parse_ints
from kvtransport.eval.multiuser import BYTES_PER_TOKEN, parse_arrivals, run_scenario, scenario
from kvtransport.eval.registries import make_allocator

BASELINES = ("equal-share", "proportional", "edf")
BEFORE, AFTER = "wf-before", "wf-after"


def load_allocator(rev: str) -> Any:
    """kvtransport/scheduling/allocator.py as git revision ``rev`` has it, as its own module."""
    root = Path(__file__).resolve().parent.parent
    try:
        text = subprocess.run(
            ["git", "show", f"{rev}:kvtransport/scheduling/allocator.py"],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"--before {rev}: {exc.stderr.strip()}") from None
    path = Path(tempfile.mkdtemp(prefix="allocator_before_")) / "allocator_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("allocator_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["allocator_before"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def paired(diffs: list[float]) -> dict[str, float]:
    """Mean and 95 % t interval of paired differences."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    m = float(d.mean())
    if d.size < 2:
        return {"mean": m, "lo": float("nan"), "hi": float("nan"), "n": int(d.size)}
    half = float(stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size))
    return {"mean": m, "lo": m - half, "hi": m + half, "n": int(d.size)}


def run_cell(
    hs: list[Any],
    rate: float,
    channel: str,
    seed: int,
    before_mod: Any,
    baselines: tuple[str, ...] = BASELINES,
) -> dict[str, Any]:
    """eval_multiuser's run_scenario with the two allocators under names of their own."""
    from kvtransport.scheduling import allocator as al

    def factory(name: str, one_way_s: float) -> Any:
        mod = {BEFORE: before_mod, AFTER: al}.get(name)
        if mod is None:
            return make_allocator(name, one_way_s)
        return mod.UtilityWaterFilling(guard_s=al.repair_guard_s(one_way_s))

    return run_scenario(
        hs, rate, channel=channel, fluid=False, seed=seed,
        policies=(*baselines, BEFORE, AFTER), factory=factory,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default="main", help="git revision of the allocator before")
    p.add_argument("--channel", default="bernoulli-5", help="netem profile(s), comma-separated")
    p.add_argument("--users", default="3,6,12")
    p.add_argument("--rates", default="200,1000")
    p.add_argument("--arrivals", default="together,staggered:0.3")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--baselines", default=",".join(BASELINES), help="baselines to run")
    p.add_argument("--out", default="results/compare_allocators")
    args = p.parse_args(argv)

    from kvtransport.scheduling.utility_model import UtilityTable, packaged_model_ids

    model_id = packaged_model_ids()[0]
    table = UtilityTable.packaged(model_id)
    if table is None:
        raise SystemExit(f"no packaged utility table for {model_id}")
    curves = [cv for cv in table if cv.model == model_id]
    before_mod = load_allocator(args.before)
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    if any(b not in BASELINES for b in baselines) or not baselines:
        raise SystemExit(f"--baselines: choose from {', '.join(BASELINES)}")
    channels = [c.strip() for c in args.channel.split(",") if c.strip()]
    arrivals = [a.strip() for a in args.arrivals.split(",") if a.strip()]
    for a in arrivals:
        parse_arrivals(a)
    rows = []
    t0 = time.perf_counter()
    for ch in channels:
        for rate in parse_floats(args.rates):
            for arr in arrivals:
                for n in parse_ints(args.users):
                    for seed in range(args.seeds):
                        hs = scenario(n, arr, seed, curves, window_s=0.5,
                                      bytes_per_token=BYTES_PER_TOKEN)  # fmt: skip
                        row = run_cell(hs, rate, ch, seed + 1, before_mod, baselines)
                        rows.append({"channel": ch, "rate_mbps": rate, "arrivals": arr,
                                     "users": n, "seed": seed, **row})  # fmt: skip
                        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["channel"], r["rate_mbps"], r["arrivals"], r["users"]), []).append(r)
    summary = []
    names = (*baselines, BEFORE, AFTER)
    for key, rs in groups.items():
        acc = {k: [r["policies"][k]["accuracy"] for r in rs] for k in names}
        best_base = [max(r["policies"][k]["accuracy"] for k in baselines) for r in rs]
        summary.append({
            "channel": key[0], "rate_mbps": key[1], "arrivals": key[2], "users": key[3],
            "seeds": len(rs),
            "accuracy": {k: float(np.mean(v)) for k, v in acc.items()},
            "ratio": {k: float(np.mean([r["policies"][k]["ratio"] for r in rs])) for k in names},
            "ratio_min": {k: float(min(r["policies"][k]["ratio"] for r in rs)) for k in names},
            "after_minus_before": paired(list(np.subtract(acc[AFTER], acc[BEFORE]))),
            "after_minus_best_baseline": paired(list(np.subtract(acc[AFTER], best_base))),
            "before_minus_best_baseline": paired(list(np.subtract(acc[BEFORE], best_base))),
            "identical": bool(np.array_equal(acc[AFTER], acc[BEFORE])),
        })  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {"before": args.before, "seconds": round(time.perf_counter() - t0, 1),
                 "command": "scripts/compare_allocators.py " + " ".join(argv or sys.argv[1:])},
        "summary": summary,
        "scenarios": rows,
    }  # fmt: skip
    (out / "compare.json").write_text(json.dumps(doc, indent=1))

    def ci(d: dict[str, float]) -> str:
        return f"{d['mean']:+.4f} [{d['lo']:+.4f},{d['hi']:+.4f}]"

    short = {"equal-share": "equal", "proportional": "prop", "edf": "edf"}
    print(f"{'channel':<12}{'rate':>5} {'arrivals':<13}{'N':>3} "
          + "".join(f"{short[b]:>6} " for b in baselines)
          + f"{'before':>6} {'after':>6} {'b/clv':>6} {'a/clv':>6} {'a_min':>6}  "
          f"{'after-before':<27} {'after-best base':<27} {'before-best base':<27}")  # fmt: skip
    for s in summary:
        a = s["accuracy"]
        same = " (identical)" if s["identical"] else ""
        print(
            f"{s['channel']:<12}{s['rate_mbps']:>5g} {s['arrivals']:<13}{s['users']:>3} "
            + "".join(f"{a[b]:>6.3f} " for b in baselines)
            + f"{a[BEFORE]:>6.3f} {a[AFTER]:>6.3f} {s['ratio'][BEFORE]:>6.3f} "
            f"{s['ratio'][AFTER]:>6.3f} {s['ratio_min'][AFTER]:>6.3f}  "
            f"{ci(s['after_minus_before']):<27} {ci(s['after_minus_best_baseline']):<27} "
            f"{ci(s['before_minus_best_baseline']):<27}{same}"
        )
    print(f"wrote {out / 'compare.json'} ({doc['meta']['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
