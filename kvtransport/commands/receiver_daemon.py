"""`kvtransport receiver-daemon`: long-running receiver publishing results over ZeroMQ."""

from __future__ import annotations

import argparse

from kvtransport.bounds import float_arg, int_arg
from kvtransport.commands import _common
from kvtransport.errors import UserError

NAME = "receiver-daemon"
HELP = "run the receiver daemon (UDP data plane, results published over ZeroMQ)"
DESCRIPTION = """\
Receive any number of transfers on one UDP port (demultiplexed by transfer id, a session
per transfer), send feedback to their senders, and at each transfer's deadline (or when
it is complete, or aborted) publish the result (complete blocks, missing-block list,
stats) on the PUB socket --publish; with --out-dir also write it as
<transfer id>.result.safetensors (a cache card when a card was sent). With --race-dir
each transfer is also mirrored into <DIR>/<transfer id>.kvrace (mode 0600) while it
arrives, so that a model process on this host races it instead of waiting for the result:
kvtransport.race_daemon(model, context_ids, race_dir=DIR) computes the context's front,
loads each token range as it completes and recomputes what never comes. A mirror is a
second copy of its transfer's payload (outside --budget-mb). A racer (`kvtransport answer
--race-dir`) claims its context's transfer before it looks: a claimed mirror stays until
that racer is done with it (at most 10 minutes after the result), an unclaimed one
--race-keep-s seconds after it (default 120); finished mirrors beyond 1 GiB in all go
oldest first; every mirror goes when the daemon stops.

Local clients: kvtransport.embed.client.ResultSubscriber for results, ReceiverClient for
status/abort on --control. State is bounded: --max-transfers at once, --max-mb per
transfer, --budget-mb for the buffers of all of them, and a transfer whose manifest never
comes ends --idle-timeout seconds after its last datagram. A subscriber that lags gets its
results late, in order (each carries a "seq"); past the daemon's backlog the loss is
counted (stats: publish_lost) and, with --out-dir, the result is still in its file.
Garbage, forged and foreign datagrams are counted (status, stats) and dropped, and so
is a replayed transfer (a stale manifest, or one accepted before, even before a restart:
--replay-file). SIGTERM
or SIGINT: deliver every transfer in progress as a partial result, close, exit 0.

Example:
  kvtransport receiver-daemon --listen :9400 --key-file psk.hex --out-dir results --stats
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtransport.daemons.api import DEFAULT_RECEIVER_CONTROL, DEFAULT_RESULTS
    from kvtransport.daemons.race_share import CLAIM_KEEP_S, KEEP_S

    p.add_argument("--listen", default="0.0.0.0:9400", metavar="HOST:PORT",
                   help="UDP address (default 0.0.0.0:9400)")  # fmt: skip
    p.add_argument("--control", default=DEFAULT_RECEIVER_CONTROL, metavar="ENDPOINT",
                   help=f"control endpoint (default {DEFAULT_RECEIVER_CONTROL})")  # fmt: skip
    p.add_argument("--publish", default=DEFAULT_RESULTS, metavar="ENDPOINT",
                   help=f"ZeroMQ PUB endpoint for results (default {DEFAULT_RESULTS})")  # fmt: skip
    _common.add_key(p)
    _common.add_identity(p, sending=False)
    p.add_argument("--out-dir", metavar="DIR", help="also write each result into DIR")
    p.add_argument("--race-dir", metavar="DIR",
                   help="mirror each transfer into DIR while it arrives (e.g. a 0700 folder "
                   "under /dev/shm), so a model process on this host races it: "
                   "kvtransport.embed.live_race.race_daemon")  # fmt: skip
    p.add_argument("--race-keep-s", type=float_arg(0, 86400), default=None, metavar="S",
                   help="with --race-dir: keep a finished transfer's mirror S seconds for a "
                   f"racer that has not claimed it (default {KEEP_S:g}; a claimed one stays "
                   f"until its racer is done, at most {CLAIM_KEEP_S:g} s)")  # fmt: skip
    p.add_argument(
        "--max-transfers", type=int_arg(1, 4096), default=16, help="at once (default 16)"
    )
    p.add_argument("--max-mb", type=float_arg(0, 1e6, lo_open=True), default=256.0,
                   help="largest transfer accepted, MB (default 256)")  # fmt: skip
    p.add_argument(
        "--idle-timeout",
        type=float_arg(0, 3600, lo_open=True),
        default=10.0,
        help="end a transfer with no manifest this long after its last datagram",
    )
    p.add_argument("--budget-mb", type=float_arg(0, 1e7, lo_open=True), default=None, metavar="MB",
                   help="buffers of all transfers held at once, MB (default: the larger of "
                   "--max-mb and 1073.7)")  # fmt: skip
    p.add_argument("--no-gro", action="store_true", help="read one datagram per call")
    _common.add_replay(p)
    _common.add_curve(p)
    _common.add_daemon_output(p)


def run(args: argparse.Namespace) -> int:
    from kvtransport.daemons.daemon import setup_logging
    from kvtransport.daemons.daemon_receiver import ReceiverDaemon, log
    from kvtransport.daemons.udp import parse_address, set_realtime

    if args.race_keep_s is not None and args.race_dir is None:
        raise UserError("--race-keep-s goes with --race-dir")
    if args.max_transfers < 1 or not args.max_mb > 0 or not args.idle_timeout > 0:
        raise UserError("--max-transfers, --max-mb and --idle-timeout must be positive")
    setup_logging(args.verbose, "receiver-daemon", json_lines=args.log_json)
    _common.setup_memory(args, log)
    set_realtime(args.realtime)
    stats, metrics = _common.daemon_stats(args, "receiver")
    daemon = ReceiverDaemon(
        bind=parse_address(args.listen, what="--listen"),
        control=args.control,
        publish=args.publish,
        key=_common.key_from(args),
        out_dir=args.out_dir,
        race_dir=args.race_dir,
        race_keep_s=args.race_keep_s,
        gro=not args.no_gro,
        max_transfers=args.max_transfers,
        max_bytes=int(args.max_mb * 1e6),
        idle_timeout=args.idle_timeout,
        budget_bytes=None if args.budget_mb is None else int(args.budget_mb * 1e6),
        stats=stats,
        replay_file=args.replay_file,
        replay_window_s=args.replay_window,
        curve_secret_file=args.curve_secret,
    )
    if metrics is not None:
        metrics.attach(daemon)
    daemon.run_until_signalled()
    return 0
