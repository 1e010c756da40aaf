"""Loss accounting on both ends of the feedback loop.

The receiver's :class:`LossMonitor` turns the data path's packet numbers (the header's
``seq``, one per data datagram whatever its type) into counts of received and lost
datagrams, a smoothed loss rate and a smoothed loss-burst length; these go into every
feedback report. The sender's :class:`SentLog` remembers, per recent packet number, when it
left and how many sources and repairs had left by then, so a report that echoes packet
``seq`` tells the sender its RTT and exactly what is still in flight.

Both are fixed-size rings: state stays bounded on endless streams.

Refusals: a receiver that refuses a transfer (a stale or replayed manifest, one too large,
its memory budget or transfer limit reached) says why in the feedback it answers with:
the feedback ``flags``' high byte holds the reason's code (:data:`REFUSALS`; 0: none),
with ``FB_FINISHED`` set. It is feedback like any other, sealed with the transfer's key,
so only a holder of the key can refuse a transfer, and a receiver sends at most one per
manifest datagram it receives (kvtransport.hosts.receiver_host), so it amplifies nothing.
A sender reads it with :func:`refusal_reason`; senders that predate it see a receiver
that finished. :func:`refusal_datagram` is the reply of a receiver that has no session
for the transfer (its transfer limit is reached).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvtransport.core.wire import (
    FB_FINISHED,
    DatagramType,
    Feedback,
    Framer,
    SealKey,
    encode_feedback,
)

SEQ_RING = 1 << 14
_MASK = SEQ_RING - 1
BURST_GAIN = 1 / 8
LOSS_MEMORY_PACKETS = 256.0
REORDER_MARGIN = 1.25
"""The reordering window is this many times the longest reordering seen (QUIC: 9/8 RTT)."""
MAX_REORDER_S = 0.5
"""Reordering beyond this is not tolerated (the window never exceeds 1.25 x this)."""
REORDER_SCAN = 64
"""A late datagram's reordering is timed against the first of the next this many numbers
that arrived."""


REFUSALS = (
    "",
    "stale_manifest",
    "replayed_manifest",
    "too_large",
    "decoder_window",
    "over_budget",
    "over_capacity",
    "result_unsaved",
)
"""A refusal's reason by its code in the feedback flags' high byte (code 0: not refused).
The first two are kvtransport.core.replay's names; then the receiver's drop reasons; then
:data:`RESULT_UNSAVED`."""
RESULT_UNSAVED = "result_unsaved"
"""The final report of a transfer that arrived but whose result the receiver could not
write where it was asked to (kvtransport.core.receiver: ``hold_report``): the sender is
told, as by a refusal, that nothing was delivered there."""
REFUSAL_SHIFT = 8
_REFUSAL_CODE = {name: code for code, name in enumerate(REFUSALS) if name}
REFUSAL_SEQ = 0xFFFFFFFF
"""The feedback sequence number of :func:`refusal_datagram` (less the reason's code):
beyond any a session reaches."""

REFUSAL_EPOCH = (1 << 64) - 1
"""The feedback epoch (kvtransport.core.wire, "Sealing") of :func:`refusal_datagram`."""

_REFUSAL_TEXT = {
    "stale_manifest": "the manifest's send time is outside the receiver's replay window: "
    "are both hosts' clocks in sync (NTP)?",
    "replayed_manifest": "the receiver accepted this transfer before (a replay)",
    "too_large": "the transfer is larger than the receiver accepts (its --max-mb)",
    "decoder_window": "the transfer's decoder window is wider than the receiver allows",
    "over_budget": "the receiver's memory budget for transfers is spent",
    "over_capacity": "the receiver is receiving as many transfers as it allows",
    RESULT_UNSAVED: "the data arrived but the receiver could not write the result where it "
    "was asked to (its output directory is full or read-only): see the receiver's error",
}


def refusal_flags(reason: str) -> int:
    """The feedback flags' bits that carry refusal ``reason`` (0 for "")."""
    return _REFUSAL_CODE.get(reason, 0) << REFUSAL_SHIFT


def refusal_reason(flags: int) -> str:
    """The refusal a feedback's ``flags`` carry ("" when none; "refusal N" for a code this
    version does not know)."""
    code = (flags >> REFUSAL_SHIFT) & 0xFF
    if not code:
        return ""
    return REFUSALS[code] if code < len(REFUSALS) else f"refusal {code}"


def refusal_text(reason: str) -> str:
    """One line for people: what refusal ``reason`` means and what to check."""
    return _REFUSAL_TEXT.get(reason, reason)


def refusal_datagram(key: SealKey | None, transfer_id: int, reason: str) -> bytes:
    """The FEEDBACK datagram a receiver without a session for ``transfer_id`` refuses it
    with: counters all zero, ``FB_FINISHED`` and the reason's code, sealed with the
    transfer's key, feedback sequence number ``REFUSAL_SEQ`` less the code. Its bytes
    depend on the key, the transfer id and the reason alone: sent again it repeats its
    nonce only with the same plaintext, which reveals nothing: its feedback epoch is the
    fixed :data:`REFUSAL_EPOCH` (a session's random epoch is never it but by a 2^-64
    chance)."""
    code = _REFUSAL_CODE[reason]
    fb = Feedback(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 1.0, FB_FINISHED | code << REFUSAL_SHIFT, ())
    framer = Framer(transfer_id, key, epoch=REFUSAL_EPOCH if key is not None else 0)
    n = encode_feedback(fb, framer.payload_view(128))
    return framer.finish(DatagramType.FEEDBACK, REFUSAL_SEQ - code, n)


class LossMonitor:
    """Receiver-side accounting of the data path from packet numbers.

    A late datagram that fills a gap (reordering) is counted as received, a repeated number
    (duplicate) is ignored. A run of missing numbers among the settled ones (below) is one
    loss burst of that many datagrams: ``burst_mean`` smooths their lengths as they settle,
    so a gap that late datagrams fill within the window is no burst, and one they fill in
    part is the runs they leave. ``loss_rate`` is refreshed by :meth:`sample` at each
    feedback report, weighted by the number of datagrams the interval covered (memory about
    LOSS_MEMORY_PACKETS).

    Reordering tolerance (as QUIC's time threshold, RFC 9002 6.1.2): a missing number
    counts as lost only once a later one has been held for the reordering window,
    ``REORDER_MARGIN`` x the longest reordering seen (how long a late datagram arrived
    after the first datagram numbered above it); numbers within the window are *settled*
    later. Jitter that reorders thus stops reading as loss after its first late
    datagrams; without reordering the window is 0 and every gap counts at once.
    ``settled`` is always a number that arrived (the highest one as of a window ago), and
    ``settled_at`` its arrival time: the report echoes that pair, so everything the
    sender sent after it counts as in flight until the receiver can tell it arrived or not
    (without reordering: the highest number and its arrival).
    """

    __slots__ = (
        "_ring",
        "_at",
        "highest",
        "received",
        "duplicates",
        "burst_mean",
        "loss_rate",
        "reorder_s",
        "settled",
        "settled_received",
        "settled_at",
        "_tops",
        "_prev_lost",
        "_prev_received",
        "_sampled",
    )

    def __init__(self) -> None:
        self._ring = [-1] * SEQ_RING
        self._at = [0.0] * SEQ_RING  # arrival time per ring slot
        self.highest = -1
        self.received = 0
        self.duplicates = 0
        self.burst_mean = 1.0
        self.loss_rate = 0.0
        self.reorder_s = 0.0
        self.settled = -1  # numbers up to here are settled: received or lost
        self.settled_received = 0  # of which received
        self.settled_at = 0.0  # when number ``settled`` arrived (once it is >= 0)
        self._tops: deque[tuple[float, int]] = deque()  # (arrival, number): each new highest
        self._prev_lost = 0
        self._prev_received = 0
        self._sampled = False

    @property
    def lost(self) -> int:
        """Datagrams declared lost: missing among the settled numbers."""
        return self.settled + 1 - self.settled_received

    @property
    def window_s(self) -> float:
        """How long a gap may stay open before it counts as loss (0: at once)."""
        return REORDER_MARGIN * self.reorder_s

    def on_packet(self, seq: int, now: float = 0.0) -> int:
        """Account datagram ``seq`` arriving at ``now``: returns the length of a newly
        detected gap (0 if none), or -1 for a duplicate (or a number too old to tell)."""
        h = self.highest
        if seq == h + 1:  # the next one in order (the common case): cannot be a duplicate
            i = seq & _MASK
            self._ring[i] = seq
            self._at[i] = now
            self.received += 1
            self.highest = seq
            self._tops.append((now, seq))
            return 0
        if seq <= h - SEQ_RING:
            self.duplicates += 1
            return -1
        slot = seq & _MASK
        if self._ring[slot] == seq:
            self.duplicates += 1
            return -1
        self._ring[slot] = seq
        self._at[slot] = now
        self.received += 1
        if seq <= h:  # late: fills a gap
            if seq <= self.settled:
                self.settled_received += 1  # counted lost already: it was not
            self._late(seq, now)
            return 0
        self.highest = seq
        self._tops.append((now, seq))
        return seq - h - 1

    def on_run(self, n: int, now: float = 0.0) -> None:
        """Account the next ``n`` datagrams in order (numbers ``highest + 1`` on) arriving at
        ``now``: exactly ``n`` :meth:`on_packet` calls, each returning 0."""
        first = self.highest + 1
        end = first + n
        if n > SEQ_RING:  # only the last SEQ_RING numbers stay in the ring
            self._tops.extend(zip(repeat(now), range(first, end - SEQ_RING)))
            first = end - SEQ_RING
        ring, at = self._ring, self._at
        lo = first & _MASK
        k = min(end - first, SEQ_RING - lo)  # up to the ring's end, then from its start
        ring[lo : lo + k] = range(first, first + k)
        at[lo : lo + k] = repeat(now, k)
        ring[: end - first - k] = range(first + k, end)
        at[: end - first - k] = repeat(now, end - first - k)
        self.received += n
        self.highest = end - 1
        self._tops.extend(zip(repeat(now), range(first, end)))

    def _late(self, seq: int, now: float) -> None:
        """A late arrival: how long after the first later-numbered datagram it came."""
        ring, at = self._ring, self._at
        for nxt in range(seq + 1, min(seq + 1 + REORDER_SCAN, self.highest + 1)):
            i = nxt & _MASK
            if ring[i] == nxt:
                delay = now - at[i]
                if delay > self.reorder_s:
                    self.reorder_s = min(delay, MAX_REORDER_S)
                return

    def settle(self, now: float) -> None:
        """Settle the numbers whose reordering window has passed by ``now``."""
        tops = self._tops
        target, at = self.settled, self.settled_at
        cutoff = now - self.window_s
        while tops and tops[0][0] <= cutoff:
            at, target = tops.popleft()
        if target <= self.settled:
            return
        self.settled_at = at
        ring = self._ring
        first = max(self.settled + 1, target - SEQ_RING + 1)
        # numbers older than the ring count as lost (as in ``lost``); ``settled`` and
        # ``target`` arrived, so every run of lost numbers ends inside this walk
        run = first - self.settled - 1
        got = 0
        burst = self.burst_mean
        for s in range(first, target + 1):
            if ring[s & _MASK] == s:
                got += 1
                if run:
                    burst += BURST_GAIN * (run - burst)
                    run = 0
            else:
                run += 1
        self.burst_mean = burst
        self.settled_received += got
        self.settled = target

    def echo(self) -> tuple[int, float] | None:
        """The number a report echoes and its arrival time: ``settled`` once a number is
        settled, before that the oldest highest one still in its window (None: nothing
        has arrived). Call :meth:`settle` (or :meth:`sample`) with the report's time first."""
        if self.settled >= 0:
            return self.settled, self.settled_at
        if self._tops:
            at, seq = self._tops[0]
            return seq, at
        return None

    def sample(self, now: float = 0.0) -> None:
        """Fold the datagrams settled since the last call into ``loss_rate``."""
        self.settle(now)
        lost, received = self.lost, self.settled_received
        dl = lost - self._prev_lost
        dr = received - self._prev_received
        n = dl + dr
        if n <= 0:
            return
        rate = min(max(dl / n, 0.0), 1.0)
        if not self._sampled:
            self.loss_rate = rate
            self._sampled = True
        else:
            w = min(1.0, n / LOSS_MEMORY_PACKETS)
            self.loss_rate += w * (rate - self.loss_rate)
        self._prev_lost, self._prev_received = lost, received


class SentLog:
    """Sender-side ring: per recent packet number, its send time and how many source,
    repair and reactive-repair datagrams had been sent up to and including it. The sender
    fills slot ``seq & (SEQ_RING - 1)`` inline on its per-datagram path."""

    __slots__ = ("t", "src", "rep", "rea", "newest")

    def __init__(self) -> None:
        self.t = [0.0] * SEQ_RING
        self.src = [0] * SEQ_RING
        self.rep = [0] * SEQ_RING
        self.rea = [0] * SEQ_RING
        self.newest = -1

    def holds(self, seq: int) -> bool:
        return 0 <= seq <= self.newest and self.newest - seq < SEQ_RING

    def lookup(self, seq: int) -> tuple[float, int, int, int]:
        i = seq & _MASK
        return self.t[i], self.src[i], self.rep[i], self.rea[i]


def loss_ranges(
    known: bytearray, lo: int, hi: int, limit: int, skip: Sequence[int] | np.ndarray = ()
) -> tuple:
    """Runs of zero bytes in ``known[lo:hi]`` as ((first, count), ...), lowest first, at most
    ``limit`` runs, counts capped at 65535 (the feedback's u16), leaving out the ESIs in
    ``skip`` (``known`` is unchanged on return). Two C-level ``find`` calls per run:
    feedback goes out every millisecond or so and usually has few holes. ``skip`` is
    marked and unmarked in two vectorized stores (a receiver's pending pivots: up to its
    decoder's ``max_pending``)."""
    marked = np.asarray(skip, dtype=np.int64)
    view = None
    if marked.size:
        view = np.frombuffer(known, np.uint8)  # released below, before any resize
        marked = marked[(marked >= lo) & (marked < hi)]
        marked = marked[view[marked] == 0]
        view[marked] = 1
    out: list[tuple[int, int]] = []
    find = known.find
    pos = find(0, lo, hi)
    while pos >= 0 and len(out) < limit:
        end = find(1, pos, hi)
        if end < 0:
            end = hi
        out.append((pos, min(end - pos, 0xFFFF)))
        pos = find(0, end, hi)
    if view is not None:
        view[marked] = 0
        del view  # the bytearray may be resized again
    return tuple(out)


OPEN_LOOP_LOSS = 0.15
"""The least loss a sender assumes once its receiver has been silent long enough to count
as open loop (since the start, or since its last report): above the stationary loss of
every named link profile (ge-heavy's 12 % the highest), since the smoothed rate the last
report gave may lie below the loss (an EWMA) and no report will correct it, so ``owed``
and the tail rule leave room for the repairs that cover what went out unreported
(kvtransport.core.schemes.rlc walks them over the stream)."""


class FeedbackState:
    """What the sender knows from its receiver's reports: the last report taken (its
    feedback epoch and sequence number, the packet it echoed), what it said (loss rates,
    burst length, decoded-through, highest ESI seen, holes still owed, sources sent before
    the echoed packet it has not seen), the sender's counters as of the echoed packet
    (``*_mark``, from its :class:`SentLog`), the loss prior a shell gave, and whether the
    receiver has been silent long enough to count as open loop. ``loss_estimate`` is the
    sender's loss belief from these."""

    __slots__ = (
        "time",
        "seq",
        "epoch",
        "echo",
        "data_received",
        "loss",
        "loss_recent",
        "burst",
        "through",
        "esi_end",
        "deficit",
        "unseen",
        "src_mark",
        "rep_mark",
        "rea_mark",
        "prev",
        "prior_loss",
        "open_loop",
    )

    def __init__(self, prior_loss: float | None) -> None:
        self.time: float | None = None  # when the last report was taken (None: none yet)
        self.seq = -1  # its feedback sequence number
        self.epoch = -1  # the feedback epoch ``seq`` counts in (-1: no report yet)
        self.echo = -1  # the highest packet number a report echoed
        self.data_received = 0  # data datagrams the receiver reported received
        self.loss = 0.0
        self.loss_recent = 0.0
        self.burst = 1.0
        self.through = 0
        self.esi_end = 0
        self.deficit = 0
        self.unseen = 0
        self.src_mark = 0
        self.rep_mark = 0
        self.rea_mark = 0
        self.prev = (0, 0)  # (lost, lost + received) of the report before
        self.prior_loss = prior_loss
        self.open_loop = False  # no feedback for a while: repair open-loop

    def fresh(self, epoch: int, seq: int, fb: Feedback) -> bool:
        """Is a report newer than the last one taken? Within one feedback epoch (one
        receiving session, kvtransport.core.wire "Sealing") by its sequence number; from
        another epoch (a receiver restarted, or the host's answer before its session
        opened) only when it echoes a packet newer than any report before."""
        if epoch == self.epoch:
            return seq > self.seq
        return self.epoch == -1 or fb.echo_seq > self.echo

    def take_echo(self, fb: Feedback, log: SentLog) -> float | None:
        """The echoed packet's send time, if it is newer than any echoed before and the
        log still holds it (its counters become the marks); else None."""
        echo = fb.echo_seq
        if echo > self.echo and log.holds(echo):
            self.echo = echo
            sent_t, self.src_mark, self.rep_mark, self.rea_mark = log.lookup(echo)
            return sent_t
        return None

    def take_counts(self, fb: Feedback, next_esi: int) -> None:
        """Take a report's loss counts and positions (``next_esi``: sources sent)."""
        prev_lost, prev_total = self.prev
        dl = fb.lost - prev_lost
        dn = dl + fb.received - (prev_total - prev_lost)
        if dn > 0:
            self.loss_recent = min(max(dl / dn, 0.0), 1.0)
        self.prev = (fb.lost, fb.received + fb.lost)
        self.loss = fb.loss_rate
        self.burst = fb.burst_mean
        self.through = max(self.through, min(fb.decoded_through, next_esi))
        self.esi_end = fb.esi_end if fb.esi_end > self.esi_end else self.esi_end
        # equations the receiver still needs to close the span of the holes it reported
        # (it already holds ``pending`` independent ones confined to that span), and the
        # sources sent before the echoed packet that it has not seen at all
        self.deficit = max(0, fb.unrecovered - fb.pending)
        self.unseen = max(0, self.src_mark - fb.esi_end)

    def restart(self) -> None:
        """The receiver restarted: its numbers and decoded-through start over."""
        self.seq = -1
        self.through = 0
        self.esi_end = 0
        self.prev = (0, 0)

    def loss_measured(self) -> tuple[int, int]:
        """The whole transfer's loss as the latest report counts it (since its receiving
        session began): (data datagrams lost, lost + received); (0, 0) before a report."""
        return self.prev

    def loss_estimate(self) -> float:
        """The receiver's smoothed loss rate; before its first report, the prior, else 0;
        open loop, at least ``OPEN_LOOP_LOSS``."""
        if self.time is not None:
            p = self.loss
        else:
            p = self.prior_loss if self.prior_loss is not None else 0.0
        return max(p, OPEN_LOOP_LOSS) if self.open_loop else p
