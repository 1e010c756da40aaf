"""Discrete-event simulator: the real sessions over userspace channels, on a virtual clock.

Nothing here models the protocol: :class:`Simulation` runs the daemons' own sans-I/O hosts,
a :class:`~kvtransport.hosts.sender_host.SenderHost` with the one transfer alone on its
link (so it paces at the link rate, below it while the host's queue guard caps it) and a
:class:`~kvtransport.hosts.receiver_host.ReceiverHost`, and moves their datagrams through a
data-path channel and a feedback-path channel (kvtransport.netem: loss, rate limit with
queue, delay, jitter), firing their timers at the virtual times they ask for. Simulation
results are results of the real code.

The two hosts are endpoints of a kvtransport.sim.virtual_clock.VirtualClockLoop, the event
loop every virtual-clock shell shares: ties go to deliveries first, then the sender's
timer, then the receiver's. The sender releases datagrams on their slots (no burst lead).
Both hosts share the virtual clock, so the receiver's session is opened at the start with
the exact deadline (``ReceiverHost.expect``) and ``utility_recovered`` is what it had
decoded *at* the deadline. ``prior_loss`` reaches the sender as the sender daemon's memory
of the receiver's path does (``SenderHost.submit``).

Step mode for the Gymnasium environment: build the episode with :func:`make_simulation`
and ``policy=ExternalPolicy()``; the sender then pauses at each decision,
:meth:`Simulation.run_until_decision` returns there (observation in ``sim.sender.obs``),
:meth:`Simulation.apply_action` resumes, and ``sim.utility`` is the reward's running sum (it
stops growing at the deadline). :meth:`Simulation.result` summarizes the episode.

Determinism: everything random is drawn from the seed (channels, synthetic payload, transfer
id); the same arguments give the same result, bit for bit.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvtransport.core.policy_base import Policy
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import Transfer, synthetic_transfer
from kvtransport.core.wire import full_send_time, link_bytes
from kvtransport.hosts.receiver_host import DEFAULT_MAX_BYTES, Incoming, ReceiverHost
from kvtransport.hosts.sender_host import alone_on_link
from kvtransport.netem import Channel, Profile, load_profile, make_channel
from kvtransport.sim.oracle import make_sim_policy
from kvtransport.sim.virtual_clock import Channel as LinkDirection
from kvtransport.sim.virtual_clock import VirtualClockLoop

DEFAULT_SIZE_BYTES = 10_000_000
DEFAULT_BLOCK_BYTES = 12_288
"""One SmolLM2 block (one layer, 16 tokens, K and V, fp16, 3 kv heads x 64) is 12 KiB."""
SENDER_ADDR = "sender"
RECEIVER_ADDR = "receiver"
"""The two hosts' addresses on the simulation's loop."""


@dataclass
class SimResult:
    """What one simulated transfer achieved (``to_dict`` for JSON)."""

    policy: str
    channel: str
    rate_mbps: float
    rho: float
    seed: int
    size_bytes: int
    n_source: int
    decoder_window: int  # the ESIs the sender's encoder and the receiver's decoder held
    deadline_s: float
    utility_recovered: float
    utility_bound: float  # genie: every surviving slot carried a new useful symbol
    source_sent: int
    repair_sent: int
    retransmit_sent: int  # of repair_sent: sources sent again (ARQ; RLC below its floor)
    manifest_sent: int
    packets_sent: int
    packets_lost: int
    feedback_sent: int
    feedback_lost: int
    blocks_total: int
    blocks_missing: int
    symbols_recovered: int
    manifest_at: float | None
    complete_at: float | None
    sender_finish: str
    receiver_finish: str
    events: int
    cpu_s: float
    timeseries: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self, timeseries: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not timeseries:
            d.pop("timeseries")
        return d


class Simulation:
    """One transfer between a real sender and a real receiver over two channels.

    ``trace``: a list that receives the loop's record of every call and datagram
    (kvtransport.sim.virtual_clock; the sender host is endpoint 0, the receiver host
    endpoint 1). ``sender`` / ``receiver``: the transfer's sessions in the two hosts
    (``sender_host`` / ``receiver_host``); ``transfer``: what is sent (the sender host
    releases its session's payload when the session is done).

    ``config``: the protocol's settings both hosts are built with (kvtransport.core.protocol;
    also the symbol size and initial RTT when not given). A channel that counts a link
    overhead per datagram (``overhead_bytes``, as kvtransport.netem's) must count the
    config's ``link_overhead``, which the sender paces with: ValueError otherwise.

    ``whole_groups``: how the transfer's utility is scored. None: every complete block
    counts on its own (the receiver's own ``utility``). Otherwise a group id per block
    (a handoff stream's token range): a block's utility counts only once every block of
    its group is complete (:func:`whole_group_utility`), as the handoff receiver loads a
    token range only when every layer's block of it arrived and recomputes a partial one
    (kvtransport.model.race). ``utility``, ``utility_recovered``, the result and the genie
    bound all score this way. ``queue_guard``: the sender host's (SenderHost).
    """

    def __init__(
        self,
        transfer: Transfer,
        policy: Policy,
        data_channel: Channel,
        feedback_channel: LinkDirection,
        *,
        rate_bps: float,
        deadline: float,
        transfer_id: int = 1,
        key: bytes | None = None,
        symbol_size: int | None = None,
        initial_rtt: float | None = None,
        record: bool = True,
        prior_loss: float | None = None,
        trace: list[tuple[Any, ...]] | None = None,
        config: ProtocolConfig = STANDARD,
        whole_groups: np.ndarray | None = None,
        queue_guard: bool = True,
    ) -> None:
        for name, ch in (("data", data_channel), ("feedback", feedback_channel)):
            counted = getattr(ch, "overhead_bytes", config.link_overhead)
            if counted != config.link_overhead:
                raise ValueError(
                    f"the {name} channel counts {counted} bytes of link overhead per "
                    f"datagram, the config's link_overhead is {config.link_overhead}"
                )
        self.config = config
        if whole_groups is not None:
            whole_groups = np.asarray(whole_groups, dtype=np.int64)
            if whole_groups.shape != (len(transfer.blocks),) or (whole_groups < 0).any():
                raise ValueError("whole_groups must give every block a group id >= 0")
        self.whole_groups = whole_groups
        self.data_channel = data_channel
        self.feedback_channel = feedback_channel
        self.deadline = deadline
        self.transfer = transfer
        self.transfer_id = transfer_id
        self.key = key
        if hasattr(policy, "bind_channel"):
            policy.bind_channel(data_channel)
        self.sender_host, outgoing = alone_on_link(
            transfer,
            RECEIVER_ADDR,
            rate_bps=rate_bps,
            deadline_s=deadline,
            policy=policy,
            transfer_id=transfer_id,
            key=key,
            symbol_size=config.symbol_size if symbol_size is None else symbol_size,
            initial_rtt=config.initial_rtt if initial_rtt is None else initial_rtt,
            prior_loss=prior_loss,
            config=config,
            queue_guard=queue_guard,
        )
        self.sender: SenderSession = outgoing.session
        if hasattr(policy, "bind_sender"):
            policy.bind_sender(self.sender)
        self.receiver_host = self._receiver_host()
        self._incoming: Incoming | None = self.receiver_host.expect(
            transfer_id, SENDER_ADDR, 0.0, deadline
        )
        self._restarted = False
        self.record = record
        self.meta: dict[str, Any] = {}
        self._decisions_seen = 0
        self.series: dict[str, list[float]] = {
            k: []
            for k in (
                "t",
                "utility",
                "source_sent",
                "repair_sent",
                "share",
                "admit",
                "loss",
                "owed",
            )
        }
        # the two hosts on the virtual-clock loop: the sender's timer goes first on a
        # tie, data through the data channel, feedback through the feedback channel
        self.loop = VirtualClockLoop(trace)
        self._tx_i = self.loop.add(
            self.sender_host, SENDER_ADDR, rank=1, channel=data_channel, after=self._after_sender
        )
        self._rx_i = self.loop.add(
            self.receiver_host,
            RECEIVER_ADDR,
            rank=2,
            channel=feedback_channel,
            after=self._after_receiver,
        )

    def _receiver_host(self) -> ReceiverHost:
        return ReceiverHost(
            key=self.key,
            max_bytes=max(self.transfer.nbytes, DEFAULT_MAX_BYTES),
            config=self.config,
        )

    @property
    def receiver(self) -> ReceiverSession:
        """The receiving session (after :meth:`restart_receiver`, the new host's once the
        next datagram opened it; the old one's until then)."""
        assert self._incoming is not None  # the first host's is opened at the start
        return self._incoming.session

    def restart_receiver(self) -> None:
        """The receiving endpoint restarts now: a fresh host with no state takes its
        place (as a restarted receiver daemon: the transfer's session opens at its next
        datagram, with the manifest's deadline counted from there)."""
        self.receiver_host = self._receiver_host()
        self._restarted = True
        self.loop.replace(self._rx_i, self.receiver_host)

    def _after_receiver(self, t: float) -> None:
        if self._restarted:
            inc = self.receiver_host.get(self.transfer_id)
            if inc is not None:
                self._incoming, self._restarted = inc, False

    @property
    def now(self) -> float:
        """The virtual clock: the time of the last event handled."""
        return self.loop.now

    @property
    def events(self) -> int:
        return self.loop.events

    @property
    def feedback_sent(self) -> int:
        """Feedback datagrams the receiver sent (lost ones included)."""
        return self.loop.sent(self._rx_i)[0]

    # ---------------------------------------------------------------- event loop

    def _after_sender(self, t: float) -> None:
        if self.record and self.sender.stats["decisions"] != self._decisions_seen:
            self._decisions_seen = self.sender.stats["decisions"]
            self._sample(t)

    def _sample(self, t: float) -> None:
        s = self.sender
        o = self.series
        o["t"].append(t)
        o["utility"].append(self.utility)
        o["source_sent"].append(s.source_sent)
        o["repair_sent"].append(s.repair_sent)
        o["share"].append(s.share)
        o["admit"].append(1.0 if s.admit else 0.0)
        o["loss"].append(s.loss_estimate())
        o["owed"].append(s.owed())

    def _over(self) -> bool:
        s = self.sender
        if s.awaiting_action:
            return True
        return self.receiver.finished and (s.done or not self.loop.in_flight)

    def run_until_decision(self, until: float = math.inf) -> bool:
        """Advance until the sender awaits an action (True) or the transfer is over (False)."""
        self.loop.run(until, self._over)
        return self.sender.awaiting_action

    def apply_action(self, action: int) -> None:
        self.sender.apply_action(action)
        self.loop.touch(self._tx_i)
        if self.record:
            self._sample(self.now)

    def run(self) -> None:
        """Run to the end (the policy must not defer)."""
        if self.run_until_decision():
            raise RuntimeError("the policy deferred its decision; use run_until_decision")

    def result(self, cpu_s: float = 0.0) -> SimResult:
        """What the transfer achieved (call once it is over)."""
        s, r = self.sender, self.receiver
        res = r.result
        meta = self.meta
        transfer = self.transfer
        n_blocks = len(transfer.blocks)
        data_ch, fb_ch = self.data_channel, self.feedback_channel
        return SimResult(
            policy=s.policy.name,
            channel=meta.get("channel", "custom"),
            rate_mbps=meta.get("rate_mbps", s.rate_bps / 1e6),
            rho=meta.get("rho", math.nan),
            seed=meta.get("seed", -1),
            size_bytes=transfer.nbytes,
            n_source=s.n_source,
            decoder_window=s.decoder_window,
            deadline_s=self.deadline,
            utility_recovered=self.utility_recovered,
            utility_bound=meta.get("utility_bound", math.nan),
            source_sent=s.stats["source_sent"],
            repair_sent=s.repair_sent,
            retransmit_sent=s.stats["retransmit_sent"],
            manifest_sent=s.stats["manifest_sent"],
            packets_sent=getattr(data_ch, "sent", 0),
            packets_lost=getattr(data_ch, "lost", 0) + getattr(data_ch, "dropped", 0),
            feedback_sent=self.feedback_sent,
            feedback_lost=getattr(fb_ch, "lost", 0) + getattr(fb_ch, "dropped", 0),
            blocks_total=n_blocks,
            blocks_missing=int(res.missing.size) if res and res.manifest else n_blocks,
            symbols_recovered=r.symbols_recovered,
            manifest_at=r.timings.get("manifest"),
            complete_at=r.timings.get("complete"),
            sender_finish=s.finish_reason,
            receiver_finish=res.reason if res is not None else "running",
            events=self.events,
            cpu_s=cpu_s,
            timeseries=self.series if self.record else {},
        )

    @property
    def utility(self) -> float:
        """Utility the receiver has decoded so far (frozen at the deadline), scored as
        ``whole_groups`` says: the reward's running sum."""
        if self.whole_groups is None:
            return self.receiver.utility
        return self.utility_recovered

    @property
    def utility_recovered(self) -> float:
        """The transfer's score: its receiver's result once finished (what was decoded at
        the deadline, at most 1), the utility decoded so far before; scored as
        ``whole_groups`` says."""
        r = self.receiver
        res = r.result
        if self.whole_groups is None:
            return res.utility_recovered if res is not None else r.utility
        src = res if res is not None else r
        if src.manifest is None:  # no manifest: nothing is complete
            return 0.0
        return whole_group_utility(self.transfer.blocks.utilities, src.complete, self.whole_groups)


def whole_group_utility(utilities: np.ndarray, complete: np.ndarray, groups: np.ndarray) -> float:
    """Utility (at most 1) of the ``complete`` blocks whose group (``groups``: an id per
    block) is complete in every block; a block of a partial group counts nothing."""
    partial = np.bincount(groups, weights=~complete, minlength=int(groups.max(initial=-1)) + 1)
    whole = complete & (partial[groups] == 0)
    return float(min(utilities[whole].sum(), 1.0))


def genie_bound(
    transfer: Transfer,
    data_channel: Channel,
    rate_bps: float,
    deadline: float,
    delay_s: float,
    symbol_size: int,
    key: bytes | None = None,
    link_overhead: int = STANDARD.link_overhead,
    whole_groups: np.ndarray | None = None,
) -> float:
    """Utility no scheme pacing at the link rate can beat on this channel's future.

    Every datagram that leaves in time (by deadline - delay) and survives carries at most
    one symbol's worth of new information; the manifest needs its own symbols first, and
    the best case delivers the source symbols in stream order. So at most the first
    ``surviving - manifest symbols`` source symbols arrive, and only blocks entirely
    inside them count (with ``whole_groups``, as :class:`Simulation` scores, only blocks
    of groups entirely inside them). Datagrams take ``link_overhead`` bytes on the link
    besides themselves (kvtransport.core.wire.link_bytes). Call before the channel is used.
    """
    from kvtransport.core.manifest_fec import manifest_symbols
    from kvtransport.core.transfer import TransportManifest

    slot = link_bytes(symbol_size, key is not None, link_overhead=link_overhead) * 8 / rate_bps
    n_slots = max(0, int((deadline - delay_s) / slot) + 1)
    surviving = n_slots - int(data_channel.lookahead_losses(n_slots).sum()) if n_slots else 0
    m = manifest_symbols(
        TransportManifest(
            symbol_size, transfer.nbytes, transfer.blocks, transfer.app_metadata
        ).to_bytes(),
        symbol_size,
    )
    k = max(0, surviving - m)
    b = transfer.blocks
    inside = (b.offsets + b.lengths) <= np.uint64(k * symbol_size)
    if whole_groups is not None:
        return whole_group_utility(b.utilities, inside, np.asarray(whole_groups, np.int64))
    return float(min(b.utilities[inside].sum(), 1.0))


def make_simulation(
    transfer: Transfer | None = None,
    *,
    channel: str | Profile = "ge-heavy",
    feedback_channel: str | Profile | LinkDirection | None = None,
    rate_mbps: float | None = None,
    delay_ms: float | None = None,
    rho: float = 0.8,
    policy: str | Policy = "adaptive",
    seed: int = 1,
    size_bytes: int = DEFAULT_SIZE_BYTES,
    n_blocks: int | None = None,
    utility_profile: str = "zipf",
    symbol_size: int | None = None,
    key: bytes | None = None,
    record: bool = True,
    prior_loss: float | None = None,
    config: ProtocolConfig = STANDARD,
    trace: list[tuple[Any, ...]] | None = None,
    whole_groups: np.ndarray | None = None,
    queue_guard: bool = True,
) -> Simulation:
    """Set up one transfer (see ``kvtransport simulate --help`` for the arguments).

    The feedback path defaults to the same profile as the data path (independent draws);
    a channel (anything with kvtransport.sim.virtual_clock.Channel's ``transmit``) is
    used as it is.
    ``transfer`` defaults to a synthetic stream of ``size_bytes`` in ``n_blocks`` blocks
    (default: 12 KiB each) with the given utility profile. Every random choice (channels,
    payload, transfer id) derives from ``seed``. ``prior_loss``: the sender's loss prior
    before any feedback (``SenderSession.set_prior_loss``; None: none, as a daemon's first
    transfer to a receiver). ``config``: the protocol's settings (kvtransport.core.protocol;
    ``symbol_size`` None is its symbol size); its ``link_overhead`` is what the channels
    count per datagram, the sender paces with and rho's unit (``full_send_time``) and the
    genie bound assume. ``trace`` and ``whole_groups`` (how utility is scored): as
    :class:`Simulation`'s. ``queue_guard``: the sender host paces below the link rate while
    the path's queue builds (kvtransport.hosts.queue_guard; False: as without it). The
    Gymnasium environment builds its episodes here and steps them with ``run_until_decision`` /
    ``apply_action``.
    """
    if not rho > 0:
        raise ValueError("rho must be positive")
    if symbol_size is None:
        symbol_size = config.symbol_size
    overhead = config.link_overhead
    prof = load_profile(channel).with_overrides(rate_mbps, delay_ms)
    rate_bps = prof.rate_mbps * 1e6
    ss = np.random.SeedSequence(seed)
    data_seed, fb_seed, tid_seed, payload_seed = ss.spawn(4)
    if transfer is None:
        blocks = n_blocks or max(1, size_bytes // DEFAULT_BLOCK_BYTES)
        transfer = synthetic_transfer(
            size_bytes, blocks, utility_profile, seed=int(payload_seed.generate_state(1)[0])
        )
    pol = make_sim_policy(policy) if isinstance(policy, str) else policy
    data_ch = make_channel(prof, data_seed, overhead_bytes=overhead)
    if feedback_channel is None or isinstance(feedback_channel, (str, Profile)):
        fb_prof = prof if feedback_channel is None else load_profile(feedback_channel)
        fb_ch: LinkDirection = make_channel(
            fb_prof.with_overrides(rate_mbps, delay_ms), fb_seed, overhead_bytes=overhead
        )
    else:
        fb_ch = feedback_channel
    deadline = rho * full_send_time(
        transfer.nbytes, rate_bps, symbol_size, key is not None, link_overhead=overhead
    )
    tid = int(tid_seed.generate_state(2, np.uint64)[0])
    bound = genie_bound(
        transfer, data_ch, rate_bps, deadline, prof.delay_ms * 1e-3, symbol_size, key, overhead,
        whole_groups,
    )  # fmt: skip
    sim = Simulation(
        transfer,
        pol,
        data_ch,
        fb_ch,
        rate_bps=rate_bps,
        deadline=deadline,
        transfer_id=tid,
        key=key,
        symbol_size=symbol_size,
        initial_rtt=2e-3 * prof.delay_ms + 1e-3,
        record=record,
        prior_loss=prior_loss,
        trace=trace,
        config=config,
        whole_groups=whole_groups,
        queue_guard=queue_guard,
    )
    sim.meta = {
        "channel": prof.name,
        "rate_mbps": prof.rate_mbps,
        "rho": rho,
        "seed": seed,
        "utility_bound": bound,
    }
    return sim


def simulate(transfer: Transfer | None = None, **kwargs: Any) -> SimResult:
    """Run one transfer to its end; arguments as :func:`make_simulation`."""
    sim = make_simulation(transfer, **kwargs)
    cpu0 = time.process_time()
    sim.run()
    return sim.result(time.process_time() - cpu0)
