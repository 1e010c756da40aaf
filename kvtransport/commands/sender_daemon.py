"""`kvtransport sender-daemon`: long-running sender with a ZeroMQ control API."""

from __future__ import annotations

import argparse
import math

from kvtransport.errors import UserError

NAME = "sender-daemon"
HELP = "run the sender daemon (UDP data plane, ZeroMQ control for local clients)"
DESCRIPTION = """\
Serve transfer requests from local clients (kvtransport.client.SenderClient, or any
ZeroMQ REQ socket speaking kvtransport.api) and send each over UDP to the receiver it
names, paced to the link rate. Several transfers can be in flight at once; they then share
--rate-mbps as the multi-user allocator decides every --slot-ms (weighted utility
water-filling with admission), and `status` reports each transfer's share.

Control: a ROUTER socket on --control (ipc:// by default, reachable from other network
namespaces; or tcp://127.0.0.1:PORT). SIGTERM or SIGINT: abort the transfers in flight
(their receivers deliver what they have), close, exit 0. Logs go to stderr; --stats
prints one JSON line per finished transfer (to stdout, or appended to FILE).

Example:
  kvtransport sender-daemon --rate-mbps 100 --key psk.hex --stats
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtransport.api import DEFAULT_SENDER_CONTROL
    from kvtransport.udp import REALTIME_HELP

    p.add_argument("--control", default=DEFAULT_SENDER_CONTROL, metavar="ENDPOINT",
                   help=f"ZeroMQ control endpoint (default {DEFAULT_SENDER_CONTROL})")  # fmt: skip
    p.add_argument("--bind", default="0.0.0.0:0", metavar="HOST:PORT",
                   help="local UDP address (default any port)")  # fmt: skip
    p.add_argument("--rate-mbps", type=float, default=100.0, help="link rate (default 100)")
    p.add_argument("--policy",
                   help="repair policy for requests that name none "
                   "(ddqn if its weights ship, else adaptive)")  # fmt: skip
    p.add_argument("--key", metavar="FILE|HEX", help="pre-shared key: authenticate datagrams")
    p.add_argument("--symbol-size", type=int, default=1280, help="bytes per symbol (1280)")
    p.add_argument("--max-transfers", type=int, default=64, help="in flight at once (64)")
    p.add_argument("--slot-ms", type=float, default=10.0,
                   help="link-sharing decision period when several transfers run (10)")  # fmt: skip
    p.add_argument("--burst-us", type=float, default=200.0,
                   help="send the slots due within this lead at once (default 200)")  # fmt: skip
    p.add_argument("--utility-table", metavar="FILE",
                   help="fitted utility curves (from fit-utility) for link sharing")  # fmt: skip
    p.add_argument("--no-gso", action="store_true",
                   help="one send() per datagram (use under kernel netem)")  # fmt: skip
    p.add_argument("--stats", nargs="?", const="-", metavar="FILE",
                   help="one JSON line per finished transfer (stdout, or FILE)")  # fmt: skip
    p.add_argument("--realtime", nargs="?", type=int, const=5, metavar="PRIO",
                   help=REALTIME_HELP)  # fmt: skip
    p.add_argument("-v", "--verbose", action="count", default=0, help="debug logs")


def run(args: argparse.Namespace) -> int:
    from kvtransport.policy import default_policy

    args.policy = args.policy or default_policy()
    from kvtransport.api import parse_key
    from kvtransport.daemon import StatsWriter, StopSignal, setup_logging
    from kvtransport.daemon_sender import SenderDaemon
    from kvtransport.udp import parse_address, set_realtime

    if not (args.rate_mbps > 0 and math.isfinite(args.rate_mbps)):
        raise UserError("--rate-mbps must be a positive number")
    if not 64 <= args.symbol_size <= 8192:
        raise UserError("--symbol-size must be 64..8192 bytes")
    if args.max_transfers < 1 or not args.slot_ms > 0 or not 0 <= args.burst_us <= 100_000:
        raise UserError("--max-transfers and --slot-ms must be positive, --burst-us 0..100000")
    setup_logging(args.verbose, "sender-daemon")
    set_realtime(args.realtime)
    daemon = SenderDaemon(
        bind=parse_address(args.bind, what="--bind"),
        control=args.control,
        rate_bps=args.rate_mbps * 1e6,
        key=parse_key(args.key),
        policy=args.policy,
        symbol_size=args.symbol_size,
        gso=not args.no_gso,
        burst_s=args.burst_us * 1e-6,
        slot_s=args.slot_ms * 1e-3,
        max_transfers=args.max_transfers,
        utility_table=args.utility_table,
        stats=StatsWriter(args.stats),
    )
    stop = StopSignal().install()
    try:
        daemon.run(stop)
    finally:
        stop.restore()
    return 0
