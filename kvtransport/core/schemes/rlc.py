"""Sliding-window RLC (RFC 8681, dense, DT = 15): the default code.

Reactive repairs: feedback lists the receiver's holes that still need an equation (those no
pending equation is pivoted on; an older receiver lists every hole and, per aligned segment
of ``REPAIR_SEGMENT`` ESIs, the equations it holds pivoted there); each segment owed
equations gets repairs over its own holes only, lowest segment first. Segments thus decode
independently, any equation fixes any hole of its segment, a lost repair costs one more
next round, and windows stay short (decoding cost grows with the window). A ``reactive``
policy has them sent as soon as feedback asks; otherwise they take the proactive share's
slots first. In a segment's last round (a lost repair could no longer be reported and
replaced before the stop time) it is owed more repairs than it lacks equations, a margin
for the reported loss, unless the reported bursts are long enough to take the whole margin
with the repair it protects (``last_round_repairs``).

Proactive repairs (one whenever the repair credit, the policy's share added per slot,
reaches one; and, once no source may go, instead of an idle slot): over the symbols
feedback has not described: the newest, those it cannot have reported yet, or, when its
hole list was cut at ``MAX_FEEDBACK_RANGES``, those from where it stopped (holes the
receiver knows of and could not list, which no reactive repair can aim at); one RTT plus
one interval of them (at least a segment, at most the session's ``max_repair_span``),
never below decoded-through or the receiver's decoder window; open loop (no feedback for a
while) at least ``OPEN_LOOP_SPAN``, and the windows walk the stream from the first symbol
the last report did not describe (from the first symbol, with no report ever), one stride
of ``(1 - p) / p`` symbols per repair (``p`` the session's loss estimate), so the sources
sent before the silence counted are repaired too.

A repair is a REPAIR datagram (kvtransport.core.wire: repair key, DT and NSS, first ESI).
RLC is the window scheme: its decoder (:class:`RLCReceiver`, ``decoder_window`` ESIs, at
most ``max_pending_equations`` pending equations, from the receiver's protocol config) is
the receiver's window decoder, which holds every known source (kvtransport.core.schemes.
base, kvtransport.core.receiver). The sender's encoder holds the sender's
``decoder_window`` ESIs and no repair reaches below ``highest ESI sent - decoder_window +
1``. A policy that answers holes sends a reported hole below that floor (reported late on a
path whose round trips outlast the window, or after repairs to it were lost) again as a
source (RETRANSMIT, kvtransport.core.schemes.arq.Retransmits), lowest first and before any
repair: no repair could reach it, and given up it would cost its block to the deadline.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from kvtransport.codecs.rlc import RLCDecoder, RLCEncoder
from kvtransport.core.protocol import REPAIR_SEGMENT, ProtocolConfig
from kvtransport.core.schemes.arq import Retransmits
from kvtransport.core.schemes.base import (
    OWED_SEGMENTS,
    BadFEC,
    RepairScheme,
    SenderRepair,
    WindowDecoder,
)
from kvtransport.core.wire import (
    MAX_FEEDBACK_RANGES,
    Datagram,
    DatagramType,
    pack_dt_nss,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.policy_base import Policy
    from kvtransport.core.schemes.base import SenderView
    from kvtransport.core.wire import Feedback

_REPAIR = int(DatagramType.REPAIR)
_DT_DENSE = 15
_REPAIR_BATCH = 8
"""Most repairs built ahead in one pass over their sources (RLCEncoder.repairs_into) when
the sender knows it will send several over the same span (see ``_repair``)."""
_TAIL_BATCH = 4
"""Repairs built ahead once every source is sent: the span then holds until feedback moves
decoded-through, and at most this many minus one are built in vain when it does."""
OPEN_LOOP_SPAN = 512
"""Open loop, each proactive repair covers at least this many newest symbols (wider spans
recover more of an unreported loss pattern, but cost more to encode and decode)."""


LAST_ROUND_Z = 2.0
"""Margin, in standard deviations of the losses, of the repairs sent in a segment's last
round (``last_round_repairs``)."""
LAST_ROUND_BURST_SHARE = 0.5
"""On a bursty path a segment's last-round margin is sent only where it lowers the
segment's failure probability by at least this share of what it does where losses are
independent (``last_round_repairs``)."""


def last_round_repairs(missing: int, loss: float, burst: float = 1.0) -> int:
    """Repairs to send for ``missing`` equations when a lost repair could no longer be
    replaced. With independent losses at rate ``loss``: the fewest k whose expected
    arrivals, less LAST_ROUND_Z standard deviations, cover ``missing`` (k (1 - p) -
    z sqrt(k p (1 - p)) >= missing); ``missing`` itself without loss. One owed equation at
    5 % loss gets two repairs (the segment then fails with p^2 instead of p), four get six.

    Where the receiver's mean loss burst ``burst`` (datagrams; the sender's
    ``fb_burst``) is longer than independent losses give (1 / (1 - p)),
    back-to-back repairs are lost together, and a margin shorter than a burst buys little:
    the margin's k - missing repairs are sent only if, under the Gilbert model of that
    loss and burst (``_gilbert_failures``), they lower the segment's failure probability
    by at least LAST_ROUND_BURST_SHARE of what they do with independent losses; else
    ``missing``. One owed equation at 9 % loss in bursts of 20 (the margin saves 0.0045 of
    the segment instead of 0.082) gets one repair; at 11 % in bursts of 2.3 (0.078 instead
    of 0.113) it keeps its three."""
    if missing <= 0 or loss <= 0.0:
        return max(missing, 0)
    p = min(loss, 0.5)
    k = missing
    while k * (1.0 - p) - LAST_ROUND_Z * math.sqrt(k * p * (1.0 - p)) < missing:
        k += 1
    if k == missing or burst * (1.0 - p) <= 1.0:
        return k
    independent = _gilbert_failures(missing, k, p, 1.0 / (1.0 - p))  # Bernoulli's
    bursty = _gilbert_failures(missing, k, p, burst)
    saved = bursty[missing] - bursty[k]
    if saved < LAST_ROUND_BURST_SHARE * (independent[missing] - independent[k]):
        return missing
    return k


def _gilbert_failures(missing: int, k: int, loss: float, burst: float) -> list[float]:
    """P(fewer than ``missing`` of j back-to-back datagrams arrive), for j = 0..k, on the
    two-state Gilbert channel (every datagram lost in the bad state) with stationary loss
    ``loss`` and mean burst ``burst``: bad -> good with 1 / burst, good -> bad with
    loss / burst / (1 - loss); the first datagram sees the stationary state. Counts losses
    up to k - missing + 1 (any more fail every j <= k): O(k (k - missing)) steps."""
    r = 1.0 / burst
    g = min(1.0, loss * r / (1.0 - loss))
    cap = k - missing + 1
    good = [0.0] * (cap + 1)  # P(the state the next datagram meets, losses so far)
    bad = [0.0] * (cap + 1)
    good[0], bad[0] = 1.0 - loss, loss
    fail = [1.0]
    for j in range(1, k + 1):
        nxt_good = [0.0] * (cap + 1)
        nxt_bad = [0.0] * (cap + 1)
        for lost in range(cap + 1):
            more = min(lost + 1, cap)
            nxt_good[lost] += good[lost] * (1.0 - g)  # good: it arrives, the state moves on
            nxt_bad[lost] += good[lost] * g
            nxt_good[more] += bad[lost] * r  # bad: it is lost
            nxt_bad[more] += bad[lost] * (1.0 - r)
        good, bad = nxt_good, nxt_bad
        spare = j - missing  # the losses j datagrams can take and still deliver missing
        fail.append(1.0 - sum(good[: spare + 1]) - sum(bad[: spare + 1]) if spare >= 0 else 1.0)
    return fail


class RLCSender(SenderRepair):
    """The encoder (reading the sources in place from the payload), the repair credit, the
    segments still owed equations and the repairs built ahead."""

    owed_model = OWED_SEGMENTS
    fills_idle = True
    repairs_open_loop = True

    def __init__(self, view: SenderView, policy: Policy) -> None:
        super().__init__(view, policy)
        s, n = view.symbol_size, view.n_source
        self.decoder_window = view.decoder_window
        # stream mode: no per-source copy into an encoder ring
        self.encoder: RLCEncoder | None = RLCEncoder(
            s, window=min(self.decoder_window, max(n, 1)), stream=view.payload
        )
        self.answer_holes = bool(policy.reactive)
        # holes below the repair floor, sent again as sources (answer_holes only)
        self.resend = Retransmits(view)
        self.credit = 0.0
        self.key = 0
        self.span = REPAIR_SEGMENT  # proactive span (rtt_changed)
        # [segment, equations still to send, one past its highest hole], lowest first
        self.segments: deque[list[int]] = deque()
        self.flight: deque[tuple[int, int]] = deque()  # (seq, segment) sent after echo
        # where the last feedback's hole list stopped when it was cut at its cap (-1: not cut)
        self.unreported_from = -1
        # open loop: the symbol the next repair's walk starts at (None: not walking)
        self.walk_from: float | None = None
        # repairs built ahead over one span (rows), for keys ahead_key..
        self._area = view.framer.payload_view(s)
        self._ahead = np.zeros((_REPAIR_BATCH, s), dtype=np.uint8)
        self._ahead_span = (-1, 0)
        self._ahead_key = -1
        self._ahead_i = self._ahead_n = 0

    # ------------------------------------------------------------------ session hooks

    def before_source(self, t: float) -> bytes | None:
        reactive = self.needed > 0
        if reactive and self.answer_holes:
            d = self._answer(t)
            if d is not None:
                self.reactive = True
                return d
        s = self.view
        self.credit += s.share
        if self.credit >= 1.0:
            self.credit -= 1.0
            d = self._repair(reactive)
            if d is not None:
                self.reactive = reactive
                return d
            self.credit = 0.0
        return None

    def quiet_slots(self, limit: int) -> int:
        # holes to answer: before_source tries a repair first (slot by slot); otherwise
        # the slots whose credit stays below one (the same additions before_source makes)
        if self.needed > 0 and self.answer_holes:
            return 0
        share, credit = self.view.share, self.credit
        k = 0
        while k < limit:
            credit += share
            if credit >= 1.0:
                break
            k += 1
        return k

    def passed(self, k: int) -> None:
        share, credit = self.view.share, self.credit
        for _ in range(k):
            credit += share
        self.credit = credit

    def fill(self, t: float) -> bytes | None:
        reactive = self.needed > 0
        self.reactive = reactive
        if reactive and self.answer_holes:
            return self._answer(t)
        return self._repair(reactive)

    def _answer(self, t: float) -> bytes | None:
        """A reply to reported holes: the lowest one below the repair floor sent again,
        else a reactive repair."""
        if self.resend:
            d = self.resend.take(t)
            if d is not None:
                self.needed -= 1
                return d
        return self._repair(True)

    def rtt_changed(self) -> None:
        s = self.view
        span = int(2.0 * s.owd / s.slot_s) + s.decision_packets
        self.span = min(s.max_repair_span, max(REPAIR_SEGMENT, span))

    def restart(self) -> None:
        self.segments.clear()
        self.flight.clear()
        self.resend.clear()
        self.unreported_from = -1
        self.walk_from = None
        self.needed = 0

    def release(self) -> None:
        self.encoder = None

    def on_feedback(self, fb: Feedback, now: float) -> int | None:
        """Equations still owed per segment: its listed holes (those that need an equation),
        minus the equations an older receiver reports pivoted there, minus reactive repairs
        to it still in flight. A list cut at its cap sends proactive repairs to where it
        stopped (``unreported_from``).

        Reactive repairs never leave their aligned segment, so segments decode on their
        own: any equation to a segment fixes any one of its holes, a lost one costs one
        more next round, and the lowest segments (the most useful, in utility order) are
        served first. In the last round (a repair sent now, if lost, would be reported
        and replaced after the stop time: now + a round trip + a feedback interval is past
        it) a segment's missing equations get ``last_round_repairs`` at the reported loss
        and burst length (``fb_burst``), so one lost repair no longer leaves the
        segment, and the stream after it, undecodable."""
        s = self.view
        last = now + 2.0 * s.owd + s.config.feedback_interval > s.stop_time
        loss = s.loss_estimate() if last else 0.0
        burst = s.fb_burst if last else 1.0
        flight = self.flight
        while flight and flight[0][0] <= s.fb_echo:
            flight.popleft()  # it had arrived (or was lost) when the receiver reported
        in_flight: dict[int, int] = {}
        for _, seg in flight:
            in_flight[seg] = in_flight.get(seg, 0) + 1
        pending = dict(fb.segments)
        ranges = fb.ranges
        cut = len(ranges) >= MAX_FEEDBACK_RANGES
        self.unreported_from = ranges[-1][0] + ranges[-1][1] if cut else -1
        self.walk_from = None  # a report: the loop is closed again
        floor = max(0, s.next_esi - self.decoder_window + 1)
        resend = self.resend if self.answer_holes else None
        holes: dict[int, list[int]] = {}  # segment -> [holes, end]
        for first, count in fb.ranges:
            first_ok = max(first, floor)
            end = first + count
            if resend is not None and first < floor:
                resend.add(first, min(end, floor), now)  # beyond every repair's reach
            while first_ok < end:
                seg = first_ok // REPAIR_SEGMENT
                stop = min(end, (seg + 1) * REPAIR_SEGMENT)
                h = holes.setdefault(seg, [0, stop])
                h[0] += stop - first_ok
                h[1] = stop
                first_ok = stop
        plan: deque[list[int]] = deque()
        total = 0
        with_margin: dict[int, int] = {}  # missing -> last-round repairs (same loss, burst)
        for seg in sorted(holes):
            n, end = holes[seg]
            missing = n - pending.get(seg, 0)
            if last:
                k = with_margin.get(missing)
                if k is None:
                    k = with_margin[missing] = last_round_repairs(missing, loss, burst)
                missing = k
            owed = missing - in_flight.get(seg, 0)
            if owed > 0:
                plan.append([seg, owed, end])
                total += owed
        self.segments = plan
        if resend is not None:
            total += len(resend)
        self.needed = total
        return total if fb.ranges else max(0, fb.unrecovered - fb.pending)

    # ------------------------------------------------------------------ repairs

    def _window(self, reactive: bool) -> tuple[int, int]:
        s = self.view
        hi = s.next_esi
        floor = max(0, hi - self.decoder_window + 1)
        if reactive and self.segments:
            # the lowest segment still short of equations, from its first hole (at or
            # above decoded-through) to its last
            seg, _, end = self.segments[0]
            return max(seg * REPAIR_SEGMENT, s.fb_through, floor), min(end, hi)
        # proactive: the symbols feedback has not described: where its hole list was cut,
        # else the newest (one RTT and an interval of them, which it cannot have reported
        # yet); older holes are the reactive repairs' job
        span = self.span
        if s.open_loop:
            span = max(OPEN_LOOP_SPAN, span)
            # no report describes what went out since the last one (or since the start):
            # the sources sent before the silence counted got only the repairs sent since
            # that report, so windows of ``span`` walk the stream a stride apart, from
            # where those would have reached, until they reach the newest span. They start
            # a span before the first undescribed symbol (cut at decoded-through), so it
            # lies in as many windows as any other, and the reported holes just below it,
            # whose answers may be lost, in some.
            p = min(max(s.loss_estimate(), 0.01), 0.5)
            stride = (1.0 - p) / p  # symbols per repair: the tail rule's room, spread evenly
            if self.walk_from is None:
                self.walk_from = s.fb_esi_end + s.in_flight()[1] * stride - span
            start = int(self.walk_from)
            if start + span < hi:
                self.walk_from += stride
                return max(start, floor, s.fb_through), start + span
        lo = self.unreported_from
        if lo >= 0:
            lo = max(s.fb_through, floor, lo)
            return lo, min(hi, lo + span)
        return max(s.fb_through, floor, hi - span), hi

    def _repair(self, reactive: bool) -> bytes | None:
        lo, hi = self._window(reactive)
        if hi <= lo:
            return None
        s = self.view
        key = self.key
        self.key = (key + 1) & 0xFFFF
        nss = hi - lo
        enc = self.encoder
        assert enc is not None  # not released
        if enc.next_esi != s.next_esi:
            enc.add_stream_sources(s.next_esi)  # what has been sent so far
        i = self._ahead_i
        if i < self._ahead_n and key == self._ahead_key and (lo, nss) == self._ahead_span:
            self._area[:] = self._ahead[i]  # built ahead, bit-identical
            self._ahead_i = i + 1
            self._ahead_key = (key + 1) & 0xFFFF
        else:
            self._ahead_n = 0
            # several repairs over this span to come: build them in one pass over its sources
            if reactive and self.segments:
                count = min(self.segments[0][1], _REPAIR_BATCH)
            elif s.next_esi >= s.n_source:
                count = _TAIL_BATCH
            else:
                count = 1  # sources still go out between repairs, moving the span
            if count > 1:
                keys = np.arange(key, key + count, dtype=np.int64) & 0xFFFF
                enc.repairs_into(self._ahead, lo, nss, keys, _DT_DENSE)
                self._area[:] = self._ahead[0]
                self._ahead_span, self._ahead_key = (lo, nss), (key + 1) & 0xFFFF
                self._ahead_i, self._ahead_n = 1, count
            else:
                enc.repair_into(self._area, lo, nss, key, _DT_DENSE)
        if reactive and self.segments:
            entry = self.segments[0]
            self.flight.append((s.seq, entry[0]))
            self.needed -= 1
            entry[1] -= 1
            if entry[1] <= 0:
                self.segments.popleft()
        s.stats["rlc_repair_sent"] += 1
        return s.framer.finish(
            _REPAIR, s.seq, s.symbol_size, esi=lo, key=key, dt_nss=pack_dt_nss(_DT_DENSE, nss)
        )


class RLCReceiver(RLCDecoder):
    """The receiver's window decoder (kvtransport.core.schemes.base.WindowDecoder): the RLC
    decoder, ``config.decoder_window`` ESIs wide, holding at most
    ``config.max_pending_equations`` pending equations, taking REPAIR datagrams."""

    def __init__(self, symbol_size: int, config: ProtocolConfig) -> None:
        super().__init__(
            symbol_size,
            max_window=config.decoder_window,
            max_pending=config.max_pending_equations,
        )

    def add_repair_datagram(self, d: Datagram) -> list[int]:
        _, _, _, _, key, dt_nss, first, payload = d
        try:
            return self.add_repair(first, dt_nss & 0xFFF, key, dt_nss >> 12, payload)
        except ValueError:
            raise BadFEC("RLC repair fields out of range") from None

    def repair_row(self, d: Datagram) -> tuple[int, int, int, int]:
        _, _, _, _, key, dt_nss, first, _ = d
        nss, dt = dt_nss & 0xFFF, dt_nss >> 12
        try:
            self.check_repair(first, nss, key, dt)
        except ValueError:
            raise BadFEC("RLC repair fields out of range") from None
        return first, nss, key, dt


class RLC(RepairScheme):
    name = "rlc"
    wire_type = _REPAIR
    window = True
    stat = "rlc_repair_sent"

    def sender(self, view: SenderView, policy: Policy) -> SenderRepair:
        return RLCSender(view, policy)

    def check(self, d: Datagram) -> int:
        # the coding fields are the decoder's to check (add_repair_datagram, repair_row)
        return d[6] + (d[5] & 0xFFF) - 1  # the last ESI it covers

    def window_decoder(self, symbol_size: int, config: ProtocolConfig) -> WindowDecoder:
        return RLCReceiver(symbol_size, config)


SCHEME = RLC()
