"""The virtual-clock shell: endpoints on one heap of events, datagrams through channels.

Every shell that runs the protocol without sockets and without a wall clock (the
single-transfer simulator, the multi-user simulator, each process of the demo's emulated
link) is a :class:`VirtualClockLoop` around its endpoints; the daemons' shell is the
socket loop (kvtransport.daemons.daemon.serve). An endpoint is anything shaped like the sans-I/O
hosts (kvtransport.hosts.sender_host.SenderHost, kvtransport.hosts.receiver_host.ReceiverHost):

- ``get_timer() -> float | None`` and ``handle_timer(now)``;
- ``receive_datagram(data, addr, now)``;
- ``datagrams_to_send(now) -> [(datagrams, address), ...]``.

A bare session takes that shape through :class:`SenderSessionEndpoint` /
:class:`ReceiverSessionEndpoint` (the session tests; the simulators and the emulated
link run the hosts).

The loop's contract, which every virtual-clock shell therefore shares:

- Events are datagram deliveries, endpoint timers and scheduled calls (:meth:`call_at`),
  handled in time order. At equal times deliveries go first (in the order they were
  sent), then endpoint timers by the endpoint's ``rank`` (then in the order they were
  armed), then scheduled calls by their rank. Time never runs backwards: a timer already
  past fires at the current time.
- After every event at an endpoint (and after a call that ``touches`` it) the loop takes
  what the endpoint has to send, passes each datagram to an endpoint of the loop through
  the sender's ``channel`` (``transmit(t, size) -> arrival time or None``, e.g.
  kvtransport.netem) or, when its address is not one of the loop's, appends ``(t,
  datagram, address)`` to :attr:`VirtualClockLoop.outbox`; then calls the endpoint's
  ``after(t)`` hook (the shell's events and bookkeeping); then re-reads its timer.
- An endpoint's timer moves only when the endpoint is called; a shell that calls one
  itself between runs (an action, a replaced session) says so with :meth:`touch`, or
  makes the call a scheduled one (:meth:`call_at`) when it may send.
- ``trace`` (a list) receives every call the loop makes and every datagram sent:
  ``("timer", t, i)``, ``("recv", t, i, datagram)``, ``("call", t, i)`` (a scheduled call
  touching endpoint i, -1 for none), ``("send", t, i, datagram)``, ``i`` the endpoint's
  index. tests/test_hosts.py replays such traces into the daemons' engines.

Determinism: the loop draws nothing random; given deterministic endpoints and channels
the same inputs give the same events, bit for bit.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.receiver import ReceiverSession
    from kvtransport.core.sender import SenderSession

Address = Any


class Endpoint(Protocol):
    """What the loop drives (the sans-I/O hosts' shell API)."""

    def get_timer(self) -> float | None: ...

    def handle_timer(self, now: float) -> None: ...

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None: ...

    def datagrams_to_send(self, now: float) -> list[tuple[list[bytes], Address]]: ...


class Channel(Protocol):
    """One direction of a link (kvtransport.netem.Channel is one)."""

    def transmit(self, t: float, size: int) -> float | None: ...


class SenderSessionEndpoint:
    """One :class:`~kvtransport.core.sender.SenderSession` as an endpoint: its timer is its
    next slot; at the timer it releases what is due, to ``peer``. Feedback releases
    nothing by itself (the session's timer says when it sends next)."""

    def __init__(self, session: SenderSession, peer: Address) -> None:
        self.session = session
        self.peer = peer
        self._out: list[bytes] = []

    def get_timer(self) -> float | None:
        return self.session.next_timer()

    def handle_timer(self, now: float) -> None:
        s = self.session
        s.handle_timer(now)
        out = s.datagrams_to_send(now)
        if out:
            self._out.extend(out)

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self.session.receive_datagram(data, now)

    def datagrams_to_send(self, now: float) -> list[tuple[list[bytes], Address]]:
        if not self._out:
            return []
        out, self._out = self._out, []
        return [(out, self.peer)]


class ReceiverSessionEndpoint:
    """One :class:`~kvtransport.core.receiver.ReceiverSession` as an endpoint (its feedback
    goes to ``peer``). ``session`` may be replaced between runs (then :meth:`touch` it)."""

    def __init__(self, session: ReceiverSession, peer: Address) -> None:
        self.session = session
        self.peer = peer

    def get_timer(self) -> float | None:
        return self.session.next_timer()

    def handle_timer(self, now: float) -> None:
        self.session.handle_timer(now)

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self.session.receive_datagram(data, now)

    def datagrams_to_send(self, now: float) -> list[tuple[list[bytes], Address]]:
        out = self.session.datagrams_to_send(now)
        return [(out, self.peer)] if out else []


@dataclass
class _Slot:
    endpoint: Endpoint
    addr: Address
    rank: int
    channel: Channel | None
    after: Callable[[float], None] | None
    armed: float | None = None
    sent: int = 0  # datagrams it sent
    sent_bytes: int = 0


# heap entry kinds (the entry's fourth field); the second field, the rank, orders ties
_DELIVERY, _TIMER, _CALL = range(3)


class VirtualClockLoop:
    """Endpoints on a virtual clock that starts at ``now`` (see the module docstring)."""

    def __init__(self, trace: list[tuple[Any, ...]] | None = None, now: float = 0.0) -> None:
        self.now = now
        self.events = 0  # events handled
        self.stale = 0  # superseded timer entries skipped
        self.in_flight = 0  # datagrams on their way to an endpoint of the loop
        self.outbox: list[tuple[float, bytes, Address]] = []
        self.trace = trace
        self._slots: list[_Slot] = []
        self._by_addr: dict[Address, int] = {}
        self._heap: list[tuple[float, int, int, int, int, Any]] = []
        self._order = 0

    # ------------------------------------------------------------------ set-up

    def add(
        self,
        endpoint: Endpoint,
        addr: Address,
        *,
        rank: int = 1,
        channel: Channel | None = None,
        after: Callable[[float], None] | None = None,
    ) -> int:
        """Add an endpoint at ``addr`` (its index is returned). ``rank``: its timer's place
        among timers due at the same time (lower first, >= 1); ``channel``: the path its
        datagrams take to the loop's other endpoints; ``after(t)``: called after each of
        its events, once its datagrams are on their way."""
        if addr in self._by_addr:
            raise ValueError(f"address {addr!r} is already in the loop")
        if rank < 1:
            raise ValueError("an endpoint's rank must be at least 1 (deliveries go first)")
        i = len(self._slots)
        self._slots.append(_Slot(endpoint, addr, rank, channel, after))
        self._by_addr[addr] = i
        self._arm(i, self.now)
        return i

    def endpoint(self, i: int) -> Endpoint:
        return self._slots[i].endpoint

    def sent(self, i: int) -> tuple[int, int]:
        """Datagrams and bytes endpoint ``i`` has sent (to the loop or the outbox)."""
        s = self._slots[i]
        return s.sent, s.sent_bytes

    def deliver(self, t: float, data: bytes, to: int, src: Address) -> None:
        """A datagram from outside the loop (from ``src``) arrives at endpoint ``to`` at ``t``."""
        self._push(t, 0, _DELIVERY, to, (data, src))
        self.in_flight += 1

    def call_at(
        self, t: float, fn: Callable[[float], None], *, touches: int = -1, rank: int = 1 << 20
    ) -> None:
        """Call ``fn(t)`` at ``t`` (after the timers due then; ``rank`` orders calls at one
        time); endpoint ``touches`` is then handled as after its own events."""
        self._push(t, rank, _CALL, touches, fn)

    def touch(self, i: int) -> None:
        """Endpoint ``i`` was called from outside in a way that may move its timer and
        sent nothing (an action applied, a session replaced): re-read its timer."""
        self._arm(i, self.now)

    def replace(self, i: int, endpoint: Endpoint) -> None:
        """Endpoint ``i`` is now ``endpoint`` (at the same address, rank and channel; a
        restarted endpoint): its timer is read anew."""
        slot = self._slots[i]
        slot.endpoint = endpoint
        slot.armed = None
        self._arm(i, self.now)

    def take_outbox(self) -> list[tuple[float, bytes, Address]]:
        """What was sent to addresses outside the loop since the last call, in order."""
        out, self.outbox = self.outbox, []
        return out

    # ------------------------------------------------------------------ running

    def next_time(self) -> float:
        """When the next event is due (inf: none); superseded timers are dropped."""
        heap = self._heap
        slots = self._slots
        while heap:
            t, _rank, _o, kind, i, data = heap[0]
            if kind == _TIMER and slots[i].armed != data:
                heapq.heappop(heap)
                self.stale += 1
                continue
            return t
        return math.inf

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> bool:
        """Handle events up to ``until`` (inclusive). ``stop()`` is asked before each
        event; True returns True at once. Returns False when nothing is left by ``until``."""
        heap = self._heap
        pop = heapq.heappop
        slots = self._slots
        trace = self.trace
        while True:
            if stop is not None and stop():
                return True
            while heap:  # the next event; superseded timer entries are dropped
                top = heap[0]
                if top[3] == _TIMER and slots[top[4]].armed != top[5]:
                    pop(heap)
                    self.stale += 1
                    continue
                break
            else:
                return False
            t = top[0]
            if t > until:
                return False
            _, _, _, kind, i, data = pop(heap)
            self.now = t
            self.events += 1
            if kind == _DELIVERY:
                self.in_flight -= 1
                datagram, src = data
                if trace is not None:
                    trace.append(("recv", t, i, bytes(datagram)))
                slots[i].endpoint.receive_datagram(datagram, src, t)
                self._after(i, t)
            elif kind == _TIMER:
                slot = slots[i]
                slot.armed = None
                if trace is not None:
                    trace.append(("timer", t, i))
                slot.endpoint.handle_timer(t)
                self._after(i, t)
            else:
                if trace is not None:
                    trace.append(("call", t, i))
                data(t)
                if i >= 0:
                    self._after(i, t)

    # ------------------------------------------------------------------ internals

    def _push(self, t: float, rank: int, kind: int, i: int, data: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, rank, self._order, kind, i, data))

    def _arm(self, i: int, now: float) -> None:
        slot = self._slots[i]
        t = slot.endpoint.get_timer()
        if t != slot.armed:
            slot.armed = t
            if t is not None:
                self._push(t if t > now else now, slot.rank, _TIMER, i, t)

    def _after(self, i: int, t: float) -> None:
        slot = self._slots[i]
        out = slot.endpoint.datagrams_to_send(t)
        if out:
            trace = self.trace
            ch = slot.channel
            src = slot.addr
            heap = self._heap
            push = heapq.heappush
            for datagrams, addr in out:
                j = self._by_addr.get(addr)
                slot.sent += len(datagrams)
                for d in datagrams:
                    size = len(d)
                    slot.sent_bytes += size
                    if trace is not None:
                        trace.append(("send", t, i, bytes(d)))
                    if j is None:
                        self.outbox.append((t, d, addr))
                        continue
                    if ch is None:
                        raise RuntimeError(f"endpoint {i} has no channel to {addr!r}")
                    arrival = ch.transmit(t, size)
                    if arrival is not None:
                        self._order += 1
                        push(heap, (arrival, 0, self._order, _DELIVERY, j, (d, src)))
                        self.in_flight += 1
        if slot.after is not None:
            slot.after(t)
        t_next = slot.endpoint.get_timer()
        if t_next != slot.armed:
            slot.armed = t_next
            if t_next is not None:
                self._push(t_next if t_next > t else t, slot.rank, _TIMER, i, t_next)
