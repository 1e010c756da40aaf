"""One link shared by several transfers: the allocator's plan turned into pacing rates.

Sans-I/O and clock-free (every call takes ``now``). Its one user is the sending
endpoint's host (kvtransport.hosts.sender_host.SenderHost), which the sender daemon and the
multi-user simulator (kvtransport.sim.multisim) both run: what one shows of link sharing is
what the other does.

:class:`LinkShare` holds an :class:`~kvtransport.scheduling.allocator.OnlineScheduler` and the
sender sessions on the link (:class:`Member`). :meth:`LinkShare.step` is called at each
slot boundary it returns and whenever a transfer joins or leaves; it tells the scheduler,
per transfer, what a sender can know:

- **progress**: source bytes sent, less the repairs its feedback says are still owed
  (:meth:`SenderSession.owed`), never below what the receiver reported decoded; and those
  owed repairs as *pending* bytes, which the allocator serves first (a hole blocks the
  rest of the stream);
- **deadline**: the session's deadline less the link's one-way delay (the last moment a
  datagram can leave and still arrive);
- **loss**: the loss rate its receiver reports (0 before a report), which decides whether
  the allocator's guard spreads what must be sent too late to repair;
- **capacity**: the link's *payload* rate, the wire rate times the share of each datagram
  that is payload (symbol / (header + symbol + tag + link overhead)) times (1 - the loss
  rate the members' feedback reports), so a plan in payload bytes is one the link carries.

Each share becomes the member's pacing rate through ``SenderSession.set_rate``. A share
below one datagram per slot pauses the sender (paced that slowly, its next datagram and
its stop time would move past the following slots); when a share grows, a datagram still
scheduled at the old, slower pace is re-anchored to now. A transfer alone on the link gets
all of it (there is nothing to share: the allocator would hold back up to a fifth of the
link from a lone transfer with a generous deadline, and a handoff wants its bytes early).
The whole link never pauses anyone: on a link slower than one datagram per slot (about
1.1 Mbit/s at 10 ms slots) a lone transfer is paced at the link's rate, and when every
share is below a datagram per slot the member with the largest share gets the whole link
for the slot (one at a time, the allocator's favourite first), so the link never idles
while transfers wait.

A member whose adaptive repair policy has not yet heard from its own receiver starts from
its own prior when the shell has one (the sender daemon: the loss its last transfer to
the same receiver ended with), else from the loss the other members report, instead of
the blind prior (10 %), and is updated each step until its own feedback arrives: on a
fast link the blind prior's proactive repairs over the first round trip cost a few
percent of a transfer's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtransport.core.protocol import (
    DEFAULT_FEEDBACK_INTERVAL,
    DEFAULT_SYMBOL_SIZE,
    LINK_OVERHEAD_BYTES,
)
from kvtransport.core.sender import SenderSession
from kvtransport.core.wire import link_bytes
from kvtransport.policies.heuristics import Adaptive
from kvtransport.scheduling.allocator import (
    OnlineScheduler,
    ScheduledTransfer,
    SlotDecision,
    SlotPolicy,
    UtilityWaterFilling,
    repair_guard_s,
)
from kvtransport.scheduling.utility_model import SigmoidUtility

MIN_PRIOR_LOSS = 0.002
MAX_PRIOR_LOSS = 0.9


def payload_efficiency(
    symbol_size: int = DEFAULT_SYMBOL_SIZE,
    tagged: bool = False,
    *,
    link_overhead: int = LINK_OVERHEAD_BYTES,
) -> float:
    """Share of the wire bytes of a data datagram that is payload (symbol), the link
    counting ``link_overhead`` bytes per datagram (kvtransport.core.wire.link_bytes)."""
    return symbol_size / link_bytes(symbol_size, tagged, link_overhead=link_overhead)


@dataclass
class Member:
    """One transfer on the shared link: its sender session and what the allocator weighs.

    deadline: when the session stops sending (absolute, the shell's clock); arrival: when
    it joined; prior_loss: what the shell knows of this transfer's path before its own
    feedback (the loss its last transfer to the same receiver ended with), which wins over
    the other members' loss. share / rate_bps / admitted / paused: the last step's
    decision for it; slots / admitted_slots: steps it was scheduled in, and admitted in.
    """

    id: int
    session: SenderSession
    size: int
    deadline: float
    utility: SigmoidUtility
    weight: float
    arrival: float
    prior_loss: float | None = None
    share: float = 0.0
    rate_bps: float = 0.0
    admitted: bool = False
    paused: bool = False
    slots: int = 0
    admitted_slots: int = 0


class LinkShare:
    """Members of one link and the allocator that shares it (module docstring).

    rate_bps: the link's wire rate; slot_policy: how it is shared (kvtransport.scheduling.allocator;
    None: utility water-filling whose guard is derived from this link, see below);
    one_way_s: the link's one-way delay (change it with :meth:`set_one_way`); tagged:
    datagrams carry an authentication tag; capacity_Bps: feed the allocator this fixed
    payload capacity instead of the estimate from the rate and the reported loss;
    feedback_interval_s: how often the receivers report; link_overhead: the bytes the link
    counts per datagram besides it (the members' sessions must pace with the same, as
    SenderHost's config gives both).

    The default policy's guard (what must be through before a deadline so that a loss
    can still be repaired) is ``repair_guard_s(one_way_s, feedback_interval_s)`` and
    follows every :meth:`set_one_way`. A policy passed in is used as given.
    """

    def __init__(
        self,
        rate_bps: float,
        slot_policy: SlotPolicy | None = None,
        *,
        slot_s: float,
        symbol_size: int,
        tagged: bool,
        one_way_s: float = 0.0,
        capacity_Bps: float | None = None,
        feedback_interval_s: float = DEFAULT_FEEDBACK_INTERVAL,
        link_overhead: int = LINK_OVERHEAD_BYTES,
    ) -> None:
        if not (rate_bps > 0 and math.isfinite(rate_bps)):
            raise ValueError("the link rate must be a positive number")
        self.rate_bps = float(rate_bps)
        self.link_overhead = link_overhead
        self.efficiency = payload_efficiency(symbol_size, tagged, link_overhead=link_overhead)
        self.fixed_capacity = capacity_Bps
        wire = link_bytes(symbol_size, tagged, link_overhead=link_overhead)
        self.min_rate_bps = wire * 8.0 / slot_s
        self.symbol_size = symbol_size
        self.members: dict[int, Member] = {}
        self.feedback_interval_s = float(feedback_interval_s)
        # the default policy is this link's: its guard follows the one-way delay
        self.guarded: UtilityWaterFilling | None = None
        if slot_policy is None:
            slot_policy = self.guarded = UtilityWaterFilling()
        self.scheduler = OnlineScheduler(self.capacity(), slot_policy, slot_s)
        self.one_way_s = 0.0
        self.set_one_way(one_way_s)
        self.steps = 0

    # ------------------------------------------------------------------ membership

    def join(self, member: Member) -> None:
        """Put a new transfer on the link (its rate is set by the next :meth:`step`); its
        session must pace with the link's ``link_overhead`` (ValueError otherwise)."""
        if member.id in self.members:
            raise ValueError(f"transfer {member.id} is already on the link")
        if member.session.link_overhead != self.link_overhead:
            raise ValueError(
                f"transfer {member.id} paces with {member.session.link_overhead} bytes of link "
                f"overhead per datagram, the link counts {self.link_overhead}"
            )
        self.members[member.id] = member
        self._prime(member)
        self.scheduler.add(self._scheduled(member))

    def leave(self, transfer_id: int, reason: str = "finished") -> Member | None:
        """Take a transfer off the link (its session is done or abandoned)."""
        self.scheduler.remove(transfer_id, reason)
        return self.members.pop(transfer_id, None)

    def set_link_rate(self, rate_bps: float) -> None:
        """The link's wire rate changed (the next :meth:`step` shares the new one)."""
        if not (rate_bps > 0 and math.isfinite(rate_bps)):
            raise ValueError("the link rate must be a positive number")
        self.rate_bps = float(rate_bps)

    def set_one_way(self, one_way_s: float) -> None:
        """The link's one-way delay is now ``one_way_s`` (given, or estimated from the
        round trips): the allocator plans to each deadline less it, and the default
        policy's guard is re-derived from it (``repair_guard_s``)."""
        guard = repair_guard_s(one_way_s, self.feedback_interval_s)  # checks its inputs
        self.one_way_s = float(one_way_s)
        if self.guarded is not None:
            self.guarded.guard_s = guard

    # ------------------------------------------------------------------ estimates

    def link_loss(self) -> float | None:
        """Mean loss rate the members' feedback reports (None: no feedback yet)."""
        losses = [
            m.session.loss_estimate()
            for m in self.members.values()
            if m.session.fb_time is not None and not m.session.done
        ]
        return float(np.mean(losses)) if losses else None

    def capacity(self) -> float:
        """Payload bytes/s the link carries: wire rate x payload share x (1 - loss)."""
        if self.fixed_capacity is not None:
            return float(self.fixed_capacity)
        loss = min(self.link_loss() or 0.0, MAX_PRIOR_LOSS)
        return self.rate_bps / 8.0 * self.efficiency * (1.0 - loss)

    def progress(self, m: Member) -> tuple[float, float]:
        """(delivered, pending) bytes for the allocator: sources sent less the repairs
        owed for them (never below what the receiver decoded), and those repairs."""
        s = m.session
        sym = self.symbol_size
        sent = m.size if s.next_esi >= s.n_source else s.next_esi * sym
        owed = s.owed() * sym
        est = float(min(max(max(sent - owed, s.fb_through * sym), 0.0), m.size))
        return est, float(min(owed, m.size - est))

    # ------------------------------------------------------------------ the step

    def step(self, now: float) -> float | None:
        """Re-plan the shares and set every member's rate; returns when to step next
        (None: nothing is scheduled until a member joins or the link changes)."""
        live = [m for m in self.members.values() if not m.session.done]
        self.steps += 1
        if len(live) <= 1:
            for m in live:
                m.slots += 1
                m.admitted_slots += 1
                m.share, m.admitted = 1.0, True
                self._set_rate(m, self.rate_bps, now)
            return None
        sched = self.scheduler
        for m in live:
            delivered, owed = self.progress(m)
            if m.id not in sched.transfers:
                # left the scheduler as delivered, but feedback since reported holes
                if delivered >= m.size or m.deadline - self.one_way_s <= now:
                    continue
                sched.add(self._scheduled(m))
            s = m.session
            sched.set_delivered(m.id, delivered, owed, s.fb_loss if s.fb_time is not None else 0.0)
        sched.set_capacity(self.capacity())
        loss = self.link_loss()
        for m in live:
            if m.session.fb_time is None:
                self._prime(m, loss)
        decision: SlotDecision = sched.step(now)
        for m in live:
            share = decision.shares.get(m.id)
            if share is not None:
                m.slots += 1
                m.admitted_slots += m.id in decision.admitted
            m.share = float(share or 0.0)
            m.admitted = m.id in decision.admitted
        top = max(live, key=lambda m: m.share)
        whole = top.share > 0 and top.share * self.rate_bps < self.min_rate_bps
        for m in live:  # every share too small to send: the largest takes the whole link
            self._set_rate(m, self.rate_bps if whole and m is top else m.share * self.rate_bps, now)
        return decision.until if sched.transfers else None

    def _set_rate(self, m: Member, rate_bps: float, now: float) -> None:
        s = m.session
        if s.done:
            return
        if rate_bps < self.min_rate_bps and rate_bps < self.rate_bps:
            m.rate_bps = 0.0
            if not m.paused:
                s.set_rate(0.0, now)
                m.paused = True
            return
        m.rate_bps = rate_bps
        if m.paused:
            s.set_rate(rate_bps, now)  # a paused sender resumes now
            m.paused = False
            return
        if rate_bps == s.rate_bps:
            return
        s.set_rate(rate_bps, now)
        nxt = s.next_timer()
        slot = (s.datagram_bytes + s.link_overhead) * 8.0 / rate_bps
        if nxt is not None and nxt > now + slot:
            # The pending datagram was paced at the old, slower rate: re-anchor it at the
            # new one (a pause and a resume put the next datagram at `now`).
            s.set_rate(0.0, now)
            s.set_rate(rate_bps, now)

    def _scheduled(self, m: Member) -> ScheduledTransfer:
        return ScheduledTransfer(
            id=m.id,
            size=float(m.size),
            deadline=max(m.deadline - self.one_way_s, m.arrival),
            utility=m.utility,
            weight=m.weight,
            arrival=m.arrival,
        )

    def _prime(self, m: Member, loss: float | None = None) -> None:
        """A session not yet heard from its receiver starts from its own path's prior, else
        from the link's loss (its loss estimate and policy observation; an adaptive
        policy's own prior too)."""
        policy = m.session.policy
        if m.prior_loss is not None:
            loss = m.prior_loss
        elif loss is None:
            loss = self.link_loss()
        if loss is not None:
            m.session.set_prior_loss(min(max(loss, MIN_PRIOR_LOSS), MAX_PRIOR_LOSS))
        if isinstance(policy, Adaptive) and loss is not None:
            policy.prior_loss = min(max(loss, MIN_PRIOR_LOSS), MAX_PRIOR_LOSS)

    def live(self) -> Iterable[Member]:
        """Members whose sessions still run."""
        return (m for m in self.members.values() if not m.session.done)
