"""Double DQN: the target on a constructed batch, and a tiny training run that learns."""

import csv
import json

import numpy as np
import pytest
import torch as th
from kvtransport.agents.ddqn import (
    DoubleDQN,
    DuelingDQNPolicy,
    DuelingHead,
    double_dqn_target,
    export_q_network,
    load_q_network,
    torch_qvalues,
)
from kvtransport.agents.episodes import EpisodeDistribution
from kvtransport.agents.training import (
    TrainConfig,
    effective_config,
    make_env,
    play,
    train,
    validation_specs,
)
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from kvtransport.policies.ddqn import SHIPPED_WEIGHTS, DDQNPolicy, load_weights, mlp_qvalues

th.set_num_threads(1)


def _model(seed=0, gamma=0.9):
    env = make_env(TrainConfig())
    return DoubleDQN(
        "MlpPolicy",
        env,
        gamma=gamma,
        buffer_size=1000,
        learning_starts=0,
        batch_size=8,
        policy_kwargs={"net_arch": [16]},
        seed=seed,
        device="cpu",
    )


def _batch(model, n=64, seed=1):
    rng = np.random.default_rng(seed)
    dim = model.observation_space.shape[0]
    obs = th.as_tensor(rng.uniform(0, 1, (n, dim)), dtype=th.float32)
    nxt = th.as_tensor(rng.uniform(0, 1, (n, dim)), dtype=th.float32)
    actions = th.as_tensor(rng.integers(0, model.action_space.n, (n, 1)))
    rewards = th.as_tensor(rng.uniform(0, 0.05, (n, 1)), dtype=th.float32)
    dones = th.as_tensor((rng.random((n, 1)) < 0.25).astype(np.float32))
    return ReplayBufferSamples(obs, actions, nxt, dones, rewards)


def test_target_is_double_dqn_not_the_max_of_the_target_network():
    model = _model()
    # make the target network differ from the online one
    with th.no_grad():
        for p in model.q_net_target.parameters():
            p.add_(th.randn_like(p) * 0.5)
    batch = _batch(model)
    y = model.td_target(batch).numpy().ravel()

    with th.no_grad():
        q_online = model.q_net(batch.next_observations).numpy()
        q_target = model.q_net_target(batch.next_observations).numpy()
    r = batch.rewards.numpy().ravel()
    d = batch.dones.numpy().ravel()
    a_star = q_online.argmax(axis=1)
    want = r + (1 - d) * 0.9 * q_target[np.arange(len(r)), a_star]
    plain = r + (1 - d) * 0.9 * q_target.max(axis=1)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)

    disagree = (a_star != q_target.argmax(axis=1)) & (d == 0)
    agree = (a_star == q_target.argmax(axis=1)) | (d == 1)
    assert disagree.sum() >= 5 and agree.sum() >= 5  # the batch exercises both cases
    assert np.all(y[disagree] < plain[disagree] - 1e-6)  # double DQN does not take the max
    np.testing.assert_allclose(y[agree], plain[agree], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y[d == 1], r[d == 1], rtol=1e-6)  # nothing after the end


def test_function_matches_hand_computed_values():
    """Two fixed 'networks' (lookup tables) where the online net prefers a different
    action from the target net's maximum."""

    class Table(th.nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.rows = th.tensor(rows, dtype=th.float32)

        def forward(self, x):
            return self.rows[x[:, 0].long()]

    online = Table([[1.0, 2.0, 0.0], [5.0, 1.0, 1.0]])
    target = Table([[3.0, 0.5, 4.0], [2.0, 7.0, 1.0]])
    next_obs = th.tensor([[0.0], [1.0], [0.0]])
    rewards = th.tensor([[0.1], [0.2], [0.3]])
    dones = th.tensor([[0.0], [0.0], [1.0]])
    y = double_dqn_target(online, target, next_obs, rewards, dones, 0.5).numpy().ravel()
    # row 0: online picks action 1 -> target scores 0.5 (plain DQN would take 4.0)
    # row 1: online picks action 0 -> target scores 2.0 (plain DQN would take 7.0)
    np.testing.assert_allclose(y, [0.1 + 0.5 * 0.5, 0.2 + 0.5 * 2.0, 0.3])


def test_train_step_regresses_on_the_double_dqn_target():
    """SB3's training step of the subclass uses the Double-DQN target: with a buffer
    holding one transition, the logged loss is the Huber loss against that target."""
    model = _model(seed=3, gamma=0.9)
    with th.no_grad():
        for p in model.q_net_target.parameters():
            p.add_(th.randn_like(p) * 0.5)
    b = _batch(model, n=64, seed=4)
    with th.no_grad():
        q_on = model.q_net(b.next_observations).numpy()
        q_tg = model.q_net_target(b.next_observations).numpy()
    i = int(np.flatnonzero((q_on.argmax(1) != q_tg.argmax(1)) & (b.dones.numpy()[:, 0] == 0))[0])
    obs, nxt = b.observations[i].numpy(), b.next_observations[i].numpy()
    a, r = int(b.actions[i, 0]), float(b.rewards[i, 0])
    for _ in range(8):
        model.replay_buffer.add(
            obs[None], nxt[None], np.array([[a]]), np.array([r]), np.array([False]), [{}]
        )
    with th.no_grad():
        q_sa = float(model.q_net(th.as_tensor(obs[None]))[0, a])
    y_double = r + 0.9 * q_tg[i, q_on[i].argmax()]
    y_plain = r + 0.9 * q_tg[i].max()

    def huber(x):
        return 0.5 * x * x if abs(x) < 1 else abs(x) - 0.5

    model.set_logger(Logger(folder=None, output_formats=[]))
    model.train(gradient_steps=1, batch_size=8)
    loss = model.logger.name_to_value["train/loss"]
    assert loss == pytest.approx(huber(q_sa - y_double), rel=1e-5)
    assert abs(huber(q_sa - y_plain) - loss) > 1e-4


def test_expert_margin_loss():
    """DQfD's large-margin loss: zero once the expert's action leads by the margin, and
    the shortfall otherwise."""
    model = _model()
    model.set_expert_transitions(np.arange(4), margin=0.1)
    q = th.tensor([[1.0, 0.5, 0.2], [1.0, 0.95, 0.2], [0.3, 0.9, 0.2]])
    a = th.tensor([[0], [0], [0]])
    # row 0 leads by 0.5 >= 0.1: 0; row 1 leads by 0.05: 0.05 short; row 2 trails by 0.6
    # (0.9 + 0.1 - 0.3)
    want = (0.0 + 0.05 + 0.7) / 3
    assert float(model.expert_loss(q, a)) == pytest.approx(want, abs=1e-6)


@pytest.mark.slow
def test_a_tiny_training_run_improves_on_the_untrained_network(tmp_path):
    """Plain Double DQN (no expert margin) on a fixed easy distribution: small transfers,
    10 % Bernoulli loss and a feedback path that loses everything, so reactive repair is
    impossible and only a proactive share near the loss rate saves the transfer. A few
    thousand steps must lift the validation return far above the untrained network's and
    most of the way to the adaptive heuristic (which falls back to its prior loss
    estimate without feedback, close to right here). Half of the demonstrations are the
    per-episode best demonstrator, here always the adaptive heuristic's one share, so the
    learner sees the other actions mostly through its own exploration: 8 000 steps (4 000
    reached 0.58 where the old demonstration mix reached 0.64; this test took 26 s then)."""
    cfg = TrainConfig(
        steps=8_000,
        seed=1,
        hidden=(32, 32),
        demo_steps=1_000,
        eval_every=4_000,
        eval_episodes=8,
        eval_hard_episodes=2,
        shortfall_weight=3.0,
        learning_rate=1e-3,
        target_update_interval=500,
        gamma=0.98,
        expert_margin=0.0,
        distribution={
            "loss_weights": {"bernoulli": 1.0},
            "bernoulli_range": (0.08, 0.12),
            "feedback_weights": {"dead": 1.0},
            "rho_range": (0.9, 0.9),
            "blocks_range": (80, 160),
            "block_bytes": (6144,),
            "delay_range_ms": (2.0, 4.0),
            "high_rtt_share": 0.0,
            "rate_range_mbps": (50.0, 100.0),
            "utility_weights": {"flat": 1.0},
            "held_out": False,
        },
    )
    res = train(cfg, tmp_path, command="test", quiet=True)
    with open(tmp_path / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    untrained = float(rows[0]["val_ddqn"])
    trained = float(rows[-1]["val_ddqn"])
    adaptive = float(rows[0]["val_adaptive"])
    assert int(rows[-1]["step"]) == 8_000
    # the network kept is the best validation score's; every validated one is on disk
    kept = max(rows, key=lambda r: float(r["val_score"]))
    for r in rows:
        score = float(r["val_ddqn"]) - 3.0 * float(r["val_shortfall"])
        assert float(r["val_score"]) == pytest.approx(score)
        assert (r["best"] == "True") == (float(r["val_score"]) > max(
            [float(q["val_score"]) for q in rows[: rows.index(r)]], default=-1e9))  # fmt: skip
        assert (tmp_path / "checkpoints" / f"step_{r['step']}.npz").is_file()
    assert res.best_step == int(kept["step"])
    assert res.best_utility == pytest.approx(float(kept["val_ddqn"]))
    kept_weights = load_weights(tmp_path / "checkpoints" / f"step_{kept['step']}.npz")
    kept_file = load_weights(tmp_path / "ddqn.npz")
    assert np.array_equal(kept_file.layers[0][0], kept_weights.layers[0][0])
    assert untrained < 0.75 * adaptive  # the starting point is poor ...
    assert trained > untrained + 0.1  # ... and training fixes most of it
    assert trained > 0.85 * adaptive
    assert (tmp_path / "ddqn.npz").is_file() and (tmp_path / "best_model.zip").is_file()
    # next to the weights: the full effective configuration, not just what was given
    side = json.loads((tmp_path / "ddqn.json").read_text())
    assert side["command"] == "test" and side["config"] == effective_config(cfg)
    dist = side["config"]["distribution"]
    assert dist["rate_range_mbps"] == [50.0, 100.0]  # given
    assert dist["ge_p_range"] == list(EpisodeDistribution().ge_p_range)  # a default
    assert load_weights(tmp_path / "ddqn.npz").meta["config"] == side["config"]
    assert (tmp_path / "learning_curve.png").stat().st_size > 10_000


def _features_of_an_episode() -> np.ndarray:
    """The network inputs along a real episode (FeatureObservation's output)."""
    env = make_env(TrainConfig())
    out = [env.reset(seed=1)[0]]
    for i in range(60):
        obs, _, done, _, _ = env.step(i % 3)
        out.append(obs)
        if done:
            break
    return np.array(out, dtype=np.float32)


def _dueling_model(hidden: tuple[int, ...]) -> DoubleDQN:
    env = make_env(TrainConfig())
    return DoubleDQN(
        DuelingDQNPolicy,
        env,
        policy_kwargs={"net_arch": list(hidden)},
        learning_starts=1_000,
        buffer_size=1_000,
        seed=3,
        device="cpu",
    )


def test_a_network_started_from_exported_weights_computes_their_q_values():
    """load_q_network is export_q_network's inverse: the dueling head gets the folded
    layer split into value and advantage, so the torch network's Q-values on real
    features are the shipped runtime's, and exporting gives the weights back."""
    shipped = load_weights(SHIPPED_WEIGHTS)
    model = _dueling_model((64, 64))
    feats = _features_of_an_episode()
    before = torch_qvalues(model, feats)
    load_q_network(model, shipped)
    q = torch_qvalues(model, feats)
    runtime = np.array([mlp_qvalues(f, shipped.kernel_layers) for f in feats])
    assert np.abs(before - runtime).max() > 0.01  # random weights are something else
    np.testing.assert_allclose(q, runtime, atol=2e-5)
    again = export_q_network(model, shipped.actions)
    for (w, b), (w0, b0) in zip(again.layers, shipped.layers, strict=True):
        np.testing.assert_allclose(w, w0, atol=1e-6)
        np.testing.assert_allclose(b, b0, atol=1e-6)
    q_target = model.q_net_target(th.as_tensor(feats)).detach().numpy()
    np.testing.assert_allclose(q_target, q, atol=1e-6)  # the target starts there too


def test_weights_of_other_layer_sizes_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        load_q_network(_dueling_model((32, 32)), load_weights(SHIPPED_WEIGHTS))


def test_a_run_with_init_from_starts_where_those_weights_are(tmp_path):
    """The step-0 validation of a run started from the shipped weights is the shipped
    policy's own utility on the same validation episodes."""
    cfg = TrainConfig(
        steps=1,
        demo_steps=0,
        eval_every=1,
        eval_episodes=3,
        init_from=str(SHIPPED_WEIGHTS),
        distribution={"blocks_range": (100, 200), "high_rtt_share": 0.5},
    )
    train(cfg, tmp_path, command="test", quiet=True)
    with open(tmp_path / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    shipped = np.mean([play(s, DDQNPolicy()) for s in validation_specs(cfg, 3)])
    assert float(rows[0]["val_ddqn"]) == pytest.approx(shipped, abs=1e-12)
    assert json.loads((tmp_path / "ddqn.json").read_text())["config"]["init_from"] == str(
        SHIPPED_WEIGHTS
    )


def _preferences(q: np.ndarray) -> np.ndarray:
    return q - q.mean(axis=1, keepdims=True)


def test_the_anchor_penalizes_moved_preferences_not_moved_values():
    """The anchor loss is zero at the start, stays zero when every action's Q-value moves
    together (the dueling value head), and grows when the action preferences move."""
    model = _dueling_model((64, 64))
    load_q_network(model, load_weights(SHIPPED_WEIGHTS))
    model.set_anchor(1.0)
    obs = th.as_tensor(_features_of_an_episode())
    head = model.q_net.q_net[-1]
    assert isinstance(head, DuelingHead)
    with th.no_grad():
        q0 = model.q_net(obs)
        assert float(model.anchor_loss(obs, q0)) == 0.0
        head.value.bias.add_(0.3)
        q1 = model.q_net(obs)
        assert float((q1 - q0).abs().min()) > 0.29  # every value moved ...
        assert float(model.anchor_loss(obs, q1)) < 1e-10  # ... the preferences did not
        head.advantage.weight.add_(th.randn_like(head.advantage.weight) * 0.01)
        q2 = model.q_net(obs)
    drift = _preferences(q2.numpy()) - _preferences(q0.numpy())
    assert float(model.anchor_loss(obs, q2)) == pytest.approx(float((drift**2).mean()), rel=1e-5)
    assert float(model.anchor_loss(obs, q2)) > 1e-7
    model.set_anchor(0.0)
    assert model._anchor is None


def test_an_anchored_fine_tune_keeps_the_start_s_choices():
    """Training steps on noisy TD targets move the shipped network's action preferences;
    with the anchor they move far less (the loss term reaches DoubleDQN.train)."""
    feats = _features_of_an_episode()
    obs = th.as_tensor(feats)
    rng = np.random.default_rng(5)
    drift = {}
    for weight in (0.0, 100.0):
        model = _dueling_model((64, 64))
        load_q_network(model, load_weights(SHIPPED_WEIGHTS))
        model.set_anchor(weight)
        for p in model.policy.optimizer.param_groups:
            p["lr"] = 1e-3
        model.lr_schedule = lambda _: 1e-3
        for i in range(len(feats) - 1):
            a = rng.integers(0, model.action_space.n)
            model.replay_buffer.add(
                feats[i][None], feats[i + 1][None], np.array([[a]]),
                np.array([rng.uniform(-0.05, 0.05)]), np.array([False]), [{}],
            )  # fmt: skip
        model.set_logger(Logger(folder=None, output_formats=[]))
        with th.no_grad():
            before = _preferences(model.q_net(obs).numpy())
        th.manual_seed(0)
        np.random.seed(0)
        model.train(gradient_steps=60, batch_size=32)
        with th.no_grad():
            after = _preferences(model.q_net(obs).numpy())
        drift[weight] = float(np.abs(after - before).mean())
    assert drift[0.0] > 1e-3  # the targets do move the unanchored network
    assert drift[100.0] < 0.2 * drift[0.0]


def test_anchor_weight_is_recorded_only_when_set_and_needs_a_start(tmp_path):
    assert "anchor_weight" not in effective_config(TrainConfig())
    cfg = TrainConfig(init_from=str(SHIPPED_WEIGHTS), anchor_weight=10.0)
    assert effective_config(cfg)["anchor_weight"] == 10.0
    with pytest.raises(ValueError, match="init_from"):
        train(TrainConfig(anchor_weight=1.0), tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()
