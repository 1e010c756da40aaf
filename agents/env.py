"""The Gymnasium environment ``kvtransport/RepairScheduling-v0`` (``ENV_ID``, registered
with gymnasium on import of this module).

One episode is one transfer (kvtransport.agents.episodes draws it); the environment is a
third shell around the real protocol core: it drives a
:class:`kvtransport.sim.simulator.Simulation` of the real SenderSession and ReceiverSession
whose policy is an :class:`kvtransport.policies.heuristics.ExternalPolicy`, so the sender pauses at
every decision and the agent supplies it.

- **step** = one decision interval of the sender (``DECISION_PACKETS`` data-path slots):
  the action applies, the simulation runs to the sender's next decision (or to the end).
- **observation** = exactly the policy observation the sender built for that decision
  (kvtransport.core.observation.Obs, float32[OBS_SIZE]); the daemon's policy sees the same vector.
- **action** = an index into the policy action table (kvtransport.core.policy_base.ACTIONS: rows
  repair share, admit new sources).
- **reward** = utility that became decodable at the receiver during the step (a handoff
  episode: whole token ranges only, ``Simulation.utility``). The
  receiver's utility freezes at the deadline, so the undiscounted return is exactly the
  utility recovered before the deadline; nothing after it counts.

``reset(options={"spec": EpisodeSpec})`` plays a given episode; otherwise one is drawn
from the environment's :class:`~kvtransport.agents.episodes.EpisodeDistribution` with its
seeded generator (``env.episode`` holds it). ``info`` carries ``utility`` (decoded so far)
and, at reset, ``spec``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from kvtransport.agents.episodes import EpisodeDistribution, EpisodeSpec, build_simulation

from kvtransport.core.observation import OBS_CLIP, OBS_SIZE, Obs
from kvtransport.core.policy_base import ACTIONS
from kvtransport.policies.heuristics import ExternalPolicy
from kvtransport.sim.simulator import Simulation

ENV_ID = "kvtransport/RepairScheduling-v0"

_BOUNDS = {
    Obs.CAPACITY_RATIO: (0.0, 4.0),
    Obs.SLACK: (-1.0, 8.0),
    Obs.BURST_MEAN: (0.0, 2.0),
    Obs.DEFICIT: (0.0, OBS_CLIP),
    Obs.IN_FLIGHT_SRC: (0.0, OBS_CLIP),
    Obs.IN_FLIGHT_REP: (0.0, OBS_CLIP),
    Obs.OWED: (0.0, OBS_CLIP),
    Obs.FEEDBACK_AGE: (0.0, OBS_CLIP),
    Obs.RTT: (0.0, OBS_CLIP),
    Obs.RTT_LONG: (0.0, 4.0),
}


def observation_space() -> spaces.Box:
    """The policy observation's range, field by field (kvtransport.core.observation.Obs)."""
    low = np.zeros(OBS_SIZE, dtype=np.float32)
    high = np.ones(OBS_SIZE, dtype=np.float32)
    for f, (lo, hi) in _BOUNDS.items():
        low[f], high[f] = lo, hi
    return spaces.Box(low, high, dtype=np.float32)


class RepairSchedulingEnv(gym.Env):
    """Repair scheduling before a deadline over a lossy link (see the module docstring).

    distribution: the episode distribution (default: the training distribution, with
        ``trace_files`` if given).
    actions: the action table (default: the shared kvtransport.core.policy_base.ACTIONS).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        distribution: EpisodeDistribution | None = None,
        trace_files: tuple[str, ...] = (),
        actions: np.ndarray = ACTIONS,
    ) -> None:
        super().__init__()
        self.distribution = distribution or EpisodeDistribution(trace_files=tuple(trace_files))
        self.actions = np.asarray(actions, dtype=np.float32)
        self.observation_space = observation_space()
        self.action_space = spaces.Discrete(len(self.actions))
        self.sim: Simulation | None = None
        self.episode: EpisodeSpec | None = None
        self._utility = 0.0

    def _policy(self) -> ExternalPolicy:
        pol = ExternalPolicy()
        pol.actions = self.actions
        return pol

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        spec = (options or {}).get("spec")
        if spec is None:
            spec = self.distribution.sample(self.np_random)
        self.episode = spec
        self.sim = build_simulation(spec, self._policy())
        self._utility = 0.0
        if not self.sim.run_until_decision():  # pragma: no cover - a transfer always decides
            raise RuntimeError(f"episode ended before its first decision: {spec.describe()}")
        return self.sim.sender.obs.copy(), {"utility": 0.0, "spec": spec}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        sim = self.sim
        if sim is None or not sim.sender.awaiting_action:
            raise RuntimeError("call reset() first (the episode is over)")
        sim.apply_action(int(action))
        running = sim.run_until_decision()
        u = sim.utility
        reward = u - self._utility
        self._utility = u
        return sim.sender.obs.copy(), float(reward), not running, False, {"utility": u}


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="kvtransport.agents.env:RepairSchedulingEnv")
