"""Userspace impairment relay: the testbed's loss/delay/jitter where the kernel lacks netem.

It runs in the middle network namespace and bridges Ethernet frames between two veth
ends with AF_PACKET raw sockets, so the sender and the receiver see one plain L2 link
and keep the same addresses whatever the backend. Each IPv4 packet goes through a
userspace ``Channel`` built from the profile (the SAME loss samplers as the simulator;
no rate limit there): lost packets are dropped, the others are held for their delay and
then sent on. The rate limit is kernel tbf on the egress towards the receiver, so a full
tbf queue shows up here as ENOBUFS on send and is counted as a queue drop.

Details that make it transparent:

* ``PACKET_VNET_HDR`` on both sockets: a frame whose UDP/TCP checksum is still to be
  filled in by offload (veth hands over CHECKSUM_PARTIAL packets) is re-sent with the
  same virtio-net header, so the checksum is completed and the receiver accepts it.
* UDP GSO super-frames (one send of many datagrams) are cut into their datagrams here,
  so the loss model applies per datagram, as on a real link. (The testbed also sets
  ``gso_max_segs 1`` on the end veths, so the kernel normally does this before the relay
  sees the frames; TCP then sends MTU-sized packets. A TCP GSO frame, should one come,
  passes as one unit.)
* ``PACKET_IGNORE_OUTGOING``: the relay never reads back what it sent itself.
* Non-IPv4 frames (ARP) pass at once, unimpaired.
* It loads the channels' compiled loss kernels before it reports ready, so the link's
  first frames are not held while they load (``_warm_up``), and runs at SCHED_FIFO
  (``RelayConfig.priority``, the testbed's ``relay_priority``).

Counters (forwarded, lost by the loss model, dropped by the queue, overruns of the
relay's own socket buffer) are logged and written as JSON to a status file twice a
second. Run as ``python -m kvtransport.netem.relay CONFIG.json`` (the testbed does).
"""

from __future__ import annotations

import errno
import heapq
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtransport.core.protocol import LINK_OVERHEAD_BYTES

__all__ = ["RelayConfig", "run_relay", "segment_udp4", "main"]

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("@qq")
ANC_SPACE = socket.CMSG_SPACE(TIMESPEC.size)

VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_off
VNET_LEN = VNET_HDR.size
GSO_NONE = 0
GSO_UDP_L4 = 5
NO_VNET = VNET_HDR.pack(0, GSO_NONE, 0, 0, 0, 0)
MAX_FRAME = 65536 + VNET_LEN + 64
DRAIN_BATCH = 64
STATUS_PERIOD_S = 0.5
LOG_PERIOD_S = 10.0
RT_PRIORITY = 10


@dataclass
class RelayConfig:
    """What the testbed hands the relay (serialized as JSON)."""

    profile: str
    profile_spec: dict[str, Any]
    seed: int
    fwd_in: str
    fwd_out: str
    reverse: str = "full"
    shaper: str = "tbf"
    status_file: str | None = None
    sndbuf_bytes: int = 8 << 20
    rcvbuf_bytes: int = 8 << 20
    priority: int = RT_PRIORITY  # SCHED_FIFO priority (1..99); 0: ordinary scheduling

    @classmethod
    def load(cls, path: str | Path) -> RelayConfig:
        return cls(**json.loads(Path(path).read_text()))


def _ip_checksum(header: bytes | bytearray) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def segment_udp4(frame: bytes, gso_size: int) -> list[bytes]:
    """Cut an Ethernet/IPv4/UDP GSO super-frame into its datagrams (UDP checksum 0,
    which IPv4 allows; IP header checksum recomputed; IP id incremented per segment)."""
    ihl = (frame[14] & 0x0F) * 4
    udp_at = 14 + ihl
    eth = frame[:14]
    ip = bytearray(frame[14:udp_at])
    ports = frame[udp_at : udp_at + 4]
    payload = memoryview(frame)[udp_at + 8 :]
    ip_id = struct.unpack_from("!H", ip, 4)[0]
    out = []
    for k, off in enumerate(range(0, len(payload), gso_size)):
        chunk = payload[off : off + gso_size]
        struct.pack_into("!H", ip, 2, ihl + 8 + len(chunk))
        struct.pack_into("!H", ip, 4, (ip_id + k) & 0xFFFF)
        struct.pack_into("!H", ip, 10, 0)
        struct.pack_into("!H", ip, 10, _ip_checksum(ip))
        udp = ports + struct.pack("!HH", 8 + len(chunk), 0)
        out.append(b"".join((eth, ip, udp, chunk)))
    return out


class _Direction:
    """One direction through the relay: its sockets, its channel and its counters."""

    def __init__(self, name: str, rx: socket.socket, tx: socket.socket, channel: Any) -> None:
        self.name = name
        self.rx = rx
        self.tx = tx
        self.channel = channel  # None: pass unimpaired
        self.counters = {
            "received": 0,
            "forwarded": 0,
            "lost": 0,
            "queue_dropped": 0,
            "overruns": 0,
            "send_errors": 0,
            "passed_non_ip": 0,
            "gso_frames_split": 0,
            "late_over_1ms": 0,
            "malformed": 0,
        }
        self.last_t = 0.0
        self.lag_max = 0.0


def _wire_payload(frame: bytes) -> int:
    """Bytes the Channel should count: the frame minus the Ethernet, IPv4 and UDP headers
    (LINK_OVERHEAD_BYTES) it adds itself (so a UDP datagram counts as its payload, as in
    the simulator)."""
    return len(frame) - VNET_LEN - LINK_OVERHEAD_BYTES


def clock_offset(
    real: Callable[[], float] = time.time,
    mono: Callable[[], float] = time.monotonic,
    tries: int = 3,
    tight_s: float = 20e-6,
) -> float:
    """CLOCK_MONOTONIC minus CLOCK_REALTIME, from a monotonic reading bracketed by two
    realtime ones (the tightest bracket of up to ``tries``, stopping at one within
    ``tight_s``), so that the relay being preempted between two reads cannot shift the
    offset by the preemption: a kernel arrival stamp (realtime) converted with an offset
    too small by d would release the frame d early."""
    best_gap, best = float("inf"), 0.0
    for _ in range(tries):
        r1 = real()
        m = mono()
        r2 = real()
        if r2 - r1 < best_gap:
            best_gap, best = r2 - r1, m - (r1 + r2) / 2
        if best_gap <= tight_s:
            break
    return best


def _packet_socket(ifname: str, cfg: RelayConfig) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, cfg.rcvbuf_bytes)
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, cfg.sndbuf_bytes)
    s.bind((ifname, ETH_P_ALL))
    s.setblocking(False)
    return s


def _overruns(s: socket.socket) -> int:
    """Frames the kernel dropped because the relay's receive buffer was full (resets)."""
    _packets, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return drops


def _raise_priority(priority: int = RT_PRIORITY) -> str:
    """Run the relay ahead of ordinary processes: an emulator that waits for a CPU adds
    delay and bursts no profile asked for. SCHED_FIFO at a low real-time priority (the
    relay sleeps in select between packets, and the kernel's RT throttling still
    reserves 5% for everyone else); nice -10 if real-time scheduling is refused.
    ``priority`` 0 leaves the scheduling alone."""
    if priority <= 0:
        return "default"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        return f"SCHED_FIFO {priority}"
    except (OSError, AttributeError):
        try:
            os.nice(-10)
            return "nice -10"
        except OSError:
            return "default"


def _build_channels(cfg: RelayConfig) -> tuple[Any, Any, str]:
    """(forward channel, reverse channel or None, description), from the profile."""
    import numpy as np
    from kvtransport.netem.channel import Channel
    from kvtransport.netem.profiles import profile_from_mapping

    prof = profile_from_mapping(cfg.profile, cfg.profile_spec, "relay config")
    seeds = np.random.SeedSequence(cfg.seed).spawn(2)
    shaped = cfg.shaper == "relay"  # else kernel tbf limits the rate

    def channel(p: Any, seed: np.random.SeedSequence) -> Any:
        loss, delay = p.samplers(seed)
        if not (shaped and p.rate_limited):
            return Channel(loss, delay)
        # the simulator's token bucket, working on the kernel's arrival timestamps
        return Channel(
            loss, delay, p.rate_bps, p.effective_queue_bytes(), p.effective_burst_bytes()
        )

    fwd = channel(prof, seeds[0])
    rev = None if cfg.reverse == "none" else channel(prof.reverse_profile(cfg.reverse), seeds[1])
    return fwd, rev, prof.describe()


def _warm_up(channels: tuple[Any, ...]) -> float:
    """Load the channels' compiled kernels before the relay says it is ready.

    A channel draws its loss fates in chunks with a numba kernel, which the process loads
    from numba's cache on first use (a quarter of a second on a busy machine). Paid at the
    first frame, that stall held the link's first frames and released them in one burst
    that overflowed the rate limiter's queue. A clone draws the first chunk instead: its
    future is the original's, so the channels' sequences do not change. Returns seconds.
    """
    t0 = time.monotonic()
    for ch in channels:
        if ch is not None:
            ch.clone().transmit(0.0, 1200)
    return time.monotonic() - t0


def run_relay(cfg: RelayConfig, stop_after_s: float | None = None) -> dict[str, Any]:
    """Run until SIGTERM/SIGINT (or ``stop_after_s``); returns the final counters."""
    fwd_ch, rev_ch, description = _build_channels(cfg)
    warm_s = _warm_up((fwd_ch, rev_ch))
    a = _packet_socket(cfg.fwd_in, cfg)
    b = _packet_socket(cfg.fwd_out, cfg)
    fwd = _Direction("forward", a, b, fwd_ch)
    rev = _Direction("reverse", b, a, rev_ch)
    by_sock = {a.fileno(): fwd, b.fileno(): rev}
    pending: list[tuple[float, int, _Direction, bytes]] = []  # (release, order, dir, frame)
    order = 0
    stopping = False

    def _stop(_sig: int, _frm: object) -> None:
        nonlocal stopping
        stopping = True

    priority = _raise_priority(cfg.priority)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    started = time.monotonic()
    cpu_at_start = time.process_time()
    print(
        f"relay: {cfg.fwd_in} -> {cfg.fwd_out}: {description}; reverse: {cfg.reverse}; "
        f"seed {cfg.seed}; pid {os.getpid()}; scheduling {priority}; "
        f"warm-up {warm_s * 1e3:.0f} ms",
        flush=True,
    )

    def _send(d: _Direction, frame: bytes) -> None:
        try:
            d.tx.send(frame)
            d.counters["forwarded"] += 1
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:  # the egress qdisc (tbf) is full
                d.counters["queue_dropped"] += 1
            else:
                d.counters["send_errors"] += 1

    def _status(final: bool = False) -> dict[str, Any]:
        for d in (fwd, rev):
            d.counters["overruns"] += _overruns(d.rx)
        doc = {
            "pid": os.getpid(),
            "profile": cfg.profile,
            "description": description,
            "uptime_s": round(time.monotonic() - started, 3),
            "pending": len(pending),
            "cpu_s": round(time.process_time() - cpu_at_start, 3),
            "forward": dict(fwd.counters, max_wait_ms=round(fwd.lag_max * 1e3, 3)),
            "reverse": dict(rev.counters, max_wait_ms=round(rev.lag_max * 1e3, 3)),
            "running": not final,
        }
        if cfg.status_file:
            tmp = cfg.status_file + ".tmp"
            Path(tmp).write_text(json.dumps(doc))
            os.replace(tmp, cfg.status_file)
        return doc

    def _ingest(d: _Direction, data: bytes, now: float) -> None:
        nonlocal order
        d.counters["received"] += 1
        if len(data) < VNET_LEN + 14 or data[VNET_LEN + 12 : VNET_LEN + 14] != b"\x08\x00":
            d.counters["passed_non_ip"] += 1
            _send(d, data)
            return
        ch = d.channel
        if ch is None:
            _send(d, data)
            return
        gso_size = VNET_HDR.unpack_from(data)[3]
        if data[1] == GSO_UDP_L4 and gso_size > 0 and len(data) > VNET_LEN + LINK_OVERHEAD_BYTES:
            if data[VNET_LEN + 23] != 17:  # UDP_L4 GSO that is not UDP: malformed
                d.counters["malformed"] += 1
                return
            d.counters["gso_frames_split"] += 1
            frames = [NO_VNET + f for f in segment_udp4(data[VNET_LEN:], gso_size)]
        else:
            frames = [data]
        for frame in frames:
            before = ch.dropped
            arrival = ch.transmit(now, _wire_payload(frame))
            if arrival is None:
                d.counters["queue_dropped" if ch.dropped > before else "lost"] += 1
                continue
            if arrival <= now and not pending:
                _send(d, frame)
            else:
                order += 1
                heapq.heappush(pending, (arrival, order, d, frame))

    offset = clock_offset()
    last_status = 0.0
    last_log = started
    last_logged: tuple[int, ...] = ()
    socks = [a, b]
    _status()
    while not stopping:
        now = time.monotonic()
        offset = clock_offset()
        if stop_after_s is not None and now - started >= stop_after_s:
            break
        timeout = STATUS_PERIOD_S
        if pending:
            timeout = min(timeout, max(pending[0][0] - now, 0.0))
        ready, _, _ = select.select(socks, [], [], timeout)
        for s in ready:
            d = by_sock[s.fileno()]
            for _ in range(DRAIN_BATCH):
                try:
                    data, anc, _flags, _addr = s.recvmsg(MAX_FRAME, ANC_SPACE)
                except (BlockingIOError, InterruptedError):
                    break
                now = time.monotonic()
                t_rx = now
                for level, kind, raw in anc:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        sec, nsec = TIMESPEC.unpack_from(raw)
                        t_rx = sec + nsec * 1e-9 + offset
                # the kernel's arrival time anchors the delay: time the frame spent
                # waiting for the relay to run is not added on top of the profile's delay
                t_rx = min(max(t_rx, d.last_t), now)
                lag = now - t_rx
                if lag > d.lag_max:
                    d.lag_max = lag
                if lag > 0.001:
                    d.counters["late_over_1ms"] += 1
                d.last_t = t_rx
                try:
                    _ingest(d, data, t_rx)
                except (ValueError, IndexError, struct.error):
                    d.counters["malformed"] += 1  # never let one odd frame stop the link
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _release, _o, d, frame = heapq.heappop(pending)
            _send(d, frame)
        if now - last_status >= STATUS_PERIOD_S:
            last_status = now
            _status()
            key = tuple(fwd.counters.values()) + tuple(rev.counters.values())
            if now - last_log >= LOG_PERIOD_S and key != last_logged:
                last_log, last_logged = now, key
                print(f"relay: forward {fwd.counters} reverse {rev.counters}", flush=True)
    final = _status(final=True)
    print(f"relay: stopped; forward {fwd.counters} reverse {rev.counters}", flush=True)
    a.close()
    b.close()
    return final


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvtransport.netem.relay CONFIG.json", file=sys.stderr)
        return 2
    try:
        cfg = RelayConfig.load(args[0])
    except (OSError, ValueError, TypeError) as exc:
        print(f"relay: bad config {args[0]}: {exc}", file=sys.stderr)
        return 2
    try:
        run_relay(cfg)
    except OSError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
