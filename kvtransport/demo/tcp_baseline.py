"""The TCP baseline: the same transfer over one plain TCP connection, cut at the deadline.

What users of LMCache or Mooncake over TCP get today: the sender writes the transfer's
bytes into a kernel TCP socket (the kernel's congestion control, retransmissions, no
FEC, no utility order beyond the stream order) and the receiver keeps whatever whole
blocks arrived by the deadline. It crosses the same links as the FEC transport (the netns
testbed's relay works on Ethernet frames, so TCP sees the same loss model).

Stream (one connection, sender to receiver)::

    0   4  magic b"KVTC"
    4   4  manifest length M (u32, little-endian)
    8   M  kvtransport.core.transfer.TransportManifest bytes (block table, app metadata)
    8+M    payload: the transfer's bytes, blocks in stream order

The receiver's clock starts at the connection's first byte (as the UDP receiver's starts
at the first datagram; the handshake before it is the sender's ``connect_s``). A block is
complete when its last byte has arrived; :class:`BlockClock` records when each block
became complete (seconds from the first byte). At the deadline the receiver resets the
connection and reports what was complete; the sender then stops.

Command line (thin; run inside a testbed namespace like the daemons)::

    python -m kvtransport.demo.tcp_baseline recv 10.77.0.2:9401 --deadline-s 1.5 --out DIR
    python -m kvtransport.demo.tcp_baseline send 10.77.0.2:9401 STREAM_FILE

``recv`` prints ``ready`` once it listens, then one JSON summary line, and writes
``DIR/result.json``, ``DIR/manifest.bin`` and ``DIR/payload.bin``; ``send`` prints one
JSON line (bytes sent, the kernel's TCP_INFO counters). :func:`write_stream` writes the
STREAM_FILE of a transfer. Data plane: stdlib sockets and numpy only.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.core.transfer import BlockTable, Transfer, TransportManifest
from kvtransport.core.wire import BadPayload
from kvtransport.errors import UserError

__all__ = [
    "BlockClock",
    "Receipt",
    "MAGIC",
    "stream_header",
    "write_stream",
    "receive",
    "send",
    "tcp_info",
    "main",
]

MAGIC = b"KVTC"
_HEAD = struct.Struct("<4sI")
MAX_MANIFEST_BYTES = 64 << 20
SYMBOL_SIZE = 1448  # TransportManifest needs one; TCP ignores it (an Ethernet MSS)
RECV_CHUNK = 1 << 20


def stream_header(transfer: Transfer) -> bytes:
    """Magic, manifest length and manifest: what precedes the payload on the connection."""
    manifest = TransportManifest(
        SYMBOL_SIZE, transfer.nbytes, transfer.blocks, transfer.app_metadata
    ).to_bytes()
    return _HEAD.pack(MAGIC, len(manifest)) + manifest


def write_stream(path: str | Path, transfer: Transfer) -> int:
    """Write the whole stream (header then payload) of ``transfer`` to ``path``; its size."""
    head = stream_header(transfer)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.write(memoryview(transfer.payload))
    return len(head) + transfer.nbytes


class BlockClock:
    """When each block became complete, from how many payload bytes have arrived in order.

    Sans-I/O: the caller reports ``advance(received, t)`` after each read (``received``:
    payload bytes so far, never decreasing; ``t``: seconds on the caller's clock). A block
    is complete once ``received`` reaches its end; its arrival time is the ``t`` of the
    first report that reached it. Blocks are in increasing offset order
    (kvtransport.core.transfer.BlockTable), so they complete in stream order.
    """

    def __init__(self, blocks: BlockTable) -> None:
        self.ends = (blocks.offsets + blocks.lengths).astype(np.int64)
        self.arrival_s = np.full(len(blocks), np.inf)
        self.received = 0
        self.done = 0  # blocks complete so far (a prefix)

    def advance(self, received: int, t: float) -> int:
        """Record ``received`` payload bytes at time ``t``; returns how many blocks completed."""
        if received < self.received:
            raise ValueError(f"received bytes went back from {self.received} to {received}")
        self.received = received
        upto = int(np.searchsorted(self.ends, received, side="right"))
        newly = upto - self.done
        if newly > 0:
            self.arrival_s[self.done : upto] = t
            self.done = upto
        return newly

    @property
    def complete(self) -> np.ndarray:
        return np.isfinite(self.arrival_s)


@dataclass
class Receipt:
    """What the TCP receiver got.

    reason: "complete" (every payload byte), "deadline", "fin" (the sender closed early),
    "idle" (no connection, or no first byte, within the accept timeout), "abort" (not a
    KVTC stream: ``error`` says why). ``payload`` holds the received prefix of the payload
    (zeros after it; complete blocks are exact); empty when the manifest never arrived, as
    are ``arrival_s``. Times in ``timings`` are seconds from the first byte, except
    ``*_mono`` (CLOCK_MONOTONIC, shared by every process of one host).
    """

    reason: str
    manifest: TransportManifest | None
    manifest_bytes: bytes
    payload: np.ndarray
    arrival_s: np.ndarray
    bytes_received: int  # every byte on the connection, header included
    timings: dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def complete(self) -> np.ndarray:
        return np.isfinite(self.arrival_s)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: everything but the payload and the manifest bytes (inf -> null)."""
        return {
            "reason": self.reason,
            "error": self.error,
            "manifest": self.manifest is not None,
            "payload_len": self.manifest.payload_len if self.manifest else 0,
            "bytes_received": self.bytes_received,
            "blocks": len(self.arrival_s),
            "blocks_complete": int(self.complete.sum()),
            "arrival_s": [None if math.isinf(a) else round(a, 6) for a in self.arrival_s],
            "timings": self.timings,
        }


class _Ended(Exception):
    """The connection ended before a read was satisfied: reason "deadline" or "fin"."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def receive(
    listener: socket.socket,
    deadline_s: float,
    accept_timeout_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> Receipt:
    """Accept one connection on ``listener`` and read a KVTC stream from it until the
    payload is complete or ``deadline_s`` seconds after its first byte (then reset it)."""
    if not deadline_s > 0:
        raise ValueError(f"deadline must be > 0 s, not {deadline_s}")
    t_listen = clock()
    listener.settimeout(accept_timeout_s)
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        return _empty("idle", 0, {"finished_mono": clock()})
    t_accept = clock()
    timings = {"accept_mono": t_accept, "accept_wait_s": t_accept - t_listen}
    got = 0
    first: float | None = None
    end_at = t_accept + accept_timeout_s  # until the first byte, then first + deadline

    def read_into(buf: memoryview) -> int:
        nonlocal got, first, end_at
        left = end_at - clock()
        if left <= 0:
            raise _Ended("deadline" if first is not None else "idle")
        conn.settimeout(left)
        try:
            n = conn.recv_into(buf)
        except TimeoutError:
            raise _Ended("deadline" if first is not None else "idle") from None
        except ConnectionError:
            raise _Ended("fin") from None
        if n == 0:
            raise _Ended("fin")
        if first is None:
            first = clock()
            end_at = first + deadline_s
            timings["first_byte_mono"] = first
        got += n
        return n

    def read_exact(size: int) -> bytes:
        buf = bytearray(size)
        view, pos = memoryview(buf), 0
        while pos < size:
            pos += read_into(view[pos:])
        return bytes(buf)

    manifest, mbytes, clock_ = None, b"", None
    payload = np.zeros(0, dtype=np.uint8)
    reason, error = "complete", ""
    try:
        magic, mlen = _HEAD.unpack(read_exact(_HEAD.size))
        assert first is not None  # read_into sets it on the first byte
        if magic != MAGIC:
            raise BadPayload(f"not a KVTC stream (magic {magic!r})")
        if mlen > MAX_MANIFEST_BYTES:
            raise BadPayload(f"manifest of {mlen} bytes > {MAX_MANIFEST_BYTES}")
        mbytes = read_exact(mlen)
        manifest = TransportManifest.from_bytes(mbytes)
        timings["manifest_s"] = clock() - first
        payload = np.zeros(manifest.payload_len, dtype=np.uint8)
        clock_ = BlockClock(manifest.blocks)
        view, pos = memoryview(payload), 0
        while pos < manifest.payload_len:
            pos += read_into(view[pos : pos + RECV_CHUNK])
            clock_.advance(pos, clock() - first)
    except _Ended as end:
        reason = end.reason
    except BadPayload as exc:
        reason, error = "abort", str(exc)
    finally:
        if reason != "complete":
            # reset, not a graceful close: a sender cut at the deadline stops at once
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    now = clock()
    timings["finished_mono"] = now
    if first is not None:
        timings["first_byte_s"] = first - t_accept
        timings["finished_s"] = now - first
    if clock_ is None:
        out = _empty(reason, got, timings)
        out.manifest_bytes, out.error = mbytes, error
        return out
    return Receipt(reason, manifest, mbytes, payload, clock_.arrival_s, got, timings, error)


def _empty(reason: str, got: int, timings: dict[str, float]) -> Receipt:
    return Receipt(reason, None, b"", np.zeros(0, np.uint8), np.zeros(0), got, timings)


# TCP_INFO (linux/tcp.h, struct tcp_info): the fields the baseline reports, by offset
_TCP_INFO_LEN = 232
_TCP_INFO_FIELDS = {
    "rtt_us": (68, "I"),
    "snd_cwnd": (80, "I"),
    "total_retrans": (100, "I"),
    "bytes_acked": (120, "Q"),
    "min_rtt_us": (148, "I"),
    "data_segs_out": (156, "I"),
    "bytes_sent": (200, "Q"),
    "bytes_retrans": (208, "Q"),
}


def tcp_info(sock: socket.socket) -> dict[str, int]:
    """The kernel's TCP_INFO counters of ``sock`` (Linux; {} where unavailable): segments
    and bytes sent and retransmitted, acknowledged bytes, RTT, congestion window."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return {}
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, _TCP_INFO_LEN)
    except OSError:
        return {}
    return {
        name: struct.unpack_from("<" + fmt, raw, off)[0]
        for name, (off, fmt) in _TCP_INFO_FIELDS.items()
        if off + struct.calcsize(fmt) <= len(raw)
    }


def send(
    dest: tuple[str, int],
    chunks: Sequence[bytes | bytearray | memoryview | np.ndarray],
    timeout_s: float = 60.0,
    congestion: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Connect to ``dest``, write ``chunks`` (the stream) and wait until the receiver
    closes or resets the connection (so the kernel's counters are final).
    ``congestion``: the TCP congestion control (e.g. "cubic", "bbr"; None: the kernel's
    default for this network namespace).

    Returns bytes handed to the kernel, why it stopped ("complete": everything written
    and the receiver closed; "reset": the receiver cut it short), ``connect_s`` (the
    handshake), ``start_mono`` (CLOCK_MONOTONIC just before connecting) and ``tcp``
    (:func:`tcp_info` at the end, plus the congestion control's name)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if congestion is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        except OSError as exc:
            sock.close()
            raise UserError(
                f"congestion control {congestion!r} unavailable: {exc.strerror or exc}"
            ) from None
    sock.settimeout(timeout_s)
    start = clock()
    try:
        sock.connect(dest)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot connect to {dest[0]}:{dest[1]}: {exc.strerror or exc}") from None
    connected = clock()
    written, reason = 0, "complete"
    try:
        sock.settimeout(max(timeout_s - (connected - start), 0.001))
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                sock.sendall(view)
                written += len(view)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):
                pass
        except ConnectionError:
            reason = "reset"
        except TimeoutError:
            reason = "timeout"
        info: dict[str, Any] = tcp_info(sock)
        info["congestion"] = _congestion(sock)
    finally:
        sock.close()
    return {
        "reason": reason,
        "bytes_written": written,
        "connect_s": connected - start,
        "start_mono": start,
        "elapsed_s": clock() - start,
        "tcp": info,
    }


def _congestion(sock: socket.socket) -> str:
    """The name of the socket's congestion control ("" where unavailable)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    except (OSError, AttributeError):
        return ""
    return raw.split(b"\0", 1)[0].decode()


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def _listen(bind: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(bind)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {bind[0]}:{bind[1]}: {exc.strerror or exc}") from None
    sock.listen(1)
    return sock


def _cmd_recv(args: argparse.Namespace) -> int:
    from kvtransport.daemons.udp import parse_address, set_realtime

    if not args.deadline_s > 0:
        raise UserError(f"--deadline-s must be > 0, not {args.deadline_s:g}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {exc.strerror}") from None
    bind = parse_address(args.listen, what="listen address")
    set_realtime(args.realtime)
    with _listen(bind) as listener:
        print("ready", flush=True)
        rec = receive(listener, args.deadline_s, args.accept_timeout_s)
    summary = rec.summary()
    (out / "manifest.bin").write_bytes(rec.manifest_bytes)
    (out / "payload.bin").write_bytes(memoryview(rec.payload))
    (out / "result.json").write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)
    return 0


def _cmd_send(args: argparse.Namespace) -> int:
    from kvtransport.daemons.udp import parse_address, set_realtime

    dest = parse_address(args.to, default_host="127.0.0.1", what="receiver address")
    try:
        data = Path(args.stream).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {args.stream}: {exc.strerror}") from None
    if data[:4] != MAGIC:
        raise UserError(f"{args.stream} is not a KVTC stream (see write_stream)")
    set_realtime(args.realtime)
    print(json.dumps(send(dest, [data], args.timeout_s, args.congestion)), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvtransport.bounds import OneLineArgumentParser
    from kvtransport.daemons.udp import REALTIME_HELP

    p = OneLineArgumentParser(
        prog="python -m kvtransport.demo.tcp_baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="mode", required=True, parser_class=OneLineArgumentParser)
    r = sub.add_parser("recv", help="receive one stream until complete or the deadline")
    r.add_argument("listen", metavar="HOST:PORT", help="address to listen on")
    r.add_argument(
        "--deadline-s",
        type=float,
        required=True,
        help="seconds after the first byte at which the connection is cut",
    )
    r.add_argument(
        "--accept-timeout-s",
        type=float,
        default=30.0,
        help="give up (reason idle) if no byte comes within this (default 30)",
    )
    r.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="where result.json, manifest.bin and payload.bin go",
    )
    s = sub.add_parser("send", help="send a stream file written by write_stream")
    s.add_argument("to", metavar="HOST:PORT", help="the receiver's address")
    s.add_argument("stream", metavar="STREAM_FILE", help="header and payload (write_stream)")
    s.add_argument(
        "--timeout-s", type=float, default=60.0, help="give up after this many seconds (default 60)"
    )
    s.add_argument(
        "--congestion",
        metavar="NAME",
        help="TCP congestion control, e.g. cubic or bbr (default: the kernel's)",
    )
    for q in (r, s):
        q.add_argument(
            "--realtime", nargs="?", type=int, const=5, metavar="PRIO", help=REALTIME_HELP
        )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvtransport.demo.tcp_baseline``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _cmd_recv(args) if args.mode == "recv" else _cmd_send(args)
    except UserError as exc:
        print(f"kvtransport.demo.tcp_baseline {args.mode}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
