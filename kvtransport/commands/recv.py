"""`kvtransport recv`: receive one transfer over UDP and report (or save) the result."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvtransport.bounds import float_arg
from kvtransport.commands import _common
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.daemons.api import DeliveredResult

EXIT_COMPLETE = _common.EXIT_COMPLETE
EXIT_PARTIAL = _common.EXIT_PARTIAL
EXIT_NOTHING = _common.EXIT_NOTHING

NAME = "recv"
HELP = "receive one transfer over UDP; print the utility recovered, save the result"
DESCRIPTION = """\
Wait for one transfer from `kvtransport send` (or a sender daemon), feed it to the
receiver session (authentication, RLC decoding, feedback to the sender) and stop at its
deadline, when everything is decoded, or when the sender aborts. Prints the utility
recovered and which blocks are missing; --out DIR writes the result as
<transfer id>.result.safetensors (mode 0600; a cache card when a card was sent, see
kvtransport.daemons.api). --out is checked at start (a writable directory with room); if
writing the result fails later (disk full), the result is kept in the state directory's
results/ folder instead and the failure named on standard error (exit 2), and the sender
is told (its final report waits for the write): `kvtransport send` names
result_unsaved and exits 4.
Datagrams of any other transfer are counted and dropped.

Exit status: 0 when every block arrived, 3 when the result is partial (blocks missing at
the deadline or on abort), 4 when the manifest never arrived or the transfer was refused
(nothing usable; a refused transfer ends the wait a second later unless another one
started), 2 when no transfer arrived or on bad input, 130 when interrupted. When
datagrams failed authentication (another key) or a transfer was refused (a stale manifest:
clocks out of sync), a line on standard error says so.

Examples:
  kvtransport recv --listen :9400 --json
  kvtransport recv --listen 10.77.0.2:9400 --key-file psk.hex --out results/
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="0.0.0.0:9400", metavar="HOST:PORT",
                   help="UDP address to receive on (default 0.0.0.0:9400)")  # fmt: skip
    _common.add_key(p)
    _common.add_identity(p, sending=False)
    p.add_argument("--out", metavar="DIR", help="write the result file into DIR")
    p.add_argument("--timeout", type=float_arg(0, 1e6, lo_open=True), default=60.0,
                   help="give up if no transfer starts within this many seconds (60)")  # fmt: skip
    p.add_argument("--idle-timeout", type=float_arg(0, 3600, lo_open=True), default=10.0,
                   help="end a transfer this long after its last datagram when its "
                   "manifest (and so its deadline) never arrived (default 10 s)")  # fmt: skip
    p.add_argument("--max-mb", type=float_arg(0, 1e6, lo_open=True), default=1024.0,
                   help="largest transfer accepted, MB (default 1024)")  # fmt: skip
    p.add_argument("--no-gro", action="store_true", help="read one datagram per call")
    _common.add_replay(p)
    _common.add_realtime(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtransport.core.replay import open_record
    from kvtransport.core.wire import PeerKeys
    from kvtransport.daemons.api import keep_result, probe_result_dir
    from kvtransport.daemons.daemon import warm_up
    from kvtransport.daemons.udp import DatagramSocket, parse_address, set_realtime
    from kvtransport.embed.inprocess import delivered, run_receive

    if args.out:
        probe_result_dir(args.out, "--out")
    if not args.timeout > 0 or not args.idle_timeout > 0 or not args.max_mb > 0:
        raise UserError("--timeout, --idle-timeout and --max-mb must be positive")
    key = _common.key_from(args)
    bind = parse_address(args.listen, what="--listen")
    replay = open_record(args.replay_file, bind[1], args.replay_window)
    set_realtime(args.realtime)
    warm_up(key)
    sock = DatagramSocket(bind, gro=not args.no_gro)
    host, port = sock.address
    print(f"kvtransport recv: listening on {host}:{port}", file=sys.stderr, flush=True)
    engines: list = []
    written: dict = {}

    def keep(inc: Any) -> bool:
        """The result into --out before the sender is told (else kept elsewhere)."""
        result = written["result"] = delivered(inc, engines[0])
        try:
            path, kept = keep_result(args.out, inc.session.result, result.stats)
        except UserError as exc:  # neither --out nor the state directory took it
            written["lost"] = str(exc)
            return False
        result.stats["file"] = str(path)
        if kept is not None:
            result.stats["file_error"] = written["kept"] = kept
        return kept is None

    with _common.stoppable(sock) as stop, _common.warnings_to_stderr(NAME):
        inc, engine = run_receive(
            sock, stop=stop, key=key, timeout_s=args.timeout, idle_timeout_s=args.idle_timeout,
            max_bytes=int(args.max_mb * 1e6), replay=replay, on_engine=engines.append,
            keep=keep if args.out else None,
        )  # fmt: skip
        if inc is None and stop.signal_name == "refused":
            print(f"kvtransport recv: error: {engine.host.last_refusal}", file=sys.stderr)
            return EXIT_NOTHING
        if inc is None:
            note = engine.host.failure_note()
            why = f"; {note}" if note else ""
            if stop.signal_name.startswith("SIG"):
                raise UserError(
                    f"interrupted ({stop.signal_name}) before any transfer arrived{why}"
                )
            raise UserError(f"no transfer arrived on {args.listen} within {args.timeout:g} s{why}")
        note = engine.host.failure_note(refusals=False)  # a refusal was logged as it came
        if note:
            print(f"kvtransport recv: {note}", file=sys.stderr)
        result = written["result"] if "result" in written else delivered(inc, engine)
        stats = result.stats
        if isinstance(key, PeerKeys):  # pairwise secrets tried on transfers of no known peer
            stats["peer_tries"] = key.tries
    if "lost" in written:
        raise UserError(f"the result could not be written: {written['lost']}")
    _common.report(args, stats, _print)
    if "kept" in written:
        raise UserError(f"{written['kept']}: the result is kept in {stats['file']} instead")
    return exit_status(result)


def exit_status(result: DeliveredResult) -> int:
    """0: every block arrived; 3: partial (some blocks missing at the deadline or abort);
    4: the manifest never arrived, so nothing of the transfer is usable."""
    if result.blocks is None:
        return EXIT_NOTHING
    return EXIT_COMPLETE if result.is_complete else EXIT_PARTIAL


def _print(st: dict) -> None:
    reason = st["reason"] + (f" ({st['refused']})" if st.get("refused") else "")
    print(
        f"transfer {st['transfer_id']} from {st['from']}: {reason} after "
        f"{st['elapsed_s'] * 1e3:.1f} ms, utility recovered {st['utility']:.4f}"
    )
    blocks = st["blocks"]
    rows = [
        ("blocks complete", f"{st['blocks_complete']} of {blocks}" if blocks else "no manifest"),
        ("datagrams", f"{st['datagrams']} ({st['datagrams_lost']} lost on the way)"),
        ("source / repair", f"{st['source_received']} / {st['repair_received']}"),
        ("symbols recovered", str(st["symbols_recovered"])),
        ("dropped", f"{st['dropped']} {st['drop_reasons'] or ''}".strip()),
        ("feedback sent", str(st["feedback_sent"])),
    ]
    if "file" in st:
        rows.append(("written to", st["file"]))
    _common.print_rows(rows, 20)
