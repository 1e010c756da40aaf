"""Several handovers sharing one backhaul: real sessions, one bottleneck, the allocator.

kvtransport.simulator runs one transfer; here several users hand over at once, each with
its own real :class:`~kvtransport.sender.SenderSession` / :class:`~kvtransport.receiver.
ReceiverSession` pair, and every data datagram of every sender goes through ONE data-path
channel (kvtransport.netem: loss model, then the link's token bucket with its FIFO queue,
then delay), every feedback datagram through one reverse-path channel. A
:class:`~kvtransport.allocator.OnlineScheduler` with the slot policy under test (this
allocator or a baseline) decides every ``slot_s`` (and whenever a handover arrives) how
the link is shared, and each sender's pacing rate is set through its rate hook
(``SenderSession.set_rate``): share x link rate; a share of 0 pauses the sender.

How the link is shared is kvtransport.link_share's :class:`~kvtransport.link_share.
LinkShare`, the code the sender daemon runs: what the scheduler sees of each handover
(progress less owed repairs, owed repairs served first, the deadline less the one-way
delay, the payload capacity net of the reported loss), pausing below one datagram per
slot, re-anchoring a sender whose share grew, and the repair prior of a session not yet
heard from. Here the one-way delay is the profile's.

A handover's accuracy is its fitted sigmoid (kvtransport.utility_model) at the fraction of
its cache delivered *in utility order* when its deadline came: the bytes of the longest
prefix of the stream whose blocks are all complete at the receiver, over the cache size.

Event loop: one heap holds datagrams in flight and the sessions' timers. A session's timer
is re-read from ``next_timer()`` after everything that can move it and pushed when it
changed; entries that are no longer current are skipped when popped (a per-session record
of the armed time says which is current). At equal times deliveries go first, then
senders, receivers, arrivals and slot boundaries. Everything random derives from ``seed``.

The channel's loss, rate and delay come from a kvtransport.netem profile ("clean": 5 ms,
no loss), with the link rate overridden by the scenario.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtransport.allocator import SlotPolicy
from kvtransport.link_share import LinkShare, Member, payload_efficiency
from kvtransport.netem import Channel, Profile, load_profile, make_channel
from kvtransport.policy import make_policy
from kvtransport.protocol import DEFAULT_SYMBOL_SIZE, LINK_OVERHEAD_BYTES
from kvtransport.receiver import ReceiverSession
from kvtransport.sender import SenderSession
from kvtransport.simulator import DEFAULT_BLOCK_BYTES
from kvtransport.transfer import BlockTable, Transfer, utility_profile
from kvtransport.utility_model import SigmoidUtility

DEFAULT_SLOT_S = 0.01
# Event kinds, in the order they are handled at equal times.
_TO_RECEIVER, _TO_SENDER, _SENDER, _RECEIVER, _ARRIVAL, _SLOT = range(6)


@dataclass(frozen=True)
class Handover:
    """One user's KV-cache handover: when it starts, its deadline, its cache and its curve.

    size: cache bytes (the stream, in utility order); utility: accuracy as a function of
    the delivered fraction; weight: its weight in the allocator's objective.
    """

    id: int
    arrival: float
    deadline: float
    size: int
    utility: SigmoidUtility
    weight: float = 1.0
    context_tokens: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"handover {self.id}: size must be positive")
        if not (math.isfinite(self.deadline) and self.deadline > self.arrival >= 0.0):
            raise ValueError(f"handover {self.id}: need 0 <= arrival < deadline")


@dataclass
class HandoverOutcome:
    """What one handover got.

    fraction: bytes of the longest all-complete prefix of the stream at the deadline over
    the size (0 if the manifest never arrived); accuracy: its curve there; complete_fraction:
    bytes of every complete block (also those past a hole) over the size; admitted_slots:
    slots in which the allocator admitted it, out of ``slots`` while it was scheduled.
    """

    id: int
    arrival: float
    deadline: float
    size: int
    context_tokens: int
    weight: float
    fraction: float
    accuracy: float
    complete_fraction: float
    source_sent: int
    repair_sent: int
    sender_finish: str
    receiver_finish: str
    admitted_slots: int
    slots: int


@dataclass
class MultiResult:
    """One scenario under one slot policy (``to_dict`` for JSON)."""

    policy: str
    channel: str
    rate_mbps: float
    outcomes: list[HandoverOutcome]
    packets_sent: int
    packets_lost: int
    packets_dropped: int
    wire_bytes: int  # data datagrams on the link, with the link's per-datagram overhead
    decoded_bytes: int  # bytes of every complete block at the receivers
    payload_capacity_Bps: float  # the capacity the scheduler was fed last
    slots: int
    events: int
    cpu_s: float

    @property
    def mean_accuracy(self) -> float:
        return float(np.mean([o.accuracy for o in self.outcomes])) if self.outcomes else 0.0

    @property
    def weighted_utility(self) -> float:
        return float(sum(o.weight * o.accuracy for o in self.outcomes))

    @property
    def efficiency(self) -> float:
        """Decoded payload per byte on the link: header, loss and FEC overhead together."""
        return self.decoded_bytes / self.wire_bytes if self.wire_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_accuracy"] = self.mean_accuracy
        d["weighted_utility"] = self.weighted_utility
        d["efficiency"] = self.efficiency
        return d


@dataclass
class _Pair:
    """A handover's sessions and bookkeeping inside the loop."""

    h: Handover
    transfer: Transfer
    tid: int
    sender: SenderSession | None = None
    receiver: ReceiverSession | None = None
    member: Member | None = None
    sender_armed: float | None = None
    receiver_armed: float | None = None
    finished: bool = False
    outcome: HandoverOutcome | None = None

    @property
    def tx(self) -> SenderSession:
        """The sender, once the handover has arrived."""
        assert self.sender is not None
        return self.sender

    @property
    def rx(self) -> ReceiverSession:
        """The receiver, once the handover has arrived."""
        assert self.receiver is not None
        return self.receiver

    @property
    def mb(self) -> Member:
        """Its share of the link, once the handover has arrived."""
        assert self.member is not None
        return self.member


class MultiSimulation:
    """Handovers over one shared link, their rates set by an OnlineScheduler each slot.

    handovers: the scenario; slot_policy: how the link is shared (kvtransport.allocator:
    UtilityWaterFilling, EqualShare, ProportionalToSize, EarliestDeadlineFirst);
    channel: a netem profile (name or Profile) for both directions, rate overridden by
    rate_mbps; repair_policy: each session's FEC policy (kvtransport.policy names);
    capacity_Bps: feed the scheduler this fixed payload capacity instead of estimating
    it from the link rate and the reported loss.
    """

    def __init__(
        self,
        handovers: Sequence[Handover],
        slot_policy: SlotPolicy,
        *,
        channel: str | Profile = "clean",
        rate_mbps: float | None = None,
        delay_ms: float | None = None,
        repair_policy: str = "adaptive",
        slot_s: float = DEFAULT_SLOT_S,
        seed: int = 1,
        symbol_size: int = DEFAULT_SYMBOL_SIZE,
        key: bytes | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        capacity_Bps: float | None = None,
    ) -> None:
        if not handovers:
            raise ValueError("a scenario needs at least one handover")
        ids = [h.id for h in handovers]
        if len(set(ids)) != len(ids):
            raise ValueError("handover ids must be unique")
        make_policy(repair_policy)  # a bad name fails here, not at the first arrival
        self.profile = load_profile(channel).with_overrides(rate_mbps, delay_ms)
        self.rate_bps = self.profile.rate_mbps * 1e6
        self.delay_s = self.profile.delay_ms * 1e-3
        self.repair_policy = repair_policy
        self.symbol_size = symbol_size
        self.key = key
        self.slot_s = slot_s
        self.link = LinkShare(
            self.rate_bps,
            slot_policy,
            slot_s=slot_s,
            symbol_size=symbol_size,
            tagged=key is not None,
            one_way_s=self.delay_s,
            capacity_Bps=capacity_Bps,
        )
        ss = np.random.SeedSequence(seed)
        data_seed, fb_seed, id_seed, payload_seed = ss.spawn(4)
        self.data_channel: Channel = make_channel(self.profile, data_seed)
        self.feedback_channel: Channel = make_channel(self.profile, fb_seed)
        tids = np.random.default_rng(id_seed).integers(1, 2**63, len(handovers), dtype=np.int64)
        # One random pool: every cache is a prefix of it (contents do not matter here).
        pool = np.random.default_rng(payload_seed).integers(
            0, 256, max(h.size for h in handovers), dtype=np.uint8
        )
        self.pairs: list[_Pair] = []
        for h, tid in sorted(
            zip(handovers, tids.tolist(), strict=True), key=lambda p: p[0].arrival
        ):
            n_blocks = max(1, -(-h.size // block_bytes))
            edges = np.minimum(np.arange(n_blocks + 1, dtype=np.int64) * block_bytes, h.size)
            blocks = BlockTable(edges[:-1], np.diff(edges), utility_profile("zipf", n_blocks))
            self.pairs.append(_Pair(h, Transfer(pool[: h.size], blocks), int(tid)))
        self.policy_name = getattr(slot_policy, "name", type(slot_policy).__name__)
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._order = 0
        self._slot_at: float | None = None
        self.events = 0
        self.wire_bytes = 0
        for i, p in enumerate(self.pairs):
            self._push(p.h.arrival, _ARRIVAL, i, None)

    # ------------------------------------------------------------------ plumbing

    def _push(self, t: float, kind: int, i: int, data: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, kind, self._order, i, data))

    def _arm(self, i: int) -> None:
        """Re-read both sessions' timers of pair i; push the ones that moved."""
        p = self.pairs[i]
        ts = p.tx.next_timer()
        if ts != p.sender_armed:
            p.sender_armed = ts
            if ts is not None:
                self._push(ts, _SENDER, i, ts)
        tr = p.rx.next_timer()
        if tr != p.receiver_armed:
            p.receiver_armed = tr
            if tr is not None:
                self._push(tr, _RECEIVER, i, tr)

    def _send_data(self, i: int, t: float, datagrams: list[bytes]) -> None:
        ch = self.data_channel
        for d in datagrams:
            self.wire_bytes += len(d) + LINK_OVERHEAD_BYTES
            arrival = ch.transmit(t, len(d))
            if arrival is not None:
                self._push(arrival, _TO_RECEIVER, i, d)

    def _send_feedback(self, i: int, t: float) -> None:
        out = self.pairs[i].rx.datagrams_to_send(t)
        ch = self.feedback_channel
        for d in out:
            arrival = ch.transmit(t, len(d))
            if arrival is not None:
                self._push(arrival, _TO_SENDER, i, d)

    # ------------------------------------------------------------------ scheduling

    def _on_slot(self, now: float) -> None:
        nxt = self.link.step(now)
        for i, p in enumerate(self.pairs):
            if p.sender is not None:
                self._arm(i)
        waiting = [p.h.arrival for p in self.pairs if p.sender is None]
        if nxt is None and waiting:
            nxt = min(waiting)
        self._slot_at = nxt
        if nxt is not None:
            self._push(nxt, _SLOT, -1, nxt)

    # ------------------------------------------------------------------ handovers

    def _arrive(self, i: int, now: float) -> None:
        p = self.pairs[i]
        h = p.h
        p.sender = SenderSession(
            p.transfer,
            make_policy(self.repair_policy),
            rate_bps=self.rate_bps,
            deadline=h.deadline,
            now=now,
            transfer_id=p.tid,
            key=self.key,
            symbol_size=self.symbol_size,
            initial_rtt=2.0 * self.delay_s + 1e-3,
        )
        p.receiver = ReceiverSession(p.tid, key=self.key, now=now, deadline=h.deadline)
        p.member = Member(
            id=h.id,
            session=p.sender,
            size=h.size,
            deadline=h.deadline,
            utility=h.utility,
            weight=h.weight,
            arrival=h.arrival,
            rate_bps=self.rate_bps,
        )
        self.link.join(p.member)

    def _check_finished(self, i: int, now: float) -> None:
        p = self.pairs[i]
        r = p.rx
        if p.finished or not r.finished:
            return
        p.finished = True
        self.link.leave(p.h.id)
        res = r.result
        h = p.h
        fraction = complete = 0.0
        if res is not None and res.manifest is not None:
            b = p.transfer.blocks
            done = res.complete
            first_missing = int(np.argmin(done)) if not done.all() else done.size
            prefix = int(b.offsets[first_missing]) if first_missing < done.size else h.size
            fraction = prefix / h.size
            complete = float(b.lengths[done].sum()) / h.size
        s = p.tx
        p.outcome = HandoverOutcome(
            id=h.id,
            arrival=h.arrival,
            deadline=h.deadline,
            size=h.size,
            context_tokens=h.context_tokens,
            weight=h.weight,
            fraction=fraction,
            accuracy=float(h.utility(fraction)),
            complete_fraction=complete,
            source_sent=s.stats["source_sent"],
            repair_sent=s.repair_sent,
            sender_finish=s.finish_reason or "running",
            receiver_finish=res.reason if res is not None else "running",
            admitted_slots=p.mb.admitted_slots,
            slots=p.mb.slots,
        )

    # ------------------------------------------------------------------ the loop

    def run(self) -> MultiResult:
        """Run every handover to its deadline; returns what each got."""
        cpu0 = time.process_time()
        heap = self._heap
        pop = heapq.heappop
        pairs = self.pairs
        while heap:
            t, kind, _, i, data = pop(heap)
            self.events += 1
            if kind == _TO_RECEIVER:
                p = pairs[i]
                p.rx.receive_datagram(data, t)
                self._send_feedback(i, t)
                self._arm(i)
                self._check_finished(i, t)
            elif kind == _TO_SENDER:
                pairs[i].tx.receive_datagram(data, t)
                self._arm(i)
            elif kind == _SENDER:
                p = pairs[i]
                if p.sender_armed != data:
                    continue  # superseded
                p.sender_armed = None
                s = p.tx
                s.handle_timer(t)
                out = s.datagrams_to_send(t)
                if out:
                    self._send_data(i, t, out)
                self._arm(i)
            elif kind == _RECEIVER:
                p = pairs[i]
                if p.receiver_armed != data:
                    continue
                p.receiver_armed = None
                p.rx.handle_timer(t)
                self._send_feedback(i, t)
                self._arm(i)
                self._check_finished(i, t)
            elif kind == _ARRIVAL:
                self._arrive(i, t)
                self._on_slot(t)  # a new transfer: re-plan now
            else:  # _SLOT
                if data != self._slot_at:
                    continue
                self._on_slot(t)
        outcomes = [p.outcome for p in pairs if p.outcome is not None]
        if len(outcomes) < len(pairs):  # pragma: no cover - a loop invariant
            raise RuntimeError("a handover never finished")
        ch = self.data_channel
        decoded = sum(int(o.complete_fraction * o.size) for o in outcomes)
        return MultiResult(
            policy=self.policy_name,
            channel=self.profile.name,
            rate_mbps=self.rate_bps / 1e6,
            outcomes=outcomes,
            packets_sent=getattr(ch, "sent", 0),
            packets_lost=getattr(ch, "lost", 0),
            packets_dropped=getattr(ch, "dropped", 0),
            wire_bytes=self.wire_bytes,
            decoded_bytes=decoded,
            payload_capacity_Bps=self.link.scheduler.capacity_Bps,
            slots=self.link.steps,
            events=self.events,
            cpu_s=time.process_time() - cpu0,
        )


def simulate_handovers(
    handovers: Sequence[Handover], slot_policy: SlotPolicy, **kwargs: Any
) -> MultiResult:
    """Run one scenario under one slot policy (arguments as :class:`MultiSimulation`)."""
    return MultiSimulation(handovers, slot_policy, **kwargs).run()


__all__ = [
    "Handover",
    "HandoverOutcome",
    "MultiResult",
    "MultiSimulation",
    "payload_efficiency",
    "simulate_handovers",
]
