"""`kvtransport send`: one transfer over real UDP, paced to the link rate."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvtransport.bounds import float_arg
from kvtransport.commands import _common
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.transfer import Transfer

NAME = "send"
HELP = "send one transfer (a cache card or a synthetic stream) over UDP"
DESCRIPTION = """\
Send one transfer to a `kvtransport recv` (or a receiver daemon) over UDP, with the same
sender session, policies and deadline rule as `kvtransport simulate`: the manifest first
(protected), then the stream in utility order with repair symbols where the policy asks,
paced to --rate-mbps, stopping at the deadline. Start the receiver first.

What to send: --card FILE (a cache card from `kvtransport prefill`), or a synthetic
stream of --size-mb random bytes in 12 KiB blocks with --utility block utilities.

The deadline is --deadline-ms from now, or --rho times the time the whole stream takes
loss-free at the link rate. With --deadline-ms a card is planned for it (kvtransport.model.plan):
each block goes as fp16, int8 or int4 (--precision; int4 only for the least useful blocks,
down to an expected fidelity of 0.999), upgraded by utility while the bytes still
cross in time at --rate-mbps and --loss-estimate, in prefix order (token ranges front first,
so what the deadline cuts off is a tail the receiver recomputes cheaply; --order back sends
the last range first, for a receiver computing from the front); --precision keep
sends the card as it is, fp32 only when asked (--precision fp32). Both ends must use the
same pre-shared key (--key-file, or the default key file ~/.config/kvtransport/key, made
on first use: copy it to the peer host); --insecure on both ends runs without one.

Exit status, as the receiver last reported (as `kvtransport recv`'s): 0 when it decoded
every source symbol, 3 when partial (it decoded the manifest, not every symbol), 4 when
nothing was delivered: no feedback at all (no receiver there, or another key), the
receiver refused the transfer (its reason is printed: a stale manifest means the hosts'
clocks disagree), or it never decoded the manifest; 2 on bad input, 130 when interrupted.
A transfer that is not complete gets a line on standard error naming why.

Examples:
  kvtransport recv --listen :9400 &
  kvtransport send 127.0.0.1:9400 --size-mb 10 --rate-mbps 500 --rho 0.9 --json
  kvtransport send 10.77.0.2:9400 --card ctx.card --deadline-ms 300 --policy fixed:4/32
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("to", metavar="HOST:PORT", help="the receiver's address")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--card", metavar="FILE", help="send this cache card")
    _common.add_synthetic(p, what)
    p.add_argument(
        "--rate-mbps",
        type=float_arg(0, 1e6, lo_open=True),
        default=100.0,
        help="link rate (default 100)",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--deadline-ms", type=float_arg(0, 3.6e6, lo_open=True), help="deadline from now, in ms"
    )
    when.add_argument(
        "--rho",
        type=float_arg(0, 1e4, lo_open=True),
        help="deadline / loss-free send time (default 1.0)",
    )
    p.add_argument("--precision", default="auto", metavar="LIST",
                   help="card with --deadline-ms: precisions the plan may send, best first "
                   "(default auto = fp16,int8,int4 with int4 only where it costs little utility; "
                   "keep: as the card is; e.g. fp32, or fp16,int8,k8v4,int4 for keys int8 with "
                   "values int4 between int8 and int4; int8r: int8's values "
                   "entropy-coded)")  # fmt: skip
    p.add_argument("--loss-estimate", type=float_arg(0, 0.9), default=0.05, metavar="P",
                   help="loss share the plan assumes (default 0.05)")  # fmt: skip
    p.add_argument("--order", choices=("position", "back"), default="position",
                   help="card with --deadline-ms: token ranges front first (position, the "
                   "default) or the last first (back)")  # fmt: skip
    p.add_argument("--policy", help="repair policy, as for simulate (default: ddqn if its "
                   "weights ship, else adaptive; for a planned card, whose token ranges go "
                   "whole, over a long --initial-rtt-ms: adaptive)")  # fmt: skip
    _common.add_key(p)
    _common.add_identity(p, sending=True)
    _common.add_pacing(p)
    p.add_argument("--bind", default="0.0.0.0:0", metavar="HOST:PORT", help="local address")
    p.add_argument("--initial-rtt-ms", type=float_arg(0, 10_000, lo_open=True), default=20.0,
                   help="RTT assumed before the first feedback (default 20)")  # fmt: skip
    _common.add_realtime(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _transfer(args: argparse.Namespace) -> Transfer:
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.daemons.api import transfer_from_card
    from kvtransport.sim.simulator import DEFAULT_BLOCK_BYTES

    if args.card:
        if args.precision == "keep" or args.deadline_ms is None:
            return transfer_from_card(args.card)
        return _planned_card(args)
    size_mb = 10.0 if args.size_mb is None else args.size_mb
    if not (0 < size_mb <= 4096):
        raise UserError("--size-mb must be in (0, 4096]")
    size = int(size_mb * 1e6)
    blocks = args.blocks or max(1, size // DEFAULT_BLOCK_BYTES)
    if not 1 <= blocks <= size:
        raise UserError("--blocks must be between 1 and the stream size in bytes")
    return synthetic_transfer(size, blocks, args.utility, seed=args.seed)


def _planned_card(args: argparse.Namespace) -> Transfer:
    """The card re-encoded by the handoff plan for the deadline (see the description)."""
    from kvtransport.kvformat.blocks import EncodedStream
    from kvtransport.kvformat.card import read_card
    from kvtransport.model.plan import LinkEstimate, parse_levels, planned_stream

    try:
        levels = parse_levels(args.precision)
    except ValueError as exc:
        raise UserError(f"--{exc} (or keep)") from None
    if not 0 <= args.loss_estimate < 0.9:
        raise UserError(f"--loss-estimate must be in [0, 0.9), not {args.loss_estimate:g}")
    card = read_card(args.card)
    stream = EncodedStream(card.manifest, card.manifest.to_bytes(), card.payload)
    link = LinkEstimate(
        rate_bps=args.rate_mbps * 1e6,
        loss=args.loss_estimate,
        one_way_s=args.initial_rtt_ms * 5e-4,
        symbol_size=args.symbol_size,
    )
    try:
        plan, planned = planned_stream(stream, link=link, budget_s=args.deadline_ms * 1e-3,
                                       levels=levels, order=args.order)  # fmt: skip
    except ValueError as exc:
        raise UserError(f"{args.card}: cannot plan this card ({exc})") from None
    if not args.json:
        print(f"plan: {plan.describe()}")
    return planned.to_transfer()


def run(args: argparse.Namespace) -> int:
    from kvtransport.daemons.daemon import warm_up
    from kvtransport.daemons.daemon_sender import deadline_from, transfer_policy
    from kvtransport.daemons.udp import DatagramSocket, parse_address, set_realtime
    from kvtransport.embed.inprocess import run_send

    named = args.policy
    _common.check_sending(args)
    key = _common.key_from(args)
    dest = parse_address(args.to, what="receiver")
    bind = parse_address(args.bind, what="--bind")
    transfer = _transfer(args)
    rate = args.rate_mbps * 1e6
    spec = {"deadline_ms": args.deadline_ms, "rho": args.rho}
    if spec["deadline_ms"] is None and spec["rho"] is None:
        spec["rho"] = 1.0
    deadline_s = deadline_from(spec, transfer.nbytes, rate, args.symbol_size, key is not None)
    if named is None:  # the default for this transfer and link (as kvtransport.send)
        args.policy = transfer_policy(transfer, args.initial_rtt_ms * 1e-3, rate, deadline_s)

    set_realtime(args.realtime)
    warm_up(key, (args.policy,))  # every kernel; says so on stderr when compiling
    sock = DatagramSocket(bind, dest, gso=not args.no_gso)
    with _common.stoppable(sock) as stop:
        status, interrupted = run_send(
            sock, transfer, dest, rate_bps=rate, deadline_s=deadline_s, stop=stop, key=key,
            policy=args.policy, symbol_size=args.symbol_size, burst_s=args.burst_us * 1e-6,
            initial_rtt=args.initial_rtt_ms * 1e-3,
        )  # fmt: skip
    _common.report(args, status, _print)
    if status.get("note"):
        print(f"kvtransport send: {status['note']}", file=sys.stderr)
    if interrupted:
        return 130
    return _common.EXIT_BY_OUTCOME.get(status.get("delivered", ""), _common.EXIT_NOTHING)


def _print(st: dict) -> None:
    print(
        f"transfer {st['transfer_id']} to {st['to']}: {st['finish_reason']} after "
        f"{st['elapsed_s'] * 1e3:.1f} ms (deadline {st['deadline_s'] * 1e3:.1f} ms)"
    )
    if st["srtt_ms"] is None:  # no feedback, or only a refusal (which measures nothing)
        rtt = "no feedback" if not st["feedback_received"] else "no sample"
    else:
        rtt = f"{st['srtt_ms']} ms (mean deviation {st['rttvar_ms']} ms)"
    rows = [
        ("delivered", st["delivered"]),
        ("policy", st["policy"]),
        ("source symbols sent", f"{st['source_sent']} of {st['n_source']}"),
        ("repair symbols sent", _common.repairs_text(st["repair_sent"], st["retransmit_sent"])),
        ("receiver decoded", f"{st['decoded_through']} of {st['n_source']} in order"),
        ("loss measured", _loss(st)),
        ("loss estimate (recent)", f"{100 * st['loss_estimate']:.2f}%"),
        ("smoothed RTT", rtt),
        ("stop margin for jitter", f"{st['jitter_margin_ms']} ms"),
        ("feedback received", str(st["feedback_received"])),
        ("send calls / datagrams", f"{st['socket']['send_calls']} / {st['datagrams_sent']}"),
    ]
    _common.print_rows(rows, 24)


def _loss(st: dict) -> str:
    """The whole transfer's loss as the receiver counted it (its latest report)."""
    if st.get("loss_measured") is None:
        return "no report"
    return f"{100 * st['loss_measured']:.2f}% ({st['datagrams_lost']} datagrams lost)"
