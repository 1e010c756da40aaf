"""The repair-scheduling Gymnasium environment: API, reward = utility, episode distribution."""

from pathlib import Path

import gymnasium as gym
import kvtransport.agents  # noqa: F401  (registers the environment)
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from kvtransport.agents.env import ENV_ID, RepairSchedulingEnv
from kvtransport.agents.episodes import (
    EVAL_CHANNELS,
    HELD_OUT_SEED,
    EpisodeDistribution,
    eval_spec,
    near_eval_channel,
    previous_transfer_loss,
    round_trip,
    spec_deadline,
    spec_transfer,
)
from kvtransport.netem import SAMPLE_TRACE, Bernoulli, FourState, GilbertElliott, load_profile
from kvtransport.netem.profiles import ProfileError

from kvtransport.core.observation import OBS_SIZE, Obs
from kvtransport.core.policy_base import ACTIONS, Policy
from kvtransport.sim.simulator import simulate

SMALL = {"blocks_range": (60, 160), "utility_weights": {"zipf": 1.0, "flat": 1.0}}


class Replay(Policy):
    """Plays a recorded action sequence (ExternalPolicy's properties: RLC, reactive)."""

    name = "replay"
    reactive = True

    def __init__(self, actions):
        self.seq = list(actions)
        self.i = 0

    def act(self, obs):
        a = self.seq[self.i]
        self.i += 1
        return a


def test_registered_and_passes_the_gymnasium_checker():
    env = gym.make(ENV_ID, distribution=EpisodeDistribution(**SMALL))
    check_env(env.unwrapped)
    assert env.action_space.n == len(ACTIONS)
    assert env.observation_space.shape == (OBS_SIZE,)
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    assert info["utility"] == 0.0
    env.close()


@pytest.mark.parametrize("seed", [5, 11])
def test_rewards_sum_to_the_utility_the_simulator_reports(seed):
    """The return of an episode is exactly what `simulate` reports as utility recovered
    before the deadline for the same transfer, channels, seed and actions."""
    rng = np.random.default_rng(seed)
    env = RepairSchedulingEnv(EpisodeDistribution(**SMALL))
    obs, info = env.reset(seed=seed)
    spec = info["spec"]
    actions, rewards, done = [], [], False
    while not done:
        a = int(rng.choice(len(ACTIONS), p=[0.5] + [0.45 / 7] * 7 + [0.05]))
        obs, r, done, trunc, info = env.step(a)
        assert not trunc and env.observation_space.contains(obs)
        assert r >= 0.0
        actions.append(a)
        rewards.append(r)
    res = simulate(
        spec_transfer(spec),
        channel=spec.channel,
        feedback_channel=spec.feedback,
        rho=spec.rho,
        policy=Replay(actions),
        seed=spec.seed,
        symbol_size=spec.symbol_size,
        record=False,
    )
    assert len(actions) > 5
    assert sum(rewards) == pytest.approx(res.utility_recovered, abs=1e-12)
    assert info["utility"] == pytest.approx(res.utility_recovered, abs=1e-15)
    assert res.utility_recovered > 0.2


def test_return_counts_nothing_after_the_deadline():
    """An episode ends after the deadline; the last reward still counts only utility that
    was decoded by then (the receiver's result at the deadline)."""
    env = RepairSchedulingEnv()
    spec = eval_spec("ge-heavy", 0.6, 2, utility="zipf:1")
    env.reset(options={"spec": spec})
    total, done = 0.0, False
    while not done:
        _, r, done, _, _ = env.step(0)
        total += r
    sim = env.sim
    assert sim.receiver.result.reason == "deadline"
    assert sim.now >= sim.deadline
    assert total == pytest.approx(sim.receiver.result.utility_recovered, abs=1e-12)
    assert total < 0.99  # rho 0.6: not everything fits


def test_same_seed_same_episode():
    a = RepairSchedulingEnv(EpisodeDistribution(**SMALL))
    b = RepairSchedulingEnv(EpisodeDistribution(**SMALL))
    oa, ia = a.reset(seed=42)
    ob, ib = b.reset(seed=42)
    assert ia["spec"] == ib["spec"] and np.array_equal(oa, ob)
    for _ in range(4):
        ra = a.step(1)
        rb = b.step(1)
        assert np.array_equal(ra[0], rb[0]) and ra[1] == rb[1]
    oc, ic = a.reset(seed=43)
    assert ic["spec"] != ia["spec"]


def test_training_distribution_is_wide_and_keeps_the_evaluation_out():
    dist = EpisodeDistribution(trace_files=(SAMPLE_TRACE,))
    rng = np.random.default_rng(0)
    specs = [dist.sample(rng) for _ in range(400)]
    kinds = {s.channel.loss.kind for s in specs}
    assert {"gemodel", "random", "trace"} <= kinds
    assert "state" not in kinds  # the 4-state model is never trained on
    assert all(s.seed < HELD_OUT_SEED for s in specs)
    for s in specs:
        if s.channel.loss.kind in ("gemodel", "random"):
            assert not near_eval_channel(s.channel.loss)
    rhos = np.array([s.rho for s in specs])
    assert rhos.min() < 0.65 and rhos.max() > 1.15
    rates = np.array([s.channel.rate_mbps for s in specs])
    assert rates.min() < 60 and rates.max() > 700  # 50 Mbit/s .. 1 Gbit/s
    losses = [s.channel.stationary_loss() for s in specs if s.channel.loss.kind == "gemodel"]
    assert min(losses) < 0.01 and max(losses) > 0.15
    utilities = {s.utility.split(":")[0] for s in specs}
    assert utilities == {"measured", "zipf", "flat", "linear"}
    assert all(s.utility.startswith("measured:train:") for s in specs if "measured" in s.utility)
    fb_delays = {
        round(s.feedback.delay_ms / s.channel.delay_ms, 3)
        for s in specs
        if not s.channel.is_trace and s.channel.delay_ms > 0
    }
    assert len(fb_delays) > 10  # feedback delays vary on their own
    # long links (one-way 20..90 ms) make up about high_rtt_share of the non-trace draws,
    # with deadlines down to high_rtt_min_rtts round trips (short links keep 5)
    links = [s for s in specs if not s.channel.is_trace]
    long = [s for s in links if s.channel.delay_ms >= dist.delay_range_ms[1]]
    assert 0.3 < len(long) / len(links) < 0.6
    assert max(s.channel.delay_ms for s in long) > 70
    rtts = [spec_deadline(s) / round_trip(s) for s in long]
    assert min(rtts) >= dist.high_rtt_min_rtts and min(rtts) < 4.0
    assert all(spec_deadline(s) >= 5.0 * round_trip(s) for s in links if s not in long)
    # without the long-link share the draws are those of the short-link distribution
    short = EpisodeDistribution(trace_files=(SAMPLE_TRACE,), high_rtt_share=0.0)
    rng0 = np.random.default_rng(0)
    assert all(short.sample(rng0).channel.delay_ms < 20.0 for _ in range(100))
    # every evaluation channel is itself "near" (so it is excluded), a far one is not
    for name in EVAL_CHANNELS[:3]:
        assert near_eval_channel(load_profile(name).loss)
    assert not near_eval_channel(Bernoulli(0.15))
    assert isinstance(load_profile("4state-bursty").loss, FourState)


def test_a_profiles_file_keeps_its_channels_out_of_the_loss_draws(tmp_path):
    """A range widened to long outages (r from 3 %) would draw gilbert-long's neighbours;
    with held-out.toml excluded it does not, and still draws long outages elsewhere."""
    held_out = str(Path(__file__).resolve().parents[1] / "netem" / "data" / "held-out.toml")
    gilbert_long = load_profile("gilbert-long", held_out).loss
    near = GilbertElliott(0.005, 0.055, 1.0, 0.0)  # within EXCLUDE_FACTOR of it
    wide = {
        "ge_r_range": (0.03, 0.1),
        "ge_bad_range": (1.0, 1.0),
        "ge_good_range": (0.0, 0.0),
        "loss_weights": {"ge": 1.0},
    }
    kept = EpisodeDistribution(exclude_profiles=(held_out,), **wide)
    assert near_eval_channel(near, more=kept._excluded)
    assert near_eval_channel(gilbert_long, more=kept._excluded)
    assert not near_eval_channel(near)  # not an evaluation channel by itself
    rng, other = np.random.default_rng(3), EpisodeDistribution(**wide)
    losses = [kept._loss(rng, "ge") for _ in range(400)]
    assert not any(near_eval_channel(x, more=kept._excluded) for x in losses)
    assert max(x.mean_burst_length() for x in losses) > 10  # long outages still drawn
    assert any(near_eval_channel(other._loss(rng, "ge"), more=kept._excluded) for _ in range(400))
    bad = tmp_path / "bad.toml"
    bad.write_text("[profiles.x]\nloss = 'nonsense'\n")
    with pytest.raises(ProfileError):
        EpisodeDistribution(exclude_profiles=(str(bad),))


def test_trace_window_episode_runs():
    dist = EpisodeDistribution(trace_files=(SAMPLE_TRACE,), loss_weights={"trace": 1.0}, **SMALL)
    env = RepairSchedulingEnv(dist)
    _, info = env.reset(seed=1)
    assert info["spec"].channel.is_trace
    done, total = False, 0.0
    while not done:
        _, r, done, _, _ = env.step(0)
        total += r
    assert 0.0 < total <= 1.0


def test_evaluation_episodes_are_held_out():
    s = eval_spec("ge-heavy", 0.8, 3)
    assert s.seed >= HELD_OUT_SEED and s.utility.startswith("measured:eval:")
    assert s.channel.name == "ge-heavy" and s.feedback == s.channel
    far = eval_spec("ge-heavy", 0.8, 3, delay_ms=40)
    assert far.channel.delay_ms == far.feedback.delay_ms == 40.0
    assert far.seed == s.seed and far.channel.loss == s.channel.loss


def test_long_round_trips_are_observed_past_the_rtt_clip():
    """RTT clips at 16 intervals (what the heuristics read); RTT_LONG carries the smoothed
    RTT up to 256 intervals, so the network can tell a 40 ms link from an 80 ms one."""
    seen = {}
    for delay in (5.0, 40.0, 80.0):
        env = RepairSchedulingEnv()
        obs, _ = env.reset(options={"spec": eval_spec("ge-heavy", 1.0, 0, delay_ms=delay)})
        done = False
        while not done and obs[Obs.FEEDBACK_AGE] >= 16.0:
            obs, _, done, _, _ = env.step(0)
        assert not done and env.observation_space.contains(obs)
        if obs[Obs.RTT] < 16.0:
            assert obs[Obs.RTT_LONG] * 64.0 == pytest.approx(obs[Obs.RTT], rel=1e-5)
        seen[delay] = (float(obs[Obs.RTT]), float(obs[Obs.RTT_LONG]) * 64.0)
    assert seen[5.0][0] < 16.0
    assert seen[40.0][0] == seen[80.0][0] == 16.0  # the clipped field cannot tell them apart
    assert 16.0 < seen[40.0][1] < seen[80.0][1]
    assert seen[80.0][1] == pytest.approx(2 * seen[40.0][1], rel=0.15)


def test_episodes_carry_a_loss_prior_as_a_daemon_has_it_and_the_agent_observes_it():
    dist = EpisodeDistribution(**SMALL)
    rng = np.random.default_rng(3)
    specs = [dist.sample(rng) for _ in range(120)]
    priors = [s.prior_loss for s in specs]
    assert 0.15 < sum(p is None for p in priors) / len(priors) < 0.5  # first transfers
    known = [(s, p) for s, p in zip(specs, priors, strict=True) if p is not None]
    # an earlier transfer's loss tracks the link's, with an estimate's scatter
    lossy = [(s.channel.stationary_loss(), p) for s, p in known if not s.channel.is_trace]
    truth, est = np.array(lossy).T
    assert np.corrcoef(truth, est)[0, 1] > 0.8 and np.any(np.abs(est - truth) > 1e-3)
    ge = load_profile("ge-heavy")
    prev = [previous_transfer_loss(ge, i) for i in range(40)]
    assert abs(np.mean(prev) - ge.stationary_loss()) < 0.03 and np.std(prev) > 0.005
    assert eval_spec("ge-heavy", 0.8, 0).prior_loss is None  # the default: none
    held = eval_spec("ge-heavy", 0.8, 2, prior="previous")
    assert held.prior_loss == previous_transfer_loss(ge, HELD_OUT_SEED + 2)
    assert eval_spec("ge-heavy", 0.8, 2, prior="profile").prior_loss == ge.stationary_loss()
    # the agent sees it from the first decision, and it stands in for the loss estimate
    # until the first feedback
    env = RepairSchedulingEnv(dist)
    for prior in (None, 0.12):
        spec = eval_spec("ge-heavy", 0.8, 0, delay_ms=40)
        spec = type(spec)(**{**spec.__dict__, "prior_loss": prior})
        obs, _ = env.reset(options={"spec": spec})
        assert obs[Obs.FEEDBACK_AGE] == 16.0  # nothing heard yet
        assert obs[Obs.PRIOR_KNOWN] == (prior is not None)
        assert obs[Obs.PRIOR_LOSS] == np.float32(prior or 0.0)
        assert obs[Obs.LOSS_RATE] == np.float32(prior or 0.0)
        assert env.observation_space.contains(obs)
