"""Handoff episodes: the planned stream (prefix order, mixed precisions) as an episode."""

import hashlib

import numpy as np
import pytest
from kvtransport.agents.env import RepairSchedulingEnv
from kvtransport.agents.episodes import (
    HANDOFF_LAYERS,
    EpisodeDistribution,
    EpisodeSpec,
    build_simulation,
    eval_spec,
    handoff_ranges,
    handoff_stream,
    handoff_table,
    handoff_utilities,
    spec_deadline,
    spec_transfer,
)

from kvtransport.kvformat.blocks import Geometry
from kvtransport.model.utility import stream_order
from kvtransport.policies.heuristics import ConstantAction
from kvtransport.sim.simulator import simulate

SMOLLM2 = Geometry(HANDOFF_LAYERS, 3, 16, 64, "float16")
BLOCK_SIZES = {int(SMOLLM2.block_nbytes(p)) for p in ("fp16", "int8", "int4")}


def default_digest() -> str:
    """A digest of a few default (utility-stream) episodes: specs, deadlines, tables."""
    h = hashlib.sha256()
    rng = np.random.default_rng(7)
    dist = EpisodeDistribution()
    specs = [dist.sample(rng) for _ in range(6)]
    specs += [
        eval_spec("ge-heavy", 0.8, 1),
        eval_spec("bernoulli-5", 1.0, 2, utility="zipf:1", delay_ms=40),
    ]
    for s in specs:
        t = spec_transfer(s)
        h.update(s.describe().encode())
        h.update(repr(spec_deadline(s)).encode())
        for a in (t.blocks.offsets, t.blocks.lengths, t.blocks.utilities):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(str(len(t.payload)).encode())
    return h.hexdigest()


def test_default_episodes_are_unchanged():
    """The digest the code before stream modes gave for the same draws."""
    assert default_digest() == "724a4b5b34dbb1f2c447063fcdbf1425e0f7d8f962dc44f74a9de5f696ffdb83"


@pytest.mark.parametrize("index", range(4))
def test_handoff_stream_is_the_plans_tail_in_position_order(index):
    spec = eval_spec("ge-heavy", 1.0, index, stream="handoff")
    t = spec_transfer(spec)
    table = t.blocks
    n = len(table)
    assert 0 < n <= spec.n_blocks
    # contiguous blocks that make up the payload, at SmolLM2's per-precision sizes
    assert int(table.lengths.sum()) == len(t.payload) == spec.size_bytes
    assert np.array_equal(table.offsets[1:], np.cumsum(table.lengths)[:-1])
    assert set(table.lengths.tolist()) <= BLOCK_SIZES
    # the sent blocks are the last n of the position order (the receiver's prefix is the
    # front), each with its share of the sent utility; utility is not sorted
    u = handoff_utilities(spec.seed, spec.n_blocks // HANDOFF_LAYERS)
    pos = u.reshape(-1)[stream_order(u, 16, "position")][-n:]
    np.testing.assert_allclose(table.utilities, pos / pos.sum(), rtol=1e-12)
    assert table.utilities.sum() == pytest.approx(1.0)
    assert (np.diff(table.utilities) > 0).any()


def test_handoff_episodes_mix_precisions_and_leave_a_prefix():
    tables = [handoff_table(eval_spec("bernoulli-5", 1.0, i, stream="handoff")) for i in range(8)]
    assert any(len(set(t.lengths.tolist())) > 1 for t in tables)
    specs = [eval_spec("bernoulli-5", 1.0, i, stream="handoff") for i in range(8)]
    assert any(len(t) < s.n_blocks for t, s in zip(tables, specs, strict=True))


def test_handoff_episode_is_reproducible_from_its_seed():
    spec = eval_spec("ge-heavy", 1.0, 2, stream="handoff")
    a = handoff_table(spec)
    handoff_stream.cache_clear()
    b = handoff_table(spec)
    assert a is not b
    for x, y in ((a.offsets, b.offsets), (a.lengths, b.lengths), (a.utilities, b.utilities)):
        assert np.array_equal(x, y)
    other = handoff_table(EpisodeSpec(**{**spec.__dict__, "seed": spec.seed + 100}))
    assert not np.array_equal(other.utilities, a.utilities[: len(other)])


def test_distribution_draws_handoff_episodes_only_when_asked():
    rng = np.random.default_rng(3)
    mixed = EpisodeDistribution(handoff_share=0.5, handoff_tokens=(150, 400))
    specs = [mixed.sample(rng) for _ in range(12)]
    handoff = [s for s in specs if s.stream == "handoff"]
    assert 0 < len(handoff) < len(specs)
    for s in handoff:
        assert 0.95 <= s.rho <= 1.1 and s.n_blocks % HANDOFF_LAYERS == 0
        assert len(set(handoff_table(s).lengths.tolist())) >= 1
    plain = [EpisodeDistribution().sample(np.random.default_rng(3)) for _ in range(2)]
    assert all(s.stream == "utility" for s in plain)


def test_environment_plays_a_handoff_episode_as_the_simulator_does():
    spec = eval_spec("ge-heavy", 1.0, 0, stream="handoff")
    env = RepairSchedulingEnv()
    env.reset(options={"spec": spec})
    total, done = 0.0, False
    while not done:
        _, r, done, _, _ = env.step(0)
        total += r
    res = simulate(
        spec_transfer(spec),
        channel=spec.channel,
        feedback_channel=spec.feedback,
        rho=spec.rho,
        policy=ConstantAction(0),
        seed=spec.seed,
        symbol_size=spec.symbol_size,
        record=False,
        whole_groups=handoff_ranges(spec),
    )
    assert 0.2 < total < 1.0
    assert total == pytest.approx(res.utility_recovered, abs=1e-12)


def test_bad_stream_settings_are_one_line_errors():
    prof = eval_spec("ge-heavy", 1.0, 0).channel
    with pytest.raises(ValueError, match="unknown stream"):
        EpisodeSpec(seed=1, channel=prof, feedback=prof, rho=1.0, n_blocks=60, stream="x")
    with pytest.raises(ValueError, match="multiple of 30"):
        EpisodeSpec(seed=1, channel=prof, feedback=prof, rho=1.0, n_blocks=61, stream="handoff")
    with pytest.raises(ValueError, match="unknown stream"):
        eval_spec("ge-heavy", 1.0, 0, stream="prefix")


def test_handoff_ranges_are_whole_token_ranges_in_stream_order():
    spec = eval_spec("bernoulli-5", 1.0, 1, stream="handoff")
    ranges = handoff_ranges(spec)
    assert len(ranges) == len(handoff_table(spec))
    # prefix order: each sent token range is HANDOFF_LAYERS consecutive blocks, ranges rise
    counts = np.unique(ranges, return_counts=True)[1]
    assert (counts == HANDOFF_LAYERS).all()
    assert (np.diff(ranges) >= 0).all() and ranges[0] > 0  # the receiver computes a prefix


def test_a_handoff_range_missing_one_block_scores_nothing():
    """ge-heavy, rho 1.0, episode 10, tail rule only: one token range ends the transfer
    with 29 of its 30 layer blocks decoded; the range is recomputed by the receiver, so
    none of its utility counts, and the score is the utility of the whole ranges. (Since
    a hole reported in its last round gets a spare repair, it is the only such range in
    episodes 1-11 of ge-heavy at rho 0.8 and 1.0 and bernoulli-5 at rho 0.8.)"""
    spec = eval_spec("ge-heavy", 1.0, 10, stream="handoff")
    sim = build_simulation(spec, ConstantAction(0))
    sim.run()
    res = sim.receiver.result
    ranges = handoff_ranges(spec)
    util = handoff_table(spec).utilities
    whole, partial = 0.0, {}
    for r in np.unique(ranges):
        done = res.complete[ranges == r]
        if done.all():
            whole += float(util[ranges == r].sum())
        elif done.any():
            partial[int(r)] = (int((~done).sum()), float(util[ranges == r][done].sum()))
    one_lost = [r for r, (missing, _) in partial.items() if missing == 1]
    assert one_lost, partial  # the case this test is about
    lost = sum(u for _, u in partial.values())
    assert lost > 0.001
    assert sim.utility_recovered == pytest.approx(whole, abs=1e-12)
    assert sim.result().utility_recovered == sim.utility_recovered
    # the receiver's own count (block by block) credits the partial ranges' blocks
    assert res.utility_recovered == pytest.approx(whole + lost, abs=1e-12)


def test_utility_stream_episodes_score_block_by_block():
    spec = eval_spec("ge-heavy", 0.8, 1)
    sim = build_simulation(spec, ConstantAction(0))
    assert sim.whole_groups is None
    sim.run()
    assert sim.utility_recovered == sim.receiver.result.utility_recovered
