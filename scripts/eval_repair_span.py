"""Proactive RLC repair span on long links: does covering the whole round trip pay?

The sender's proactive RLC repairs cover the newest symbols, those feedback cannot have
reported yet: one RTT plus one decision interval of them, capped at
``ProtocolConfig.max_repair_span`` (standard: kvtransport.core.protocol.MAX_REPAIR_SPAN;
kvtransport/core/sender.py ``_rtt_changed``). On a long link the round trip holds more
slots than the cap (100 Mbit/s, one-way 80 ms: ~1500 slots of 1280-byte symbols), so the
oldest symbols in flight are outside every proactive repair. This script plays the same
held-out episodes (scripts/eval_policy.py's long-link cells:
kvtransport.agents.episodes.eval_spec with a one-way delay, measured block utilities) with
the cap set to each of --spans in turn (a ProtocolConfig with that ``max_repair_span``
passed to the simulation; nothing else changes), and reports, per cell and scheme, the
mean utility recovered before the deadline at the first span and the paired differences
(same episodes, same channel draws) of every other span against it, with 95 % t-intervals.

The CPU side is measured in the same runs: every call of the sender's
``datagrams_to_send`` and the receiver's ``receive_datagram`` is timed, as is every
repair the encoder computes (``RLCEncoder.repair_into``) and the receiver's decoder takes
(``RLCDecoder.add_repair``), so the table gives microseconds per packet and per repair on
each side at each span (the spans of one episode run back to back, so the machine's noise
hits them alike; compare ratios).

Cells are ``CHANNEL+DELAYms@RHO`` (100 Mbit/s) or ``CHANNEL+DELAYms@RHO/RATEMbps``.

    .venv/bin/python scripts/eval_repair_span.py --episodes 24 --out results/repair_span
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from time import perf_counter_ns

import numpy as np

from kvtransport.core.protocol import REPAIR_SEGMENT, STANDARD
from kvtransport.eval.registries import make_scheme
from kvtransport.eval.statistics import mean_ci

DEFAULT_CELLS = tuple(
    f"{c}+{d}ms@{r}"
    for c in ("ge-heavy", "bernoulli-5")
    for d in (40, 80)
    for r in (0.7, 0.85, 1.0)
) + ("ge-heavy+20ms@0.85/1000Mbps", "bernoulli-5+20ms@0.85/1000Mbps")
DEFAULT_SCHEMES = ("fixed:4/32", "adaptive", "ddqn")
DEFAULT_SPANS = (1024, 2048, 4096)


def parse_cell(text: str) -> tuple[str, float, float, float]:
    """``CHANNEL+DELAYms@RHO[/RATEMbps]`` -> (channel, one-way delay ms, rho, Mbit/s)."""
    try:
        head, _, rate = text.partition("/")
        left, rho = head.rsplit("@", 1)
        channel, delay = left.rsplit("+", 1)
        mbps = float(rate.removesuffix("Mbps")) if rate else 100.0
        cell = channel, float(delay.removesuffix("ms")), float(rho), mbps
    except ValueError:
        raise ValueError(f"bad cell {text!r}: want CHANNEL+DELAYms@RHO[/RATEMbps]") from None
    if not (cell[1] >= 0 and cell[2] > 0 and cell[3] > 0):
        raise ValueError(f"bad cell {text!r}: delay >= 0, rho > 0 and rate > 0 expected")
    return cell


class Timers:
    """Per-call nanosecond totals of the methods that cost CPU per packet and per repair."""

    def __init__(self) -> None:
        from kvtransport.codecs.rlc import RLCDecoder, RLCEncoder

        from kvtransport.core.receiver import ReceiverSession
        from kvtransport.core.sender import SenderSession

        self.totals: dict[str, list[int]] = {}
        self._wrap(SenderSession, "datagrams_to_send", "sender")
        self._wrap(ReceiverSession, "receive_datagram", "receiver")
        self._wrap(RLCEncoder, "repair_into", "encode", nss_arg=3)
        self._wrap(RLCDecoder, "add_repair", "decode", nss_arg=2)

    def _wrap(self, cls: type, name: str, label: str, nss_arg: int | None = None) -> None:
        fn = getattr(cls, name)
        narrow = self.totals.setdefault(label, [0, 0, 0])  # ns, calls, sum of nss
        wide = self.totals.setdefault(label + "_wide", [0, 0, 0]) if nss_arg else narrow

        def timed(*a, **k):
            t0 = perf_counter_ns()
            r = fn(*a, **k)
            dt = perf_counter_ns() - t0
            # repairs wider than a segment are proactive (reactive ones stay in a segment)
            tot = wide if nss_arg is not None and a[nss_arg] > REPAIR_SEGMENT else narrow
            tot[0] += dt
            tot[1] += 1
            if nss_arg is not None:
                tot[2] += int(a[nss_arg])
            return r

        setattr(cls, name, timed)

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        return {k: tuple(v) for k, v in self.totals.items()}


def run_episode(cell: str, scheme: str, span: int, index: int, timers: Timers) -> dict:
    from kvtransport.agents.episodes import build_simulation, eval_spec
    from kvtransport.netem import load_profile

    channel, delay, rho, mbps = parse_cell(cell)
    prof = replace(load_profile(channel), rate_mbps=mbps)
    spec = eval_spec(prof, rho, index, "measured", delay_ms=delay)
    before = timers.snapshot()
    config = replace(STANDARD, max_repair_span=span)
    sim = build_simulation(spec, make_scheme(scheme, None), config=config)
    sim.run()
    after = timers.snapshot()
    s = sim.sender
    cost = {k: [a - b for a, b in zip(after[k], before[k], strict=True)] for k in after}
    return {
        "utility": float(sim.receiver.result.utility_recovered),
        "packets": s.seq,
        "received": cost["receiver"][1],
        "rlc_repairs": s.stats["rlc_repair_sent"],
        "final_span": s._proactive_span,
        "cost": cost,
    }


def per(total) -> float:
    """Microseconds per call of a [ns, calls, nss] total."""
    return total[0] / 1e3 / max(total[1], 1)


def summarize(rows: dict, cells, schemes, spans) -> dict:
    base = spans[0]
    out = {}
    for cell in cells:
        for scheme in schemes:
            runs = {sp: rows[(cell, scheme, sp)] for sp in spans}
            u0 = np.array([r["utility"] for r in runs[base]])
            entry = {"base_mean": mean_ci(u0), "n": len(u0), "diff": {}, "cpu": {}}
            for sp in spans:
                u = np.array([r["utility"] for r in runs[sp]])
                if sp != base:
                    d = u - u0
                    m, h = mean_ci(d)
                    entry["diff"][sp] = {"mean": m, "ci95": h, "equal": int((d == 0).sum())}
                costs = runs[sp][0]["cost"]
                tot = {k: np.sum([r["cost"][k] for r in runs[sp]], axis=0) for k in costs}
                pk = sum(r["packets"] for r in runs[sp])
                entry["cpu"][sp] = {
                    "sender_us_per_packet": tot["sender"][0] / 1e3 / max(pk, 1),
                    "receiver_us_per_datagram": per(tot["receiver"]),
                    "encode_us_per_wide_repair": per(tot["encode_wide"]),
                    "decode_us_per_wide_repair": per(tot["decode_wide"]),
                    "encode_us_per_segment_repair": per(tot["encode"]),
                    "decode_us_per_segment_repair": per(tot["decode"]),
                    "mean_wide_nss_sent": tot["encode_wide"][2] / max(tot["encode_wide"][1], 1),
                    "wide_repair_share": tot["encode_wide"][1] / max(pk, 1),
                    "repair_share": (tot["encode"][1] + tot["encode_wide"][1]) / max(pk, 1),
                    "final_span": float(np.mean([r["final_span"] for r in runs[sp]])),
                }
            out[f"{cell} {scheme}"] = entry
    return out


def table(summary: dict, spans) -> str:
    base = spans[0]
    head = ["cell", "scheme", f"utility @{base}"] + [f"{sp} - {base}" for sp in spans[1:]]
    head += [f"wide NSS @{sp}" for sp in spans]
    head += [f"enc+dec us/wide repair @{sp}" for sp in spans]
    head += [f"tx+rx us/packet @{sp}" for sp in spans]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, e in summary.items():
        cell, scheme = key.rsplit(" ", 1)
        m, h = e["base_mean"]
        row = [cell, scheme, f"{m:.4f} ± {h:.4f}"]
        for sp in spans[1:]:
            d = e["diff"][sp]
            star = "*" if abs(d["mean"]) > d["ci95"] else ""
            row.append(f"{d['mean']:+.4f} ± {d['ci95']:.4f}{star} ({d['equal']}=)")
        c = e["cpu"]
        row += [f"{c[sp]['mean_wide_nss_sent']:.0f}" for sp in spans]
        row += [
            f"{c[sp]['encode_us_per_wide_repair']:.0f}+{c[sp]['decode_us_per_wide_repair']:.0f}"
            for sp in spans
        ]
        row += [
            f"{c[sp]['sender_us_per_packet']:.1f}+{c[sp]['receiver_us_per_datagram']:.1f}"
            for sp in spans
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Cells: " + ", ".join(DEFAULT_CELLS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cells", default=",".join(DEFAULT_CELLS), help="comma-separated cells")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help="policy names")
    p.add_argument(
        "--spans",
        default=",".join(map(str, DEFAULT_SPANS)),
        help="max_repair_span values (64..DECODER_WINDOW); the first is the baseline",
    )
    p.add_argument("--episodes", type=int, default=24, help="held-out episodes per cell (24)")
    p.add_argument("--out", type=Path, default=Path("results/repair_span"), help="output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    from kvtransport.codecs.rlc import MAX_NSS
    from kvtransport.netem import load_profile
    from tqdm import tqdm

    cells = [c for c in args.cells.split(",") if c]
    schemes = [s for s in args.schemes.split(",") if s]
    try:
        for c in cells:
            load_profile(parse_cell(c)[0])
        for s in schemes:
            make_scheme(s, None)
        spans = [int(s) for s in args.spans.split(",") if s]
    except Exception as exc:  # one line for the user, no traceback
        p.error(str(exc))
    if not cells or not schemes or len(spans) < 2 or args.episodes < 2:
        p.error("need a cell, a scheme, two spans and --episodes >= 2")
    if not all(REPAIR_SEGMENT <= sp <= MAX_NSS for sp in spans):
        p.error(
            f"spans must be in {REPAIR_SEGMENT}..{MAX_NSS} (a reactive repair's segment up to "
            "the most symbols one repair can cover)"
        )
    timers = Timers()
    rows: dict = {(c, s, sp): [] for c in cells for s in schemes for sp in spans}
    t0 = time.time()
    todo = [(c, i, s) for c in cells for i in range(args.episodes) for s in schemes]
    for cell, i, scheme in tqdm(todo, disable=args.quiet, desc="episodes", unit="ep"):
        for sp in spans:  # back to back: the machine's noise hits every span alike
            rows[(cell, scheme, sp)].append(run_episode(cell, scheme, sp, i, timers))
    summary = summarize(rows, cells, schemes, spans)
    md = table(summary, spans)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(sys.argv),
        "episodes": args.episodes,
        "spans": spans,
        "wall_s": time.time() - t0,
        "summary": summary,
        "runs": {f"{c} {s} {sp}": v for (c, s, sp), v in rows.items()},
    }
    (args.out / "eval_repair_span.json").write_text(json.dumps(record, indent=1, default=str))
    (args.out / "eval_repair_span.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
