"""`kvtransport submit`: hand one transfer to a running sender daemon."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvtransport.bounds import float_arg
from kvtransport.commands import _common, _control
from kvtransport.errors import UserError

NAME = "submit"
HELP = "submit a transfer (a cache card or a synthetic stream) to a running sender daemon"
DESCRIPTION = """\
Hand one transfer to a running `kvtransport sender-daemon` over its control endpoint
(--control, the daemon's default unless it was started with another) and print its
transfer id; the daemon sends it over UDP to the receiver at --to (a `kvtransport
receiver-daemon` or `kvtransport recv`) with its own key, link rate and pacing, sharing
the link with the other transfers in flight. `kvtransport status ID` then shows its
progress, `kvtransport cancel ID` aborts it.

What to send: CARD, a cache card file (from `kvtransport prefill`, or a result file a
receiver wrote), or a synthetic stream of --size-mb random bytes in 12 KiB blocks.

The deadline is --deadline-ms from now, or --rho times the time the whole stream takes
loss-free at the daemon's link rate (default --rho 1). With --deadline-ms a card is
planned for it here, as `kvtransport send` plans one (--precision, --loss-estimate; the
daemon's link rate), and goes as the plan encodes it; --precision keep sends it as it is.

--wait blocks until the transfer is done and prints its final status; the exit status is
then that of `kvtransport recv` as the receiver's feedback reported it: 0 when every
block arrived, 3 when part did, 4 when nothing did (or no feedback came back).
2 on bad input, or when no daemon answers.

Examples:
  kvtransport sender-daemon --rate-mbps 100 &
  kvtransport submit ctx.card --to 10.77.0.2:9400 --deadline-ms 300
  kvtransport submit --size-mb 4 --to 127.0.0.1:9400 --rho 0.9 --label test --wait
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("card", nargs="?", metavar="CARD", help="the cache card file to send")
    _common.add_synthetic(p, what)
    p.add_argument("--to", required=True, metavar="HOST:PORT",
                   help="the receiver's UDP address (required)")  # fmt: skip
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--deadline-ms", type=float_arg(0, 3.6e6, lo_open=True), help="deadline from now, in ms"
    )
    when.add_argument("--rho", type=float_arg(0, 1e4, lo_open=True),
                      help="deadline / loss-free send time at the daemon's rate "
                      "(default 1.0)")  # fmt: skip
    p.add_argument("--precision", default="auto", metavar="LIST",
                   help="card with --deadline-ms: precisions the plan may send, best first "
                   "(default auto = fp16,int8,int4 with int4 only where it costs little "
                   "utility; keep: as the card is; e.g. fp16,int8,k8v4,int4 for keys int8 with "
                   "values int4 between int8 and int4; int8r: int8's values "
                   "entropy-coded)")  # fmt: skip
    p.add_argument("--loss-estimate", type=float_arg(0, 0.9), default=0.05, metavar="P",
                   help="loss share the plan assumes (default 0.05)")  # fmt: skip
    p.add_argument("--initial-rtt-ms", type=float_arg(0, 10_000, lo_open=True),
                   help="round trip assumed before the first feedback (default: the "
                   "shortest the daemon measured to this receiver, else its own "
                   "default)")  # fmt: skip
    p.add_argument("--policy", help="repair policy, as for send (default: the daemon's)")
    p.add_argument("--weight", type=float_arg(0, 1e6, lo_open=True), default=1.0,
                   help="share of the link against the other transfers in flight "
                   "(default 1)")  # fmt: skip
    p.add_argument("--label", default="", help="a name shown in status and the daemon's stats")
    p.add_argument("--wait", action="store_true",
                   help="wait until the transfer is done; print its final status")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _control.add_control(p)


def run(args: argparse.Namespace) -> int:
    from kvtransport.commands.send import _transfer

    if args.card is None and args.precision != "auto":
        raise UserError("--precision applies to a card (give CARD)")
    if args.deadline_ms is None and args.rho is None:
        args.rho = 1.0
    # a card goes as a path (the client plans it); else send's synthetic stream
    what: Any = args.card if args.card is not None else _transfer(args)
    with _control.connect_sender(args) as client:
        tid = client.submit(
            what, args.to, deadline_ms=args.deadline_ms, rho=args.rho, policy=args.policy,
            weight=args.weight, label=args.label, initial_rtt_ms=args.initial_rtt_ms,
            precision=args.precision, loss_estimate=args.loss_estimate,
        )  # fmt: skip
        if not args.wait:
            _common.report(args, {"transfer_id": tid}, lambda r: print(r["transfer_id"]))
            return 0
        if not args.json:
            print(f"transfer {tid} submitted; waiting", file=sys.stderr, flush=True)
        st = _wait(client, tid)
    _common.report(args, st, show_final)
    return _control.exit_status(st)


def _wait(client: Any, tid: str) -> dict[str, Any]:
    """The transfer's final status, polled; a transfer past its deadline and a grace
    period is reported as not done (the daemon stops at the deadline, so that is a bug or
    a daemon that stopped answering)."""
    deadline_s = float(client.status(tid)["deadline_s"])
    end = time.monotonic() + deadline_s + 30.0
    while True:
        st: dict[str, Any] = client.status(tid)
        if st["state"] == "done":
            return st
        if time.monotonic() > end:
            raise UserError(f"transfer {tid} not done {deadline_s + 30:.0f} s after submit")
        time.sleep(0.05)


def show_final(st: dict[str, Any]) -> None:
    """A finished transfer's status for people (also `kvtransport status ID`)."""
    print(
        f"transfer {st['transfer_id']} to {st['to']}: {st['finish_reason'] or st['state']} "
        f"after {st['elapsed_s'] * 1e3:.1f} ms (deadline {st['deadline_s'] * 1e3:.1f} ms)"
    )
    rtt = "not measured" if st["srtt_ms"] is None else f"{st['srtt_ms']:g} ms"
    rows = [
        ("label", st["label"] or "-"),
        ("policy", st["policy"]),
        ("receiver decoded", f"{st['decoded_through']} of {st['n_source']} source symbols"),
        ("source symbols sent", f"{st['source_sent']} of {st['n_source']}"),
        ("repair symbols sent", _common.repairs_text(st["repair_sent"], st["retransmit_sent"])),
        ("loss estimate", f"{100 * st['loss_estimate']:.2f}%"),
        ("smoothed RTT", rtt),
        ("feedback received", str(st["feedback_received"])),
        ("link share", f"{st['share']:.2f} of {st['rate_mbps']:g} Mbit/s"),
    ]
    _common.print_rows(rows, 20)
