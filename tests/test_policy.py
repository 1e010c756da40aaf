"""Repair policies: names, the observation/action contract, and the heuristics' choices."""

import numpy as np
import pytest

from kvtransport.core.observation import OBS_CLIP, OBS_FIELDS, OBS_SIZE, Obs
from kvtransport.core.policy_base import ACTIONS, REPAIR_SHARES, Policy, PolicyContext
from kvtransport.errors import UserError
from kvtransport.policies.heuristics import ARQ, N_ACTIONS, REPAIR_ONLY, Adaptive, NoFEC
from kvtransport.policies.registry import _FACTORIES, make_policy, register_policy
from kvtransport.sim.oracle import Oracle, make_sim_policy


def test_policy_names_build_the_right_policies():
    assert isinstance(make_policy("none"), NoFEC)
    assert isinstance(make_policy("arq"), ARQ)
    assert isinstance(make_policy("adaptive"), Adaptive)
    assert isinstance(make_sim_policy("oracle"), Oracle)  # a simulation name only
    f = make_policy("fixed:4/32")
    assert f.scheme == "rlc" and f.actions[0].tolist() == pytest.approx([4 / 36, 1.0])
    b = make_policy("block-rs:4/32")
    assert b.scheme == "block-rs" and (b.block_k, b.block_p) == (32, 4)
    for bad in ("bogus", "fixed:4", "fixed:1/0", "block-rs:100/200", "fixed:-1/3", ""):
        with pytest.raises(UserError):
            make_policy(bad)


def test_registered_policies_are_built_by_name():
    class Constant(Policy):
        name = "constant-test"

        def act(self, obs):
            return 3

    register_policy("constant-test", Constant)
    try:
        assert make_policy("constant-test").act(np.zeros(OBS_SIZE, np.float32)) == 3
    finally:
        _FACTORIES.pop("constant-test")


def test_observation_and_action_tables_are_consistent():
    assert OBS_SIZE == len(OBS_FIELDS) == len(set(OBS_FIELDS))
    assert [f.value for f in Obs] == list(range(OBS_SIZE))
    assert ACTIONS.dtype == np.float32 and ACTIONS.shape == (N_ACTIONS, 2)
    assert ACTIONS[REPAIR_ONLY].tolist() == [1.0, 0.0]
    assert (ACTIONS[:-1, 1] == 1.0).all() and (np.diff(ACTIONS[:-1, 0]) > 0).all()


def _ctx(n_source=8000):
    return PolicyContext(n_source, 1280, 108e-6, 32, 0.7)


def _obs(**fields):
    o = np.zeros(OBS_SIZE, np.float32)
    o[Obs.TIME_LEFT] = 1.0
    o[Obs.SOURCE_LEFT] = 0.5
    o[Obs.LOSS_RATE] = 0.1
    o[Obs.BURST_MEAN] = 0.2
    o[Obs.RTT] = 3.0
    o[Obs.FEEDBACK_AGE] = 0.5
    for k, v in fields.items():
        o[Obs[k.upper()]] = v
    return o


def test_adaptive_admits_with_room_and_stops_when_what_is_owed_fills_the_time():
    a = Adaptive()
    a.reset(_ctx())
    plenty = a.act(_obs())
    assert plenty != REPAIR_ONLY and ACTIONS[plenty, 0] == 0.0  # feedback fresh: reactive
    slots_left = 0.7 / 108e-6
    # 40 slots of sending time left, 30 repairs owed: no room for a new interval of sources
    tight = _obs(time_left=40 / slots_left, owed=30 / 32)
    assert a.act(tight) == REPAIR_ONLY
    # everything sent already: nothing to admit, so it does not ask for repair-only
    assert a.act(_obs(time_left=40 / slots_left, owed=30 / 32, source_left=0.0)) != REPAIR_ONLY


def test_adaptive_stops_admitting_in_steps_not_a_whole_interval_at_once():
    """As the room before the deadline shrinks below one interval of sources, the repair
    share rises through the table (the interval's sources fit what room is left) before
    repair only: a whole interval stopped early spent up to 32 slots on repairs nothing
    needed."""
    a = Adaptive()
    a.reset(_ctx())
    slots_left = 0.7 / 108e-6
    shares = []
    for left in range(120, 0, -1):  # fresh feedback, nothing owed: only the room decides
        act = a.act(_obs(time_left=left / slots_left))
        shares.append(1.0 if act == REPAIR_ONLY else float(ACTIONS[act, 0]))
    assert shares[0] == 0.0 and shares[-1] == 1.0
    assert (np.diff(shares) >= 0).all()  # never admits more as time runs out
    partial = sorted(set(shares) - {0.0, 1.0})
    assert len(partial) >= 4 and max(partial) == REPAIR_SHARES[-1]
    # while it still admits, an interval's sources n (1 - share) shrink one step at a time:
    # no jump from a whole interval of sources to none
    sources = [32 * (1.0 - s) for s in shares if s < 1.0]
    assert min(sources) <= 16.0 + 1e-9


def test_adaptive_protects_proactively_without_fresh_feedback():
    a = Adaptive(prior_loss=0.1)
    a.reset(_ctx())
    blind = a.act(_obs(feedback_age=OBS_CLIP))
    stale = a.act(_obs(feedback_age=6.0, loss_rate=0.2))
    assert 0.1 <= ACTIONS[blind, 0] <= 0.2
    assert ACTIONS[stale, 0] >= 0.2


def test_oracle_needs_the_channel_and_reads_its_future():
    o = Oracle()
    o.reset(_ctx())
    with pytest.raises(RuntimeError):
        o.act(_obs())


def test_fixed_baselines_ignore_the_observation():
    for name in ("none", "fixed:2/16", "block-rs:2/16", "arq"):
        p = make_policy(name)
        p.reset(_ctx())
        assert p.act(_obs()) == p.act(_obs(loss_rate=0.9, time_left=0.01)) == 0
        assert len(p.actions) == 1
