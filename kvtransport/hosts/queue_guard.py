"""A cap on one link's pacing rate while the path's queue builds (its capacity dipped).

Senders pace at the link rate they were given. When the path's capacity drops below it (a
radio link degrading, a backhaul shared with traffic kvtransport does not see) the excess
waits in the bottleneck's queue and, once the queue is full, is lost there: on the held-out
``rate-dip`` channel (100 Mbit/s falling to 25 for 0.2 s) a quarter to a third of a
transfer's datagrams died in the queue, with every repair scheme (docs/results.md). No
repair can give back what a sender pacing above capacity throws away.

:class:`QueueGuard` watches what each feedback tells of the path, sans-I/O and clock-free:

- **queueing delay**: the smallest of the last ``PERSIST`` round-trip samples (one late
  report, a host's stall, is not a queue) less the smallest since the guard was (re)set
  (the path's base round trip);
- **delivery rate**: the data datagrams the receiver reports received (``received`` in
  each feedback), per second of feedback arrival, over the last ``window`` (a base round
  trip, at least ``MIN_WINDOW_S``), read only from a window whose reports came without a
  stall (``_window_count``: a silence between two reports of new data over ``STALL_SHARE`` of
  the window says nothing of the link's rate; on the netns testbed a 21 ms one, as the
  rate came back, read as 8 Mbit/s on a link draining its queue at 100, and the cut cost
  that transfer 0.08 of its utility). The same rule leaves alone a link that delivers less
  than a datagram per half window (about 0.9 Mbit/s at 25 ms): that reads as a stall, as
  an outage does.

It follows one transfer: the host feeds it while a transfer is alone on the link and sets
it anew whenever the link's transfers change (several transfers' paths, bottlenecks and
paced rates would need their own accounting: not done).

When the queueing delay exceeds ``QUEUE_DELAY_S`` plus ``QUEUE_RTT_SHARE`` of the base
round trip *and* the link delivers less than ``SHORTFALL`` of the rate it is paced at
(once capped: less than ``GROWING`` of the cap, the queue still growing), the cap becomes
``DRAIN`` times the delivery rate (the queue drains at the rest; never below ``min_bps``;
an outage gives no round-trip samples, so it cuts nothing), at most once per window
(while the queue holds data the bottleneck's delivery rate does not depend on the
pacing). Once the queueing delay is back under half that threshold, the cap grows by
``PROBE`` per round trip (at most once per round-trip sample's length since the last
change), and goes once it reaches the link rate. Only a path whose base round trip is at
most ``MAX_BASE_RTT_S`` is capped (on a longer one the news of a dip comes too late). The
two conditions together keep jitter (delay without a shortfall) and random loss (a
shortfall without delay) from cutting the rate: on the simulated paths whose capacity
never dips that were tested (loss models, jitter, long links, the training distribution)
it never acted, and the transfer was paced exactly as without it
(tests/test_queue_guard.py, docs/results.md). A real receiver short of CPU, whose socket
buffer queues, could look like a dip to it.

The shell (kvtransport.hosts.sender_host.SenderHost) feeds it every feedback its lone
session takes and paces the link at ``min(link rate, cap)``.
"""

from __future__ import annotations

import math
from collections import deque

QUEUE_DELAY_S = 0.010
"""Queueing delay (beyond the base round trip) always tolerated: jitter of a few ms per
direction on a healthy path stays under it."""
QUEUE_RTT_SHARE = 0.5
"""... plus this share of the base round trip (long paths jitter more in absolute terms)."""
SHORTFALL = 0.8
"""The queue counts as building only if the link delivers less than this share of its
pacing rate (random loss up to a fifth does not trigger it)."""
DRAIN = 0.9
"""The cap: this share of the delivery rate measured while the queue built (while the
queue holds data the bottleneck still delivers at its full rate; the rest drains it)."""
GROWING = 0.95
"""Once capped, the queue counts as still building if the link delivers less than this
share of the (capped) pacing rate."""
PROBE = 1.5
"""Growth of the cap per round trip once the queue has drained."""
MAX_BASE_RTT_S = 0.050
"""The guard acts only on paths whose base round trip is at most this. It learns of a dip
a round trip plus the queue's delay late, and probes back up a round trip at a time: on the
held-out rate-dip channel (a 0.2 s dip) at 40 and 80 ms one way its first cut came after
the dip and held the link below its restored rate to the deadline, costing utility-ordered
streams up to 0.017 (docs/results.md)."""
PERSIST = 3
"""Round-trip samples in a row the queueing delay must show (about 12 ms of reports)."""
MIN_WINDOW_S = 0.025
"""Shortest window the delivery rate is measured over (several feedback intervals)."""
STALL_SHARE = 0.5
"""A silence between two delivery reports longer than this share of the window (12.5 ms
of the 25 ms one; three 4 ms reports lost in a row) is a stall: the window's rate is not
read."""


def _window_count(delivered: deque[tuple[float, int]], cutoff: float, window: float) -> int | None:
    """The data datagrams reported after ``cutoff``, or None when the reports do not span
    the window (none at or before ``cutoff``) or fell silent for over ``STALL_SHARE`` of
    it between two of them (reports handed over together, at one time, are one arrival)."""
    if not delivered or delivered[0][0] > cutoff:
        return None
    last, got = -math.inf, 0
    for t, n in delivered:
        if t > cutoff:
            if t - last > STALL_SHARE * window:
                return None  # a stall (a host's hiccup): no rate to read
            got += n
        last = t
    return got


class QueueGuard:
    """The cap on one link's pacing rate while one transfer is alone on it (module
    docstring). ``rate_bps``: the link's nominal wire rate; ``wire_bits``: the bits the link
    counts per data datagram; ``min_bps``: the lowest cap (the link's rate of one datagram
    per slot)."""

    def __init__(self, rate_bps: float, wire_bits: float, min_bps: float) -> None:
        self.rate_bps = float(rate_bps)
        self.wire_bits = float(wire_bits)
        self.min_bps = float(min_bps)
        self.cuts = 0  # times the cap was lowered
        self.cap_bps: float | None = None
        self.reset()

    def reset(self) -> bool:
        """Forget the path (the link's transfers changed) and lift the cap; returns whether
        :meth:`pacing_bps` changed."""
        capped = self.cap_bps is not None
        self.cap_bps = None
        self._base = math.inf
        self._recent: deque[float] = deque(maxlen=PERSIST)
        self._received: int | None = None
        self._delivered: deque[tuple[float, int]] = deque()  # (arrival, datagrams new)
        self._changed_at = -math.inf
        return capped

    def pacing_bps(self) -> float:
        """The rate the link is paced at: its nominal rate, or the cap (always below it)."""
        return self.rate_bps if self.cap_bps is None else self.cap_bps

    def on_feedback(self, now: float, rtt_s: float | None, received: int) -> bool:
        """A feedback arrived at ``now``: its round-trip sample (None: it echoed nothing
        new) and the data datagrams the receiver reports received so far (a restarted
        receiver counts from zero again). Returns whether :meth:`pacing_bps` changed (a cut
        lowers it, a probe raises it or lifts the cap)."""
        last = self._received
        self._received = received
        if last is not None and received > last:
            self._delivered.append((now, received - last))
        if rtt_s is None or rtt_s <= 0.0:
            return False
        base = self._base = min(self._base, rtt_s)
        recent = self._recent
        recent.append(rtt_s)
        if len(recent) < PERSIST:
            return False
        window = max(base, MIN_WINDOW_S)
        cutoff = now - window
        delivered = self._delivered
        while delivered and delivered[0][0] <= cutoff - window:
            delivered.popleft()  # keep two windows: enough to see one whole
        since = now - self._changed_at
        threshold = QUEUE_DELAY_S + QUEUE_RTT_SHARE * base
        queue_s = min(recent) - base
        pacing = self.pacing_bps()
        if queue_s > threshold and base <= MAX_BASE_RTT_S:  # (on a long path: too late)
            got = None if since < window else _window_count(delivered, cutoff, window)
            if got is None:
                return False  # no whole window of reports since the last change, or a stall
            rate = got * self.wire_bits / window
            # uncapped, a clear shortfall; capped, the queue still growing
            if rate >= (SHORTFALL if self.cap_bps is None else GROWING) * pacing:
                return False
            cap = min(max(DRAIN * rate, self.min_bps), pacing)
            if cap >= pacing:
                return False  # at the floor already
            self.cap_bps = cap
            self.cuts += 1
        elif self.cap_bps is not None and queue_s < 0.5 * threshold and since >= rtt_s:
            cap = self.cap_bps * PROBE
            self.cap_bps = None if cap >= self.rate_bps else cap
        else:
            return False
        self._changed_at = now
        return True
