"""The sending endpoint, sans-I/O: :class:`SenderHost`, several transfers on one link.

A host is what one sending endpoint runs above its :class:`~kvtransport.core.sender.
SenderSession` s, in the style of aioquic's ``QuicConnection``: it never touches a socket
or reads a clock; every call takes ``now`` (seconds, the shell's clock), and the shell moves
the datagrams:

- :meth:`SenderHost.submit` / :meth:`SenderHost.cancel` start and abort transfers;
- :meth:`SenderHost.receive_datagram` ``(data, addr, now)`` hands a feedback datagram to the
  session its header's transfer id names (a datagram of no transfer in flight is dropped
  and counted: ``truncated``, ``finished_transfer``, ``foreign_transfer``);
- :meth:`SenderHost.get_timer` says when to call :meth:`SenderHost.handle_timer` next,
  which re-plans the link when a slot is due and releases every datagram due up to
  ``now + burst_s``;
- :meth:`SenderHost.datagrams_to_send` ``(now)`` returns what is ready as ``(datagrams,
  address)`` pairs, one per destination in the order the sessions produced them;
- :meth:`SenderHost.next_event` returns the typed events that happened
  (:class:`TransferFinished`), oldest first, None when there are none.

Pacing. Each session paces itself at its rate (its timer is its next slot). The host's
timer is ``burst_s`` before the earliest slot, and it releases what is due up to
``now + burst_s``: a real shell sends the burst in one GSO call and shares the wake-up
costs (a 200 us lead is about two datagrams at 100 Mbit/s); a simulator passes 0.

Link sharing. The host's :class:`~kvtransport.hosts.link_share.LinkShare` re-plans every
``slot_s`` and whenever a transfer starts or ends: the allocator's shares become the
sessions' pacing rates (a share below one datagram per slot pauses a session, the whole
link never does). The link's one-way delay it plans with is ``one_way_s`` when given,
else half the shortest smoothed round trip the sessions measured; the default
allocator's guard (the time a loss near a deadline needs to be repaired) is derived from
it and follows it. Each transfer's utility curve is what its submitter gave, else
:func:`stream_utility_curve`. The host remembers, of each receiver's last transfer
(``RECEIVER_MEMORY`` receivers), the loss it ended with and its shortest round trip: a new
transfer to that receiver starts its repair from that loss (status ``prior_loss``) and,
unless told its initial RTT, assumes that round trip (``initial_rtt_for``), which also
sizes its decoder window.

Queueing. With ``queue_guard`` (the default) the host paces the link at most at what a
:class:`~kvtransport.hosts.queue_guard.QueueGuard` allows while a transfer is alone on it:
every feedback its session takes tells the guard the path's queueing delay and delivery
rate, and while the path's queue builds because its capacity dipped below the link rate,
the link is paced below what it delivers until the queue drains, then probes back up
(host stats ``pacing_mbps``, ``queue_cuts``). It acts on short paths only
(``MAX_BASE_RTT_S``), and on the simulated paths whose capacity never dips that were
tested it never acted (tests/test_queue_guard.py, docs/results.md). When a
transfer joins or leaves, the guard starts over and the cap goes: with several transfers
on the link it does nothing (their paths and paced rates would need accounting of their
own).

Admission (:meth:`SenderHost.submit` raises :class:`~kvtransport.errors.UserError` and
changes nothing): at most ``max_transfers`` in flight, a deadline in
[MIN_DEADLINE_S, MAX_DEADLINE_S] that leaves time to send (longer than the one-way delay
the initial RTT implies, plus a datagram), an initial RTT in (0, MAX_INITIAL_RTT_S], a
non-negative weight, an unused transfer id.

Outcome. Each transfer's status says what its receiver reported holding
(:meth:`Outgoing.outcome`): ``delivered`` is "complete" (every source decoded), "partial"
(the manifest decoded, not every source), or "nothing" (no feedback at all, a refusal, or
the manifest never decoded), with ``note``, one line naming why when not complete. It is
the receiver's last report, also one that arrives after the transfer finished (counted
as a ``finished_transfer`` drop, and read for the outcome): one lost on the way leaves
the previous one. :meth:`Outgoing.outcome_final` says when to stop waiting for it.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransport import bounds
from kvtransport.bounds import MAX_DEADLINE_S, MIN_DEADLINE_S
from kvtransport.core.feedback import refusal_text
from kvtransport.core.policy_base import Policy
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import Transfer
from kvtransport.core.wire import HEADER_SIZE, SealKey, link_bytes
from kvtransport.errors import UserError
from kvtransport.hosts.link_share import LinkShare, Member
from kvtransport.hosts.queue_guard import QueueGuard
from kvtransport.policies.registry import make_policy
from kvtransport.scheduling.allocator import SlotPolicy
from kvtransport.scheduling.utility_model import SigmoidUtility

DEFAULT_BURST_S = 200e-6
DEFAULT_SLOT_S = 0.01
DEFAULT_MAX_TRANSFERS = 64
HISTORY = 256
LATE_REPORT_RTTS = 3.0
"""A finished transfer's outcome waits this many round trips for the receiver's final
report (``Outgoing.outcome_final``) ..."""
LATE_REPORT_MIN_S = 0.05
"""... at least this long ..."""
LATE_REPORT_MAX_S = 1.0
"""... and at most this long."""
NO_FEEDBACK = "no feedback from the receiver: is it running, reachable, and using the same key?"
"""Finished transfers whose status the host keeps (the oldest forgotten)."""
RECEIVER_MEMORY = 1024
"""Receivers whose last transfer's loss the host remembers (the oldest forgotten)."""
_TID = struct.Struct("!Q")

Address = Any
"""A peer's address as the shell knows it (a (host, port) tuple over UDP)."""


def _remember(memory: OrderedDict[Address, float], dest: Address, value: float) -> None:
    """``memory[dest] = value`` as its newest entry, at most RECEIVER_MEMORY entries."""
    memory[dest] = value
    memory.move_to_end(dest)
    while len(memory) > RECEIVER_MEMORY:
        memory.popitem(last=False)


def stream_utility_curve(transfer: Transfer) -> SigmoidUtility:
    """The utility-of-delivered-fraction curve the stream itself implies, as a sigmoid.

    A stream in utility order delivers, after a fraction x of its bytes, the utility of
    the blocks wholly inside that prefix. The logistic a / (1 + exp(-b (x - c))) with a =
    the stream's total utility, c = the fraction where half of it is in and b = 2 ln 3 /
    (x75 - x25) (the logistic reaches a/4 and 3a/4 exactly ln 3 / b either side of c)
    matches that curve's middle and spread in closed form: no fit, microseconds. Used for
    scheduling when the submitter gave no measured accuracy curve.
    """
    b = transfer.blocks
    total = float(b.utilities.sum())
    if len(b) == 0 or total <= 0.0:
        return SigmoidUtility(a=1.0, b=4.0, c=0.5)
    x = (b.offsets + b.lengths).astype(np.float64) / max(transfer.nbytes, 1)
    y = np.cumsum(b.utilities)
    x25, x50, x75 = (
        x[min(int(np.searchsorted(y, q * total)), len(x) - 1)] for q in (0.25, 0.5, 0.75)
    )
    spread = max(float(x75 - x25), 1e-3)
    return SigmoidUtility(a=total, b=min(2.0 * math.log(3.0) / spread, 1e3), c=float(x50))


def alone_on_link(
    transfer: Transfer,
    dest: Address,
    *,
    rate_bps: float,
    deadline_s: float,
    policy: str | Policy,
    transfer_id: int,
    key: SealKey | None,
    symbol_size: int,
    initial_rtt: float,
    prior_loss: float | None = None,
    config: ProtocolConfig = STANDARD,
    queue_guard: bool = True,
) -> tuple[SenderHost, Outgoing]:
    """A fresh host with ``transfer`` submitted at time 0, alone on its link (so it paces
    at ``rate_bps``, below it while the queue guard caps it), releasing datagrams on their
    slots (no burst lead): how a virtual-clock shell with one transfer runs its sender (the
    simulator, each transfer of the demo's emulated link). A fresh host per transfer
    remembers no earlier receiver's loss, so each transfer starts from ``prior_loss``
    alone."""
    host = SenderHost(
        rate_bps=rate_bps,
        key=key,
        symbol_size=symbol_size,
        burst_s=0.0,
        max_transfers=1,
        config=config,
        queue_guard=queue_guard,
    )
    out = host.submit(
        transfer,
        dest,
        now=0.0,
        deadline_s=deadline_s,
        policy=policy,
        transfer_id=transfer_id,
        initial_rtt=initial_rtt,
        prior_loss=prior_loss,
    )
    return host, out


@dataclass
class Outgoing:
    """One transfer in the host, and what status reports about it.

    sent_datagrams: datagrams the host handed to the shell for it (the shell's own send
    failures are the shell's to count); max_lag: worst lateness of the shell's calls
    behind this session's timer (s).
    """

    link: Member  # the session and its place on the shared link (kvtransport.hosts.link_share)
    dest: Address
    policy: str
    label: str = ""
    keep: Any = None  # the buffers the payload views (zero-copy ZeroMQ frames)
    name: int | None = None  # a client's id for it (SenderHost.submit's ``name``)
    state: str = "sending"
    finished: float | None = None
    sent_datagrams: int = 0
    max_lag: float = 0.0

    @property
    def transfer_id(self) -> int:
        return self.link.id

    @property
    def session(self) -> SenderSession:
        return self.link.session

    @property
    def size(self) -> int:
        return self.link.size

    @property
    def submitted(self) -> float:
        return self.link.arrival

    @property
    def deadline(self) -> float:
        return self.link.deadline

    def outcome(self) -> tuple[str, str]:
        """``(delivered, note)`` as the receiver last reported (module docstring): delivered
        is "complete", "partial" or "nothing"; note one line naming why it is not complete
        ("" when it is, or while the transfer is in flight with nothing wrong yet)."""
        s = self.session
        if s.refused:
            return "nothing", f"refused by the receiver ({s.refused}): {refusal_text(s.refused)}"
        if s.fb_time is None:
            return "nothing", NO_FEEDBACK if s.done else ""
        if s.fb_through >= s.n_source:
            return "complete", ""
        if not s.manifest.acked:
            note = "the receiver never decoded the manifest: nothing it holds is usable"
            return "nothing", note if s.done else ""
        return "partial", ""

    def outcome_final(self, now: float) -> bool:
        """Whether :meth:`outcome` can no longer change by ``now``: the transfer is
        complete or refused, or it finished ``LATE_REPORT_RTTS`` round trips ago (within
        [LATE_REPORT_MIN_S, LATE_REPORT_MAX_S]), time for the receiver's last report (its
        ``ALL_DONE`` as the last datagrams arrive, or its result) to come back."""
        if self.finished is None:
            return False
        s = self.session
        if s.refused or s.fb_through >= s.n_source:
            return True
        rtt = 2.0 * s.owd  # the smoothed round trip, else the initial one
        wait = min(max(LATE_REPORT_RTTS * rtt, LATE_REPORT_MIN_S), LATE_REPORT_MAX_S)
        return now >= self.finished + wait

    def status(self, now: float) -> dict[str, Any]:
        """The status view of this transfer (the control API's ``status`` entry).

        ``share`` is the allocator's own figure, not rounded, so the shares of the
        transfers on one link sum to at most one in the report as on the link."""
        s = self.session
        m = self.link
        st = s.stats
        end = self.finished if self.finished is not None else now
        delivered, note = self.outcome()
        return {
            "transfer_id": f"{self.transfer_id:016x}",
            "name": f"{self.name:016x}" if self.name is not None else None,
            "label": self.label,
            "state": self.state,
            "finish_reason": s.finish_reason,
            "delivered": delivered,
            "note": note,
            "refused": s.refused,
            "to": f"{self.dest[0]}:{self.dest[1]}",
            "policy": self.policy,
            "bytes": self.size,
            "n_source": s.n_source,
            "source_sent": st["source_sent"],
            "repair_sent": s.repair_sent,
            "manifest_sent": st["manifest_sent"],
            "retransmit_sent": st["retransmit_sent"],
            "datagrams_sent": self.sent_datagrams,
            "idle_polls": st["idle_polls"],
            "max_lag_ms": round(self.max_lag * 1e3, 3),
            "feedback_received": st["feedback_received"],
            "feedback_dropped": st["dropped"],
            "receiver_restarts": st["receiver_restarts"],
            "drop_reasons": dict(s.drop_reasons),
            "decoded_through": s.fb_through,
            "delivered_bytes": min(s.fb_through * s.symbol_size, self.size),
            "loss_estimate": round(s.loss_estimate(), 5),
            # the whole transfer's, as the receiver's latest report counts it
            "datagrams_lost": s.fb.loss_measured()[0],
            "loss_measured": _ratio(*s.fb.loss_measured()),
            "decisions": s.decision_latency(),
            "srtt_ms": None if s.srtt is None else round(s.srtt * 1e3, 3),
            "min_rtt_ms": None if s.min_rtt is None else round(s.min_rtt * 1e3, 3),
            "rttvar_ms": round(s.rttvar * 1e3, 3),
            "jitter_margin_ms": round(s.jitter_margin * 1e3, 3),
            "decoder_window": s.decoder_window,
            "rate_mbps": round(m.rate_bps / 1e6, 6),
            "share": m.share,
            "admitted": m.admitted,
            "weight": m.weight,
            "prior_loss": None if m.prior_loss is None else round(m.prior_loss, 5),
            "deadline_s": round(self.deadline - self.submitted, 6),
            "elapsed_s": round(end - self.submitted, 6),
        }


def _ratio(part: int, whole: int) -> float | None:
    """``part / whole`` rounded for a status (None when ``whole`` is 0)."""
    return round(part / whole, 5) if whole else None


NO_TIME_TO_SEND = "leaves no time to send"
"""The words of :class:`NoTimeToSend`'s message (a refusal crosses the control API as text)."""


class NoTimeToSend(UserError):
    """:meth:`SenderHost.submit`'s refusal of a deadline that leaves no time to send: by the
    initial RTT a datagram sent now would arrive after it. Callers that can do without the
    transfer (the main job: the receiver computes what does not cross) catch this one, or
    its message (it holds :data:`NO_TIME_TO_SEND`) where it crossed a process boundary."""


@dataclass(frozen=True)
class TransferFinished:
    """A transfer's session is done (it sent FIN or ABORT, or its receiver said it is
    finished): its status is final and it left the link. ``at``: when (shell's clock)."""

    transfer: Outgoing
    at: float

    @property
    def transfer_id(self) -> int:
        return self.transfer.transfer_id

    @property
    def reason(self) -> str:
        return self.transfer.session.finish_reason or "finished"


SenderEvent = TransferFinished


class SenderHost:
    """Sender sessions of one endpoint on one shared link (see the module docstring).

    rate_bps: the link rate shared by all transfers; key: the datagrams' authentication
    key; slot_policy: how the link is shared (kvtransport.scheduling.allocator; None: utility
    water-filling with its guard derived from the link's one-way delay, see
    kvtransport.hosts.link_share.LinkShare); one_way_s: the link's one-way delay for the
    allocator's last useful send time (None: half the shortest measured round trip);
    capacity_Bps: feed the allocator this fixed payload capacity instead of its estimate;
    config: the protocol's settings every session of the host is built with
    (kvtransport.core.protocol; also the symbol size and initial RTT when not given, and
    the feedback interval the allocator's guard assumes, and the per-datagram link
    overhead the link's capacity and the sessions' pacing count); queue_guard: pace the
    link below its rate while the path's queue builds (module docstring).
    """

    def __init__(
        self,
        *,
        rate_bps: float,
        key: SealKey | None = None,
        symbol_size: int | None = None,
        burst_s: float = DEFAULT_BURST_S,
        slot_s: float = DEFAULT_SLOT_S,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        slot_policy: SlotPolicy | None = None,
        one_way_s: float | None = None,
        capacity_Bps: float | None = None,
        config: ProtocolConfig = STANDARD,
        queue_guard: bool = True,
    ) -> None:
        if not (rate_bps > 0 and math.isfinite(rate_bps)):
            raise UserError("the link rate must be a positive number")
        self.rate_bps = float(rate_bps)
        self.key = key
        self.config = config
        self.symbol_size = symbol_size = config.symbol_size if symbol_size is None else symbol_size
        self.burst_s = burst_s
        self.slot_s = slot_s
        self.max_transfers = max_transfers
        self.fixed_one_way_s = one_way_s
        self.active: dict[int, Outgoing] = {}
        self.finished: OrderedDict[int, Outgoing] = OrderedDict()
        self._names: dict[int, int] = {}  # a client's id (name) -> the wire id
        self.drop_reasons: dict[str, int] = {}
        self.dropped = 0
        # the loss each receiver's last transfer ended with and its shortest round trip (at
        # most RECEIVER_MEMORY of them): a new transfer to it starts from those, not from
        # a blind prior and the config's initial RTT
        self.receiver_loss: OrderedDict[Address, float] = OrderedDict()
        self.receiver_rtt: OrderedDict[Address, float] = OrderedDict()
        self.link = LinkShare(
            self.rate_bps,
            slot_policy,
            slot_s=slot_s,
            symbol_size=symbol_size,
            tagged=key is not None,
            one_way_s=one_way_s or 0.0,
            capacity_Bps=capacity_Bps,
            feedback_interval_s=config.feedback_interval,
            link_overhead=config.link_overhead,
        )
        self.guard: QueueGuard | None = None
        if queue_guard:
            wire = link_bytes(symbol_size, key is not None, link_overhead=config.link_overhead)
            self.guard = QueueGuard(self.rate_bps, wire * 8.0, self.link.min_rate_bps)
        self._sched_at: float | None = None
        self._replan_at: float | None = None  # a transfer ended then: re-plan at once
        self._outbox: list[tuple[list[bytes], Address]] = []
        self._events: deque[SenderEvent] = deque()

    # ------------------------------------------------------------------ transfers

    def submit(
        self,
        transfer: Transfer,
        dest: Address,
        *,
        now: float,
        deadline_s: float,
        policy: str | Policy = "adaptive",
        transfer_id: int | None = None,
        weight: float = 1.0,
        utility: SigmoidUtility | None = None,
        label: str = "",
        initial_rtt: float | None = None,
        keep: Any = None,
        wall_offset: float = 0.0,
        prior_loss: float | None = None,
        name: int | None = None,
    ) -> Outgoing:
        """Start sending ``transfer`` to ``dest`` with ``deadline_s`` from ``now``;
        ``policy``: a policy name (``make_policy``) or a policy instance, which the
        transfer's session then owns; ``wall_offset``: the wall clock minus the shell's
        (the manifest's send time); ``prior_loss``: what the shell knows of this path's
        loss (instead of what the host remembers of ``dest``; see ``Member.prior_loss``).
        ``initial_rtt``: None takes ``initial_rtt_for(dest)``. A refusal raises UserError
        and changes nothing (module docstring).

        Transfer ids: the wire id (the per-transfer key's salt, kvtransport.core.wire) is
        drawn at random unless ``transfer_id`` gives it, which only a shell that vouches
        for its uniqueness under the key does (a simulator replaying a seed). A client's
        id is a ``name``: the transfer gets a random wire id, and :meth:`get`,
        :meth:`cancel` and :meth:`status` find it by its name too while the host
        remembers it; a name in use by a transfer in flight is refused."""
        if len(self.active) >= self.max_transfers:
            raise UserError(f"{len(self.active)} transfers in flight (the limit): try later")
        if not MIN_DEADLINE_S <= deadline_s <= MAX_DEADLINE_S:
            raise UserError(
                f"the deadline must be {MIN_DEADLINE_S:g}..{MAX_DEADLINE_S:g} s ({deadline_s})"
            )
        if initial_rtt is None:
            initial_rtt = self.initial_rtt_for(dest)
        if not 0.0 < initial_rtt <= bounds.MAX_INITIAL_RTT_S:
            raise UserError(
                f"the initial RTT must be in (0, {bounds.MAX_INITIAL_RTT_S * 1e3:g}] ms "
                f"({initial_rtt * 1e3:g})"
            )
        if not (weight >= 0 and math.isfinite(weight)):
            raise UserError("the weight must be a non-negative number")
        if transfer_id is not None and (transfer_id in self.active or transfer_id in self.finished):
            raise UserError(f"transfer id {transfer_id:016x} is already in use")
        if name is not None:
            if transfer_id is not None:
                raise ValueError("a transfer has a wire id or a name, not both")
            if self._names.get(name) in self.active:
                raise UserError(f"transfer id {name:016x} is already in use")
        pol = make_policy(policy) if isinstance(policy, str) else policy
        try:
            session = SenderSession(
                transfer,
                pol,
                rate_bps=self.rate_bps,
                deadline=now + deadline_s,
                now=now,
                transfer_id=transfer_id,
                key=self.key,
                symbol_size=self.symbol_size,
                initial_rtt=initial_rtt,
                wall_offset=wall_offset,
                config=self.config,
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if session.stop_time <= now:  # it would send nothing, and so never learn the RTT
            raise NoTimeToSend(
                f"a {deadline_s * 1e3:g} ms deadline {NO_TIME_TO_SEND}: by the initial "
                f"RTT ({initial_rtt * 1e3:g} ms) a datagram takes {session.owd * 1e3:g} ms to "
                "arrive; give the link's real round trip (initial RTT) if it is shorter"
            )
        if session.transfer_id in self.active or session.transfer_id in self.finished:
            raise UserError("transfer id collision (random 64-bit): submit again")
        member = Member(
            id=session.transfer_id,
            session=session,
            size=transfer.nbytes,
            deadline=now + deadline_s,
            utility=utility if utility is not None else stream_utility_curve(transfer),
            weight=float(weight),
            arrival=now,
            prior_loss=prior_loss if prior_loss is not None else self.receiver_loss.get(dest),
            rate_bps=self.rate_bps,
        )
        out = Outgoing(link=member, dest=dest, policy=pol.name, label=label, keep=keep, name=name)
        self.active[out.transfer_id] = out
        self.link.join(member)
        try:
            self._reschedule(now)  # shares are right from the first status reply on
        except Exception:
            del self.active[out.transfer_id]  # refused: nothing of it may run
            self.link.leave(out.transfer_id, "refused")
            self._replan(now)
            raise
        if self._guard_anew():
            self._reschedule(now)  # the cap went: share the whole link again
        if name is not None:
            self._name(name, out.transfer_id)
        return out

    def _name(self, name: int, transfer_id: int) -> None:
        """Let ``name`` find ``transfer_id``; names of transfers forgotten are forgotten."""
        names = self._names
        names[name] = transfer_id
        if len(names) > len(self.active) + len(self.finished):
            for n, tid in list(names.items()):
                if tid not in self.active and tid not in self.finished:
                    del names[n]

    def resolve(self, transfer_id: int) -> int:
        """The wire id of a transfer given its wire id or its name (module docstring of
        kvtransport.core.wire: a client's id is a name); unknown ids come back as given."""
        if transfer_id in self.active or transfer_id in self.finished:
            return transfer_id
        return self._names.get(transfer_id, transfer_id)

    def cancel(self, transfer_id: int, now: float) -> bool:
        """Abort a transfer in flight (its receiver is told to deliver what it has)."""
        out = self.active.get(self.resolve(transfer_id))
        if out is None:
            return False
        out.session.cancel(now)
        self._flush(out, now)
        return True

    def close(self, now: float) -> None:
        """Abort everything still in flight (the endpoint shuts down)."""
        for tid in list(self.active):
            self.cancel(tid, now)

    def get(self, transfer_id: int) -> Outgoing | None:
        """A transfer in flight or recently finished (by its wire id or its name)."""
        tid = self.resolve(transfer_id)
        return self.active.get(tid) or self.finished.get(tid)

    def status(self, now: float, transfer_id: int | None = None) -> list[dict[str, Any]]:
        """Status of one transfer (in flight or recently finished) or of all of them."""
        if transfer_id is not None:
            out = self.get(transfer_id)
            if out is None:
                raise UserError(f"no transfer {transfer_id:016x}")
            return [out.status(now)]
        return [o.status(now) for o in (*self.active.values(), *self.finished.values())]

    def stats(self) -> dict[str, Any]:
        """Counters of the host (the shell adds its socket's)."""
        return {
            "active": len(self.active),
            "finished": len(self.finished),
            "dropped": self.dropped,
            "drop_reasons": dict(self.drop_reasons),
            "pacing_mbps": self.link.rate_bps / 1e6,
            "queue_cuts": 0 if self.guard is None else self.guard.cuts,
        }

    # ------------------------------------------------------------------ datagrams

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        """Feedback: to the session its transfer id names (else dropped and counted)."""
        if len(data) < HEADER_SIZE:
            self._drop("truncated")
            return
        tid = _TID.unpack_from(data, 8)[0]
        out = self.active.get(tid)
        if out is None:
            done = self.finished.get(tid)
            self._drop("finished_transfer" if done is not None else "foreign_transfer")
            if done is not None:  # the receiver's last report may still tell the outcome
                done.session.late_feedback(data, now)
            return
        s = out.session
        taken = s.stats["feedback_received"]
        s.receive_datagram(data, now)
        guard = self.guard
        if guard is not None and len(self.active) == 1 and s.stats["feedback_received"] != taken:
            if guard.on_feedback(now, s.rtt_sample, s.fb_data_received):
                self.link.set_link_rate(guard.pacing_bps())
                self._reschedule(now)
        if s.done:  # the receiver is finished: nothing more to send
            self._flush(out, now)

    def datagrams_to_send(self, now: float) -> list[tuple[list[bytes], Address]]:
        """What is ready to go, as (datagrams, destination) pairs in order."""
        out = self._outbox
        self._outbox = []
        return out

    def next_event(self) -> SenderEvent | None:
        """The oldest event not yet taken (None: none)."""
        return self._events.popleft() if self._events else None

    # ------------------------------------------------------------------ timers

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` has work next (a burst's lead before the earliest
        slot, a slot boundary, or at once after a transfer ended); None: nothing planned."""
        wake = self._sched_at
        if self._replan_at is not None and (wake is None or self._replan_at < wake):
            wake = self._replan_at
        lead = self.burst_s
        for out in self.active.values():
            t = out.link.session.next_timer()  # (not the property: this is the hot path)
            if t is not None:
                t -= lead
                if wake is None or t < wake:
                    wake = t
        return wake

    def handle_timer(self, now: float) -> None:
        """Re-plan the link if a slot is due; release every datagram due up to
        ``now + burst_s``; finish what is done."""
        if (self._replan_at is not None and now >= self._replan_at) or (
            self._sched_at is not None and now >= self._sched_at
        ):
            self._reschedule(now)
        horizon = now + self.burst_s
        for out in list(self.active.values()):
            s = out.link.session
            t = s.next_timer()
            if t is not None and t <= horizon:
                if now - t > out.max_lag:
                    out.max_lag = now - t
                self._flush(out, horizon)
            elif s.done:
                self._flush(out, now)

    # ------------------------------------------------------------------ internals

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def _flush(self, out: Outgoing, t: float) -> None:
        s = out.link.session
        datagrams = s.datagrams_to_send(t)
        if datagrams:
            out.sent_datagrams += len(datagrams)
            self._outbox.append((datagrams, out.dest))
        if s.done:
            self._finish(out, t)

    def _replan(self, now: float) -> None:
        if self._replan_at is None or now < self._replan_at:
            self._replan_at = now

    def _finish(self, out: Outgoing, now: float) -> None:
        if out.state == "done":
            return
        out.state = "done"
        out.finished = now
        out.keep = None
        out.session.release()  # the payload goes now, the status figures stay
        del self.active[out.transfer_id]
        self.finished[out.transfer_id] = out
        while len(self.finished) > HISTORY:
            self.finished.popitem(last=False)
        self.link.leave(out.transfer_id, out.session.finish_reason or "finished")
        self._guard_anew()
        if self.active:
            self._replan(now)  # the others share the link anew
        else:
            self._reschedule(now)  # nothing left to share: no wake-up for it
        if out.session.fb_time is not None:  # its receiver reported: remember its path
            _remember(self.receiver_loss, out.dest, out.session.loss_estimate())
            if out.session.min_rtt is not None:
                _remember(self.receiver_rtt, out.dest, out.session.min_rtt)
        self._events.append(TransferFinished(out, now))

    def has_prior_for(self, dest: Address) -> bool:
        """Whether a transfer submitted now to ``dest`` starts from a loss prior: the loss
        that receiver's last transfer ended with, or the loss the link's transfers report
        (see ``LinkShare._prime``)."""
        return dest in self.receiver_loss or self.link.link_loss() is not None

    def initial_rtt_for(self, dest: Address) -> float:
        """The round trip a new transfer to ``dest`` assumes before its first feedback: the
        shortest its last transfer measured (within the allowed initial RTTs), else the
        config's ``initial_rtt``."""
        rtt = self.receiver_rtt.get(dest)
        if rtt is None:
            return self.config.initial_rtt
        return min(max(rtt, 1e-6), bounds.MAX_INITIAL_RTT_S)

    def _guard_anew(self) -> bool:
        """The link's transfers changed: the queue guard starts over, its cap gone. Returns
        whether the link's pacing rate changed."""
        if self.guard is not None and self.guard.reset():
            self.link.set_link_rate(self.guard.pacing_bps())
            return True
        return False

    def _reschedule(self, now: float) -> None:
        self._replan_at = None
        if self.fixed_one_way_s is None:
            # the link's one-way delay, for the allocator's last useful send time: half
            # the shortest smoothed round trip any transfer measured (0 until one has)
            rtts = [o.session.srtt for o in self.active.values() if o.session.srtt is not None]
            if rtts:
                self.link.set_one_way(min(rtts) / 2.0)
        self._sched_at = self.link.step(now)
