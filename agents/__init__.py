"""kvtransport.agents: repair scheduling by Double DQN.

- ``env``: the Gymnasium environment ``kvtransport/RepairScheduling-v0`` (registered on
  import of this package), a shell around the real sessions in the simulator;
- ``episodes``: the seeded episode distribution and held-out evaluation episodes;
- ``utility_profiles``: block-utility profiles measured once from the real model;
- ``features``, ``runtime``: the numpy/numba policy runtime (no torch), registered as the
  ``ddqn`` repair policy of kvtransport.policy;
- ``ddqn``, ``training``: Double DQN on stable-baselines3 and the training loop behind
  ``kvtransport train`` (these import torch; nothing else here does).

Importing the package needs only the core install (numpy, numba): the policy runtime is
part of the data plane. The environment is registered only where gymnasium is installed
(the ``train`` extra).
"""

from __future__ import annotations

from kvtransport.agents.runtime import DDQNPolicy, shipped_policy_available

from kvtransport.policy import register_policy

ENV_ID = "kvtransport/RepairScheduling-v0"

register_policy("ddqn", DDQNPolicy)
try:
    import gymnasium as _gym
except ModuleNotFoundError:  # the core install: no environment, the runtime still works
    _gym = None
if _gym is not None and ENV_ID not in _gym.registry:
    _gym.register(id=ENV_ID, entry_point="kvtransport.agents.env:RepairSchedulingEnv")

__all__ = ["ENV_ID", "DDQNPolicy", "shipped_policy_available"]
