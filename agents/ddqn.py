"""Double DQN on stable-baselines3 (imports torch: training side only).

stable-baselines3's DQN bootstraps from ``max_a Q_target(s', a)``: the same network picks
and scores the next action, which over-estimates (van Hasselt et al., 2016).
:class:`DoubleDQN` changes only the target: the online network picks
``a* = argmax_a Q_online(s', a)`` and the target network scores it,

    y = r + (1 - done) * gamma^n * Q_target(s', a*).

Everything else (replay buffer with optional n-step returns, epsilon-greedy exploration,
target-network sync, Huber loss, gradient clipping) is SB3's. :func:`export_q_network`
turns the trained online network into plain arrays for kvtransport.policies.ddqn.
"""

from __future__ import annotations

import copy

import numpy as np
import torch as th
from stable_baselines3 import DQN
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.dqn.policies import DQNPolicy, QNetwork
from torch import nn
from torch.nn import functional as F

from kvtransport.policies.ddqn import QWeights


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
    """stable-baselines3 DQN with the Double-DQN target, plus an optional large-margin
    loss on expert demonstrations (DQfD, Hester et al., 2018).

    ``set_expert_transitions(indices, margin)`` marks replay-buffer entries played by an
    expert; then a quarter of every batch is drawn from them and the loss adds
    ``weight * mean(max_a [Q(s, a) + margin * (a != a_E)] - Q(s, a_E))``: the expert's
    action must look at least ``margin`` better than the others in its own states, which
    anchors the network where the TD signal is weak; the TD loss (on the whole batch) still
    decides everywhere else. Without experts, training is SB3's with the Double-DQN target.

    ``set_anchor(weight)`` freezes a copy of the current network (a fine-tune's start) and
    adds ``weight * mean((P(s, a) - P_0(s, a))^2)`` over the whole batch, where
    ``P(s, a) = Q(s, a) - mean_a' Q(s, a')`` is the network's action preference and
    ``P_0`` the frozen copy's: a conservative fine-tune, free to move the state values
    that TD corrects but held near the start's choices except where TD pays for moving.
    """

    _expert_idx: np.ndarray | None = None
    expert_margin = 0.0
    expert_weight = 1.0
    anchor_weight = 0.0
    _anchor: nn.Module | None = None

    def set_expert_transitions(self, indices: np.ndarray, margin: float,
                               weight: float = 1.0) -> None:  # fmt: skip
        self._expert_idx = np.asarray(indices, dtype=np.int64)
        self.expert_margin = float(margin)
        self.expert_weight = float(weight)

    def set_anchor(self, weight: float) -> None:
        """Anchor the action preferences to the network as it is now (class docstring);
        ``weight`` 0 removes the anchor."""
        self.anchor_weight = float(weight)
        self._anchor = None
        if self.anchor_weight > 0:
            self._anchor = copy.deepcopy(self.q_net).requires_grad_(False).eval()

    def anchor_loss(self, obs: th.Tensor, q: th.Tensor) -> th.Tensor:
        """Mean squared drift of the preferences ``q`` [n, A] at ``obs`` from the anchor's."""
        assert self._anchor is not None
        with th.no_grad():
            q0 = self._anchor(obs)
        drift = (q - q.mean(dim=1, keepdim=True)) - (q0 - q0.mean(dim=1, keepdim=True))
        return (drift**2).mean()

    def td_target(self, replay_data: ReplayBufferSamples) -> th.Tensor:
        discounts = replay_data.discounts if replay_data.discounts is not None else self.gamma
        return double_dqn_target(
            self.q_net,
            self.q_net_target,
            replay_data.next_observations,
            replay_data.rewards,
            replay_data.dones,
            discounts,
        )

    def _sample(self, batch_size: int) -> tuple[ReplayBufferSamples, int]:
        """A batch, and how many of its last rows are expert transitions."""
        buf = self.replay_buffer
        assert buf is not None  # made by DQN._setup_model
        if self._expert_idx is None or not self._expert_idx.size or self.expert_weight <= 0:
            return buf.sample(batch_size, env=self._vec_normalize_env), 0
        n_e = batch_size // 4
        upper = buf.buffer_size if buf.full else buf.pos
        inds = np.concatenate(
            [
                np.random.randint(0, upper, size=batch_size - n_e),
                np.random.choice(self._expert_idx, size=n_e),
            ]
        )
        return buf._get_samples(inds, env=self._vec_normalize_env), n_e

    def expert_loss(self, q: th.Tensor, actions: th.Tensor) -> th.Tensor:
        """The large-margin loss of expert rows ``q`` [n, A] with expert ``actions`` [n, 1]."""
        margins = th.full_like(q, self.expert_margin)
        margins.scatter_(1, actions, 0.0)
        return ((q + margins).max(dim=1).values - q.gather(1, actions).squeeze(1)).mean()

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        # SB3's DQN.train with td_target in place of the max over the target network
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            replay_data, n_e = self._sample(batch_size)
            target_q = self.td_target(replay_data)
            actions = replay_data.actions.long()
            q_all = self.q_net(replay_data.observations)
            current_q = th.gather(q_all, 1, actions)
            loss = F.smooth_l1_loss(current_q, target_q)
            if n_e:
                loss = loss + self.expert_weight * self.expert_loss(q_all[-n_e:], actions[-n_e:])
            if self._anchor is not None:
                loss = loss + self.anchor_weight * self.anchor_loss(replay_data.observations, q_all)
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", float(np.mean(losses)) if losses else 0.0)


class DuelingHead(nn.Module):
    """Dueling output layer (Wang et al., 2016): Q = V(h) + A(h, a) - mean_a A(h, a).

    The value head absorbs how good a state is (it varies a lot: the utility still to
    come), so the advantage head only has to learn the small differences between
    actions. It is linear in ``h``, so it folds into one plain Linear layer for export."""

    def __init__(self, n_in: int, n_actions: int) -> None:
        super().__init__()
        self.value = nn.Linear(n_in, 1)
        self.advantage = nn.Linear(n_in, n_actions)

    def forward(self, h: th.Tensor) -> th.Tensor:
        a = self.advantage(h)
        return self.value(h) + a - a.mean(dim=1, keepdim=True)

    def folded(self) -> tuple[np.ndarray, np.ndarray]:
        """(W, b) of the equivalent Linear layer."""
        wa = self.advantage.weight.detach().cpu().numpy().astype(np.float64)
        ba = self.advantage.bias.detach().cpu().numpy().astype(np.float64)
        wv = self.value.weight.detach().cpu().numpy().astype(np.float64)
        bv = self.value.bias.detach().cpu().numpy().astype(np.float64)
        w = wa - wa.mean(axis=0, keepdims=True) + wv
        b = ba - ba.mean() + bv
        return w.astype(np.float32), b.astype(np.float32)


class DuelingDQNPolicy(DQNPolicy):
    """SB3's MLP DQN policy with a :class:`DuelingHead` as the last layer."""

    def make_q_net(self) -> QNetwork:
        net = super().make_q_net()
        layers = list(net.q_net)
        last = layers[-1]
        layers[-1] = DuelingHead(last.in_features, last.out_features)
        net.q_net = nn.Sequential(*layers).to(self.device)
        return net


def load_q_network(model: DQN, weights: QWeights) -> None:
    """Start ``model``'s online and target Q-networks from exported ``weights`` (the
    inverse of :func:`export_q_network`; same layer sizes and action count, else
    ValueError). A dueling last layer gets the exported layer split exactly: the value
    head the mean over actions, the advantage head the rest, so the network's Q-values
    equal the exported ones."""
    net = list(model.q_net.q_net)
    dense = (nn.Linear, DuelingHead)
    linears = [m for m in net if isinstance(m, dense)]
    shapes = [
        (m.advantage.out_features, m.advantage.in_features)
        if isinstance(m, DuelingHead)
        else (m.out_features, m.in_features)
        for m in linears
    ]
    if shapes != [w.shape for w, _ in weights.layers]:
        raise ValueError(
            f"the weights' layers {[w.shape for w, _ in weights.layers]} do not match "
            f"the network's {shapes}"
        )
    with th.no_grad():
        for m, (w, b) in zip(linears, weights.layers, strict=True):
            w64, b64 = w.astype(np.float64), b.astype(np.float64)
            parts: tuple[tuple[nn.Linear, np.ndarray, np.ndarray], ...]
            if isinstance(m, DuelingHead):
                wv, bv = w64.mean(axis=0, keepdims=True), b64.mean(keepdims=True)
                parts = ((m.value, wv, bv), (m.advantage, w64 - wv, b64 - bv))
            else:
                parts = ((m, w64, b64),)
            for layer, pw, pb in parts:
                layer.weight.copy_(th.as_tensor(pw, dtype=layer.weight.dtype))
                layer.bias.copy_(th.as_tensor(pb, dtype=layer.bias.dtype))
    model.q_net_target.load_state_dict(model.q_net.state_dict())


def export_q_network(model: DQN, actions: np.ndarray, meta: dict | None = None) -> QWeights:
    """The online Q-network of an SB3 DQN (MLP policy, ReLU, flatten extractor, plain or
    dueling last layer) as arrays."""
    net = list(model.q_net.q_net)
    dense = (nn.Linear, DuelingHead)
    linears = [m for m in net if isinstance(m, dense)]
    acts = [m for m in net if not isinstance(m, dense)]
    if not all(isinstance(m, nn.ReLU) for m in acts) or len(acts) != len(linears) - 1:
        raise ValueError("export needs an MLP of Linear layers with ReLU between them")
    layers = [
        m.folded()
        if isinstance(m, DuelingHead)
        else (m.weight.detach().cpu().numpy().copy(), m.bias.detach().cpu().numpy().copy())
        for m in linears
    ]
    return QWeights(layers, actions, meta)


def torch_qvalues(model: DQN, feats: np.ndarray) -> np.ndarray:
    """Q-values of the torch online network for a batch of feature vectors."""
    with th.no_grad():
        x = th.as_tensor(np.asarray(feats, dtype=np.float32))
        return model.q_net(x).cpu().numpy()
