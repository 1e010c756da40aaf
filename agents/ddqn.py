"""Double DQN on stable-baselines3 (imports torch: training side only).

stable-baselines3's DQN bootstraps from ``max_a Q_target(s', a)``: the same network picks
and scores the next action, which over-estimates (van Hasselt et al., 2016).
:class:`DoubleDQN` changes only the target: the online network picks
``a* = argmax_a Q_online(s', a)`` and the target network scores it,

    y = r + (1 - done) * gamma^n * Q_target(s', a*).

Everything else (replay buffer with optional n-step returns, epsilon-greedy exploration,
target-network sync, Huber loss, gradient clipping) is SB3's. :func:`export_q_network`
turns the trained online network into plain arrays for kvtransport.agents.runtime.
"""

from __future__ import annotations

import numpy as np
import torch as th
from kvtransport.agents.runtime import QWeights
from stable_baselines3 import DQN
from torch.nn import functional as F


def double_dqn_target(
    q_online: th.nn.Module,
    q_target: th.nn.Module,
    next_obs: th.Tensor,
    rewards: th.Tensor,
    dones: th.Tensor,
    discounts: th.Tensor | float,
) -> th.Tensor:
    """The Double-DQN TD target (shape [batch, 1]; see the module docstring)."""
    with th.no_grad():
        next_action = q_online(next_obs).argmax(dim=1, keepdim=True)
        next_q = th.gather(q_target(next_obs), dim=1, index=next_action)
        return rewards + (1.0 - dones) * discounts * next_q


class DoubleDQN(DQN):
    """stable-baselines3 DQN with the Double-DQN target (everything else unchanged)."""

    def td_target(self, replay_data: object) -> th.Tensor:
        discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
        return double_dqn_target(
            self.q_net,
            self.q_net_target,
            replay_data.next_observations,
            replay_data.rewards,
            replay_data.dones,
            discounts,
        )

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        # SB3's DQN.train with td_target in place of the max over the target network
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            replay_data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env)
            target_q = self.td_target(replay_data)
            current_q = th.gather(
                self.q_net(replay_data.observations), 1, replay_data.actions.long()
            )
            loss = F.smooth_l1_loss(current_q, target_q)
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", float(np.mean(losses)) if losses else 0.0)


def export_q_network(model: DQN, actions: np.ndarray, meta: dict | None = None) -> QWeights:
    """The online Q-network of an SB3 DQN (MLP policy, ReLU, flatten extractor) as arrays."""
    net = model.q_net.q_net
    linears = [m for m in net if isinstance(m, th.nn.Linear)]
    acts = [m for m in net if not isinstance(m, th.nn.Linear)]
    if not all(isinstance(m, th.nn.ReLU) for m in acts) or len(acts) != len(linears) - 1:
        raise ValueError("export needs an MLP of Linear layers with ReLU between them")
    layers = [
        (m.weight.detach().cpu().numpy().copy(), m.bias.detach().cpu().numpy().copy())
        for m in linears
    ]
    return QWeights(layers, actions, meta)


def torch_qvalues(model: DQN, feats: np.ndarray) -> np.ndarray:
    """Q-values of the torch online network for a batch of feature vectors."""
    with th.no_grad():
        x = th.as_tensor(np.asarray(feats, dtype=np.float32))
        return model.q_net(x).cpu().numpy()
