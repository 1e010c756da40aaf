"""The built-in repair policies (heuristics): one small interface, observation -> action.

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

import numpy as np

from kvtransport.core.observation import BURST_UNIT, OBS_CLIP, Obs
from kvtransport.core.policy_base import ACTIONS, DEFER, Policy
from kvtransport.errors import UserError

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
