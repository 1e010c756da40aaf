"""Repair policies: one small interface, observation -> discrete action.

The sender asks its policy once per **decision interval** of ``DECISION_PACKETS`` (32)
data-path slots (manifest, source and repair datagrams alike; at 100 Mbit/s and 1280-byte
symbols that is about 3.5 ms, close to the receiver's feedback period), and once more
right after a shared link raises the sender's rate (kvtransport.core.sender's
``RATE_REDECIDE``). Counting slots rather than milliseconds keeps the meaning of "repair
share" independent of the link rate, so one learned policy serves every rate.

**Observation**: a float32 vector of ``OBS_SIZE`` named fields (``OBS_FIELDS``, indices in
:class:`Obs`), built in place from the sender's own counters and the latest feedback by a
numba kernel (kvtransport.core.observation); every field is scaled to a small range (mostly
0..1, counts in units of one interval and clipped). The Gymnasium environment of the DDQN
sees exactly this vector. The sender calls ``policy.decide(raw, obs)``, which fills the
observation and calls ``act``; a compiled policy does both in one kernel.

**Action**: an index into the policy's ``actions`` table, rows ``(repair_share, admit)``:
the share of the next interval's slots that carry proactive repair symbols, and whether new
source symbols may still be admitted (``admit = 0``: the interval is repair, or a source
only when nothing is left to repair). The shared table :data:`ACTIONS` is what adaptive,
oracle and DDQN choose from; the fixed-rate baselines carry a one-row table with their
exact ratio. A ``reactive`` policy also lets the session answer every hole that feedback
reports with a repair as soon as it can, before the share is spent (as ARQ would, but any
repair of a segment fixes any of its holes); the learned policy then decides what feedback
cannot: how much to protect what is still in flight, and when to stop admitting.

**Scheme** (``Policy.scheme``, a name in kvtransport.core.schemes) says what a repair *is* for
this policy and how it is built: a sliding-window RLC symbol (``rlc``), nothing
(``none``), a Reed-Solomon parity of fixed blocks (``block-rs``: ``block_k`` sources then
``block_p`` parities, regardless of the action), or a retransmission of a source the
receiver NACKed (``arq``: retransmissions first, then new sources).

Whatever the policy says, the session never admits a source symbol that cannot be useful:
while ``tail_rule`` is on, the next source is admitted only if the expected surviving slots
before the deadline cover the repairs still owed plus the rest of that source's block (see
kvtransport.core.sender). The clairvoyant oracle turns the rule off and plans admission itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvtransport.core.observation import (  # noqa: F401 (the observation's names, re-exported)
    BURST_UNIT,
    OBS_CLIP,
    OBS_FIELDS,
    OBS_SIZE,
    Obs,
    observe_into,
)
from kvtransport.core.policy_base import (  # noqa: F401 (the interface, re-exported)
    ACTIONS,
    DECISION_PACKETS,
    DEFER,
    REPAIR_SHARES,
    Policy,
    PolicyContext,
)
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.sender import SenderSession
    from kvtransport.netem import Channel

N_ACTIONS = len(ACTIONS)
REPAIR_ONLY = N_ACTIONS - 1


class NoFEC(Policy):
    """Sources only, in utility order: whatever is lost stays lost."""

    name = "none"
    scheme = "none"
    actions = np.array([(0.0, 1.0)], dtype=np.float32)

    def act(self, obs: np.ndarray) -> int:
        return 0


class FixedRLC(Policy):
    """Streaming RLC at a fixed rate: R repair symbols per N source symbols, spread evenly
    (repair share R / (R + N)), each over the window the receiver still misses."""

    scheme = "rlc"

    def __init__(self, r: int, n: int) -> None:
        self.r, self.n = _check_rate(r, n, "fixed")
        self.name = f"fixed:{r}/{n}"
        self.actions = np.array([(r / (r + n), 1.0)], dtype=np.float32)

    def act(self, obs: np.ndarray) -> int:
        return 0


class BlockRS(Policy):
    """Block Reed-Solomon: after every N source symbols, R parity symbols of that block
    (reedsolo-compatible RS over GF(2^8); N + R <= 255). Blind to feedback."""

    scheme = "block-rs"
    actions = np.array([(0.0, 1.0)], dtype=np.float32)

    def __init__(self, r: int, n: int) -> None:
        self.r, self.n = _check_rate(r, n, "block-rs")
        if r + n > 255:
            raise UserError(f"block-rs:{r}/{n}: R + N must be at most 255 (RS over GF(256))")
        self.name = f"block-rs:{r}/{n}"
        self.block_k, self.block_p = n, r

    def act(self, obs: np.ndarray) -> int:
        return 0


class ARQ(Policy):
    """Retransmit what the receiver NACKs (at most once per RTT each), before new sources."""

    name = "arq"
    scheme = "arq"
    actions = np.array([(0.0, 1.0)], dtype=np.float32)

    def act(self, obs: np.ndarray) -> int:
        return 0


class ConstantAction(Policy):
    """One action throughout, with reactive hole repair. Action 0 (``tail-rule``): no
    proactive repair and keep admitting, the session's tail rule and reactive repair doing
    the rest; a learned policy that does not beat it is a constant."""

    reactive = True

    def __init__(self, action: int = 0) -> None:
        self.action = action
        self.name = "tail-rule" if action == 0 else f"constant:{action}"

    def act(self, obs: np.ndarray) -> int:
        return self.action


class Adaptive(Policy):
    """Heuristic RLC scheduler on the feedback's loss and burst estimates.

    Holes that feedback reports are answered first, one RLC repair each over exactly the
    span holding them (``reactive``: as efficient as ARQ, but any repair fixes any hole).
    On top, the action's proactive share covers losses feedback cannot report in time:
    ``p`` times a burst margin when feedback is missing or stale, nothing otherwise. New
    sources are admitted while the expected surviving slots left cover what is owed, this
    interval's sources, and ``z`` standard deviations of the losses over the horizon the
    sender can no longer react to (one RTT plus an interval; inflated for bursts). A
    shortfall at the end leaves a whole coupled window undecodable, hence the margin.
    Where that room holds part of an interval's sources, the interval takes the least
    repair share that keeps its sources within the room (at least half of them; below
    that it is repair only): stopping a whole interval early left up to one interval of
    slots to repairs nothing needed.
    """

    name = "adaptive"
    scheme = "rlc"
    reactive = True

    def __init__(self, prior_loss: float = 0.1, z: float = 2.0) -> None:
        self.prior_loss = prior_loss
        self.z = z
        self._shares = ACTIONS[:REPAIR_ONLY, 0].astype(np.float64)

    def act(self, obs: np.ndarray) -> int:
        ctx = self.ctx
        n = float(ctx.decision_packets)
        stale = obs[Obs.FEEDBACK_AGE] >= 4.0
        # before feedback: the session's prior (the observed loss rate then) if the shell
        # gave one, else this policy's own
        blind_start = obs[Obs.FEEDBACK_AGE] >= OBS_CLIP and not obs[Obs.PRIOR_KNOWN]
        p = self.prior_loss if blind_start else float(obs[Obs.LOSS_RATE])
        p = min(max(p, float(obs[Obs.LOSS_RECENT]) * 0.5, 0.002), 0.9)
        burst = max(1.0, float(obs[Obs.BURST_MEAN]) * BURST_UNIT)
        owed = float(obs[Obs.OWED]) * n
        slots_left = float(obs[Obs.TIME_LEFT]) * ctx.budget_s / ctx.slot_s
        blind = min(slots_left, float(obs[Obs.RTT]) * n + n)
        if stale:
            blind = slots_left
        sigma = math.sqrt(max(blind, 1.0) * p * (1.0 - p) * (2.0 * burst - 1.0))
        room = slots_left * (1.0 - p) - owed - self.z * sigma
        # index of the least repair share this interval needs (row 0: none); after a
        # decision off the 32-slot grid (a rate rise) the interval is shorter than n, and
        # counting a whole one errs toward repair
        least = 0
        if obs[Obs.SOURCE_LEFT] > 0 and room < n:
            share = 1.0 - room / n  # that keeps this interval's sources within the room
            if share > self._shares[-1]:
                return REPAIR_ONLY
            least = int(np.searchsorted(self._shares, share - 1e-9))
        if not stale:
            return least
        want = p * (1.0 + 0.15 * (burst - 1.0))
        i = int(np.searchsorted(self._shares, min(want, self._shares[-1]) - 1e-9))
        return max(min(i, REPAIR_ONLY - 1), least)


class Oracle(Policy):
    """Clairvoyant reference for evaluation: sees the data channel's future losses.

    The simulator binds the data channel and the sender (``bind_channel``,
    ``bind_sender``). The oracle reads the loss fate of every slot left before the stop
    time and of the datagrams in flight, so it knows exactly how many symbols the receiver
    will miss among what was sent and how many future slots will survive. Reported holes
    are repaired reactively as in :class:`Adaptive`; it admits sources while the surviving
    slots left cover what is truly owed plus this interval's sources (no safety margin),
    and in the last RTT (when feedback can no longer help) sets the proactive share to
    the losses the next interval will suffer. Not deployable: it reads the channel's
    random future.

    ``margin`` (decision intervals of surviving slots kept beyond what is owed before
    admission stops), ``tail_rule`` (the session's own admission rule on top) and
    ``proactive`` (cover the next interval's exact losses at every decision, not only in
    the last RTT: on long links feedback comes too late for most holes) move where the
    repairs go; the clairvoyant planner (kvtransport.sim.repair_planner) searches over them. The
    defaults are the plain oracle. Unlike :class:`Adaptive` it still stops admitting a
    whole interval at a time (the planner also counts every causal policy's own result, so
    it never falls below them).
    """

    name = "oracle"
    scheme = "rlc"
    reactive = True
    tail_rule = False

    def __init__(
        self, margin: float = 0.0, tail_rule: bool = False, proactive: bool = False
    ) -> None:
        self.margin = float(margin)
        self.tail_rule = tail_rule
        self.proactive = proactive
        self.channel: Channel | None = None
        self.sender: SenderSession | None = None
        self._shares = ACTIONS[:REPAIR_ONLY, 0].astype(np.float64)
        self._fates = np.zeros(0, dtype=np.bool_)

    def bind_channel(self, channel: Channel) -> None:
        self.channel = channel

    def bind_sender(self, sender: SenderSession) -> None:
        self.sender = sender

    def act(self, obs: np.ndarray) -> int:
        if self.channel is None or self.sender is None:
            raise RuntimeError("the oracle needs the data channel and the sender (bind_*)")
        s, ch = self.sender, self.channel
        n = self.ctx.decision_packets
        slots_left = max(int(float(obs[Obs.TIME_LEFT]) * self.ctx.budget_s / self.ctx.slot_s), 0)
        future = ch.lookahead_losses(max(slots_left, n))
        start = ch.sent  # channel index of the next datagram
        if self._fates.shape[0] < start + future.shape[0]:
            grown = np.zeros(start + future.shape[0], dtype=np.bool_)
            grown[: self._fates.shape[0]] = self._fates
            self._fates = grown
        self._fates[start : start + future.shape[0]] = future
        # datagrams in flight: after the last one feedback reported, up to now
        lost_src, got_pro = 0, 0
        log = s._log
        first = max(s._fb_echo + 1, s.seq - 4096, 0)
        for seq in range(first, s.seq):
            if seq >= self._fates.shape[0]:
                break
            _, src, rep, rea = log.lookup(seq)
            _, src0, rep0, rea0 = log.lookup(seq - 1) if seq > 0 else (0.0, 0, 0, 0)
            if src > src0:
                lost_src += int(self._fates[seq])
            elif rep - rea > rep0 - rea0 and not self._fates[seq]:
                got_pro += 1
        owed = max(0, s.reactive_needed() + lost_src - got_pro)
        surviving_left = slots_left - int(future[:slots_left].sum())
        if obs[Obs.SOURCE_LEFT] > 0 and surviving_left - owed < n * (1.0 + self.margin):
            return REPAIR_ONLY
        if not self.proactive and slots_left > float(obs[Obs.RTT]) * n + 2 * n:
            return 0
        want = float(future[:n].sum()) / n
        i = int(np.searchsorted(self._shares, min(want, self._shares[-1]) - 1e-9))
        return min(i, REPAIR_ONLY - 1)


class ExternalPolicy(Policy):
    """The action comes from outside (the Gymnasium environment): ``act`` defers, the
    sender pauses with the observation ready, and the shell calls ``apply_action``."""

    name = "external"
    reactive = True

    def __init__(self, scheme: str = "rlc") -> None:
        self.scheme = scheme

    def act(self, obs: np.ndarray) -> int:
        return DEFER


def _check_rate(r: int, n: int, what: str) -> tuple[int, int]:
    if r < 0 or n < 1:
        raise UserError(f"{what}:R/N needs R >= 0 and N >= 1 (got {r}/{n})")
    return r, n


_RATE = re.compile(r"^(fixed|block-rs):(\d+)/(\d+)$")


def _ddqn() -> Policy:
    """The shipped DDQN runtime (numpy/numba only; imported on first use)."""
    from kvtransport.agents.runtime import DDQNPolicy

    return DDQNPolicy()


_FACTORIES: dict[str, Callable[[], Policy]] = {
    "none": NoFEC,
    "arq": ARQ,
    "adaptive": Adaptive,
    "tail-rule": ConstantAction,
    "oracle": Oracle,
    "ddqn": _ddqn,
}
POLICY_HELP = (
    "none, fixed:R/N, block-rs:R/N, arq, adaptive, tail-rule, oracle, ddqn (the shipped DDQN)"
)


def default_policy() -> str:
    """The policy a shell uses when told none: ``ddqn`` when the package ships trained
    weights (kvtransport.agents), else ``adaptive``."""
    try:
        from kvtransport.agents.runtime import shipped_policy_available
    except ImportError:
        return "adaptive"
    return "ddqn" if shipped_policy_available() else "adaptive"


LONG_LINK_ONE_WAY_S = 0.02
"""From this one-way delay on (a 40 ms round trip), a whole-range stream gets
``LONG_LINK_HANDOFF_POLICY`` (:func:`default_policy_for`)."""
LONG_LINK_HANDOFF_POLICY = "adaptive"
"""The policy of a whole-range stream over a long link when the shell is told none."""
FAST_LINK_POLICY = "adaptive"
"""The policy in place of the shipped DDQN on a link whose bandwidth-delay product is
beyond any it was trained on (:func:`default_policy_for`)."""
PRIOR_MAX_BDP_BITS = 24e6
"""With a loss prior (the sender knows the path's loss before its first feedback), the
largest bandwidth-delay product (bits: rate x round trip) on which a shipped DDQN trained
without priors keeps the transfer; beyond it the transfer gets ``FAST_LINK_POLICY``
(:func:`default_policy_for`)."""
SHORT_DEADLINE_RTTS = 2.0
"""A transfer over a long link whose deadline is under this many round trips gets
``SHORT_DEADLINE_POLICY`` in place of the shipped DDQN (:func:`default_policy_for`)."""
SHORT_DEADLINE_POLICY = "adaptive"
"""The policy in place of the shipped DDQN on a long link with a deadline under
``SHORT_DEADLINE_RTTS`` round trips (:func:`default_policy_for`)."""


def default_policy_for(
    one_way_s: float,
    whole_ranges: bool,
    rate_bps: float | None = None,
    deadline_s: float | None = None,
    prior_known: bool = False,
) -> str:
    """The policy a shell uses for one transfer when told none.

    ``whole_ranges``: the stream sends each token range's blocks one after another (the
    handoff plan's and the vLLM connector's prefix order), so the racing receiver loads a
    range only once every block of it arrived and a partial range is worth nothing.
    ``one_way_s``: the link's one-way delay as the sender knows it before feedback (half
    the RTT it assumes). Such a stream over a link of at least ``LONG_LINK_ONE_WAY_S``
    gets ``LONG_LINK_HANDOFF_POLICY``: there the shipped DDQN, trained mostly on
    utility-ordered streams, recovers less than the heuristic under bursty loss (up to
    0.11 of utility per episode) and about as much under light loss (docs/results.md,
    issue 16). ``rate_bps``: the link's rate (None: not known). Where
    :func:`default_policy` is the shipped DDQN and the link's bandwidth-delay product
    (``rate_bps`` x twice ``one_way_s``) exceeds the largest one it was trained on
    (kvtransport.agents.runtime.shipped_trained_bdp_bits: 180 Mbit, 1 Gbit/s x 180 ms),
    the transfer gets ``FAST_LINK_POLICY``: beyond its training the network meets spans
    in flight it never saw; the shipped one mostly ties the heuristic there but fell
    0.013 below it at 2 Gbit/s, 80 ms one way, with a deadline of half a round trip, and
    its predecessor, trained to 400 Mbit/s, fell below it in 9 of 16 cells at 1 Gbit/s
    (docs/results.md, issue 16). ``deadline_s``: the transfer's deadline from its first
    datagram (None: not known). Where the shipped DDQN would run over a link of at least
    ``LONG_LINK_ONE_WAY_S`` with a deadline under ``SHORT_DEADLINE_RTTS`` round trips,
    the transfer gets ``SHORT_DEADLINE_POLICY``: at 1-1.5 round trips the DDQN fell 0.025
    below the heuristic on average (1.5-2: 0.012), and tied it from 2 on
    (scripts/eval_short_deadlines.py; docs/results.md, issue 16). ``prior_known``: the
    sender starts from a loss prior (a daemon's later transfers to a receiver, or a link
    whose other transfers report loss). Where the shipped DDQN trained without priors
    (its sidecar says so), the bandwidth-delay product it keeps is then at most
    ``PRIOR_MAX_BDP_BITS``: the heuristic starts from the prior, while such a network
    reads it only as a loss estimate in states where it never saw one (its prior inputs
    are zeroed: kvtransport.agents.runtime); with a previous transfer's prior the shipped
    one fell below the heuristic in 12 of 32 cells beyond 24 Mbit (400 Mbit/s and 1 Gbit/s,
    40 and 80 ms one way; up to 0.015) and in none of the 48 at 24 Mbit or less (50-150
    Mbit/s; scripts/eval_fast_links.py --prior previous; docs/results.md, issue 16).
    Every other transfer gets :func:`default_policy`."""
    long_link = one_way_s >= LONG_LINK_ONE_WAY_S
    if whole_ranges and long_link:
        return LONG_LINK_HANDOFF_POLICY
    policy = default_policy()
    if policy != "ddqn":
        return policy
    if rate_bps is not None:
        from kvtransport.agents.runtime import shipped_trained_bdp_bits, shipped_trained_priors

        limit = shipped_trained_bdp_bits()
        if prior_known and not shipped_trained_priors():
            limit = min(limit, PRIOR_MAX_BDP_BITS)
        if rate_bps * 2.0 * one_way_s > limit:
            return FAST_LINK_POLICY
    if long_link and deadline_s is not None and deadline_s < SHORT_DEADLINE_RTTS * 2 * one_way_s:
        return SHORT_DEADLINE_POLICY
    return policy


def register_policy(name: str, factory: Callable[[], Policy]) -> None:
    """Make ``make_policy(name)`` build ``factory()``."""
    _FACTORIES[name] = factory


def make_policy(spec: str) -> Policy:
    """Build a policy from its command-line name (see ``POLICY_HELP``)."""
    spec = spec.strip()
    m = _RATE.match(spec)
    if m:
        kind, r, n = m.group(1), int(m.group(2)), int(m.group(3))
        return FixedRLC(r, n) if kind == "fixed" else BlockRS(r, n)
    if spec not in _FACTORIES:
        raise UserError(f"unknown policy {spec!r}; choose from {POLICY_HELP}")
    return _FACTORIES[spec]()
