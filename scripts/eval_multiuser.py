"""Several handovers at once on one backhaul: average accuracy per allocator (issue 6).

Scenarios: N users (2..32) hand over a KV cache each over one shared link (100 Mbit/s to
1 Gbit/s), every cache due 500 ms after its handover starts. The users arrive together
or spread uniformly over a few hundred milliseconds ("staggered:S" spreads them over S
seconds). Each user's context length is drawn from the lengths the utility table has
for the model, its cache size is that many tokens times --bytes-per-token (SmolLM2-135M's
K and V in fp16: 23040 bytes per token), and its accuracy curve is the table's fitted
sigmoid (kvtransport/data/<model>-utility.json, measured by `kvtransport fit-utility
--measure`).

Every scenario runs in kvtransport.sim.multisim: the sender daemon's own host
(kvtransport.hosts.sender_host, real sessions with adaptive RLC repair) and one receiver host
per user, sharing one channel, once per slot policy: equal share,
proportional to size, earliest deadline first and this allocator (UtilityWaterFilling,
with the guard the daemon's link derives, see kvtransport.eval.registries.make_allocator),
each setting the sessions' pacing rates every 10 ms through their rate hook. A user's
accuracy is its curve at the fraction of its cache decoded (in utility order) by its
deadline.

The clairvoyant bound (kvtransport.scheduling.allocation_bound.clairvoyant_bound: every arrival
known in advance, solved offline over a fluid link, certified by duality and branch and bound) is
fed the *effective* capacity the sessions achieve: the link rate times the decoded
payload per byte on the link, the best any of the four policies reached in that
scenario. The protocol's own costs (headers, losses, FEC repairs, manifests) are paid
by every scheduler alike and are not a scheduling loss, so the bound must not count
them as capacity; taking the best efficiency keeps the bound an upper bound for all four.
The bound's branch and bound reports a bracket: `clairvoyant` is the certified upper
bound (ratios are to it), `clairvoyant_found` the best offline schedule it found.
`ceiling` is everyone's accuracy with the whole cache (the full-cache ceiling).

Writes multiuser.json and multiuser.png into --out and prints a table; --json prints the
JSON document instead of the table. --fluid replaces the sessions by a loss-free fluid link
(seconds instead of minutes, for exploring).

    .venv/bin/python scripts/eval_multiuser.py --out results/multiuser
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.eval.args import parse_floats, parse_ints
from kvtransport.eval.multiuser import BYTES_PER_TOKEN, parse_arrivals, run_scenario, scenario
from kvtransport.eval.registries import ALLOCATOR, ALLOCATORS


def summarize(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> list[dict[str, Any]]:
    """Mean over seeds per (rate, arrivals, users); the allocator's worst seed ratio."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["rate_mbps"], r["arrivals"], r["users"]), []).append(r)
    out = []
    for (rate, arr, users), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        item: dict[str, Any] = {
            "rate_mbps": rate,
            "arrivals": arr,
            "users": users,
            "seeds": len(rs),
            "ceiling": float(np.mean([r["ceiling"] for r in rs])),
            "clairvoyant": float(np.mean([r["clairvoyant"] for r in rs])),
            "clairvoyant_found": float(np.mean([r["clairvoyant_found"] for r in rs])),
            "efficiency": float(np.mean([r["efficiency"] for r in rs])),
        }
        for p in policies:
            item[p] = {
                "accuracy": float(np.mean([r["policies"][p]["accuracy"] for r in rs])),
                "ratio": float(np.mean([r["policies"][p]["ratio"] for r in rs])),
                "ratio_min": float(np.min([r["policies"][p]["ratio"] for r in rs])),
                "ratio_found": float(np.mean([r["policies"][p]["ratio_found"] for r in rs])),
            }
        out.append(item)
    return out


def format_table(summary: list[dict[str, Any]], policies: tuple[str, ...]) -> str:
    short = {"equal-share": "equal", "proportional": "prop", "edf": "edf", "water-filling": "wf"}
    head = (
        f"{'rate':>5} {'arrivals':<15} {'N':>3} "
        + " ".join(f"{short.get(p, p)[:6]:>6}" for p in policies)
        + f" {'clairv':>6} {'found':>6} {'ceil':>6} {'wf/clv':>7} {'min':>6} {'eff':>5}"
    )
    lines = [head]
    for s in summary:
        wf = s.get(ALLOCATOR)
        cells = " ".join(f"{s[p]['accuracy']:>6.3f}" for p in policies)
        tail = f" {wf['ratio']:>7.3f} {wf['ratio_min']:>6.3f}" if wf else f" {'-':>7} {'-':>6}"
        lines.append(
            f"{s['rate_mbps']:>5g} {s['arrivals']:<15} {s['users']:>3} {cells} "
            f"{s['clairvoyant']:>6.3f} {s['clairvoyant_found']:>6.3f} {s['ceiling']:>6.3f}"
            f"{tail} {s['efficiency']:>5.3f}"
        )
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], policies: tuple[str, ...], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({s["rate_mbps"] for s in summary})
    arrivals = sorted({s["arrivals"] for s in summary}, key=lambda a: (a != "together", a))
    fig, axes = plt.subplots(
        len(arrivals), len(rates), figsize=(5.2 * len(rates), 3.8 * len(arrivals)),
        squeeze=False, sharey=True,
    )  # fmt: skip
    for r, arr in enumerate(arrivals):
        for c, rate in enumerate(rates):
            ax = axes[r][c]
            rows = sorted(
                (s for s in summary if s["rate_mbps"] == rate and s["arrivals"] == arr),
                key=lambda s: s["users"],
            )
            if not rows:
                ax.set_visible(False)
                continue
            x = [s["users"] for s in rows]
            for k, p in enumerate(policies):
                style = "-o" if p == ALLOCATOR else "--."
                ax.plot(x, [s[p]["accuracy"] for s in rows], style, color=f"C{k}", label=p)
            ax.plot(x, [s["clairvoyant"] for s in rows], "k-", lw=7, alpha=0.18, zorder=0,
                    label="clairvoyant bound")  # fmt: skip
            ax.plot(x, [s["ceiling"] for s in rows], "k:", label="full-cache ceiling")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.set_title(f"{rate:g} Mbit/s, {arr}")
            ax.set_xlabel("concurrent handovers")
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel("average accuracy")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--users", default="2,4,8,16,32", help="concurrent handovers (default 2..32)")
    p.add_argument("--rates", default="100,1000", help="backhaul rates, Mbit/s (default 100,1000)")
    p.add_argument(
        "--arrivals",
        default="together,staggered:0.3",
        help="together and/or staggered:SECONDS (default together,staggered:0.3)",
    )
    p.add_argument("--window-ms", type=float, default=500.0, help="each handover's deadline")
    p.add_argument("--seeds", type=int, default=2, help="random scenarios per cell (default 2)")
    p.add_argument("--channel", default="clean", help="netem profile of the link (default clean)")
    p.add_argument("--model", default=None, help="model id of the utility table's curves")
    p.add_argument("--table", default=None, help="utility table (default: the packaged one)")
    p.add_argument("--contexts", default=None, help="context lengths to draw from (default: all)")
    p.add_argument("--bytes-per-token", type=int, default=BYTES_PER_TOKEN)
    p.add_argument("--max-nodes", type=int, default=100, help="clairvoyant branch and bound")
    p.add_argument("--fluid", action="store_true", help="fluid link instead of real sessions")
    p.add_argument("--out", default="results/multiuser", help="output directory")
    p.add_argument("--json", action="store_true", help="print the JSON document, not the table")
    args = p.parse_args(argv)

    from tqdm import tqdm

    from kvtransport.scheduling.utility_model import UtilityTable, packaged_model_ids

    shipped = packaged_model_ids()
    model_id = args.model or (shipped[0] if shipped else "")
    table = UtilityTable.load(args.table) if args.table else UtilityTable.packaged(model_id)
    if table is None:
        raise SystemExit(f"no packaged utility table for {model_id}; pass --table")
    curves = [cv for cv in table if cv.model == model_id]
    if args.contexts:
        want = set(parse_ints(args.contexts))
        curves = [cv for cv in curves if cv.context_tokens in want]
    if not curves:
        raise SystemExit(f"the utility table has no curves for {model_id} (and --contexts)")
    users, rates = parse_ints(args.users), parse_floats(args.rates)
    arrivals = [a.strip() for a in args.arrivals.split(",") if a.strip()]
    for a in arrivals:
        parse_arrivals(a)
    window = args.window_ms * 1e-3
    cells = [
        (r, a, n, s) for r in rates for a in arrivals for n in users for s in range(args.seeds)
    ]
    rows = []
    t0 = time.perf_counter()
    for rate, arr, n, seed in tqdm(cells, desc="scenarios", file=sys.stderr):
        hs = scenario(n, arr, seed, curves, window_s=window, bytes_per_token=args.bytes_per_token)
        row = run_scenario(
            hs, rate, channel=args.channel, fluid=args.fluid, seed=seed + 1,
            max_nodes=args.max_nodes,
        )  # fmt: skip
        rows.append({"rate_mbps": rate, "arrivals": arr, "users": n, "seed": seed, **row})
    summary = summarize(rows, ALLOCATORS)
    doc = {
        "meta": {
            "model": model_id,
            "metric": sorted({cv.metric or "?" for cv in curves}),
            "contexts": sorted(cv.context_tokens for cv in curves),
            "curves": [cv.to_dict() for cv in curves],
            "window_ms": args.window_ms,
            "channel": "fluid" if args.fluid else args.channel,
            "bytes_per_token": args.bytes_per_token,
            "seeds": args.seeds,
            "policies": list(ALLOCATORS),
            "seconds": round(time.perf_counter() - t0, 1),
            "command": "scripts/eval_multiuser.py " + " ".join(argv or sys.argv[1:]),
        },
        "summary": summary,
        "scenarios": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multiuser.json").write_text(json.dumps(doc, indent=1))
    title = (
        f"{model_id}: {args.window_ms:g} ms windows, "
        f"{'fluid link' if args.fluid else args.channel + ' link, real sessions'}, "
        f"{args.seeds} seed(s) per point"
    )
    plot(summary, ALLOCATORS, out / "multiuser.png", title)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(format_table(summary, ALLOCATORS))
        print(f"wrote {out / 'multiuser.json'} and {out / 'multiuser.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
