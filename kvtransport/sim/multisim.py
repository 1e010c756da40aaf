"""Several handovers sharing one backhaul: the daemons' hosts, one bottleneck, the allocator.

kvtransport.sim.simulator runs one transfer; here several users hand over at once from one
sending endpoint, the sender daemon's own sans-I/O host (kvtransport.hosts.sender_host.
:class:`~kvtransport.hosts.sender_host.SenderHost`: transfer-id demux, admission, the link's
:class:`~kvtransport.hosts.link_share.LinkShare` with the slot policy under test, finish events),
to one receiving endpoint per user, the receiver daemon's host (kvtransport.hosts.receiver_host.
:class:`~kvtransport.hosts.receiver_host.ReceiverHost`). This module is only their shell: the
virtual-clock loop (kvtransport.sim.virtual_clock) and the channels. Every data datagram of
every transfer goes through ONE data-path channel (kvtransport.netem: loss model, then the
link's token bucket with its FIFO queue, then delay), every feedback datagram through one
reverse-path channel.
So what the multi-user figure shows of link sharing (progress less owed repairs, owed
repairs served first, the deadline less the one-way delay, the payload capacity net of
the reported loss, pausing below one datagram per slot unless a share is the whole link)
is what the sender daemon does.

As in the daemon, a receiver's session opens at the transfer's first datagram and ends at
the manifest's deadline counted from there; a transfer leaves the link when its sender
session is done. The host is told the link's one-way delay (the profile's) instead of
estimating it from the round trips, and releases datagrams on their slots (no burst lead).

A handover's accuracy is its fitted sigmoid (kvtransport.scheduling.utility_model) at the
fraction of its cache delivered *in utility order* when its receiver finished: the bytes of the
longest prefix of the stream whose blocks are all complete at the receiver, over the size.

Event loop: the hosts are endpoints of one kvtransport.sim.virtual_clock.VirtualClockLoop (the
simulators' shared loop): at equal times deliveries go first, then the sender host's
timer, the receiver hosts' timers, and the handovers' arrivals. Everything random derives
from ``seed``.

The channel's loss, rate and delay come from a kvtransport.netem profile ("clean": 5 ms,
no loss), with the link rate overridden by the scenario.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.transfer import BlockTable, Transfer, utility_profile
from kvtransport.hosts.link_share import LinkShare, payload_efficiency
from kvtransport.hosts.receiver_host import DEFAULT_MAX_BYTES, Incoming, ReceiverHost, ResultReady
from kvtransport.hosts.sender_host import SenderHost
from kvtransport.netem import Channel, Profile, load_profile, make_channel
from kvtransport.policies.registry import make_policy
from kvtransport.scheduling.allocator import SlotPolicy
from kvtransport.scheduling.utility_model import SigmoidUtility
from kvtransport.sim.simulator import DEFAULT_BLOCK_BYTES
from kvtransport.sim.virtual_clock import VirtualClockLoop

DEFAULT_SLOT_S = 0.01
# Timer ranks on the loop (lower first at equal times); arrivals come after both.
_SENDER_RANK, _RECEIVER_RANK, _ARRIVAL_RANK = 1, 2, 3


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
class _User:
    """A handover's receiving endpoint and bookkeeping inside the loop."""

    h: Handover
    transfer: Transfer
    tid: int
    addr: tuple[str, int]
    host: ReceiverHost
    received: Incoming | None = None  # its transfer at the receiver, once finished
    outcome: HandoverOutcome | None = None


SENDER_ADDR = ("sender", 1)
"""The sending endpoint's address as the receivers see it."""


class MultiSimulation:
    """Handovers over one shared link, their rates set by the sender host's LinkShare.

    handovers: the scenario; slot_policy: how the link is shared (kvtransport.scheduling.allocator:
    UtilityWaterFilling, EqualShare, ProportionalToSize, EarliestDeadlineFirst);
    channel: a netem profile (name or Profile) for both directions, rate overridden by
    rate_mbps; repair_policy: each session's FEC policy (kvtransport.policies.registry names);
    capacity_Bps: feed the scheduler this fixed payload capacity instead of estimating
    it from the link rate and the reported loss. ``trace``: a list to which the loop
    appends every call it makes into a host and what came out (kvtransport.sim.virtual_clock:
    endpoint 0 is the sender host, endpoint i + 1 user i's receiver host; a ``call`` is a
    handover's arrival, its submit to the sender host; tests/test_hosts.py replays them
    into the daemons' engines). ``config``: the protocol's settings the sender host and
    every receiver host are built with (kvtransport.core.protocol; ``symbol_size`` None is
    its symbol size); its ``link_overhead`` is what both channels and ``wire_bytes`` count
    per datagram, as the sessions' pacing and the link's capacity do.
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
        symbol_size: int | None = None,
        key: bytes | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        capacity_Bps: float | None = None,
        trace: list[tuple[Any, ...]] | None = None,
        config: ProtocolConfig = STANDARD,
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
        self.config = config
        self.sender = SenderHost(
            rate_bps=self.rate_bps,
            key=key,
            symbol_size=symbol_size,
            burst_s=0.0,
            slot_s=slot_s,
            max_transfers=len(handovers),
            slot_policy=slot_policy,
            one_way_s=self.delay_s,
            capacity_Bps=capacity_Bps,
            config=config,
        )
        ss = np.random.SeedSequence(seed)
        data_seed, fb_seed, id_seed, payload_seed = ss.spawn(4)
        overhead = config.link_overhead
        self.data_channel: Channel = make_channel(self.profile, data_seed, overhead_bytes=overhead)
        self.feedback_channel: Channel = make_channel(
            self.profile, fb_seed, overhead_bytes=overhead
        )
        tids = np.random.default_rng(id_seed).integers(1, 2**63, len(handovers), dtype=np.int64)
        # One random pool: every cache is a prefix of it (contents do not matter here).
        pool = np.random.default_rng(payload_seed).integers(
            0, 256, max(h.size for h in handovers), dtype=np.uint8
        )
        max_bytes = max(DEFAULT_MAX_BYTES, max(h.size for h in handovers))
        self.users: list[_User] = []
        for h, tid in sorted(
            zip(handovers, tids.tolist(), strict=True), key=lambda p: p[0].arrival
        ):
            n_blocks = max(1, -(-h.size // block_bytes))
            edges = np.minimum(np.arange(n_blocks + 1, dtype=np.int64) * block_bytes, h.size)
            blocks = BlockTable(edges[:-1], np.diff(edges), utility_profile("zipf", n_blocks))
            addr = (f"user-{h.id}", 1)
            host = ReceiverHost(key=key, max_transfers=1, max_bytes=max_bytes, config=config)
            self.users.append(_User(h, Transfer(pool[: h.size], blocks), int(tid), addr, host))
        self.policy_name = getattr(slot_policy, "name", type(slot_policy).__name__)
        self.loop = VirtualClockLoop(trace)
        self._sender_i = self.loop.add(
            self.sender,
            SENDER_ADDR,
            rank=_SENDER_RANK,
            channel=self.data_channel,
            after=self._sender_events,
        )
        for u in self.users:
            self.loop.add(
                u.host,
                u.addr,
                rank=_RECEIVER_RANK,
                channel=self.feedback_channel,
                after=partial(self._receiver_events, u),
            )
        for i, u in enumerate(self.users):
            self.loop.call_at(
                u.h.arrival,
                partial(self._arrive, i),
                touches=self._sender_i,
                rank=_ARRIVAL_RANK,
            )

    @property
    def link(self) -> LinkShare:
        """The sender host's shared link."""
        return self.sender.link

    @property
    def events(self) -> int:
        """Heap entries handled (superseded timer entries included)."""
        return self.loop.events + self.loop.stale

    @property
    def wire_bytes(self) -> int:
        """Data datagrams on the link, with the link's per-datagram overhead (the config's)."""
        n, nbytes = self.loop.sent(self._sender_i)
        return nbytes + n * self.config.link_overhead

    # ------------------------------------------------------------------ events

    def _sender_events(self, t: float) -> None:
        while self.sender.next_event() is not None:
            pass  # a finished transfer: its outcome is its receiver's

    def _receiver_events(self, u: _User, t: float) -> None:
        while (ev := u.host.next_event()) is not None:
            if isinstance(ev, ResultReady):
                self._outcome(u)

    # ------------------------------------------------------------------ handovers

    def _arrive(self, i: int, now: float) -> None:
        u = self.users[i]
        h = u.h
        self.sender.submit(
            u.transfer,
            u.addr,
            now=now,
            deadline_s=h.deadline - now,
            policy=self.repair_policy,
            transfer_id=u.tid,
            weight=h.weight,
            utility=h.utility,
            initial_rtt=2.0 * self.delay_s + 1e-3,
        )

    def _outcome(self, u: _User) -> None:
        """What handover ``u`` got: its receiver's result (just finished), or nothing
        when not one of its datagrams reached the receiver (e.g. paused throughout)."""
        inc = u.host.get(u.tid)
        u.received = inc
        res = inc.session.result if inc is not None else None
        h = u.h
        fraction = complete = 0.0
        if res is not None and res.manifest is not None:
            b = u.transfer.blocks
            done = res.complete
            first_missing = int(np.argmin(done)) if not done.all() else done.size
            prefix = int(b.offsets[first_missing]) if first_missing < done.size else h.size
            fraction = prefix / h.size
            complete = float(b.lengths[done].sum()) / h.size
        out = self.sender.get(u.tid)
        assert out is not None  # submitted before any datagram reached the receiver
        s = out.session
        u.outcome = HandoverOutcome(
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
            receiver_finish=res.reason if res is not None else "nothing arrived",
            admitted_slots=out.link.admitted_slots,
            slots=out.link.slots,
        )

    # ------------------------------------------------------------------ the loop

    def run(self) -> MultiResult:
        """Run every handover to its deadline; returns what each got."""
        cpu0 = time.process_time()
        self.loop.run()
        users = self.users
        for u in users:
            if u.outcome is None and u.host.get(u.tid) is None and u.tid not in u.host.recent:
                self._outcome(u)  # its receiver never heard of it
        outcomes = [u.outcome for u in users if u.outcome is not None]
        if len(outcomes) < len(users):  # pragma: no cover - a loop invariant
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
