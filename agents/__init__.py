"""kvtransport.agents: repair scheduling by Double DQN.

- ``env``: the Gymnasium environment ``kvtransport/RepairScheduling-v0`` (registered on
  import of that module), a shell around the real sessions in the simulator;
- ``episodes``: the seeded episode distribution and held-out evaluation episodes;
- ``utility_profiles``: block-utility profiles measured once from the real model;
- ``features``, ``runtime``: the numpy/numba policy runtime (no torch), the ``ddqn`` repair
  policy of kvtransport.policies.ddqn;
- ``ddqn``, ``training``: Double DQN on stable-baselines3 and the training loop behind
  ``kvtransport train`` (these import torch; nothing else here does).

Importing the package, ``features`` or ``runtime`` needs only the core install (numpy,
numba) and loads neither gymnasium nor the simulator: the policy runtime is part of the
data plane. ``env``, ``episodes`` and ``training`` need the ``train`` extra.
"""

from __future__ import annotations

from kvtransport.policies.ddqn import DDQNPolicy, shipped_policy_available

__all__ = ["DDQNPolicy", "shipped_policy_available"]
