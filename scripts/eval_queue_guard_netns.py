"""The queue guard on a real link whose capacity dips (kvtransport.hosts.queue_guard).

The profile (default ``rate-dip`` of netem/data/held-out.toml: 1 % loss, 5 ms each way,
100 Mbit/s falling to 25 Mbit/s from 0.1 s to 0.3 s) shapes the netns testbed's data
direction with kernel tbf, and ``Testbed.play_rate_steps`` changes its rate with ``tc``
from the moment the sender daemon has accepted each transfer, as the simulator's channel
steps from a transfer's start. The real daemons (kvtransport.demo.demo_netns.NetnsLink:
sender and receiver daemons in the two namespaces, SCHED_FIFO 5, sealed datagrams) send
a synthetic stream (--size-mb, 12 KiB blocks, linear utilities) at --rho of the
loss-free send time at the profile's rate, with the guard on (the default) and off
(``--no-queue-guard``), in alternating blocks of --runs transfers, each block on a fresh
testbed and daemons.

Per transfer: the utility the receiver had at the deadline, the datagrams sent, those the
tbf dropped from its full queue (the kernel's counter), and the guard's cuts (the sender
daemon's ``queue_cuts``). The simulator's runs of the same transfers (profile, sizes,
rho, policy; seeds 1..--sim-seeds) with and without the guard are the reference.

Writes queue_guard_netns.json (every transfer) and queue_guard_netns.md (the table) into
--out and prints the table. Needs root; about 15 s per block and 1 s per transfer.

    sudo .venv/bin/python scripts/eval_queue_guard_netns.py --out results/queue_guard_netns
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.errors import UserError

PROFILE = "rate-dip"
PROFILES_FILE = "netem/data/held-out.toml"
BLOCK_BYTES = 12288
UTILITY = "linear"
ARMS = (("guard on", True), ("guard off", False))
STEPS_PRIORITY = 6
"""SCHED_FIFO of the thread that changes the rate: above the daemons (5), so that a busy
sender does not hold the steps back (below them they came up to 0.3 s late)."""


def transfer_for(size_bytes: int, run: int) -> Any:
    """The synthetic stream of transfer ``run`` (the same for both arms and the simulator)."""
    from kvtransport.core.transfer import synthetic_transfer

    return synthetic_transfer(
        size_bytes, max(1, size_bytes // BLOCK_BYTES), UTILITY, seed=100 + run
    )


def deadline_for(transfer: Any, rate_mbps: float, rho: float) -> float:
    """rho times the loss-free send time of ``transfer``'s sealed datagrams at the rate."""
    from kvtransport.core.protocol import STANDARD
    from kvtransport.core.wire import full_send_time

    send_s = full_send_time(
        transfer.nbytes, rate_mbps * 1e6, STANDARD.symbol_size, True,
        link_overhead=STANDARD.link_overhead,
    )  # fmt: skip
    return rho * send_s


def run_block(
    guard: bool,
    runs: int,
    *,
    profile: Any,
    size_bytes: int,
    rho: float,
    policy: str,
    seed: int,
    first_run: int = 0,
) -> list[dict[str, Any]]:
    """``runs`` transfers (numbered from ``first_run``) across a fresh testbed, the sender
    daemon's guard on or off; one dict per transfer."""
    from kvtransport.demo.demo_netns import NetnsLink

    sender_args = () if guard else ("--no-queue-guard",)
    link = NetnsLink(seed, profile, (policy,), shaper="tbf", sender_args=sender_args)
    rows = []
    try:
        link.ready()
        tb = link.tb
        for run in range(first_run, first_run + runs):
            tr = transfer_for(size_bytes, run)
            link.load(tr)
            holder: dict[str, Any] = {}

            def start_steps(holder: dict[str, Any] = holder) -> None:
                holder["steps"] = tb.play_rate_steps(STEPS_PRIORITY)

            link.on_submitted = start_steps
            drops0, cuts0 = tb.queue_drops(), link.sender.stats()["queue_cuts"]
            try:
                out = link.transfer(
                    policy,
                    deadline_s=deadline_for(tr, profile.rate_mbps, rho),
                    transfer_id=(seed << 20) + run + 1,
                    seed=seed,
                )
            finally:
                steps = holder.get("steps")
                if steps is not None:
                    steps.stop()
            rows.append(
                {
                    "guard": guard,
                    "run": run,
                    "utility": out.utility,
                    "reason": out.reason,
                    "datagrams_sent": int(out.counters["datagrams_sent"]),
                    "queue_drops": tb.queue_drops() - drops0,
                    "queue_cuts": link.sender.stats()["queue_cuts"] - cuts0,
                    "steps_applied": [list(a) for a in (steps.applied if steps else [])],
                }
            )
    finally:
        link.close()
    return rows


def simulated(
    guard: bool, *, profile: Any, size_bytes: int, rho: float, policy: str, seeds: int
) -> list[dict[str, Any]]:
    """The simulator's runs of transfers 0..seeds-1 (seed i+1 each) over the same profile,
    sealed as the daemons seal them."""
    from kvtransport.sim.simulator import make_simulation

    rows = []
    for i in range(seeds):
        sim = make_simulation(
            transfer_for(size_bytes, i), channel=profile, rho=rho, policy=policy, seed=i + 1,
            key=bytes(32), record=False, queue_guard=guard,
        )  # fmt: skip
        sim.run()
        res = sim.result(0.0)
        rows.append(
            {
                "guard": guard,
                "utility": res.utility_recovered,
                "datagrams_sent": res.packets_sent,
                "queue_drops": int(sim.data_channel.dropped),
                "queue_cuts": sim.sender_host.stats()["queue_cuts"],
            }
        )
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean utility (95 % t interval), the share of sent datagrams the queue dropped, and
    the mean cuts per transfer, of one arm's rows."""
    from kvtransport.eval.statistics import mean_ci

    u, ci = mean_ci(np.array([r["utility"] for r in rows]))
    sent = sum(r["datagrams_sent"] for r in rows)
    return {
        "n": len(rows),
        "utility": u,
        "utility_ci95": ci,
        "queue_drop_share": sum(r["queue_drops"] for r in rows) / max(sent, 1),
        "cuts_per_transfer": float(np.mean([r["queue_cuts"] for r in rows])),
    }


def table(real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| arm | link | transfers | utility | queue drops / sent | guard cuts per transfer |",
        "|---|---|---|---|---|---|",
    ]
    for name, _ in ARMS:
        for where, s in (("netns", real[name]), ("simulator", sim[name])):
            ci = "" if math.isnan(s["utility_ci95"]) else f" ± {s['utility_ci95']:.4f}"
            lines.append(
                f"| {name} | {where} | {s['n']} | {s['utility']:.4f}{ci} | "
                f"{s['queue_drop_share']:.1%} | {s['cuts_per_transfer']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Needs root (network namespaces, tc). See the module docstring for the set-up.",
    )
    p.add_argument(
        "--profile", default=PROFILE, help=f"a profile with rate_steps (default {PROFILE})"
    )
    p.add_argument(
        "--profiles", default=PROFILES_FILE, help=f"profiles file (default {PROFILES_FILE})"
    )
    p.add_argument("--size-mb", type=float, default=5.0, help="stream size (default 5 MB)")
    p.add_argument(
        "--rho", type=float, default=1.0, help="deadline / loss-free send time (default 1)"
    )
    p.add_argument("--policy", default="tail-rule", help="repair policy (default tail-rule)")
    p.add_argument("--rounds", type=int, default=3, help="blocks per arm, alternating (default 3)")
    p.add_argument("--runs", type=int, default=3, help="transfers per block (default 3)")
    p.add_argument("--sim-seeds", type=int, default=20, help="simulator seeds (default 20)")
    p.add_argument("--out", default="results/queue_guard_netns", help="output folder")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("eval_queue_guard_netns.py: needs root (network namespaces, tc)")
    for name in ("size_mb", "rho", "rounds", "runs", "sim_seeds"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    from kvtransport.netem.profiles import ProfileError, load_profile

    try:
        profile = load_profile(args.profile, args.profiles)
    except ProfileError as e:
        p.error(str(e))
    from kvtransport.policies.registry import make_policy

    make_policy(args.policy)  # an unknown name: its one-line error, before any testbed
    if not profile.rate_steps:
        p.error(f"profile {profile.name} has no rate_steps: the guard has no dip to answer")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    size = int(args.size_mb * 1e6)
    common = {"profile": profile, "size_bytes": size, "rho": args.rho, "policy": args.policy}
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for rnd in range(args.rounds):
        for name, guard in ARMS if rnd % 2 == 0 else ARMS[::-1]:
            print(f"round {rnd + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            rows += run_block(guard, args.runs, seed=rnd + 1, first_run=rnd * args.runs, **common)
    sim_rows = {name: simulated(g, seeds=args.sim_seeds, **common) for name, g in ARMS}
    real = {name: summarize([r for r in rows if r["guard"] == g]) for name, g in ARMS}
    sim = {name: summarize(sim_rows[name]) for name, _ in ARMS}
    text = table(real, sim)
    head = (
        f"{profile.describe()}; {args.size_mb:g} MB, rho {args.rho:g}, policy {args.policy}, "
        f"{args.rounds} x {args.runs} transfers per arm, {time.monotonic() - t0:.0f} s"
    )
    (out / "queue_guard_netns.md").write_text(f"{head}\n\n{text}\n")
    doc = {"command": " ".join(sys.argv), "head": head, "real": real, "simulator": sim,
           "transfers": rows, "simulated": sim_rows}  # fmt: skip
    (out / "queue_guard_netns.json").write_text(json.dumps(doc, indent=1))
    print(head)
    print(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f"eval_queue_guard_netns.py: {e}")
