"""UDP probe for the testbed: measure loss, bursts, one-way delay and throughput.

Both ends run on the same machine (in different namespaces), so they share
one clock (CLOCK_REALTIME) and the one-way delay is measured exactly: the sender stamps each
datagram, the receiver subtracts. The receiver can write what it saw as a trace in the
format of docs/traces.md, which is how a measured link becomes a replayable profile.

    ip netns exec kvt-rcv python -m kvtransport.netem.probe recv 10.77.0.2:9000 --json out.json
    ip netns exec kvt-snd python -m kvtransport.netem.probe send 10.77.0.2:9000 \\
        --rate-mbps 50 --size 1300 --count 20000

Datagram: seq (u64), send time in ns (u64), total count (u32), padding to --size.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from typing import Any

import numpy as np

from kvtransport.core.protocol import LINK_OVERHEAD_BYTES

__all__ = ["send", "receive", "summarize", "main", "HEADER"]

HEADER = struct.Struct("!QQI")
SO_RCVBUFFORCE = 33
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("@qq")


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def send(
    dest: tuple[str, int],
    rate_mbps: float,
    size: int,
    count: int,
    tick_s: float = 0.001,
    max_burst_s: float = 0.002,
) -> dict[str, Any]:
    """Send ``count`` datagrams of ``size`` bytes paced at ``rate_mbps`` (wire bits).

    Pacing releases what is due every ``tick_s`` (a burst of a millisecond, well inside
    the testbed's token bucket), which keeps a Python sender precise without spinning.
    After a stall longer than ``max_burst_s`` it resumes at the rate instead of catching
    up with a burst (counted as ``late``). Timestamps are CLOCK_REALTIME, to match the
    receiver's kernel receive timestamps.
    """
    if size < HEADER.size:
        raise ValueError(f"size must be >= {HEADER.size}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.connect(dest)
    buf = bytearray(size)
    gap_ns = (size + LINK_OVERHEAD_BYTES) * 8 / (rate_mbps * 1e6) * 1e9
    max_burst = max(1, int(max_burst_s * 1e9 / gap_ns))
    late = 0
    start = time.monotonic_ns()
    errors = 0
    seq = 0
    while seq < count:
        now = time.monotonic_ns()
        due = min(count, int((now - start) / gap_ns) + 1)
        if due - seq > max_burst:
            # we were descheduled: shift the schedule instead of bursting to catch up,
            # which would overflow the link's queue and read as loss
            start += int((due - seq - max_burst) * gap_ns)
            due = seq + max_burst
            late += 1
        while seq < due:
            HEADER.pack_into(buf, 0, seq, time.time_ns(), count)
            try:
                sock.send(buf)
            except OSError:
                errors += 1
            seq += 1
        next_due = start + seq * gap_ns
        wait = (next_due - time.monotonic_ns()) / 1e9
        if wait > 0:
            time.sleep(max(wait, tick_s))
    elapsed = (time.monotonic_ns() - start) / 1e9
    sock.close()
    return {
        "sent": count,
        "send_errors": errors,
        "late": late,
        "duration_s": elapsed,
        "offered_mbps": count * (size + LINK_OVERHEAD_BYTES) * 8 / max(elapsed, 1e-9) / 1e6,
    }


def receive(
    bind: tuple[str, int], idle_s: float = 1.0, max_s: float = 120.0, ready: Any = None
) -> dict[str, np.ndarray | int]:
    """Receive probe datagrams until ``idle_s`` of silence after the first (or ``max_s``).

    Arrival times are the kernel's receive timestamps (SO_TIMESTAMPNS), so a receiver
    that is slow to be scheduled does not inflate the measured delay.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    sock.bind(bind)
    if ready is not None:
        ready()
    seqs: list[int] = []
    sent_ns: list[int] = []
    recv_ns: list[int] = []
    sizes: list[int] = []
    total = 0
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    buf = bytearray(65536)
    anc_size = socket.CMSG_SPACE(16)
    deadline = time.monotonic() + max_s
    sock.settimeout(min(idle_s, max_s))
    while time.monotonic() < deadline:
        try:
            n, anc, _flags, _addr = sock.recvmsg_into([buf], anc_size)
        except TimeoutError:
            if seqs:
                break
            continue
        if n < HEADER.size:
            continue
        now = time.time_ns()
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
                sec, nsec = TIMESPEC.unpack_from(data)
                now = sec * 1_000_000_000 + nsec
        s, t, tot = HEADER.unpack_from(buf)
        seqs.append(s)
        sent_ns.append(t)
        recv_ns.append(now)
        sizes.append(n)
        total = max(total, tot)
    sock.close()
    return {
        "seq": np.asarray(seqs, dtype=np.int64),
        "sent_ns": np.asarray(sent_ns, dtype=np.int64),
        "recv_ns": np.asarray(recv_ns, dtype=np.int64),
        "size": np.asarray(sizes, dtype=np.int64),
        "total": int(total),
    }


def _runs(mask: np.ndarray) -> np.ndarray:
    x = np.concatenate([[0], mask.astype(np.int8), [0]])
    d = np.diff(x)
    return np.flatnonzero(d == -1) - np.flatnonzero(d == 1)


def summarize(rx: dict[str, Any]) -> dict[str, Any]:
    """Loss rate, loss-run lengths, one-way delay and throughput of a receive record."""
    total = int(rx["total"])
    seq = rx["seq"]
    if total == 0 or seq.size == 0:
        return {"sent": total, "received": 0, "loss_rate": 1.0 if total else None}
    valid = seq[seq < total]
    unique = np.unique(valid)
    arrived = np.zeros(total, dtype=bool)
    arrived[unique] = True
    runs = _runs(~arrived)
    owd_ms = (rx["recv_ns"] - rx["sent_ns"]) / 1e6
    # throughput over the middle 80% of arrivals (start-up and tail excluded)
    order = np.argsort(rx["recv_ns"], kind="stable")
    t = rx["recv_ns"][order] / 1e9
    wire = (rx["size"][order] + LINK_OVERHEAD_BYTES) * 8
    lo, hi = int(0.1 * t.size), int(0.9 * t.size)
    span = t[hi - 1] - t[lo] if hi - 1 > lo else 0.0
    rate = float(wire[lo + 1 : hi].sum() / span / 1e6) if span > 0 else None
    return {
        "sent": total,
        "received": int(unique.size),
        "duplicates": int(valid.size - unique.size),
        "loss_rate": float(1.0 - unique.size / total),
        "loss_runs": int(runs.size),
        "mean_loss_run": float(runs.mean()) if runs.size else 0.0,
        "loss_run_sd": float(runs.std(ddof=1)) if runs.size > 1 else 0.0,
        "reordered": int(np.count_nonzero(np.diff(seq) < 0)),
        "owd_ms": {
            "min": float(owd_ms.min()),
            "median": float(np.median(owd_ms)),
            "p99": float(np.percentile(owd_ms, 99)),
            "max": float(owd_ms.max()),
        },
        "throughput_wire_mbps": rate,
    }


def trace_arrays(rx: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(lost, owd_us) per sequence number, for ``write_trace``."""
    total = int(rx["total"])
    lost = np.ones(total, dtype=bool)
    owd = np.zeros(total)
    ok = rx["seq"] < total
    lost[rx["seq"][ok]] = False
    owd[rx["seq"][ok]] = (rx["recv_ns"][ok] - rx["sent_ns"][ok]) / 1e3
    return lost, owd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvtransport.netem.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # noqa: E501
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("send", help="send paced probe datagrams")
    s.add_argument("dest", type=_addr)
    s.add_argument("--rate-mbps", type=float, default=50.0)
    s.add_argument("--size", type=int, default=1300)
    s.add_argument("--count", type=int, default=10000)
    r = sub.add_parser("recv", help="receive probe datagrams and summarize")
    r.add_argument("bind", type=_addr)
    r.add_argument("--idle-s", type=float, default=1.0)
    r.add_argument("--max-s", type=float, default=120.0)
    r.add_argument("--json", help="write the summary here (default: stdout)")
    r.add_argument("--trace", help="also write a seq,lost,owd_us trace here (.gz: gzipped)")
    args = p.parse_args(argv)
    if args.mode == "send":
        out = send(args.dest, args.rate_mbps, args.size, args.count)
        print(json.dumps(out), flush=True)
        return 0
    rx = receive(args.bind, args.idle_s, args.max_s, ready=lambda: print("ready", flush=True))
    summary = summarize(rx)
    if args.trace and rx["total"]:
        from kvtransport.netem.trace import write_trace

        lost, owd = trace_arrays(rx)
        write_trace(args.trace, lost, owd, comment="measured by kvtransport.netem.probe")
    text = json.dumps(summary)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
