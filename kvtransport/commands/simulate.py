"""`kvtransport simulate`: one transfer through the real sessions over a channel model."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvtransport.bounds import float_arg, int_arg
from kvtransport.commands import _common
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.sim.simulator import SimResult

NAME = "simulate"
HELP = "simulate a transfer over a lossy link model (real sessions, virtual clock)"
DESCRIPTION = """\
Run the real sender and receiver sessions over a userspace model of the link (loss,
rate limit with queue, delay; feedback over a second, independent channel of the same
profile) on a virtual clock, and report the utility the receiver had decoded at the
deadline. The stream is synthetic: --size-mb of random bytes in 12 KiB blocks (one
SmolLM2 layer x 16 tokens) whose utilities follow --utility, sent most useful first.

rho is the deadline divided by the time the whole stream takes loss-free at the link
rate: below 1 not everything can arrive, so the policy decides what is worth protecting.

Policies: none (sources only), fixed:R/N (streaming RLC, R repairs per N sources),
block-rs:R/N (Reed-Solomon over blocks of N, R parities; slow: reedsolo is pure Python),
arq (retransmit what feedback NACKs), adaptive (heuristic on feedback), oracle
(clairvoyant: reads the channel's future; an upper reference), ddqn (once trained).

Examples:
  kvtransport simulate --channel ge-heavy --rho 0.8 --policy adaptive --seed 1
  kvtransport simulate --policy fixed:4/32 --seeds 10 --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--channel",
        default="ge-heavy",
        help="link profile name, netem loss string ('gemodel 5%% 30%% 80%% 0.5%%') or trace "
        "file (default ge-heavy)",
    )
    p.add_argument("--profiles", metavar="FILE", help="extra profile definitions (TOML/JSON)")
    p.add_argument(
        "--feedback-channel",
        metavar="PROFILE",
        help="profile of the feedback path (default: the same as --channel)",
    )
    p.add_argument(
        "--rate-mbps",
        type=float_arg(0, 1e6, lo_open=True),
        help="link rate (default: the profile's, 100)",
    )
    p.add_argument(
        "--delay-ms", type=float_arg(0, 1e4), help="one-way delay (default: the profile's, 5)"
    )
    p.add_argument("--rho", type=float_arg(0, 1e4, lo_open=True), default=0.8,
                   help="deadline / loss-free send time (default 0.8)")  # fmt: skip
    p.add_argument("--policy", help="repair policy (ddqn if its weights ship, else adaptive)")
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=1, help="random seed (default 1)")
    p.add_argument("--seeds", type=int_arg(1, 100_000), default=1, metavar="N",
                   help="run seeds SEED .. SEED+N-1 and report the mean (default 1)")  # fmt: skip
    p.add_argument(
        "--size-mb",
        type=float_arg(0, 4096, lo_open=True),
        default=10.0,
        help="stream size in MB (default 10)",
    )
    p.add_argument(
        "--blocks", type=int_arg(1, 10**9), help="number of blocks (default: 12 KiB each)"
    )
    p.add_argument("--utility", default="zipf", choices=("zipf", "flat", "linear"),
                   help="block utility profile (default zipf)")  # fmt: skip
    p.add_argument(
        "--symbol-size", type=int_arg(64, 8192), default=1280, help="bytes per symbol (1280)"
    )
    p.add_argument("--auth", action="store_true", help="authenticate every datagram (BLAKE2b)")
    p.add_argument(
        "--no-queue-guard",
        action="store_true",
        help="the sender paces at the link rate even while the path's queue builds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write utility and symbols over time")


def _check(args: argparse.Namespace) -> None:
    if not (args.rho > 0 and math.isfinite(args.rho)):
        raise UserError(f"--rho must be a positive number, not {args.rho}")
    if not (0 < args.size_mb <= 4096):
        raise UserError("--size-mb must be in (0, 4096]")
    if args.seeds < 1:
        raise UserError("--seeds must be at least 1")
    if args.rate_mbps is not None and not args.rate_mbps > 0:
        raise UserError("--rate-mbps must be positive")
    if args.delay_ms is not None and not args.delay_ms >= 0:
        raise UserError("--delay-ms must be >= 0")
    if not 64 <= args.symbol_size <= 8192:
        raise UserError("--symbol-size must be 64..8192 bytes")
    if args.plot and not Path(args.plot).expanduser().parent.is_dir():  # before the work
        raise UserError(f"cannot write --plot {args.plot}: its directory does not exist")
    size = int(args.size_mb * 1e6)
    if args.blocks is not None and not 1 <= args.blocks <= size:
        raise UserError("--blocks must be between 1 and the stream size in bytes")


def run(args: argparse.Namespace) -> int:
    from kvtransport.policies.registry import default_policy

    args.policy = args.policy or default_policy()
    from kvtransport.netem import load_profile
    from kvtransport.sim.oracle import make_sim_policy
    from kvtransport.sim.simulator import simulate

    _check(args)
    profile = load_profile(args.channel, args.profiles)
    fb = load_profile(args.feedback_channel, args.profiles) if args.feedback_channel else None
    make_sim_policy(args.policy)  # a bad policy name fails here, before any work
    seeds = range(args.seed, args.seed + args.seeds)
    results = []
    progress = None
    if args.seeds > 1:
        from tqdm import tqdm

        progress = tqdm(total=args.seeds, desc=f"simulate {args.policy}", file=sys.stderr)
    for seed in seeds:
        try:
            res = simulate(
                channel=profile,
                feedback_channel=fb,
                rate_mbps=args.rate_mbps,
                delay_ms=args.delay_ms,
                rho=args.rho,
                policy=make_sim_policy(args.policy),
                seed=seed,
                size_bytes=int(args.size_mb * 1e6),
                n_blocks=args.blocks,
                utility_profile=args.utility,
                symbol_size=args.symbol_size,
                key=b"kvtransport-simulate" if args.auth else None,
                record=bool(args.plot),
                queue_guard=not args.no_queue_guard,
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
        results.append(res)
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    if args.plot:
        _plot(results[0], args.plot)
    if args.json:
        print(json.dumps(_summary(results)))
    else:
        _print(results)
    return 0


_SUMMED = ("utility_recovered", "source_sent", "repair_sent", "retransmit_sent", "manifest_sent",
           "packets_sent", "packets_lost", "feedback_sent", "feedback_lost", "blocks_missing",
           "cpu_s")  # fmt: skip


def _summary(results: list) -> dict:
    if len(results) == 1:
        return results[0].to_dict()
    first = results[0].to_dict()
    out = {k: first[k] for k in ("policy", "channel", "rate_mbps", "rho", "size_bytes",
                                 "n_source", "decoder_window", "deadline_s",
                                 "blocks_total")}  # fmt: skip
    for k in _SUMMED:
        out[k] = sum(getattr(r, k) for r in results) / len(results)
    out["seeds"] = [r.seed for r in results]
    out["utility_per_seed"] = [r.utility_recovered for r in results]
    return out


def _print(results: list) -> None:
    r = results[0]
    n = len(results)
    s = _summary(results)
    head = f"seed {r.seed}" if n == 1 else f"mean of {n} seeds ({r.seed}..{results[-1].seed})"
    print(
        f"{r.channel} at {r.rate_mbps:g} Mbit/s, rho {r.rho:g} (deadline {r.deadline_s:.3f} s "
        f"for {r.size_bytes / 1e6:.2f} MB), policy {r.policy}, {head}"
    )
    lost_pct = 100.0 * s["packets_lost"] / max(s["packets_sent"], 1)
    # a count for one seed, the mean count for several
    missing = f"{r.blocks_missing:d}" if n == 1 else f"{s['blocks_missing']:.1f} (mean)"
    rows = [
        ("utility recovered", f"{s['utility_recovered']:.4f}"),
        ("blocks missing", f"{missing} of {r.blocks_total}"),
        ("source symbols sent", f"{s['source_sent']:.0f} of {r.n_source}"),
        ("repair symbols sent", _common.repairs_text(s["repair_sent"], s["retransmit_sent"])),
        ("manifest symbols sent", f"{s['manifest_sent']:.0f}"),
        ("decoder window", f"{r.decoder_window} symbols"),
        ("packets lost", f"{s['packets_lost']:.0f} of {s['packets_sent']:.0f} ({lost_pct:.1f}%)"),
        ("feedback sent / lost", f"{s['feedback_sent']:.0f} / {s['feedback_lost']:.0f}"),
        ("simulation cpu", f"{s['cpu_s']:.2f} s per run"),
    ]
    if n > 1:
        per = ", ".join(f"{u:.3f}" for u in s["utility_per_seed"])
        rows.insert(1, ("per seed", per))
    for k, v in rows:
        print(f"  {k:22s} {v}")


def _plot(res: SimResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = res.timeseries
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a1.plot(ts["t"], ts["utility"], label="utility decoded at the receiver")
    a1.axvline(res.deadline_s, color="k", ls="--", lw=1, label="deadline")
    a1.set_ylabel("utility")
    a1.set_ylim(0, 1.02)
    a1.legend(loc="lower right")
    a1.set_title(f"{res.policy} on {res.channel}, rho {res.rho:g}, seed {res.seed}")
    a2.plot(ts["t"], ts["source_sent"], label="source symbols sent")
    a2.plot(ts["t"], ts["repair_sent"], label="repair symbols sent")
    a2.axvline(res.deadline_s, color="k", ls="--", lw=1)
    a2.set_xlabel("time (s)")
    a2.set_ylabel("symbols")
    a2.legend(loc="upper left")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)
