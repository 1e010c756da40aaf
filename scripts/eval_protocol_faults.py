"""Protocol faults of issue 12, on the simulator's virtual clock (real sessions):

- restart: the receiver is killed and a new one (no state, deadline from the manifest, as a
  daemon's) takes over mid-transfer; its result must be a partial one with an exact missing
  list by the deadline;
- feedback-loss: 100 % feedback loss + 10 % Bernoulli data loss (rho 1.2 and 5 ms one way
  unless ``--rho`` / ``--delay-ms`` say otherwise; with ``--dies-at FRAC`` the return path
  works until FRAC x the deadline, then dies): utility;
- jitter: 5 +- 4 ms uniform jitter + 2 % loss: repairs and the receiver's loss estimate
  against the same link without jitter.

``python scripts/eval_protocol_faults.py [--size-mb 10] [--seeds 3] [--policy adaptive]
[--rho 1.2] [--delay-ms 5] [--out FILE]`` prints one JSON object per scenario and seed
(and writes them to FILE).
tests/test_protocol_faults.py runs the same functions at small scale.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from kvtransport.netem import Profile, make_channel, parse_loss

from kvtransport.core.protocol import STANDARD
from kvtransport.errors import UserError
from kvtransport.policies.registry import make_policy
from kvtransport.sim.simulator import make_simulation


def restart(size_mb: float, seed: int, policy: str, at: float = 0.4, rho: float = 1.0) -> dict:
    """Run until ``at`` x deadline, replace the receiver by a fresh one, run to the end."""
    sim = make_simulation(channel=Profile("b2", loss=parse_loss("2%")), rho=rho, policy=policy,
                          seed=seed, size_bytes=int(size_mb * 1e6), record=False)  # fmt: skip
    sim.run_until_decision(until=at * sim.deadline)
    sim.restart_receiver()  # a fresh receiver host: deadline from the manifest
    sim.run()
    r = sim.receiver
    res = r.result
    t = sim.transfer
    exact = res is not None and res.manifest is not None
    wrong = 0
    if exact:
        b = t.blocks
        for i in np.flatnonzero(res.complete):
            o, n = int(b.offsets[i]), int(b.lengths[i])
            wrong += not np.array_equal(res.payload[o : o + n], t.payload[o : o + n])
        exact = np.array_equal(res.missing, np.flatnonzero(~res.complete))
    return {
        "scenario": "restart",
        "seed": seed,
        "receiver_restarts_seen": sim.sender.stats["receiver_restarts"],
        "deadline_s": sim.deadline,
        "restart_s": at * sim.deadline,
        "manifest": res is not None and res.manifest is not None,
        "symbols_known": r.n_known,
        "blocks_complete": int(res.complete.sum()) if res is not None else 0,
        "blocks_total": len(t.blocks),
        "utility": res.utility_recovered if res is not None else 0.0,
        "wrong_blocks": wrong,
        "missing_exact": bool(exact),
        "finished_s": r.timings.get("finished"),
        "reason": res.reason if res is not None else "running",
    }


class _DiesAt:
    """A loss-free return path that loses every datagram handed to it from ``at`` (seconds
    on the virtual clock; 0 until set: dead from the start) on."""

    def __init__(self, delay_ms: float) -> None:
        self._link = make_channel(Profile("b0", loss=parse_loss("0%"), delay_ms=delay_ms), 0,
                                  overhead_bytes=STANDARD.link_overhead)  # fmt: skip
        self.overhead_bytes = self._link.overhead_bytes
        self.at = 0.0
        self.lost = 0

    def transmit(self, t_send: float, nbytes: int) -> float | None:
        if t_send >= self.at:
            self.lost += 1
            return None
        return self._link.transmit(t_send, nbytes)


def feedback_loss(
    size_mb: float,
    seed: int,
    policy: str,
    rho: float = 1.2,
    delay_ms: float = 5.0,
    dies_at: float = 0.0,
) -> dict:
    """10 % Bernoulli data loss, every feedback datagram lost (from ``dies_at`` x the
    deadline on: before, none)."""
    dying = _DiesAt(delay_ms)
    sim = make_simulation(channel=Profile("b10", loss=parse_loss("10%"), delay_ms=delay_ms),
                          feedback_channel=dying, rho=rho, policy=policy, seed=seed,
                          size_bytes=int(size_mb * 1e6), record=False)  # fmt: skip
    dying.at = dies_at * sim.deadline
    sim.run()
    res = sim.result()
    return {
        "scenario": "feedback-loss",
        "seed": seed,
        "rho": rho,
        "delay_ms": delay_ms,
        "dies_at": dies_at,
        "utility": res.utility_recovered,
        "source_sent": res.source_sent,
        "repair_sent": res.repair_sent,
        "repair_share": res.repair_sent / max(res.source_sent + res.repair_sent, 1),
        "feedback_received": sim.sender.stats["feedback_received"],
    }


def jitter(
    size_mb: float, seed: int, policy: str, jitter_ms: float = 4.0, rho: float = 1.0
) -> dict:
    """2 % Bernoulli loss, 5 ms one-way delay with +- ``jitter_ms`` uniform jitter."""
    prof = Profile("j", loss=parse_loss("2%"), delay_ms=5.0, jitter_ms=jitter_ms)
    sim = make_simulation(channel=prof, rho=rho, policy=policy, seed=seed,
                          size_bytes=int(size_mb * 1e6), record=False)  # fmt: skip
    sim.run()
    res = sim.result()
    return {
        "scenario": "jitter",
        "jitter_ms": jitter_ms,
        "seed": seed,
        "utility": res.utility_recovered,
        "repair_sent": res.repair_sent,
        "packets_lost": res.packets_lost,
        "loss_true": res.packets_lost / max(res.packets_sent, 1),
        "receiver_loss_estimate": float(sim.receiver.monitor.loss_rate),
        "sender_loss_estimate": float(sim.sender.loss_estimate()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=10.0)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--policy", default="adaptive")
    p.add_argument("--only", choices=["restart", "feedback-loss", "jitter"])
    p.add_argument("--rho", type=float, default=1.2, help="feedback-loss: deadline / send time")
    p.add_argument("--delay-ms", type=float, default=5.0, help="feedback-loss: one-way delay")
    p.add_argument("--dies-at", type=float, default=0.0, metavar="FRAC",
                   help="feedback-loss: the return path works until FRAC x the deadline, "
                   "then loses everything (default 0: dead from the start)")  # fmt: skip
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        make_policy(args.policy)
    except UserError as exc:
        p.error(str(exc))
    rows = []
    for seed in range(1, args.seeds + 1):
        first = len(rows)
        if args.only in (None, "restart"):
            rows.append(restart(args.size_mb, seed, args.policy))
        if args.only in (None, "feedback-loss"):
            rows.append(
                feedback_loss(
                    args.size_mb, seed, args.policy, args.rho, args.delay_ms, args.dies_at
                )
            )
        if args.only in (None, "jitter"):
            rows.append(jitter(args.size_mb, seed, args.policy, 0.0))
            rows.append(jitter(args.size_mb, seed, args.policy, 4.0))
        for r in rows[first:]:
            print(json.dumps({"policy": args.policy, **r}), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            for r in rows:
                fh.write(json.dumps({"policy": args.policy, **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
