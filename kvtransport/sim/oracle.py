"""The clairvoyant oracle: a reference policy for evaluation, never deployable.

It reads the data channel's future losses and the sender's private state, so it lives
with the simulators that can give it both; :func:`make_sim_policy` builds it by name
beside the deployable policies of kvtransport.policies.registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtransport.core.observation import Obs
from kvtransport.core.policy_base import ACTIONS, Policy
from kvtransport.policies.heuristics import REPAIR_ONLY
from kvtransport.policies.registry import POLICY_HELP, make_policy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.sender import SenderSession
    from kvtransport.netem import Channel

SIM_POLICY_HELP = f"{POLICY_HELP}, oracle (clairvoyant: simulation only)"


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
        log = s.progress.log
        first = max(s.fb_echo + 1, s.seq - 4096, 0)
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


def make_sim_policy(spec: str) -> Policy:
    """A policy by name for a simulation: ``oracle`` or any deployable name (``make_policy``)."""
    return Oracle() if spec.strip() == "oracle" else make_policy(spec)
