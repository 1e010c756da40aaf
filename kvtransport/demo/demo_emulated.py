"""The demo's emulated link: the daemons' sender and receiver hosts in two processes, joined
by the userspace channel of the link's profile, on the link's own clock.

Why the emulated link keeps its own clock. Seeding each packet's loss is not enough for a
repeatable result: on the wall clock the host's scheduler decides how many slots the
sender gets before the deadline and when each feedback arrives, and with them which
packets a feedback-driven policy sends; the same loss fates then fall on different
packets (and an unprivileged sender on a busy machine loses slots outright). So the
emulated link is a discrete-event link between the two processes: every time is the
link's, datagrams cross each direction's Channel in the order they were sent, and a
process runs its session only up to a horizon that no datagram from the other side can
precede (the one-way delay is the look-ahead, so a round covers milliseconds of link
time). The same seed then gives the same packets, the same partial caches and the same
answers; only the TTFT's compute part is measured (and varies). Every scheme sees the
same loss pattern (the channels are re-seeded per scheme), a like-for-like comparison.
Each process runs its endpoint (the sender daemon's host; the receiver daemon's host) on the
simulator's event loop (kvtransport.sim.virtual_clock) over the simulator's channels, so a
transfer ends exactly as ``kvtransport simulate`` says for the same seed
(tests/test_demo.py checks it).

The processes run ``python -m kvtransport.demo.demo_emulated --peer sender|receiver FD`` and
speak pickled messages over a socket pair (:class:`EmulatedLink` is the coordinator).
"""

from __future__ import annotations

import contextlib
import heapq
import secrets
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.demo.demo_links import (
    INITIAL_RTT_S,
    PROFILE,
    Link,
    LinkOutcome,
    NoTimeToSend,
    TransferRequest,
    refusal_is_no_time,
)
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.transfer import Transfer
    from kvtransport.hosts.receiver_host import ReceiverHost
    from kvtransport.hosts.sender_host import Outgoing, SenderHost
    from kvtransport.sim.virtual_clock import VirtualClockLoop

_SENDER, _RECEIVER = "sender", "receiver"
"""The peers' addresses on their processes' loops."""


def _peer_command(role: str, fd: int) -> list[str]:
    return [sys.executable, "-m", "kvtransport.demo.demo_emulated", "--peer", role, str(fd)]


class _Peer:
    """The coordinator's handle on one peer process."""

    def __init__(self, role: str) -> None:
        from multiprocessing.connection import Connection

        self.role = role
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                _peer_command(role, child.fileno()),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.pending = 0  # requests sent with post() whose replies are not read yet

    def post(self, *msg: Any) -> None:
        """Send a request without waiting; its reply is read (and dropped) by the next call."""
        self._send(msg)
        self.pending += 1

    def call(self, *msg: Any) -> Any:
        """Send a request and return its reply (a tuple); a refusal raises PeerError."""
        while self.pending:
            self._recv()
            self.pending -= 1
        self._send(msg)
        reply = self._recv()
        if reply[0] == "error":
            raise PeerError(reply[1])
        return reply[1:]

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise self._died() from exc

    def _recv(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _died(self) -> RuntimeError:
        return RuntimeError(
            f"the emulated link's {self.role} process died (exit {self.proc.poll()})"
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("quit",))
        with contextlib.suppress(Exception):
            self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PeerError(Exception):
    """A peer refused a request (its message is one line)."""


def _transfer_message(transfer: Any) -> dict[str, Any]:
    b = transfer.blocks
    return {
        "payload": transfer.payload,
        "offsets": b.offsets,
        "lengths": b.lengths,
        "utilities": b.utilities,
        "app_metadata": transfer.app_metadata,
    }


class EmulatedLink(Link):
    """A sender process and a receiver process joined by ``profile`` in both directions.

    Each transfer runs as a discrete-event exchange (see the module docstring): the
    coordinator (this object) alternately advances the sender up to ``receiver's time +
    feedback delay`` and the receiver up to ``sender's time + data delay``, handing each
    the datagrams that arrive by then and passing what it sent through that direction's
    Channel. Fresh channels per transfer, seeded from ``seed``: every scheme meets the
    same loss pattern. Needs a positive minimum one-way delay (the look-ahead).

    ``config``: the protocol's settings both processes' hosts are built with
    (kvtransport.core.protocol, as the simulators take it; ``symbol_size`` None is its
    symbol size); both channels count its ``link_overhead`` per datagram, as the sender
    paces with it. ``policies``: the processes load these policies' code (numba kernels,
    the DDQN network) at once, in parallel with whatever the caller does next;
    :meth:`ready` is then instant. Loading costs link time nothing either way (the
    link's clock does not run), only wall time.
    """

    name = "emulated"

    def __init__(
        self,
        profile: str = PROFILE,
        *,
        symbol_size: int | None = None,
        policies: tuple[str, ...] = (),
        config: ProtocolConfig = STANDARD,
    ) -> None:
        from kvtransport.netem import load_profile

        self.profile = load_profile(profile)
        self.config = config
        self.symbol_size = config.symbol_size if symbol_size is None else symbol_size
        self.key = secrets.token_bytes(32)  # per run: datagrams between the peers are sealed
        self.lookahead = self._min_delay()
        self.peers: list[_Peer] = []
        self.sender = self._spawn("sender")
        self.receiver = self._spawn("receiver")
        self.loaded = False
        self.trace: list[tuple[str, float, bytes]] | None = None
        """A list to record every datagram the processes send, as ``("data" | "feedback",
        time sent, datagram)`` in the order they reach the channels (None: not recorded)."""
        if policies:
            for peer in self.peers:
                peer.post("warm", list(policies))

    def describe(self) -> str:
        return (
            f"emulated: sender and receiver hosts in two processes, {self.profile.describe()} "
            "each way, on the link's clock"
        )

    def _min_delay(self) -> float:
        if self.profile.is_trace:
            raise UserError("the emulated link needs a profile with a fixed delay, not a trace")
        from kvtransport.netem.channel import DelaySampler

        _loss, delay = self.profile.samplers(0)
        assert isinstance(delay, DelaySampler)  # a fixed-delay profile's
        low = delay.bounds()[0]
        if not low > 0:
            raise UserError(
                f"profile {self.profile.name}: the emulated link needs a positive minimum "
                "one-way delay (it is the processes' look-ahead)"
            )
        return low

    def _spawn(self, role: str) -> _Peer:
        peer = _Peer(role)
        self.peers.append(peer)
        return peer

    def load(self, transfer: Any) -> None:
        """Hand the transfer to the sender process once (every scheme sends it)."""
        self.sender.call("load", _transfer_message(transfer))
        self.loaded = True

    def _transfer(self, req: TransferRequest) -> LinkOutcome:
        from kvtransport.netem import make_channel

        if not self.loaded:
            raise RuntimeError("load() a transfer first")
        deadline_s = req.deadline_s
        data_seed, fb_seed = np.random.SeedSequence(req.seed).spawn(2)
        overhead = self.config.link_overhead
        data_ch = make_channel(self.profile, data_seed, overhead_bytes=overhead)
        fb_ch = make_channel(self.profile, fb_seed, overhead_bytes=overhead)
        rate_bps = self.profile.rate_bps
        try:
            self.sender.call(
                "start",
                {
                    "policy": req.policy,
                    "rate_bps": rate_bps,
                    "deadline_s": deadline_s,
                    "transfer_id": req.transfer_id,
                    "symbol_size": self.symbol_size,
                    "initial_rtt": INITIAL_RTT_S,
                    "key": self.key,
                    "config": self.config,
                },
            )
        except PeerError as exc:
            if refusal_is_no_time(str(exc)):
                raise NoTimeToSend(str(exc)) from None
            raise
        self.receiver.call(
            "start", {"transfer_id": req.transfer_id, "key": self.key, "config": self.config}
        )
        to_rx: list[tuple[float, int, bytes]] = []
        to_tx: list[tuple[float, int, bytes]] = []
        order = 0
        t_r = 0.0  # the receiver has handled every event up to here
        s_done = False
        result = None
        s_next: float | None = 0.0
        r_next: float | None = None
        limit = deadline_s + 30.0
        look = self.lookahead
        while True:
            if not to_rx and not to_tx:  # nothing in flight: skip to the next timer
                timers = [t for t in (s_next, r_next) if t is not None]
                if not timers:
                    break
                t_r = max(t_r, min(timers) - look)
            h_s = t_r + look
            out, s_next, s_done = self.sender.call("advance", h_s, _pop_until(to_tx, h_s))
            if self.trace is not None:
                self.trace.extend(("data", t, d) for t, d in out)
            order = _cross(out, data_ch, to_rx, order)
            h_r = h_s + look
            out, r_next, rx_result = self.receiver.call("advance", h_r, _pop_until(to_rx, h_r))
            if self.trace is not None:
                self.trace.extend(("feedback", t, d) for t, d in out)
            order = _cross(out, fb_ch, to_tx, order)
            t_r = h_r
            if rx_result is not None and result is None:
                result = rx_result
            req.progress(min(t_r / deadline_s, 1.0))
            if result is not None and (s_done or (not to_rx and not to_tx)):
                break
            if t_r > limit:
                break
        (stats,) = self.sender.call("stats")
        counters = {
            "datagrams_sent": data_ch.sent,
            "datagrams_lost": data_ch.lost + data_ch.dropped,
            "source_sent": stats["source_sent"],
            "repair_sent": stats["repair_sent"],
        }
        if result is None:
            raise RuntimeError(f"the receiver delivered no result by link time {t_r:.3f} s")
        result.counters = counters
        return result

    def ready(self) -> None:
        """Wait for the processes' warm-up (started by the constructor)."""
        for peer in self.peers:
            peer.call("ping")

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers.clear()


def _cross(
    sent: list[tuple[float, bytes]], channel: Any, heap: list[tuple[float, int, bytes]], order: int
) -> int:
    """Pass what one side sent through its direction's channel; the survivors go on
    ``heap`` by arrival time (ties in sending order, numbered from ``order``, which is
    returned advanced)."""
    for t, d in sent:
        arrival = channel.transmit(t, len(d))
        if arrival is not None:
            order += 1
            heapq.heappush(heap, (arrival, order, d))
    return order


def _pop_until(heap: list[tuple[float, int, bytes]], t: float) -> list[tuple[float, bytes]]:
    out = []
    while heap and heap[0][0] <= t:
        arrival, _o, d = heapq.heappop(heap)
        out.append((arrival, d))
    return out


class _PeerRole:
    """What both peer processes answer besides their own requests."""

    def ping(self) -> tuple:
        return ()

    def warm(self, policies: list[str]) -> tuple:
        """Load the sessions' and policies' compiled code in this process: a small
        simulated transfer per policy (sender and receiver code alike). A policy that
        cannot be made is left for the transfer that names it to report."""
        from kvtransport.sim.simulator import simulate

        for policy in policies:
            with contextlib.suppress(UserError):
                simulate(policy=policy, size_bytes=120_000, seed=0, record=False)
        return ()


class _SenderPeer(_PeerRole):
    """The sender process of the emulated link: the sender daemon's host (kvtransport.
    hosts.sender_host, a fresh one per transfer with the transfer alone on the link, as in
    kvtransport.sim.simulator) on the link's clock, the one endpoint of its process's
    kvtransport.sim.virtual_clock loop."""

    def __init__(self) -> None:
        self.transfer: Transfer | None = None
        self.host: SenderHost | None = None
        self.outgoing: Outgoing | None = None
        self.loop: VirtualClockLoop | None = None
        self.finished = False

    def load(self, msg: dict[str, Any]) -> tuple:
        from kvtransport.core.transfer import BlockTable, Transfer

        blocks = BlockTable(msg["offsets"], msg["lengths"], msg["utilities"])
        self.transfer = Transfer(msg["payload"], blocks, msg["app_metadata"])
        return ()

    def start(self, msg: dict[str, Any]) -> tuple:
        from kvtransport.hosts.sender_host import alone_on_link
        from kvtransport.sim.virtual_clock import VirtualClockLoop

        if self.transfer is None:
            raise ValueError("no transfer loaded")
        self.host, self.outgoing = alone_on_link(
            self.transfer,
            _RECEIVER,
            rate_bps=msg["rate_bps"],
            deadline_s=msg["deadline_s"],
            policy=msg["policy"],
            transfer_id=msg["transfer_id"],
            key=msg["key"],
            symbol_size=msg["symbol_size"],
            initial_rtt=msg["initial_rtt"],
            config=msg["config"],
        )
        self.finished = False
        self.loop = VirtualClockLoop()
        self.loop.add(self.host, _SENDER, after=self._events)
        return ()

    def _events(self, t: float) -> None:
        assert self.host is not None  # the loop runs once started
        while self.host.next_event() is not None:  # its one transfer finished
            self.finished = True

    def advance(self, horizon: float, inputs: list[tuple[float, bytes]]) -> tuple:
        """Feedback arrivals and the host's timers up to ``horizon``, in time order;
        returns what was sent and when, the host's next timer, and whether the transfer
        is finished."""
        host, loop = self.host, self.loop
        if host is None or loop is None:
            raise ValueError("no transfer started")
        return _advance(loop, horizon, inputs, _RECEIVER), host.get_timer(), self.finished

    def stats(self) -> tuple:
        out = self.outgoing
        if out is None:
            raise ValueError("no transfer started")
        s = out.session
        return ({"source_sent": s.stats["source_sent"], "repair_sent": s.repair_sent},)


class _ReceiverPeer(_PeerRole):
    """The receiver process of the emulated link: the receiver daemon's host (kvtransport.
    receiver_host, ``single``) on the link's clock, the one endpoint of its process's
    kvtransport.sim.virtual_clock loop: the transfer's session opens at its first datagram
    with the deadline from the manifest, counted from that datagram's arrival."""

    def __init__(self) -> None:
        self.host: ReceiverHost | None = None
        self.loop: VirtualClockLoop | None = None
        self.result: LinkOutcome | None = None

    def start(self, msg: dict[str, Any]) -> tuple:
        from kvtransport.hosts.receiver_host import ReceiverHost
        from kvtransport.sim.virtual_clock import VirtualClockLoop

        self.host = ReceiverHost(key=msg["key"], single=True, config=msg["config"])
        self.loop = VirtualClockLoop()
        self.loop.add(self.host, _RECEIVER, after=self._events)
        self.result = None
        return ()

    def _events(self, t: float) -> None:
        from kvtransport.hosts.receiver_host import ResultReady

        assert self.host is not None  # the loop runs once started
        while (ev := self.host.next_event()) is not None:
            if isinstance(ev, ResultReady):
                self.result = LinkOutcome.from_result(ev.transfer.session.result, ev.at)

    def advance(self, horizon: float, inputs: list[tuple[float, bytes]]) -> tuple:
        """Data arrivals and the session's timers up to ``horizon``, in time order;
        returns what was sent and when, and the result once (when it is ready)."""
        host, loop = self.host, self.loop
        if host is None or loop is None:
            raise ValueError("no transfer started")
        out = _advance(loop, horizon, inputs, _SENDER)
        result, self.result = self.result, None
        return out, host.get_timer(), result


def _advance(
    loop: VirtualClockLoop, horizon: float, inputs: list[tuple[float, bytes]], src: str
) -> list[tuple[float, bytes]]:
    """Hand a peer's loop the datagrams that arrive from ``src`` (in arrival order), run
    it to ``horizon``; what its endpoint sent meanwhile, with the times it left."""
    for t, d in inputs:
        loop.deliver(t, d, 0, src)
    loop.run(horizon)
    return [(t, d) for t, d, _addr in loop.take_outbox()]


def _peer_main(role: str, fd: int) -> int:
    """A peer process: answer the coordinator's requests until told to quit."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    conn = Connection(fd)
    peer: Any = _SenderPeer() if role == "sender" else _ReceiverPeer()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0
        if msg[0] == "quit":
            return 0
        try:
            reply = ("ok", *getattr(peer, msg[0])(*msg[1:]))
        except UserError as exc:
            reply = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, one line
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--peer" and argv[1] in ("sender", "receiver"):
        return _peer_main(argv[1], int(argv[2]))
    print("usage: python -m kvtransport.demo.demo_emulated --peer sender|receiver FD "
          "(started by kvtransport demo)", file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
