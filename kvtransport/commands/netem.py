"""`kvtransport netem`: the Linux testbed (two namespaces joined by an impaired link)."""

from __future__ import annotations

import argparse
import json

from kvtransport.bounds import float_arg, int_arg
from kvtransport.errors import UserError

NAME = "netem"
HELP = "set up, inspect or remove the Linux testbed with an impaired link (needs root)"
DESCRIPTION = """\
Build a testbed of two network namespaces, a sender side and a receiver side, joined by a
link impaired per a named profile (the same profiles as `kvtransport simulate`):

  kvt-snd  10.77.0.1  --- loss, delay, jitter, rate limit --->  kvt-rcv  10.77.0.2

The data direction (kvt-snd -> kvt-rcv) gets the whole profile: loss (netem's Bernoulli,
Gilbert-Elliott `gemodel` or 4-state models, or a trace), then delay and jitter, then a
token-bucket rate limit with a byte queue. The reverse direction (feedback) gets the whole
profile too, drawn independently, as in `kvtransport simulate` (--reverse full|delay|none).

Backends: kernel `tc netem` + tbf where the kernel has sch_netem; otherwise (or with
--backend relay) a userspace relay in a third namespace (kvt-mid) applies loss, delay
and jitter with the simulator's own loss models, and kernel tbf limits the rate.

  kvtransport netem up --profile ge-heavy            # 100 Mbit/s, 5 ms, ~12% bursty loss
  ip netns exec kvt-rcv kvtransport receiver-daemon ...
  ip netns exec kvt-snd kvtransport sender-daemon ...
  kvtransport netem status
  kvtransport netem down

A link whose capacity changes: `kvtransport netem rate 25` sets the data direction's rate
to 25 Mbit/s now; `kvtransport netem rate --steps` plays the profile's rate_steps (as the
simulator does from a transfer's start) from the moment it runs.

Other commands: `profiles` lists the profiles with their expected loss and tc arguments;
`trace-from-irtt` converts an irtt JSON measurement into a replayable trace.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True

    up = sub.add_parser(
        "up",
        help="create the namespaces and impair the link",
        description="Create kvt-snd and kvt-rcv joined by a link impaired per --profile.",
    )
    up.add_argument(
        "--profile",
        required=True,
        metavar="NAME",
        help="a profile name (clean, bernoulli-5, ge-light, ge-heavy, 4state-bursty, or one "
        "from --profiles), a profiles file, a trace file, or netem loss notation in quotes",
    )
    up.add_argument("--profiles", metavar="FILE", help="your own profiles (TOML or JSON)")
    up.add_argument(
        "--rate-mbps",
        type=float_arg(0, 1e6, lo_open=True),
        metavar="R",
        help="override the link rate",
    )
    up.add_argument(
        "--delay-ms", type=float_arg(0, 1e4), metavar="D", help="override the one-way delay"
    )
    up.add_argument(
        "--backend",
        choices=["auto", "netem", "relay"],
        default="auto",
        help="kernel netem, the userspace relay, or auto: netem when the kernel has it "
        "(default: auto)",
    )
    up.add_argument(
        "--reverse",
        choices=["delay", "full", "none"],
        default="full",
        help="the feedback direction: the full profile (default, as the simulator), the "
        "same delay only (no loss, no rate limit), or no impairment",
    )
    up.add_argument(
        "--shaper",
        choices=["tbf", "relay"],
        default="tbf",
        help="relay backend: rate limit by kernel tbf (default), or by the relay's own token "
        "bucket on kernel arrival timestamps (exact model even on a CPU-starved machine)",
    )
    up.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=0, help="loss-model seed (relay backend)"
    )
    up.add_argument("--replace", action="store_true", help="tear down a running testbed first")
    _prefix(up)

    down = sub.add_parser(
        "down",
        help="remove the testbed (idempotent)",
        description="Stop the relay, delete the namespaces and the state. Safe to repeat.",
    )
    _prefix(down)

    st = sub.add_parser(
        "status",
        help="show what is up",
        description="Show the testbed's profile, backend, relay counters and qdisc counters.",
    )
    st.add_argument("--json", action="store_true", help="print one JSON object")
    _prefix(st)

    rt = sub.add_parser(
        "rate",
        help="change the link's rate now, or play the profile's rate steps",
        description="Change the rate limit of the data direction (sender to receiver) of a "
        "testbed that is up: kernel tbf's rate, its burst and queue limit in bytes kept "
        "(the feedback direction keeps its rate). With --steps, play the profile's "
        "rate_steps from now, in the foreground (start it with the transfer; Ctrl-C sets "
        "the profile's rate again). Not with --shaper relay, whose token bucket keeps one "
        "rate.",
    )
    rt.add_argument(
        "rate_mbps",
        nargs="?",
        type=float_arg(0, 1e6, lo_open=True),
        metavar="MBIT_S",
        help="the new rate in Mbit/s",
    )
    rt.add_argument(
        "--steps", action="store_true", help="play the profile's rate_steps from now instead"
    )
    rt.add_argument(
        "--priority",
        type=int_arg(1, 99),
        metavar="P",
        help="--steps: play them at SCHED_FIFO priority P, above real-time daemons on the same "
        "cores (at ordinary priority a busy sender can hold a step back by its whole transfer)",
    )
    _prefix(rt)

    pr = sub.add_parser(
        "profiles",
        help="list the profiles",
        description="List the built-in profiles (and yours) with their expected loss rate, "
        "mean loss-run length and tc arguments.",
    )
    pr.add_argument("--profiles", metavar="FILE", help="your own profiles (TOML or JSON)")

    tr = sub.add_parser(
        "trace-from-irtt",
        help="convert an irtt JSON result into a trace file",
        description="Convert `irtt client -o out.json` into a seq,lost,owd_us trace "
        "(docs/traces.md) for the client-to-server direction.",
    )
    tr.add_argument("source", help="irtt JSON output (.json or .json.gz)")
    tr.add_argument("dest", help="trace to write (.csv or .csv.gz)")
    tr.add_argument(
        "--owd",
        choices=["send", "rtt/2"],
        default="send",
        help="one-way delay from irtt's send delay (synchronized clocks) or half the RTT",
    )
    tr.add_argument(
        "--base-owd-ms",
        type=float_arg(0, 1e4),
        help="shift delays so the smallest equals this (for clocks with an unknown offset)",
    )


def _prefix(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix",
        default="kvt",
        help="namespace name prefix: PREFIX-snd, PREFIX-rcv, PREFIX-mid (default: kvt)",
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "profiles":
        return _profiles(args)
    if args.action == "trace-from-irtt":
        return _trace_from_irtt(args)

    from kvtransport.netem import testbed as tb

    if args.action == "up":
        if args.replace:
            tb.teardown(args.prefix)
        bed = tb.Testbed(
            args.profile,
            rate_mbps=args.rate_mbps,
            delay_ms=args.delay_ms,
            backend=args.backend,
            reverse=args.reverse,
            seed=args.seed,
            profiles_file=args.profiles,
            prefix=args.prefix,
            shaper=args.shaper,
        ).up()
        why = {
            ("auto", "netem"): "kernel sch_netem available",
            ("auto", "relay"): "this kernel has no sch_netem",
        }.get((args.backend, str(bed.backend)), "forced by --backend")
        print(f"netem up: backend {bed.backend} ({why})")
        print(f"  profile  {bed.profile.describe()}")
        print(f"  link     {bed.snd_ns} {tb.SND_ADDR}  ->  {bed.rcv_ns} {tb.RCV_ADDR}")
        shaper = "netem + tbf" if bed.backend == "netem" else f"relay, rate limit by {bed.shaper}"
        print(f"  shaping  {shaper}; reverse direction: {args.reverse}")
        print(f"  use      ip netns exec {bed.snd_ns} COMMAND   (and {bed.rcv_ns})")
        if bed.profile.rate_steps:
            steps = ", ".join(f"{r:g} Mbit/s at {t:g} s" for t, r in bed.profile.rate_steps)
            print(
                f"  rate     {bed.profile.rate_mbps:g} Mbit/s now; its steps ({steps}) play "
                f"when you run `kvtransport netem rate --steps{bed._prefix_flag()}`"
            )
        return 0
    if args.action == "down":
        removed = tb.teardown(args.prefix)
        print("netem down: removed " + ", ".join(removed) if removed else "netem down: nothing up")
        return 0
    if args.action == "rate":
        return _rate(args)
    if args.action == "status":
        st = tb.status(args.prefix)
        if args.json:
            print(json.dumps(st))
            return 0
        _print_status(st)
        return 0
    raise UserError(f"unknown action {args.action}")


def _rate(args: argparse.Namespace) -> int:
    from kvtransport.netem import testbed as tb

    if (args.rate_mbps is None) == (not args.steps):
        raise UserError("netem rate: give either a rate in Mbit/s or --steps")
    if args.priority is not None and not args.steps:
        raise UserError("netem rate: --priority goes with --steps")
    if args.rate_mbps is not None:
        tb.set_rate(args.prefix, args.rate_mbps)
        print(f"netem rate: {args.rate_mbps:g} Mbit/s from now (data direction)")
        return 0
    state = tb.saved_state(args.prefix)
    steps = tuple((float(t), float(r)) for t, r in state.get("rate_steps", []))
    if not steps:
        raise UserError(
            f"netem rate: the testbed's profile ({state.get('profile')}) has no rate steps"
        )
    player = tb.RateSteps(args.prefix, steps, float(state["rate_mbps"]), args.priority)
    try:
        player.wait()
    except KeyboardInterrupt:
        try:  # (Ctrl-C may have reached a tc call too: the base rate is set again anyway)
            player.stop()
        except tb.TestbedError:
            tb.set_rate(args.prefix, float(state["rate_mbps"]))
        print(f"netem rate: stopped; {state['rate_mbps']:g} Mbit/s again")
        return 130
    for planned, at, rate in player.applied:
        print(f"netem rate: {rate:g} Mbit/s at {at:.3f} s (planned {planned:g} s)")
    return 0


def _print_status(st: dict) -> None:
    state = st.get("state")
    if not state:
        extra = f" (stray namespaces: {', '.join(st['namespaces'])})" if st["namespaces"] else ""
        print(f"netem: nothing up for prefix {st['prefix']}{extra}")
        return
    print(f"netem: {'up' if st['up'] else 'BROKEN'} (prefix {st['prefix']})")
    print(f"  backend     {state['backend']}")
    print(f"  profile     {state['description']}")
    print(f"  shaping     {state.get('shaper', '?')}; reverse direction: {state['reverse']}")
    print(f"  namespaces  {', '.join(st['namespaces'])}")
    if state.get("relay_pid"):
        alive = "running" if st.get("relay_running") else "NOT RUNNING"
        print(f"  relay       pid {state['relay_pid']} {alive}")
        relay = st.get("relay") or {}
        for direction in ("forward", "reverse"):
            c = relay.get(direction)
            if c:
                print(
                    f"    {direction:8s} forwarded {c['forwarded']}, lost {c['lost']}, "
                    f"queue drops {c['queue_dropped']}, overruns {c['overruns']}, "
                    f"max wait {c.get('max_wait_ms', 0)} ms"
                )
    for where, text in st.get("qdiscs", {}).items():
        print(f"  qdisc {where}")
        for line in text.splitlines():
            print(f"    {line.strip()}")


def _profiles(args: argparse.Namespace) -> int:
    from kvtransport.netem.profiles import builtin_profiles, load_profiles_file

    profs = builtin_profiles()
    if args.profiles:
        profs.update(load_profiles_file(args.profiles))
    for p in profs.values():
        print(p.describe())
        if p.description:
            print(f"    {p.description}")
        print(f"    mean loss run {p.mean_burst_length():.2f} packets")
        if not p.is_trace:
            print(f"    tc netem {' '.join(p.netem_args())}")
        print(f"    tc tbf   {' '.join(p.tbf_args())}")
    return 0


def _trace_from_irtt(args: argparse.Namespace) -> int:
    import numpy as np

    from kvtransport.netem.trace import trace_from_irtt, write_trace

    seq, lost, owd = trace_from_irtt(args.source, args.owd, args.base_owd_ms)
    write_trace(args.dest, lost, owd, seq, comment=f"converted from irtt {args.source}")
    median_ms = float(np.median(owd[~lost])) / 1e3
    print(
        f"wrote {args.dest}: {len(seq)} packets, {lost.mean():.2%} lost, "
        f"median one-way delay {median_ms:.3f} ms"
    )
    return 0
