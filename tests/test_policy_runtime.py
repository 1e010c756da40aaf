"""The numpy/numba DDQN runtime: same actions as torch, weights files, policy registration."""

import json
import subprocess
import sys

import kvtransport.agents  # noqa: F401  (registers ddqn)
import numpy as np
import pytest
import torch as th
from kvtransport.agents.ddqn import DoubleDQN, DuelingDQNPolicy, export_q_network, torch_qvalues
from kvtransport.agents.env import RepairSchedulingEnv
from kvtransport.agents.episodes import EpisodeDistribution, build_simulation
from kvtransport.agents.training import TrainConfig, make_env
from kvtransport.netem import Bernoulli, GilbertElliott

from kvtransport.core.observation import BURST_UNIT, OBS_FIELDS, Obs, Raw
from kvtransport.core.policy_base import ACTIONS, Policy
from kvtransport.errors import UserError
from kvtransport.policies.ddqn import (
    PRIOR_FIELDS,
    SHIPPED_SIDECAR,
    SHIPPED_WEIGHTS,
    DDQNPolicy,
    QWeights,
    load_weights,
    save_weights,
    shipped_policy_available,
    trained_burst_packets,
)
from kvtransport.policies.features import FEATURES_VERSION, N_FEATURES, features
from kvtransport.policies.heuristics import Adaptive
from kvtransport.policies.registry import default_policy, make_policy

th.set_num_threads(1)


@pytest.fixture(scope="module")
def recorded_observations():
    """Observations recorded from real episodes (adaptive, random and shipped-DDQN
    actions, so states on and off the learned policy's path)."""
    env = RepairSchedulingEnv(EpisodeDistribution(blocks_range=(80, 400)))
    rng = np.random.default_rng(7)
    shipped = DDQNPolicy() if shipped_policy_available() else None
    out = []
    for ep in range(12):
        obs, _ = env.reset(seed=100 + ep)
        brain = Adaptive()
        brain.reset(env.sim.sender.policy.ctx)
        done = False
        while not done:
            out.append(obs)
            if ep % 3 == 0:
                a = int(rng.integers(len(ACTIONS)))
            elif ep % 3 == 1 or shipped is None:
                a = brain.act(obs)
            else:
                a = shipped.act(obs)
            obs, _, done, _, _ = env.step(a)
    return np.array(out, dtype=np.float32)


def _torch_model_with(weights):
    """An SB3 DoubleDQN whose online network holds ``weights`` (shapes from them)."""
    hidden = [int(w.shape[0]) for w, _ in weights.layers[:-1]]
    model = DoubleDQN(
        "MlpPolicy",
        make_env(TrainConfig()),
        buffer_size=10,
        policy_kwargs={"net_arch": hidden},
        device="cpu",
    )
    linears = [m for m in model.q_net.q_net if isinstance(m, th.nn.Linear)]
    with th.no_grad():
        for m, (w, b) in zip(linears, weights.layers, strict=True):
            m.weight.copy_(th.as_tensor(w))
            m.bias.copy_(th.as_tensor(b))
    return model


def _agree(model, policy, observations):
    feats = features(observations)
    q_torch = torch_qvalues(model, feats)
    q_numba = np.array([policy.weights.qvalues(o) for o in observations])
    # float32 on both sides, summed in different orders: rounding error scales with the
    # largest terms (a dueling head subtracts values of ~10 to give values near 0), so the
    # absolute tolerance is float32 resolution at the output's scale. Actions: exact.
    scale = max(1.0, float(np.abs(q_torch).max()))
    np.testing.assert_allclose(q_numba, q_torch, rtol=1e-5, atol=1e-6 * scale)
    a_torch = q_torch.argmax(axis=1)
    a_numba = np.array([policy.act(o) for o in observations])
    assert np.array_equal(a_numba, a_torch)
    return a_numba


@pytest.mark.skipif(not shipped_policy_available(), reason="no trained policy shipped yet")
def test_shipped_policy_acts_like_its_torch_network(recorded_observations):
    pol = DDQNPolicy()
    model = _torch_model_with(pol.weights)
    actions = _agree(model, pol, recorded_observations)
    assert len(recorded_observations) > 300
    assert len(np.unique(actions)) >= 2  # a policy that decides something


@pytest.mark.parametrize("dueling", [False, True])
def test_export_of_a_torch_network_acts_the_same(recorded_observations, tmp_path, dueling):
    model = DoubleDQN(
        DuelingDQNPolicy if dueling else "MlpPolicy",
        make_env(TrainConfig()),
        buffer_size=10,
        seed=5,
        policy_kwargs={"net_arch": [48, 24]},
        device="cpu",
    )
    gen = th.Generator().manual_seed(5)  # not the global stream: order-independent
    with th.no_grad():  # away from the initialization's tiny output weights
        for p in model.q_net.parameters():
            p.add_(th.randn(p.shape, generator=gen) * 0.2)
    # trained with priors, as its file says: every input keeps its weights when loaded
    provenance = {"command": "x", "config": {"distribution": {"prior_weights": {"previous": 1}}}}
    path = save_weights(tmp_path / "w.npz", export_q_network(model, ACTIONS), provenance)
    pol = DDQNPolicy(path)
    assert pol.weights.meta["command"] == "x"
    assert pol.weights.n_params == N_FEATURES * 48 + 48 + 48 * 24 + 24 + 25 * len(ACTIONS)
    actions = _agree(model, pol, recorded_observations)
    assert len(np.unique(actions)) >= 2


def test_registered_as_the_ddqn_policy():
    if not shipped_policy_available():
        with pytest.raises(UserError, match="kvtransport train"):
            make_policy("ddqn")
        return
    pol = make_policy("ddqn")
    assert isinstance(pol, DDQNPolicy) and pol.name == "ddqn"
    assert default_policy() == "ddqn"  # shells that are told no policy use the shipped one
    side = json.loads(SHIPPED_SIDECAR.read_text())
    assert side["command"].startswith("kvtransport train")
    assert side["weights"] == SHIPPED_WEIGHTS.name
    assert SHIPPED_WEIGHTS.stat().st_size < 200_000


def test_bad_weights_files_are_one_line_errors(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(UserError, match="not a DDQN weights file"):
        load_weights(junk)
    with pytest.raises(UserError, match="no such"):
        load_weights(tmp_path / "missing.npz")
    model = DoubleDQN(
        "MlpPolicy",
        make_env(TrainConfig()),
        buffer_size=10,
        policy_kwargs={"net_arch": [8]},
        device="cpu",
    )
    w = export_q_network(model, ACTIONS)
    w.meta["features_version"] = -1
    old = save_weights(tmp_path / "old.npz", w)
    with pytest.raises(UserError, match="retrain"):
        load_weights(old)


def _random_layers(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """A one-hidden-layer (16) network over today's features, random throughout."""
    return [(rng.standard_normal((16, N_FEATURES)).astype(np.float32),
             rng.standard_normal(16).astype(np.float32)),
            (rng.standard_normal((len(ACTIONS), 16)).astype(np.float32),
             rng.standard_normal(len(ACTIONS)).astype(np.float32))]  # fmt: skip


@pytest.mark.parametrize(
    ("prior_weights", "zeroed"),
    [({"none": 1.0}, True), (None, True), ({"none": 0.5, "previous": 0.5}, False)],
)
def test_a_network_trained_without_priors_loads_with_zero_prior_inputs(
    tmp_path, prior_weights, zeroed
):
    """A network whose training drew no loss prior (or whose file does not say) saw the
    prior fields at 0 only: their input weights are the random initial ones. They are
    zeroed when it is loaded, so a prior moves its Q-values only through the loss
    estimate; a network trained with priors keeps them."""
    rng = np.random.default_rng(7)
    prior = [OBS_FIELDS.index(name) for name in PRIOR_FIELDS]
    layers = _random_layers(rng)
    dist = {} if prior_weights is None else {"prior_weights": prior_weights}
    meta = {"features_version": FEATURES_VERSION, "obs_fields": list(OBS_FIELDS),
            "actions": ACTIONS.tolist(), "config": {"distribution": dist}}  # fmt: skip
    path = save_weights(tmp_path / "w.npz", QWeights(layers, ACTIONS, meta))
    got = load_weights(path)
    w0 = got.layers[0][0]
    keep = [i for i in range(N_FEATURES) if i not in prior]
    assert np.array_equal(w0[:, keep], layers[0][0][:, keep])
    assert np.all(w0[:, prior] == 0.0) == zeroed
    assert zeroed or np.array_equal(w0[:, prior], layers[0][0][:, prior])
    obs = rng.uniform(0.0, 1.0, (20, len(OBS_FIELDS))).astype(np.float32)
    without = obs.copy()
    without[:, prior] = 0.0
    pairs = zip(obs, without, strict=True)
    same = [np.array_equal(got.qvalues(o), got.qvalues(z)) for o, z in pairs]
    assert all(same) if zeroed else not any(same)


def test_weights_trained_before_new_observation_fields_load_with_zero_inputs(tmp_path):
    """A file trained on fewer observation fields (before the loss prior existed) gets zero
    first-layer weights for the new fields: it computes what it computed before."""
    rng = np.random.default_rng(5)
    new = [OBS_FIELDS.index("prior_loss"), OBS_FIELDS.index("prior_known")]
    keep = [i for i in range(N_FEATURES) if i not in new]
    layers = _random_layers(rng)
    w0 = layers[0][0]
    narrow = [(w0[:, keep], layers[0][1]), layers[1]]
    fields = [f for i, f in enumerate(OBS_FIELDS) if i not in new]
    path = tmp_path / "old.npz"
    meta = {"features_version": FEATURES_VERSION, "obs_fields": fields,
            "actions": ACTIONS.tolist()}  # fmt: skip
    np.savez(path, W0=narrow[0][0], b0=narrow[0][1], W1=narrow[1][0], b1=narrow[1][1],
             meta=np.array(json.dumps(meta)))  # fmt: skip
    old = load_weights(path)
    assert old.meta["trained_obs_fields"] == fields
    w = old.layers[0][0]
    assert np.all(w[:, new] == 0.0) and np.array_equal(w[:, keep], w0[:, keep])
    obs = rng.uniform(0.0, 1.0, (20, len(OBS_FIELDS))).astype(np.float32)
    zeroed = obs.copy()
    zeroed[:, new] = 0.0
    for o, z in zip(obs, zeroed, strict=True):
        np.testing.assert_array_equal(old.qvalues(o), old.qvalues(z))
        # the narrow network on the features without the new fields, computed by hand
        f = features(o)[keep].astype(np.float64)
        h = np.maximum(narrow[0][0].astype(np.float64) @ f + narrow[0][1], 0.0)
        q = narrow[1][0].astype(np.float64) @ h + narrow[1][1]
        np.testing.assert_allclose(old.qvalues(o), q, rtol=1e-5, atol=1e-5)
    # fields this code does not know: refused
    meta = {"features_version": FEATURES_VERSION, "obs_fields": fields[:-1] + ["bogus"],
            "actions": ACTIONS.tolist()}  # fmt: skip
    np.savez(path, W0=narrow[0][0], b0=narrow[0][1], W1=narrow[1][0], b1=narrow[1][1],
             meta=np.array(json.dumps(meta)))  # fmt: skip
    with pytest.raises(UserError, match="retrain"):
        load_weights(path)


@pytest.mark.skipif(not shipped_policy_available(), reason="no trained policy shipped yet")
def test_fused_decision_equals_the_observation_then_the_network():
    """The sender calls ``DDQNPolicy.decide``: observation, features and network in one
    kernel. It must give the observation and action of the two-step path every other
    policy takes (``Policy.decide``: ``observe_into``, then ``act``), on every sender
    state of real transfers (long links: on short ones the shipped network plays action 0
    almost throughout, and the check needs more than one action)."""
    states = []
    rng = np.random.default_rng(11)
    for _ in range(6):
        pol = DDQNPolicy()
        fused = pol.decide
        pol.decide = lambda raw, obs, fused=fused: states.append(raw.copy()) or fused(raw, obs)
        build_simulation(EpisodeDistribution(high_rtt_share=1.0).sample(rng), pol).run()
    assert len(states) > 300
    pol = DDQNPolicy()
    actions = set()
    for raw in states:
        o1, o2 = np.full(len(OBS_FIELDS), np.nan, np.float32), np.zeros(len(OBS_FIELDS), np.float32)
        a1 = pol.decide(raw, o1)
        a2 = Policy.decide(pol, raw, o2)
        assert a1 == a2 and np.array_equal(o1, o2)
        actions.add(a1)
    assert len(actions) >= 2


_RANGES = {"ge_p_range": [0.002, 0.08], "ge_r_range": [0.15, 0.7], "ge_bad_range": [0.3, 1.0],
           "bernoulli_range": [0.003, 0.2]}  # fmt: skip


@pytest.mark.parametrize(
    ("distribution", "longest"),
    [
        ({**_RANGES, "loss_weights": {"ge": 0.6, "bernoulli": 0.4}},
         GilbertElliott(0.08, 0.15, 1.0)),
        ({**_RANGES, "ge_bad_range": [0.3, 0.5], "loss_weights": {"ge": 1.0}},
         GilbertElliott(0.08, 0.15, 0.5)),
        ({**_RANGES, "loss_weights": {"ge": 0.0, "bernoulli": 1.0}}, Bernoulli(0.2)),
        ({**_RANGES, "loss_weights": {"ge": 0.5, "trace": 0.5}, "trace_files": ["t.csv"]}, None),
        ({**_RANGES, "loss_weights": {"clean": 1.0}}, None),
        ({}, None),
        (None, None),
    ],
)  # fmt: skip
def test_the_bursts_a_network_trained_on_come_from_its_distribution(distribution, longest):
    """The longest mean loss burst a training distribution could draw, as the loss models
    define it (``mean_burst_length``): its Gilbert-Elliott draws' extreme (the most loss in
    the bad state, the least recovery probability), its heaviest Bernoulli draw; no bound
    where it is unknown (traces, no lossy draw, not recorded)."""
    want = longest.mean_burst_length() if longest is not None else float("inf")
    assert trained_burst_packets(distribution) == pytest.approx(want)


@pytest.mark.skipif(not shipped_policy_available(), reason="no trained policy shipped yet")
def test_beyond_the_bursts_it_trained_on_the_network_is_not_asked(recorded_observations):
    """Where the receiver's smoothed loss burst exceeds the longest mean burst the shipped
    network trained on (6.7 packets, from its sidecar), the policy plays its base action
    (no proactive repair, keep admitting) whatever the network would pick, on both the
    two-step and the fused path; within it, the network decides."""
    pol = DDQNPolicy()
    assert pol.burst_limit == pytest.approx(1 / 0.15)
    base = pol.base_action
    assert pol.actions[base].tolist() == [0.0, 1.0]
    picks = np.array([int(np.argmax(pol.weights.qvalues(o))) for o in recorded_observations])
    chosen = recorded_observations[picks != base]
    assert len(chosen) >= 20  # states where the network bets on proactive repair
    for burst, network_decides in ((pol.burst_limit - 0.1, True), (pol.burst_limit + 0.1, False)):
        obs = chosen.copy()
        obs[:, Obs.BURST_MEAN] = burst / BURST_UNIT
        want = [int(np.argmax(pol.weights.qvalues(o))) if network_decides else base for o in obs]
        assert [pol.act(o) for o in obs] == want
        assert (np.array(want) != base).any() == network_decides
    # the fused path: real sender states, the reported burst set beyond the limit
    states = []
    fused = pol.decide
    pol.decide = lambda raw, obs: states.append(raw.copy()) or fused(raw, obs)  # type: ignore
    rng = np.random.default_rng(11)
    build_simulation(EpisodeDistribution(high_rtt_share=1.0).sample(rng), pol).run()
    pol = DDQNPolicy()
    out = np.zeros(len(OBS_FIELDS), np.float32)
    within = [pol.decide(raw, out) for raw in states]
    assert any(a != base for a in within)
    for raw in states:
        raw[Raw.FB_BURST] = pol.burst_limit + 0.1
    assert all(pol.decide(raw, out) == base for raw in states)


def test_a_subclass_that_overrides_act_sees_every_decision():
    seen = []

    class Counting(DDQNPolicy):
        def act(self, obs):
            a = super().act(obs)
            seen.append(a)
            return a

    spec = EpisodeDistribution().sample(np.random.default_rng(3))
    sim = build_simulation(spec, Counting(DDQNPolicy().weights))
    sim.run()
    assert len(seen) == sim.sender.stats["decisions"] > 10


def test_data_plane_runs_the_policy_without_torch():
    code = (
        "import sys, numpy as np\n"
        "from kvtransport.sim.simulator import simulate\n"
        "from kvtransport.policies.ddqn import DDQNPolicy, QWeights\n"
        "from kvtransport.policies.features import N_FEATURES\n"
        "from kvtransport.core.policy_base import ACTIONS\n"
        "rng = np.random.default_rng(0)\n"
        "w = QWeights([(rng.normal(size=(16, N_FEATURES)), np.zeros(16)),\n"
        "              (rng.normal(size=(len(ACTIONS), 16)), np.zeros(len(ACTIONS)))], ACTIONS)\n"
        "r = simulate(policy=DDQNPolicy(w), size_bytes=300_000, seed=1, record=False)\n"
        "assert 0.0 <= r.utility_recovered <= 1.0 and r.policy == 'ddqn'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
