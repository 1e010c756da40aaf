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


class ARQSender(SenderRepair):
    """The NACKed sources not yet retransmitted, lowest ESI first."""

    def __init__(self, session: SenderView, policy: Policy) -> None:
        super().__init__(session, policy)
        n = session.n_source
        self.reactive = True  # every retransmission answers a reported hole
        self._heap: list[int] = []
        self._queued = bytearray(n)
        self._time = [-1e300] * n  # when each ESI was last retransmitted

    def on_feedback(self, fb: Feedback, now: float) -> None:
        s = self.session
        guard = 1.5 * (2.0 * s.owd)  # the smoothed RTT (the initial one before any)
        queued, times, heap = self._queued, self._time, self._heap
        hi = s.next_esi
        for first, count in fb.ranges:
            for esi in range(first, min(first + count, hi)):
                if not queued[esi] and now - times[esi] > guard:
                    queued[esi] = 1
                    heapq.heappush(heap, esi)

    def before_source(self, t: float) -> bytes | None:
        heap, s = self._heap, self.session
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


class ARQ(RepairScheme):
    name = "arq"
    stat = "retransmit_sent"

    def sender(self, session: SenderView, policy: Policy) -> SenderRepair:
        return ARQSender(session, policy)


SCHEME = ARQ()
