"""The policy interface: the action table and the base class.

The contract (observation, action, repair scheme) is described in
kvtransport.policies.heuristics, which holds the built-in policies; kvtransport.policies.registry
builds them by name. The interface lives here, in the protocol core, below every policy (the
heuristics, the DDQN runtime kvtransport.policies.ddqn, the simulators' oracle), so the sender
session drives a policy without knowing which.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtransport.core.observation import observe_into

DECISION_PACKETS = 32
"""Data-path slots per decision interval."""
REPAIR_SHARES = (0.0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2)
ACTIONS = np.array([(s, 1.0) for s in REPAIR_SHARES] + [(1.0, 0.0)], dtype=np.float32)
"""The shared action table: rows (repair share, admit new sources)."""
DEFER = -1
"""What ``act`` returns to leave the decision to the shell (kvtransport.policies.heuristics'
ExternalPolicy: the Gymnasium environment supplies the action)."""


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know about a transfer before it starts."""

    n_source: int  # source symbols in the stream
    symbol_size: int
    slot_s: float  # seconds between two data-path datagrams at the link rate
    decision_packets: int  # slots per decision interval
    budget_s: float  # sending time from start to the sender's stop time


class Policy:
    """Base class: one decision per interval, ``act(obs) -> index into actions``.

    ``scheme`` names the repair scheme (kvtransport.core.schemes) the session builds repairs
    with; the policy decides how much repair and when (the action), the scheme how.
    ``block_k`` / ``block_p`` parametrise the block RS scheme."""

    name = "policy"
    scheme = "rlc"
    actions: np.ndarray = ACTIONS
    tail_rule = True
    reactive = False
    block_k = 0
    block_p = 0

    def reset(self, ctx: PolicyContext) -> None:
        """Called once per transfer before the first decision."""
        self.ctx = ctx

    def act(self, obs: np.ndarray) -> int:
        raise NotImplementedError

    def decide(self, raw: np.ndarray, obs: np.ndarray) -> int:
        """The sender's call: fill ``obs`` from the sender state ``raw``
        (kvtransport.core.observation) and act on it. A policy compiled with numba overrides
        this to do both in one kernel call."""
        observe_into(raw, obs)
        return self.act(obs)
