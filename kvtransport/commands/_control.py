"""Talking to a running daemon from the command line (submit, status, cancel).

Not a subcommand (the CLI skips modules whose name starts with an underscore). The
requests go through kvtransport.embed.client; this module adds the options that name the
daemon and turns "nobody answers" into one line that says how to start one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtransport.bounds import float_arg
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.embed.client import ReceiverClient, SenderClient

ROLES = ("sender", "receiver")


def add_control(parser: argparse.ArgumentParser, *, receiver_switch: bool = False) -> None:
    """``--control ENDPOINT`` (default: the sender daemon's default endpoint, or with
    ``--receiver``, where ``receiver_switch`` offers it, the receiver daemon's),
    ``--curve-server-key FILE``, ``--curve-client-key FILE`` and ``--timeout S``."""
    from kvtransport.daemons.api import DEFAULT_RECEIVER_CONTROL, DEFAULT_SENDER_CONTROL

    g = parser.add_argument_group("daemon")
    default = f"default {DEFAULT_SENDER_CONTROL}"
    if receiver_switch:
        default += f", with --receiver {DEFAULT_RECEIVER_CONTROL}"
        g.add_argument("--receiver", action="store_true",
                       help="ask the receiver daemon instead of the sender daemon")  # fmt: skip
    g.add_argument("--control", metavar="ENDPOINT",
                   help=f"the daemon's control endpoint, as it was started with "
                   f"({default})")  # fmt: skip
    g.add_argument("--curve-server-key", metavar="FILE",
                   help="the daemon's public CURVE key (FILE.pub beside its --curve-secret "
                   "FILE), for a daemon whose control runs with CURVE")  # fmt: skip
    g.add_argument("--curve-client-key", metavar="FILE",
                   help="this client's CURVE secret key (made on first use; add the line in "
                   "FILE.pub to the daemon's --curve-secret FILE.clients)")  # fmt: skip
    g.add_argument("--timeout", type=float_arg(0, 3600, lo_open=True), default=5.0,
                   metavar="S",
                   help="wait this long for the daemon to be up and answer "
                   "(default 5)")  # fmt: skip


def _no_daemon(role: str, endpoint: str, why: str) -> UserError:
    start = f"kvtransport {role}-daemon"
    if endpoint != _default(role):
        start += f" --control {endpoint}"
    return UserError(f"no {role} daemon answers at {endpoint} ({why}): start one with `{start}`")


def _default(role: str) -> str:
    from kvtransport.daemons.api import DEFAULT_RECEIVER_CONTROL, DEFAULT_SENDER_CONTROL

    return DEFAULT_RECEIVER_CONTROL if role == "receiver" else DEFAULT_SENDER_CONTROL


def role_of(args: argparse.Namespace) -> str:
    """ "receiver" when ``--receiver`` was given, else "sender"."""
    return "receiver" if getattr(args, "receiver", False) else "sender"


def connect(args: argparse.Namespace) -> SenderClient | ReceiverClient:
    """A client of the daemon ``add_control``'s options name, which has answered a ping
    (its role checked); a one-line UserError when no daemon of that role answers there
    within ``--timeout`` (an ipc:// socket file that does not exist yet is waited for as
    long, so a daemon just started is found). The caller closes it (``with``)."""
    from kvtransport.daemons.api import ApiError
    from kvtransport.embed.client import ReceiverClient, SenderClient

    role = role_of(args)
    endpoint = args.control or _default(role)
    if endpoint.startswith("ipc://"):  # a daemon starting up binds it soon
        path, end = Path(endpoint[len("ipc://") :]), time.monotonic() + args.timeout
        while not path.exists():
            if time.monotonic() > end:
                raise _no_daemon(role, endpoint, f"no socket file after {args.timeout:g} s")
            time.sleep(0.05)
    kind = ReceiverClient if role == "receiver" else SenderClient
    client = kind(
        endpoint,
        timeout_s=args.timeout,
        curve_server_key=args.curve_server_key,
        curve_client_key=args.curve_client_key,
    )
    try:
        pong = client.ping()
    except ApiError:
        client.close()
        raise _no_daemon(role, endpoint, f"no answer within {args.timeout:g} s") from None
    if pong.get("role") not in (None, role):
        client.close()
        raise UserError(f"{endpoint} is a {pong.get('role')} daemon, not a {role} daemon")
    return client


def connect_sender(args: argparse.Namespace) -> SenderClient:
    """:func:`connect` to the sender daemon."""
    from kvtransport.embed.client import SenderClient

    client = connect(args)
    assert isinstance(client, SenderClient)
    return client


def transfer_id(text: str) -> str:
    """A transfer id as the daemons print it (up to 16 hex digits), normalized."""
    from kvtransport.daemons.api import format_tid, parse_tid

    return format_tid(parse_tid(text))


def exit_status(st: dict[str, Any]) -> int:
    """A finished sender transfer's exit status, as ``kvtransport recv``'s: 0 when the
    receiver reported every source symbol decoded, 3 when it reported a part, 4 when it
    reported none (kvtransport.commands.recv's EXIT_* values). The sender knows what its
    receiver's feedback said, so a transfer whose feedback never came back counts as 4."""
    from kvtransport.commands.recv import EXIT_COMPLETE, EXIT_NOTHING, EXIT_PARTIAL

    if st.get("finish_reason") == "receiver done" or st["decoded_through"] >= st["n_source"]:
        return EXIT_COMPLETE
    return EXIT_PARTIAL if st["decoded_through"] > 0 else EXIT_NOTHING
