"""`kvtransport cancel`: abort a transfer a sender daemon has in flight."""

from __future__ import annotations

import argparse

from kvtransport.commands import _control
from kvtransport.errors import UserError

NAME = "cancel"
HELP = "abort a transfer in flight at a running sender daemon"
DESCRIPTION = """\
Ask the running sender daemon to abort transfer ID (as `kvtransport submit` printed it):
it stops sending and tells the receiver, which delivers what it has at once. Exit status
0 when it was cancelled, 1 when it had already finished, 2 when the daemon does not know
it (or no daemon answers).

Example:
  kvtransport cancel 3f2a9c0d4b5e6f70
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", metavar="ID", help="the transfer id (16 hex digits)")
    _control.add_control(p)


def run(args: argparse.Namespace) -> int:
    from kvtransport.daemons.api import ApiError

    tid = _control.transfer_id(args.id)
    with _control.connect_sender(args) as client:
        if client.cancel(tid):
            print(f"transfer {tid} cancelled")
            return 0
        try:
            st = client.status(tid)
        except ApiError:
            raise UserError(f"the sender daemon has no transfer {tid}") from None
    print(f"transfer {tid} had already finished: {st['finish_reason'] or st['state']}")
    return 1
