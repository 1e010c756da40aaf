"""`kvtransport status`: what a running daemon is doing, or one transfer's status."""

from __future__ import annotations

import argparse
from typing import Any

from kvtransport.commands import _common, _control

NAME = "status"
HELP = "show a running daemon's transfers, or one transfer's status"
DESCRIPTION = """\
Ask a running daemon (the sender daemon; with --receiver the receiver daemon) over its
control endpoint: without ID, its counters and every transfer in flight or recently
finished, one line each; with ID (a transfer id `kvtransport submit` printed), that
transfer's status in full. --json prints the daemon's answer as one JSON object.

Examples:
  kvtransport status
  kvtransport status 3f2a9c0d4b5e6f70 --json
  kvtransport status --receiver
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", metavar="ID", help="a transfer id (16 hex digits)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _control.add_control(p, receiver_switch=True)


def run(args: argparse.Namespace) -> int:
    tid = None if args.id is None else _control.transfer_id(args.id)
    role = _control.role_of(args)
    with _control.connect(args) as client:
        if tid is not None:
            st = client.status(tid)
            _common.report(args, st, _one_sender if role == "sender" else _one_receiver)
            return 0
        record = {"role": role, "endpoint": client._req.endpoint,  # noqa: SLF001
                  "stats": client.stats(), "transfers": client.status()}  # fmt: skip
    _common.report(args, record, _daemon)
    return 0


def _one_sender(st: dict[str, Any]) -> None:
    from kvtransport.commands.submit import show_final

    show_final(st)


def _one_receiver(st: dict[str, Any]) -> None:
    blocks = st["blocks"]
    print(f"transfer {st['transfer_id']} from {st['from']}: {st['state']} "
          f"{st['reason']}".rstrip())  # fmt: skip
    rows = [
        ("utility", f"{st['utility']:.4f}"),
        ("blocks complete", f"{st['blocks_complete']} of {blocks}" if blocks else "no manifest"),
        ("decoded", f"{st['decoded_through']} of {st['n_source']} source symbols in order"),
        ("datagrams", f"{st['datagrams']} ({st['datagrams_lost']} lost on the way)"),
    ]
    _common.print_rows(rows, 16)


def _daemon(record: dict[str, Any]) -> None:
    stats, transfers = record["stats"], record["transfers"]
    head = f"{record['role']} daemon at {record['endpoint']}: {stats.get('active', 0)} in flight"
    if "rate_mbps" in stats:
        head += f", link {stats['rate_mbps']:g} Mbit/s"
    print(head)
    if not transfers:
        print("  no transfers")
    for st in transfers:
        print("  " + (_sender_line(st) if record["role"] == "sender" else _receiver_line(st)))


def _sender_line(st: dict[str, Any]) -> str:
    state = st["finish_reason"] if st["state"] == "done" else st["state"]
    label = f" [{st['label']}]" if st["label"] else ""
    return (
        f"{st['transfer_id']}{label} to {st['to']}: {state}, receiver decoded "
        f"{st['decoded_through']} of {st['n_source']}, {st['elapsed_s'] * 1e3:.0f} of "
        f"{st['deadline_s'] * 1e3:.0f} ms"
    )


def _receiver_line(st: dict[str, Any]) -> str:
    blocks = st["blocks"]
    done = f"{st['blocks_complete']} of {blocks} blocks" if blocks else "no manifest yet"
    state = f"{st['state']} {st['reason']}".rstrip()
    return f"{st['transfer_id']} from {st['from']}: {state}, {done}, utility {st['utility']:.4f}"
