"""ARQ: retransmit what the receiver NACKs, at most once per 1.5 RTT each, before new sources.

A retransmission is a SOURCE datagram with the RETRANSMIT flag (kvtransport.core.wire), so the
receiver takes it as any source: the scheme has no datagram type and no decoder of its own.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from kvtransport.core.schemes.base import RepairScheme, SenderRepair
from kvtransport.core.wire import FLAG_RETRANSMIT, DatagramType

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.policy_base import Policy
    from kvtransport.core.schemes.base import SenderView
    from kvtransport.core.wire import Feedback

_SOURCE = int(DatagramType.SOURCE)


class Retransmits:
    """Sources feedback reported missing, to be sent again (SOURCE with RETRANSMIT),
    lowest ESI first, none again within 1.5 smoothed RTTs of its last retransmission (one
    still in flight is not sent twice). ARQ's whole repair; the RLC scheme's for holes
    below the repair floor its window decoder reaches (kvtransport.core.schemes.rlc).
    The per-ESI state is made with the first hole."""

    def __init__(self, view: SenderView) -> None:
        self.view = view
        self._heap: list[int] = []
        self._queued = bytearray()
        self._time: list[float] = []  # when each ESI was last retransmitted

    def __len__(self) -> int:
        """Sources queued (some may have been recovered since: ``take`` skips those below
        decoded-through)."""
        return len(self._heap)

    def add(self, first: int, end: int, now: float) -> None:
        """Queue the missing ESIs ``first .. end - 1`` (``end`` at most the sources sent)."""
        s = self.view
        if not self._queued:
            self._queued = bytearray(s.n_source)
            self._time = [-1e300] * s.n_source
        guard = 1.5 * (2.0 * s.owd)  # the smoothed RTT (the initial one before any)
        queued, times, heap = self._queued, self._time, self._heap
        for esi in range(first, min(end, s.next_esi)):
            if not queued[esi] and now - times[esi] > guard:
                queued[esi] = 1
                heapq.heappush(heap, esi)

    def clear(self) -> None:
        for esi in self._heap:
            self._queued[esi] = 0
        self._heap.clear()

    def take(self, t: float) -> bytes | None:
        """The next retransmission, sent at ``t`` (None: none queued)."""
        heap, s = self._heap, self.view
        while heap:
            esi = heapq.heappop(heap)
            self._queued[esi] = 0
            if esi < s.fb_through:
                continue  # recovered meanwhile
            self._time[esi] = t
            size = s.symbol_size
            s.framer.payload_view(size)[:] = s.source_symbol(esi)
            s.stats["retransmit_sent"] += 1
            return s.framer.finish(_SOURCE, s.seq, size, esi=esi, flags=FLAG_RETRANSMIT)
        return None


class ARQSender(SenderRepair):
    """The NACKed sources not yet retransmitted, lowest ESI first."""

    def __init__(self, view: SenderView, policy: Policy) -> None:
        super().__init__(view, policy)
        self.reactive = True  # every retransmission answers a reported hole
        self.resend = Retransmits(view)

    def on_feedback(self, fb: Feedback, now: float) -> int | None:
        for first, count in fb.ranges:
            self.resend.add(first, first + count, now)
        return None

    def before_source(self, t: float) -> bytes | None:
        return self.resend.take(t)


class ARQ(RepairScheme):
    name = "arq"
    stat = "retransmit_sent"

    def sender(self, view: SenderView, policy: Policy) -> SenderRepair:
        return ARQSender(view, policy)


SCHEME = ARQ()
