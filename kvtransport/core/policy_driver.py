"""The sender's policy driver (sans-I/O): :class:`PolicyDriver`.

It asks the policy for a decision once per ``decision_packets`` slots (and at the next
slot after the sender's rate rose by more than ``RATE_REDECIDE``, kvtransport.core.sender),
with the sender state packed into the policy's raw input (kvtransport.core.observation
``Raw``: the per-decision fields at each decision, the feedback and per-transfer fields
when they change), and turns the action into the interval's repair share and whether new
sources are admitted. Open loop (the receiver silent for ``OPEN_LOOP_RTTS`` round trips)
a scheme that repairs open-loop gets at least the share ``_open_loop_share`` spreads over
the stream. An ``ExternalPolicy`` defers (``DEFER``): the driver is then ``awaiting``
until the shell supplies the action. Each decision is timed (``decision_ns``, a
performance counter that nothing sent depends on) and, with ``record``, logged
(``history``).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from time import perf_counter_ns

import numpy as np

from kvtransport.core.feedback import FeedbackState
from kvtransport.core.observation import (
    OBS_SIZE,
    RAW_DECISION,
    RAW_FEEDBACK,
    RAW_SIZE,
    RAW_TRANSFER,
    Obs,
    observe_into,
)
from kvtransport.core.pacing import Pacer
from kvtransport.core.policy_base import DEFER, Policy, PolicyContext
from kvtransport.core.rtt import RttEstimator
from kvtransport.core.sent import SendProgress, SourceStream
from kvtransport.core.tail_rule import TailRule

OPEN_LOOP_RTTS = 4.0
"""Round trips without feedback after which the sender repairs open-loop."""
OPEN_LOOP_FIRST_RTTS = 2.0
"""... round trips (assumed, before any sample) without a first report: a receiver's
first report is due one round trip and a report interval after the first datagram."""
OPEN_LOOP_MIN_S = 0.02
"""... but never before this much silence."""
OPEN_LOOP_MAX_SHARE = 0.5
"""The most of the slots open-loop repair takes."""


def _packer(group: tuple[int, int]) -> tuple[Callable[..., None], int]:
    """``struct.pack_into`` for one group of ``Raw`` fields, and the group's byte offset."""
    first, end = group
    return struct.Struct(f"={end - first}d").pack_into, first * 8


_pack_decision, _AT_DECISION = _packer(RAW_DECISION)
_pack_feedback, _AT_FEEDBACK = _packer(RAW_FEEDBACK)
_pack_transfer, _AT_TRANSFER = _packer(RAW_TRANSFER)


class PolicyDriver:
    """One transfer's decisions (module docstring)."""

    def __init__(
        self,
        policy: Policy,
        decision_packets: int,
        record: bool,
        now: float,
        stream: SourceStream,
        progress: SendProgress,
        fb: FeedbackState,
        rtt: RttEstimator,
        pacer: Pacer,
        tail: TailRule,
    ) -> None:
        self.policy = policy
        self.decision_packets = decision_packets
        self.record = record
        self.history: list[tuple] = []
        self.start = now
        self.stream, self.progress, self.fb, self.rtt = stream, progress, fb, rtt
        self.pacer, self.tail = pacer, tail
        self.raw = np.zeros(RAW_SIZE, dtype=np.float64)  # the policy's input, see state()
        self.raw_buf = memoryview(self.raw)
        self.obs = np.zeros(OBS_SIZE, dtype=np.float32)
        self.last = (0.0, 1.0, 0.0)  # last share, last admit, share before
        self.share = 0.0
        self.admit = True
        self.awaiting = False  # an ExternalPolicy deferred: apply_action resumes
        self.decision_slot = -1
        self.stale = False  # the rate rose: ask the policy again at the next slot
        self.decision_t = now
        self.budget = 0.0
        self.decision_ns = array("q")
        """Latency of each decision (state packing + ``policy.decide``), in ns of
        ``perf_counter``: instrumentation only, it never changes what is sent."""

    def begin(self, now: float, manifest_acked: bool) -> None:
        """The transfer starts: the policy learns its context, the raw input its
        per-transfer and feedback fields (the stop time is set)."""
        stream, slot_s = self.stream, self.pacer.slot_s
        budget = max(self.tail.stop_time - now, slot_s)
        self.policy.reset(
            PolicyContext(stream.n_source, stream.symbol_size, slot_s, self.decision_packets,
                          budget)
        )  # fmt: skip
        self.budget = budget
        self.pack_transfer()
        self.pack_feedback(manifest_acked)

    def due(self, slot: int) -> bool:
        """Is a decision due at ``slot``?"""
        return (slot % self.decision_packets == 0 and self.decision_slot != slot) or self.stale

    def state(self, t: float) -> np.ndarray:
        """The raw sender state the observation is computed from (kvtransport.core.observation
        ``Raw``), its per-decision fields packed now; the others were written when they
        changed (``pack_feedback``, ``pack_transfer``, the sender's stop time). One
        ``struct.pack_into`` per group: item-by-item numpy stores cost an index conversion
        and a cast each."""
        last_share, last_admit, prev_share = self.last
        p = self.progress
        _pack_decision(
            self.raw_buf,
            _AT_DECISION,
            t,  # T
            p.next_esi,  # NEXT_ESI
            p.source_sent,  # SOURCE_SENT
            p.repair_sent,  # REPAIR_SENT
            p.reactive_sent,  # REACTIVE_SENT
            self.tail.repair.needed,  # SEG_NEEDED
            self.stream.utility_after[p.next_esi],  # UTILITY_LEFT
            last_share,  # LAST_SHARE
            last_admit,  # LAST_ADMIT
            prev_share,  # PREV_SHARE
        )
        return self.raw

    def pack_feedback(self, manifest_acked: bool) -> None:
        """Pack the state feedback changes (the stop time it moves is the sender's)."""
        fb = self.fb
        _pack_feedback(
            self.raw_buf,
            _AT_FEEDBACK,
            fb.time is not None,  # HAS_FEEDBACK
            fb.time or 0.0,  # FB_TIME
            fb.loss,  # FB_LOSS
            fb.loss_recent,  # FB_LOSS_RECENT
            fb.burst,  # FB_BURST
            fb.deficit,  # FB_DEFICIT
            fb.unseen,  # FB_UNSEEN
            fb.through,  # FB_THROUGH
            self.rtt.srtt or 0.0,  # SRTT
            fb.src_mark,  # SOURCE_MARK
            fb.rep_mark,  # REPAIR_MARK
            fb.rea_mark,  # REACTIVE_MARK
            manifest_acked,  # MANIFEST_ACKED
        )

    def pack_transfer(self) -> None:
        """Pack the per-transfer state (at the start and when the rate changes)."""
        prior = self.fb.prior_loss
        _pack_transfer(
            self.raw_buf,
            _AT_TRANSFER,
            self.pacer.slot_s,  # SLOT_S
            self.budget,  # BUDGET
            self.decision_packets,  # INTERVAL
            self.stream.n_source,  # N_SOURCE
            self.rtt.initial,  # INITIAL_RTT
            self.tail.owed_model,  # MODE
            -1.0 if prior is None else prior,  # PRIOR_LOSS
        )

    def observe(self, t: float) -> np.ndarray:
        """Fill ``obs`` (the policy's observation) for time ``t`` and return it."""
        observe_into(self.state(t), self.obs)
        return self.obs

    def decide(self, t: float) -> None:
        """Ask the policy now (slot ``progress.slot``); a deferred decision leaves the
        driver ``awaiting``."""
        self.decision_slot = self.progress.slot
        self.stale = False
        self.decision_t = t
        t0 = perf_counter_ns()
        a = self.policy.decide(self.state(t), self.obs)
        self.decision_ns.append(perf_counter_ns() - t0)
        obs = self.obs
        if a == DEFER:
            self.awaiting = True
            return
        self.set_action(a)
        if self.record:
            p = self.progress
            self.history.append(
                (
                    t,
                    a,
                    self.share,
                    self.admit,
                    p.source_sent,
                    p.repair_sent,
                    float(obs[Obs.LOSS_RATE]),
                    self.fb.deficit,
                    float(obs[Obs.OWED]) * self.decision_packets,
                    self.tail.slots_left(t),
                )  # fmt: skip
            )

    def set_action(self, a: int) -> None:
        """Apply action ``a`` (an index into the policy's table) to the interval."""
        table = self.policy.actions
        if not 0 <= a < len(table):
            raise ValueError(f"action {a} outside the policy's table of {len(table)}")
        share, admit = float(table[a, 0]), bool(table[a, 1] > 0.5)
        self.last = (share, 1.0 if admit else 0.0, self.last[0])
        self.share = share if admit else 1.0
        self.admit = admit
        fb = self.fb
        fb.open_loop = self.tail.repair.repairs_open_loop and self.silent(self.decision_t)
        if fb.open_loop:
            self.share = max(self.share, self._open_loop_share(self.decision_t))

    def silent(self, t: float) -> bool:
        """No feedback for OPEN_LOOP_RTTS round trips (at least OPEN_LOOP_MIN_S): since the
        start, the last report or the end of a pause (a sender its shell paused sent
        nothing to report on; counted from the report, a long pause looked like a dead
        feedback path and the resumed sender spent up to half its slots on blind repair).
        The sender then repairs open-loop."""
        fb_time = self.fb.time
        since = max(fb_time if fb_time is not None else self.start, self.pacer.resumed_at)
        rtt = self.rtt.smoothed
        rtts = OPEN_LOOP_RTTS if fb_time is not None else OPEN_LOOP_FIRST_RTTS
        return t - since > max(rtts * rtt, OPEN_LOOP_MIN_S)

    def _open_loop_share(self, t: float) -> float:
        """Open loop, nothing tells the sender what was lost, so the slack (slots before
        the stop time beyond the sources still to send) is spread evenly over the rest of
        the stream as proactive repairs over at least ``OPEN_LOOP_SPAN`` newest symbols
        (kvtransport.core.schemes.rlc): every part of the stream gets repairs while it is
        still inside the decoder's window, not only the newest span once all sources are
        out. At least the assumed loss (``loss_estimate``, open loop at least
        ``OPEN_LOOP_LOSS``) goes to repairs, between the sources (where the tail rule
        leaves no slack, they would otherwise all wait for the last source)."""
        left = self.tail.slots_left(t)
        sources = self.stream.n_source - self.progress.next_esi
        if left <= 0:
            return 0.0
        share = max(left - sources, 0) / left
        share = max(share, self.fb.loss_estimate())
        return min(share, OPEN_LOOP_MAX_SHARE)

    def decision_latency(self) -> dict[str, float] | None:
        """Count, mean, p50 and p99 (us) of this transfer's policy decisions as timed
        (``decision_ns``); None before the first decision."""
        if not self.decision_ns:
            return None
        us = np.frombuffer(self.decision_ns, dtype=np.int64) / 1e3
        p50, p99 = np.percentile(us, (50, 99))
        return {"n": int(us.size), "mean_us": float(us.mean()), "p50_us": float(p50),
                "p99_us": float(p99)}  # fmt: skip
