"""Benchmark of kvtransport.netem: channel cost per packet, relay latency and capacity.

    python -m kvtransport.netem.bench [--out bench_netem.json] [--quick]

Part 1 (anywhere): microseconds per ``Channel.transmit`` for every built-in profile,
side by side with a bare Python method call in the same run (the ratio is what to
compare across machines), and the cost of ``clone()``.

Part 2 (root only): the userspace relay's added one-way delay (relay with zero delay vs
a plain veth pair, same probe, same run) and its capacity (1300-byte datagrams offered
at increasing rates through a 1 Gbit/s shaper; capacity = the highest rate forwarded
without relay overruns or losses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["bench_channels", "bench_relay", "main"]


class _Nop:
    def transmit(self, t: float, n: int) -> None:
        return None


def _per_call_us(obj: Any, n: int) -> float:
    gap = 1342 * 8 / 90e6
    t0 = time.perf_counter()
    for i in range(n):
        obj.transmit(i * gap, 1300)
    return (time.perf_counter() - t0) / n * 1e6


def bench_channels(n: int = 200_000) -> dict[str, Any]:
    from kvtransport.netem import Profile, builtin_profiles, make_channel, parse_loss

    out: dict[str, Any] = {"packets": n, "baseline_us": _per_call_us(_Nop(), n)}
    profiles = dict(builtin_profiles())
    profiles["ge-heavy+jitter"] = Profile(
        "ge-heavy+jitter", loss=parse_loss("gemodel 5% 30% 80% 0.5%"), jitter_ms=1
    )
    rows = {}
    for name, prof in profiles.items():
        ch = make_channel(prof, seed=1)
        ch.transmit(0.0, 100)  # compile / warm up
        us = _per_call_us(ch, n)
        t0 = time.perf_counter()
        for _ in range(200):
            ch.clone()
        clone_us = (time.perf_counter() - t0) / 200 * 1e6
        rows[name] = {
            "transmit_us": us,
            "ratio_to_call": us / out["baseline_us"],
            "clone_us": clone_us,
        }
    out["profiles"] = rows
    return out


def _plain_veth(prefix: str) -> None:
    from kvtransport.netem.profiles import load_profile
    from kvtransport.netem.testbed import _run, build_plan

    for argv in build_plan(load_profile("clean"), "netem", "none", prefix):
        if argv[0] != "tc":
            _run(argv)


def bench_relay(quick: bool = False) -> dict[str, Any]:
    from kvtransport.netem.testbed import Testbed, teardown

    prefix = f"kvtb{os.getpid() % 100000}"
    count = 3000 if quick else 10000
    out: dict[str, Any] = {}
    teardown(prefix)
    try:
        _plain_veth(prefix)
        bed = Testbed("clean", prefix=prefix, backend="netem")
        bed.backend = "netem"
        base = bed.measure_udp(rate_mbps=50, count=count)
    finally:
        teardown(prefix)
    with Testbed("clean", prefix=prefix, backend="relay", delay_ms=0, rate_mbps=1000) as tb:
        relay = tb.measure_udp(rate_mbps=50, count=count)
        st = (tb.relay_status() or {})["forward"]  # the relay backend: always a status
    out["latency"] = {
        "veth_owd_ms": base["owd_ms"],
        "relay_owd_ms": relay["owd_ms"],
        "added_median_us": (relay["owd_ms"]["median"] - base["owd_ms"]["median"]) * 1e3,
        "added_p99_us": (relay["owd_ms"]["p99"] - base["owd_ms"]["p99"]) * 1e3,
        "relay_max_wait_ms": st["max_wait_ms"],
    }
    rates = [100, 200] if quick else [100, 200, 300, 400, 600]
    cap = []
    for rate in rates:
        n = int(rate * 1e6 / 8 / 1342 * (1.0 if quick else 2.0))
        with Testbed("clean", prefix=prefix, backend="relay", delay_ms=0, rate_mbps=1000) as tb:
            cpu0 = (tb.relay_status() or {}).get("cpu_s", 0.0)
            r = tb.measure_udp(rate_mbps=rate, count=n)
            st = tb.relay_status() or {}  # the relay backend: always a status
        f = st["forward"]
        cap.append(
            {
                "offered_mbps": r["sender"]["offered_mbps"],
                "offered_pps": n / r["sender"]["duration_s"],
                "received": r["received"],
                "sent": n,
                "overruns": f["overruns"],
                "queue_dropped": f["queue_dropped"],
                "relay_cpu_us_per_packet": (st["cpu_s"] - cpu0) / max(f["received"], 1) * 1e6,
                "owd_p99_ms": r["owd_ms"]["p99"] if r["received"] else None,
            }
        )
    out["capacity"] = cap
    ok = [c["offered_pps"] for c in cap if c["received"] == c["sent"]]
    out["capacity_pps_lossless"] = max(ok) if ok else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvtransport.netem.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="bench_netem.json")
    p.add_argument("--quick", action="store_true", help="fewer packets (a smoke run)")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"channels": bench_channels(50_000 if args.quick else 200_000)}
    ch = result["channels"]
    print(f"{'profile':18s} {'transmit us':>12s} {'x call':>8s} {'clone us':>9s}")
    print(f"{'(bare call)':18s} {ch['baseline_us']:12.3f} {1.0:8.1f}")
    for name, row in ch["profiles"].items():
        print(
            f"{name:18s} {row['transmit_us']:12.3f} {row['ratio_to_call']:8.1f} "
            f"{row['clone_us']:9.1f}"
        )
    if os.geteuid() == 0:
        result["relay"] = r = bench_relay(args.quick)
        lat = r["latency"]
        print(
            f"\nrelay added one-way delay: median {lat['added_median_us']:.0f} us, "
            f"p99 {lat['added_p99_us']:.0f} us (veth median "
            f"{lat['veth_owd_ms']['median'] * 1e3:.0f} us)"
        )
        print(
            f"{'offered Mbit/s':>14s} {'pps':>8s} {'received':>9s} {'overruns':>9s} "
            f"{'cpu us/pkt':>10s} {'p99 ms':>7s}"
        )
        for c in r["capacity"]:
            print(
                f"{c['offered_mbps']:14.0f} {c['offered_pps']:8.0f} "
                f"{c['received']:5d}/{c['sent']:<5d} {c['overruns']:7d} "
                f"{c['relay_cpu_us_per_packet']:10.1f} {c['owd_p99_ms'] or 0:7.2f}"
            )
        print(f"lossless capacity: {r['capacity_pps_lossless']:.0f} packets/s")
    else:
        print("\n(relay part skipped: needs root)")
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
