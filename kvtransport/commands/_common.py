"""Argument groups and run-time steps that several subcommands share.

Not a subcommand: the CLI skips modules whose name starts with an underscore. Kept cheap
to import (no numpy, torch or ZeroMQ at module level), like the command modules' own
``add_arguments``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvtransport.bounds import float_arg, int_arg
from kvtransport.errors import UserError

if TYPE_CHECKING:
    from kvtransport.core.wire import SealKey

EXIT_COMPLETE = 0
"""``send`` and ``recv``: every block (``send``: every source symbol) arrived."""
EXIT_PARTIAL = 3
"""Some of the transfer arrived (its manifest did), not all of it."""
EXIT_NOTHING = 4
"""Nothing usable arrived: no manifest, a refusal, or (``send``) no feedback at all."""
EXIT_BY_OUTCOME = {"complete": EXIT_COMPLETE, "partial": EXIT_PARTIAL, "nothing": EXIT_NOTHING}
"""A sender's ``delivered`` (kvtransport.hosts.sender_host.Outgoing.outcome) as an exit status."""

MODEL_HELP = (
    "model: a HuggingFace directory, a .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct)"
)


def add_model(parser: argparse.ArgumentParser) -> None:
    """``--model M``, for the commands that load the language model."""
    parser.add_argument("--model", metavar="M", default=None, help=MODEL_HELP)


KEY_HELP = (
    "Datagrams are encrypted and authenticated (AES-256-GCM) with a pre-shared key both "
    "hosts hold: --key-file FILE, --key-stdin, $KVT_KEY, or by default ~/.config/kvtransport/key "
    "(made on first use, mode 0600: copy it to the peer host with scp -p). --insecure runs "
    "without one (plaintext, forgeable)."
)


def add_synthetic(parser: argparse.ArgumentParser, what: Any) -> None:
    """A synthetic stream's ``--size-mb`` (in the mutually exclusive group ``what``, beside
    the option or argument naming a card), ``--blocks``, ``--utility`` and ``--seed``;
    kvtransport.commands.send's ``_transfer`` builds the stream from them."""
    what.add_argument(
        "--size-mb",
        type=float_arg(0, 4096, lo_open=True),
        help="synthetic stream size in MB (default 10)",
    )
    parser.add_argument(
        "--blocks", type=int_arg(1, 10**9), help="synthetic: number of blocks (default 12 KiB each)"
    )
    parser.add_argument("--utility", default="zipf", choices=("zipf", "flat", "linear"),
                        help="synthetic: block utility profile (default zipf)")  # fmt: skip
    parser.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=1, help="synthetic: payload seed (default 1)"
    )


def add_key(parser: argparse.ArgumentParser) -> None:
    """``--key-file FILE``, ``--key FILE``, ``--key-stdin`` and ``--insecure`` (see
    kvtransport.core.keys); both ends must use the same key. :func:`key_from` reads them."""
    g = parser.add_argument_group("pre-shared key", KEY_HELP)
    g.add_argument("--key-file", metavar="FILE", help="the key file (hex, mode 0600, yours)")
    g.add_argument("--key", metavar="FILE", help="the key file (as --key-file)")
    g.add_argument("--key-stdin", action="store_true",
                   help="read the key (hex) from standard input; or set $KVT_KEY")  # fmt: skip
    g.add_argument(
        "--insecure", action="store_true", help="no key: plaintext, unauthenticated datagrams"
    )


IDENTITY_HELP = (
    "Bind transfers to the peers' identities (X25519 key pairs, made by kvtransport keygen): "
    "a sender names its receiver's public key (--peer-pub), a receiver the senders' it "
    "allows (--allow-pub); only public keys are copied between hosts. A capture replayed "
    "to another receiver, or a sender not allowed, opens nothing. A pre-shared key is then "
    "mixed in only when one is named (--key-file, --key-stdin, $KVT_KEY)."
)


def add_identity(parser: argparse.ArgumentParser, *, sending: bool) -> None:
    """``--identity FILE`` and a sender's ``--peer-pub FILE`` or a receiver's
    ``--allow-pub PATH`` (kvtransport.core.keys, identities); :func:`key_from` reads them."""
    g = parser.add_argument_group("peer identities", IDENTITY_HELP)
    g.add_argument("--identity", metavar="FILE",
                   help="this host's private key (default "
                   "~/.config/kvtransport/identity)")  # fmt: skip
    if sending:
        g.add_argument("--peer-pub", metavar="FILE",
                       help="the receiver's public key file: only that receiver opens what "
                       "this sends")  # fmt: skip
    else:
        g.add_argument("--allow-pub", metavar="PATH", action="append",
                       help="a sender's public key file, or a directory of *.pub files "
                       "(repeat for more): only these senders open sessions")  # fmt: skip


def key_from(args: argparse.Namespace) -> SealKey | None:
    """The key :func:`add_key`'s options name (None only with ``--insecure``), or with
    :func:`add_identity`'s peers named, the peers' keys (kvtransport.core.keys)."""
    from kvtransport.core.keys import allowed_publics, peer_keys, read_public

    peer = getattr(args, "peer_pub", None)
    allowed: list[str] = getattr(args, "allow_pub", None) or []
    if peer is None and not allowed:
        if getattr(args, "identity", None) is not None:
            raise UserError("--identity needs the peer's public key: --peer-pub or --allow-pub")
        return _psk_from(args, explicit=False)
    if args.insecure:
        raise UserError("--insecure runs without keys; drop it or --peer-pub/--allow-pub")
    psk = _psk_from(args, explicit=True)
    if peer is not None:
        from pathlib import Path

        return peer_keys(args.identity, [(Path(peer), read_public(peer))], sending=True, psk=psk)
    return peer_keys(args.identity, allowed_publics(allowed), sending=False, psk=psk)


def _psk_from(args: argparse.Namespace, *, explicit: bool) -> bytes | None:
    """The pre-shared key :func:`add_key`'s options name; with ``explicit`` only one named
    by an option or ``$KVT_KEY`` (None otherwise: no default key file read or made)."""
    import os
    from pathlib import Path

    from kvtransport.core.keys import KEY_ENV, parse_hex, resolve_key

    if args.key is not None and not Path(args.key).exists():
        raise UserError(
            "--key takes a key file: a key in hex on the command line is visible to every "
            "user in ps; use --key-file FILE, --key-stdin or $KVT_KEY"
        )
    if getattr(args, "key_stdin", False):
        if args.key is not None or args.key_file is not None or args.insecure:
            raise UserError("give one of --key-stdin, --key-file, --key, --insecure")
        return parse_hex(sys.stdin.readline(), "the key on standard input")
    if explicit and args.key is None and args.key_file is None and not os.environ.get(KEY_ENV):
        return None
    return resolve_key(args.key_file, args.key, args.insecure)


def add_replay(parser: argparse.ArgumentParser) -> None:
    """``--replay-file`` and ``--replay-window`` of a receiver (kvtransport.core.replay)."""
    from kvtransport.core.replay import DEFAULT_WINDOW_S, MAX_WINDOW_S

    g = parser.add_argument_group(
        "replay protection",
        "A transfer is accepted once, and only while its manifest is fresh: sent within "
        "--replay-window seconds of this host's clock (keep the hosts' clocks in sync, "
        "e.g. NTP). The ids accepted are kept in --replay-file across restarts.",
    )
    g.add_argument("--replay-file", metavar="FILE",
                   help="the replay record (default: $KVT_STATE_DIR, else "
                   "$XDG_STATE_HOME/kvtransport, else ~/.local/state/kvtransport, "
                   "file replay-<port>)")  # fmt: skip
    g.add_argument("--replay-window", type=float_arg(0, MAX_WINDOW_S, lo_open=True),
                   default=DEFAULT_WINDOW_S, metavar="S",
                   help=f"freshness window, seconds (default {DEFAULT_WINDOW_S:g})")  # fmt: skip


def add_curve(parser: argparse.ArgumentParser) -> None:
    """``--curve-secret FILE``: ZeroMQ CURVE on a daemon's control/result sockets."""
    parser.add_argument(
        "--curve-secret", metavar="FILE",
        help="encrypt and authenticate the ZeroMQ sockets with CURVE, this daemon's secret "
        "key in FILE (made on first use, mode 0600; its public key in FILE.pub, which "
        "clients pass as --curve-server-key); only the clients whose public keys are in "
        "FILE.clients (one per line, or a directory of such files) get in; needed for "
        "any tcp:// endpoint",
    )  # fmt: skip


def add_realtime(parser: argparse.ArgumentParser) -> None:
    """``--realtime [PRIO]``: SCHED_FIFO for the UDP loop (kvtransport.daemons.udp.set_realtime)."""
    from kvtransport.daemons.udp import REALTIME_HELP

    parser.add_argument(
        "--realtime", nargs="?", type=int_arg(1, 99), const=5, metavar="PRIO", help=REALTIME_HELP
    )


def add_pacing(parser: argparse.ArgumentParser) -> None:
    """The sending side's symbol size, burst lead and GSO switch (send, sender-daemon)."""
    parser.add_argument(
        "--symbol-size", type=int_arg(64, 8192), default=1280, help="bytes per symbol (1280)"
    )
    parser.add_argument(
        "--burst-us",
        type=float_arg(0, 100_000),
        default=200.0,
        help="send the slots due within this lead at once (default 200)",
    )
    parser.add_argument(
        "--no-gso", action="store_true", help="one send() per datagram (use under kernel netem)"
    )


def add_daemon_output(parser: argparse.ArgumentParser) -> None:
    """What both daemons report: ``--stats`` lines, ``--realtime``, ``-v`` logs."""
    parser.add_argument(
        "--stats",
        nargs="?",
        const="-",
        metavar="FILE",
        help="one JSON line per finished transfer (stdout, or FILE)",
    )
    add_realtime(parser)
    add_memory(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logs")
    add_operability(parser)


def add_memory(parser: argparse.ArgumentParser) -> None:
    """The daemons' ``--prefault-mb`` (kvtransport.daemons.heap)."""
    parser.add_argument(
        "--prefault-mb",
        type=float_arg(0, 1e6),
        default=0.0,
        metavar="MB",
        help="fault in this much memory at start-up and keep it, and the memory of "
        "finished transfers, for the next transfers' buffers, which then take no page "
        "faults (glibc only; resident from the start; default 0: glibc's defaults)",
    )


def setup_memory(args: argparse.Namespace, log: Any) -> None:
    """Apply ``add_memory``'s option to this process (after logging is set up)."""
    from kvtransport.daemons import heap

    if not args.prefault_mb:
        return
    if not heap.keep_freed_memory():
        log.warning("--prefault-mb ignored: the C library is not glibc")
        return
    heap.prefault(int(args.prefault_mb * 1e6))
    log.info("%g MB faulted in and kept for transfers' buffers", args.prefault_mb)


def add_operability(parser: argparse.ArgumentParser) -> None:
    """The daemons' ``--metrics-port``, ``--log-json`` and ``--config``
    (kvtransport.daemons.config)."""
    parser.add_argument(
        "--metrics-port",
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST default 127.0.0.1; "
        "needs the 'metrics' extra)",
    )
    parser.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file of options (keys as the flags: rate-mbps = 100); flags override it",
    )


def daemon_stats(args: argparse.Namespace, role: str) -> tuple[Any, Any]:
    """The ``--stats`` writer, and with ``--metrics-port`` the metrics it also feeds
    (already serving; attach the daemon once it exists). Returns (writer, metrics|None)."""
    from kvtransport.daemons.daemon import StatsWriter

    writer = StatsWriter(args.stats)
    if not args.metrics_port:
        return writer, None
    from kvtransport.daemons.daemon_metrics import (
        DaemonMetrics,
        MetricsStats,
        parse_metrics_address,
    )

    host, port = parse_metrics_address(args.metrics_port)
    metrics = DaemonMetrics(role)
    metrics.serve(host, port)
    return MetricsStats(writer, metrics), metrics


def check_sending(args: argparse.Namespace) -> None:
    """Validate the sending side's shared options; an unset ``--policy`` becomes the
    default policy (ddqn if its weights ship, else adaptive), which must be makeable."""
    from kvtransport.policies.registry import default_policy, make_policy

    args.policy = args.policy or default_policy()
    if not (args.rate_mbps > 0 and math.isfinite(args.rate_mbps)):
        raise UserError("--rate-mbps must be a positive number")
    if not 64 <= args.symbol_size <= 8192:
        raise UserError("--symbol-size must be 64..8192 bytes")
    if not 0 <= args.burst_us <= 100_000:
        raise UserError("--burst-us must be 0..100000")
    make_policy(args.policy)


@contextlib.contextmanager
def warnings_to_stderr(command: str) -> Iterator[None]:
    """While inside: the package's warnings (a refused transfer, datagrams that fail
    authentication) go to standard error as ``kvtransport COMMAND: message`` lines, unless
    logging is configured already (an embedding application's handlers take them)."""
    import logging

    pkg = logging.getLogger("kvtransport")
    if logging.getLogger().handlers or pkg.handlers:
        yield
        return
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"kvtransport {command}: %(message)s"))
    pkg.addHandler(handler)
    try:
        yield
    finally:
        pkg.removeHandler(handler)


@contextlib.contextmanager
def stoppable(sock: Any) -> Iterator[Any]:
    """A kvtransport.daemons.daemon.StopSignal for one-shot send/recv (SIGTERM/SIGINT stop the
    loop); on exit the signal handlers are restored and ``sock`` is closed."""
    from kvtransport.daemons.daemon import StopSignal

    stop = StopSignal().install()
    try:
        yield stop
    finally:
        stop.restore()
        sock.close()


def report(args: argparse.Namespace, record: dict[str, Any], show: Callable[[dict], None]) -> None:
    """One JSON object with ``--json``, else ``show(record)`` for people."""
    if args.json:
        print(json.dumps(record))
    else:
        show(record)


def print_rows(rows: list[tuple[str, str]], width: int) -> None:
    """Indented ``name value`` lines, names padded to ``width``."""
    for k, v in rows:
        print(f"  {k:{width}s} {v}")


def repairs_text(sent: float, retransmitted: float) -> str:
    """Repair datagrams sent, and the sources among them sent again (ARQ's, or the RLC
    scheme's for holes below what its repairs reach) where there were any."""
    again = f" ({retransmitted:.0f} sources sent again)" if retransmitted else ""
    return f"{sent:.0f}{again}"
