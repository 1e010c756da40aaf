"""`kvtransport sender-daemon`: long-running sender with a ZeroMQ control API."""

from __future__ import annotations

import argparse

from kvtransport.bounds import float_arg, int_arg
from kvtransport.commands import _common
from kvtransport.errors import UserError

NAME = "sender-daemon"
HELP = "run the sender daemon (UDP data plane, ZeroMQ control for local clients)"
DESCRIPTION = """\
Serve transfer requests from local clients (kvtransport.embed.client.SenderClient, or any
ZeroMQ REQ socket speaking kvtransport.daemons.api) and send each over UDP to the receiver it
names, paced to the link rate. Several transfers can be in flight at once; they then share
--rate-mbps as the multi-user allocator decides every --slot-ms (weighted utility
water-filling with admission), and `status` reports each transfer's share.

Control: a ROUTER socket on --control (ipc:// by default, reachable from other network
namespaces; or tcp://127.0.0.1:PORT). SIGTERM or SIGINT: abort the transfers in flight
(their receivers deliver what they have), close, exit 0. Logs go to stderr; --stats
prints one JSON line per finished transfer (to stdout, or appended to FILE).

Example:
  kvtransport sender-daemon --rate-mbps 100 --key-file psk.hex --stats
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtransport.daemons.api import DEFAULT_SENDER_CONTROL

    p.add_argument("--control", default=DEFAULT_SENDER_CONTROL, metavar="ENDPOINT",
                   help=f"ZeroMQ control endpoint (default {DEFAULT_SENDER_CONTROL})")  # fmt: skip
    p.add_argument("--bind", default="0.0.0.0:0", metavar="HOST:PORT",
                   help="local UDP address (default any port)")  # fmt: skip
    p.add_argument(
        "--rate-mbps",
        type=float_arg(0, 1e6, lo_open=True),
        default=100.0,
        help="link rate (default 100)",
    )
    p.add_argument("--policy",
                   help="repair policy for requests that name none (default: ddqn if "
                   "its weights ship, else adaptive; for a stream of whole token ranges "
                   "over a long initial RTT: adaptive)")  # fmt: skip
    _common.add_key(p)
    _common.add_identity(p, sending=True)
    _common.add_pacing(p)
    p.add_argument(
        "--max-transfers", type=int_arg(1, 4096), default=64, help="in flight at once (64)"
    )
    p.add_argument("--slot-ms", type=float_arg(0, 1e4, lo_open=True), default=10.0,
                   help="link-sharing decision period when several transfers run (10)")  # fmt: skip
    p.add_argument("--no-queue-guard", action="store_true",
                   help="pace at --rate-mbps even while the path's queue builds (by default, "
                   "while one transfer is in flight on a path with a round trip up to 50 ms, "
                   "the link is paced below what it delivers until a capacity dip's queue "
                   "drains)")  # fmt: skip
    p.add_argument("--utility-table", metavar="FILE",
                   help="fitted utility curves (from fit-utility) for link sharing")  # fmt: skip
    _common.add_curve(p)
    _common.add_daemon_output(p)


def run(args: argparse.Namespace) -> int:
    from kvtransport.daemons.daemon import setup_logging
    from kvtransport.daemons.daemon_sender import SenderDaemon, log
    from kvtransport.daemons.udp import parse_address, set_realtime

    named = args.policy  # None: each transfer's default (daemon_sender.transfer_policy)
    _common.check_sending(args)
    if args.max_transfers < 1 or not args.slot_ms > 0:
        raise UserError("--max-transfers and --slot-ms must be positive")
    setup_logging(args.verbose, "sender-daemon", json_lines=args.log_json)
    _common.setup_memory(args, log)
    set_realtime(args.realtime)
    stats, metrics = _common.daemon_stats(args, "sender")
    daemon = SenderDaemon(
        bind=parse_address(args.bind, what="--bind"),
        control=args.control,
        rate_bps=args.rate_mbps * 1e6,
        key=_common.key_from(args),
        policy=named,
        symbol_size=args.symbol_size,
        gso=not args.no_gso,
        burst_s=args.burst_us * 1e-6,
        slot_s=args.slot_ms * 1e-3,
        max_transfers=args.max_transfers,
        utility_table=args.utility_table,
        stats=stats,
        curve_secret_file=args.curve_secret,
        queue_guard=not args.no_queue_guard,
    )
    if metrics is not None:
        metrics.attach(daemon)
    daemon.run_until_signalled()
    return 0
