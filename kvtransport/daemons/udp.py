"""The socket layer: UDP with segmentation offload, a precise wait, and the shells' clock.

The protocol sessions (kvtransport.core.sender, .receiver) never touch a socket; the daemons and the
``send``/``recv`` commands move their datagrams through :class:`DatagramSocket`:

- **Sending** takes a list of datagrams (what ``datagrams_to_send`` returned). Runs of
  equal-sized datagrams go to the kernel in one ``sendmsg`` with UDP GSO (``UDP_SEGMENT``
  ancillary data; the list is passed as an iovec, so nothing is joined in Python): one
  system call for up to ``MAX_GSO_SEGMENTS`` datagrams, about 0.2 us per datagram instead
  of 5 us (docs/results.md, "Facts the design rests on"). A datagram on its own, or a
  kernel that refuses GSO (EINVAL, EMSGSIZE, EIO: no offload or a segment over the MTU),
  goes out with plain ``send``; a refused size is remembered so the next batch does not
  try again. A segment above ``GSO_MAX_SEGMENT`` (a 1500-byte MTU's UDP payload) is never
  batched.
- **Receiving** turns ``UDP_GRO`` on: the kernel glues consecutive datagrams of one flow
  into one buffer and says the segment size in ancillary data; ``recvmsg_into`` writes them
  into a preallocated buffer and :meth:`DatagramSocket.recv_batch` cuts them back into
  datagrams (memoryviews, valid until the next ``recv_batch``). Without GRO the same call
  reads one datagram at a time into the same buffer. The list is a
  kvtransport.core.wire.ReceivedBatch: it also says where each datagram lies in the buffer,
  so the receiver opens runs of sources in one compiled call.
- **Errors** never escape into the event loop: EAGAIN on send waits briefly for room, then
  drops (the protocol treats it as loss); ECONNREFUSED (an ICMP port unreachable on a
  connected socket: the peer is not up yet), ENOBUFS, unreachable networks and truncated
  datagrams are counted in ``stats`` and dropped.
- **Buffers**: 8 MB send and receive buffers; as root ``SO_RCVBUFFORCE``/``SO_SNDBUFFORCE``
  go past ``net.core.rmem_max``/``wmem_max`` (the 208 KB default loses datagrams at these
  rates), unprivileged the kernel caps them.

:func:`wait_readable` sleeps in ``select`` (microsecond timeout, unlike epoll's and
zmq_poll's milliseconds) after :func:`set_timer_slack` has cut the kernel's default 50 us
timer slack: measured wake-up lateness about 20-30 us, enough to pace 100 Mbit/s to
1 Gbit/s in bursts of a few datagrams (the shells send every slot due within a short lead
time at once; see kvtransport.daemons.daemon_sender).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvtransport.core.wire import ReceivedBatch
from kvtransport.errors import UserError

UDP_SEGMENT = 103  # linux/udp.h: per-socket or per-call GSO segment size
UDP_GRO = 104  # linux/udp.h: receive coalesced datagrams with their segment size
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
PR_SET_TIMERSLACK = 29

MAX_GSO_SEGMENTS = 64  # UDP_MAX_SEGMENTS in the kernel
MAX_GSO_BYTES = 65000  # one UDP datagram of at most 65507 bytes carries the batch
GSO_MAX_SEGMENT = 1472  # 1500-byte MTU - IPv4 - UDP: larger segments are sent one by one
MAX_DATAGRAM = 65535
DEFAULT_BUFFER_BYTES = 8 << 20
DEFAULT_BATCH_BYTES = 4 << 20
SEND_WAIT_S = 0.002  # how long a full send buffer may block one send before we drop

clock = time.monotonic
"""The shells' clock (seconds, monotonic): every ``now`` handed to a session comes from it."""


def wall_offset() -> float:
    """The wall clock (Unix seconds) minus :data:`clock`: ``now + wall_offset()`` is the
    wall time of a shell's ``now`` (a sender's manifest send time, kvtransport.core.replay)."""
    return time.time() - clock()


_GSO_REFUSED = (errno.EINVAL, errno.EMSGSIZE, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP)
_UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN)
_INT = struct.Struct("=i")
_U16 = struct.Struct("=H")


def set_timer_slack(ns: int = 1000) -> bool:
    """Lower this thread's timer slack (Linux prctl) so short sleeps end on time."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


REALTIME_HELP = (
    "run at real-time priority PRIO (SCHED_FIFO, default 5) so that a busy machine does "
    "not stall pacing (needs root or CAP_SYS_NICE)"
)


def set_realtime(priority: int | None) -> None:
    """Put this process under SCHED_FIFO at ``priority`` (None: leave it alone).

    A paced sender that the scheduler stalls for a few milliseconds loses those slots (the
    session sends at most a short catch-up burst), and a stalled receiver reports late; on
    a machine busy with other work that costs a third of the link (measured on the 2-core
    CI machines). The loop sleeps in select whenever it is idle, so the priority costs the
    other processes only the CPU the transfer really needs.
    """
    if priority is None:
        return
    if not 1 <= priority <= 99:
        raise UserError(f"real-time priority must be 1..99, not {priority}")
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (PermissionError, OSError) as exc:
        raise UserError(
            f"cannot run at real-time priority {priority}: {exc.strerror} "
            "(needs root or CAP_SYS_NICE)"
        ) from None


def wait_readable(fds: Sequence[Any], timeout: float | None) -> list[Any]:
    """Block until one of ``fds`` is readable or ``timeout`` seconds pass (None: forever).

    ``select`` because its timeout has microsecond resolution; the shells hand it only a
    few descriptors (one UDP socket, a ZeroMQ descriptor, a signal wake-up pipe).
    """
    if timeout is not None and timeout < 0:
        timeout = 0.0
    try:
        readable, _, _ = select.select(fds, (), (), timeout)
    except InterruptedError:  # pragma: no cover (PEP 475 retries; kept for safety)
        return []
    return readable


def parse_address(text: str, default_host: str = "0.0.0.0", what: str = "address") -> tuple:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` -> (host, port); a one-line UserError otherwise."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    host = host.strip("[]") or default_host
    try:
        port = int(port_text)
    except ValueError:
        raise UserError(f"{what} {text!r} is not HOST:PORT") from None
    if not 0 <= port <= 65535:
        raise UserError(f"{what} {text!r}: port must be 0..65535")
    try:
        info = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise UserError(f"{what} {text!r}: cannot resolve {host!r} ({exc.strerror})") from None
    except UnicodeError:  # the idna codec: an empty or over-long (> 63) label
        raise UserError(f"{what} {text!r}: {host!r} is not a host name") from None
    return info[0][4]


def _set_buffer(sock: socket.socket, force: int, plain: int, nbytes: int) -> int:
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
            return sock.getsockopt(socket.SOL_SOCKET, plain)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)
    return sock.getsockopt(socket.SOL_SOCKET, plain)


class DatagramSocket:
    """A non-blocking UDP socket that sends batches with GSO and receives with GRO.

    ``bind``: local (host, port) (port 0: any). ``connect``: a fixed peer (the ``send``
    command), else every :meth:`send` names its destination (the daemons). ``gso`` /
    ``gro``: try segmentation offload on send / receive (on by default; turn GSO off
    under kernel netem, which drops a whole GSO batch as one packet).
    """

    def __init__(
        self,
        bind: tuple[str, int] = ("0.0.0.0", 0),
        connect: tuple[str, int] | None = None,
        *,
        gso: bool = True,
        gro: bool = True,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            self.sndbuf = _set_buffer(sock, SO_SNDBUFFORCE, socket.SO_SNDBUF, buffer_bytes)
            self.rcvbuf = _set_buffer(sock, SO_RCVBUFFORCE, socket.SO_RCVBUF, buffer_bytes)
            try:
                sock.bind(bind)
            except OSError as exc:
                raise UserError(f"cannot bind UDP {bind[0]}:{bind[1]}: {exc.strerror}") from None
            if connect is not None:
                sock.connect(connect)
            self.gro = False
            if gro:
                try:
                    sock.setsockopt(socket.IPPROTO_UDP, UDP_GRO, 1)
                    self.gro = True
                except OSError:
                    pass
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.connected = connect is not None
        self.gso = gso
        self._gso_limit = GSO_MAX_SEGMENT  # largest segment size GSO has not refused
        self._buf = bytearray(max(batch_bytes, 2 * MAX_DATAGRAM))
        self._mv = memoryview(self._buf)
        self._array = np.frombuffer(self._buf, np.uint8)  # the same buffer, for ReceivedBatch
        self._anc = socket.CMSG_SPACE(_INT.size)
        self.stats: dict[str, int] = {
            "datagrams_sent": 0,
            "bytes_sent": 0,
            "send_calls": 0,
            "gso_batches": 0,
            "gso_refused": 0,
            "send_blocked": 0,
            "send_dropped": 0,
            "refused": 0,
            "unreachable": 0,
            "nobufs": 0,
            "send_errors": 0,
            "datagrams_received": 0,
            "bytes_received": 0,
            "recv_calls": 0,
            "gro_batches": 0,
            "truncated": 0,
            "recv_errors": 0,
        }

    # ------------------------------------------------------------------ basics

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def address(self) -> tuple[str, int]:
        """The local (host, port) the socket is bound to."""
        return self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DatagramSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sending

    def send(self, datagrams: Sequence[bytes], addr: tuple[str, int] | None = None) -> int:
        """Send ``datagrams`` in order (to ``addr`` unless connected); returns how many the
        kernel took. Errors are counted in ``stats``, never raised."""
        n = len(datagrams)
        if n == 0:
            return 0
        if addr is not None and self.connected:
            addr = None
        sent = 0
        i = 0
        while i < n:
            size = len(datagrams[i])
            j = i + 1
            if self.gso and size <= self._gso_limit:
                limit = min(n, i + MAX_GSO_SEGMENTS, i + MAX_GSO_BYTES // max(size, 1))
                while j < limit and len(datagrams[j]) == size:
                    j += 1
                if (
                    j < limit
                    and len(datagrams[j]) < size
                    and (j - i) * size + len(datagrams[j]) <= MAX_GSO_BYTES
                ):
                    j += 1  # the last segment of a GSO batch may be shorter
            if j - i > 1:
                took = self._send_gso(datagrams[i:j], size, addr)
                if took < 0:  # GSO failed: one by one; if that works, GSO was the problem
                    took = self._send_each(datagrams[i:j], addr)
                    if took == j - i:
                        self.stats["gso_refused"] += 1
                        self._gso_limit = min(self._gso_limit, size - 1)
            else:
                took = self._send_each(datagrams[i:j], addr)
            sent += took
            if took < j - i:  # the rest would fail the same way (peer gone, buffer full)
                self.stats["send_dropped"] += n - i - took
                break
            i = j
        return sent

    def _send_gso(self, batch: Sequence[bytes], size: int, addr: tuple | None) -> int:
        anc = [(socket.IPPROTO_UDP, UDP_SEGMENT, _U16.pack(size))]
        for attempt in (0, 1):
            try:
                if addr is None:
                    nbytes = self.sock.sendmsg(batch, anc)
                else:
                    nbytes = self.sock.sendmsg(batch, anc, 0, addr)
            except BlockingIOError:
                if attempt == 0 and self._wait_writable():
                    continue
                return 0
            except OSError as exc:
                if exc.errno in _GSO_REFUSED:
                    return -1
                self._count_error(exc)
                return 0
            self.stats["send_calls"] += 1
            self.stats["gso_batches"] += 1
            self.stats["datagrams_sent"] += len(batch)
            self.stats["bytes_sent"] += nbytes
            return len(batch)
        return 0  # pragma: no cover

    def _send_each(self, batch: Iterable[bytes], addr: tuple | None) -> int:
        sock = self.sock
        took = 0
        for d in batch:
            for attempt in (0, 1):
                try:
                    nbytes = sock.send(d) if addr is None else sock.sendto(d, addr)
                    break
                except BlockingIOError:
                    if attempt == 0 and self._wait_writable():
                        continue
                    return took
                except OSError as exc:
                    self._count_error(exc)
                    return took
            self.stats["send_calls"] += 1
            self.stats["datagrams_sent"] += 1
            self.stats["bytes_sent"] += nbytes
            took += 1
        return took

    def _wait_writable(self) -> bool:
        self.stats["send_blocked"] += 1
        _, writable, _ = select.select((), (self.sock,), (), SEND_WAIT_S)
        return bool(writable)

    def _count_error(self, exc: OSError) -> None:
        code = exc.errno
        if code == errno.ECONNREFUSED:
            self.stats["refused"] += 1
        elif code == errno.ENOBUFS:
            self.stats["nobufs"] += 1
        elif code in _UNREACHABLE:
            self.stats["unreachable"] += 1
        else:
            self.stats["send_errors"] += 1

    # ------------------------------------------------------------------ receiving

    def recv_batch(self, max_datagrams: int = 4096) -> ReceivedBatch:
        """Every datagram waiting (up to the batch buffer or ``max_datagrams``) as
        ``(data, (host, port))``; ``data`` stays valid until the next call. The list also
        says where each datagram lies in the socket's buffer (:class:`ReceivedBatch`)."""
        out: list[tuple[memoryview, Any]] = []
        starts: list[int] = []
        ends: list[int] = []
        mv = self._mv
        limit = len(self._buf) - MAX_DATAGRAM
        anc_size = self._anc
        recvmsg_into = self.sock.recvmsg_into
        stats = self.stats
        off = 0
        while off <= limit and len(out) < max_datagrams:
            try:
                nbytes, anc, flags, addr = recvmsg_into([mv[off : off + MAX_DATAGRAM]], anc_size)
            except BlockingIOError:
                break
            except ConnectionRefusedError:
                stats["refused"] += 1
                continue
            except OSError as exc:
                if exc.errno in _UNREACHABLE:
                    stats["unreachable"] += 1
                    continue
                stats["recv_errors"] += 1
                break
            stats["recv_calls"] += 1
            if flags & socket.MSG_TRUNC:
                stats["truncated"] += 1
                continue
            seg = 0
            for level, kind, data in anc:
                if level == socket.IPPROTO_UDP and kind == UDP_GRO and len(data) >= 4:
                    seg = _INT.unpack_from(data)[0]
            end = off + nbytes
            if 0 < seg < nbytes:
                stats["gro_batches"] += 1
                for s in range(off, end, seg):
                    out.append((mv[s : min(s + seg, end)], addr))
                starts.extend(range(off, end, seg))
                ends.extend(range(off + seg, end, seg))
            else:
                out.append((mv[off:end], addr))
                starts.append(off)
            ends.append(end)
            stats["bytes_received"] += nbytes
            off = end
        stats["datagrams_received"] += len(out)
        return ReceivedBatch(out, self._array, np.array(starts, np.int64), np.array(ends, np.int64))
