"""Repair policies: names, the observation/action contract, and the heuristics' choices."""

import numpy as np
import pytest

from kvtransport.core import policy as P
from kvtransport.errors import UserError


def test_policy_names_build_the_right_policies():
    assert isinstance(P.make_policy("none"), P.NoFEC)
    assert isinstance(P.make_policy("arq"), P.ARQ)
    assert isinstance(P.make_policy("adaptive"), P.Adaptive)
    assert isinstance(P.make_policy("oracle"), P.Oracle)
    f = P.make_policy("fixed:4/32")
    assert f.scheme == "rlc" and f.actions[0].tolist() == pytest.approx([4 / 36, 1.0])
    b = P.make_policy("block-rs:4/32")
    assert b.scheme == "block-rs" and (b.block_k, b.block_p) == (32, 4)
    for bad in ("bogus", "fixed:4", "fixed:1/0", "block-rs:100/200", "fixed:-1/3", ""):
        with pytest.raises(UserError):
            P.make_policy(bad)


def test_registered_policies_are_built_by_name():
    class Constant(P.Policy):
        name = "constant-test"

        def act(self, obs):
            return 3

    P.register_policy("constant-test", Constant)
    try:
        assert P.make_policy("constant-test").act(np.zeros(P.OBS_SIZE, np.float32)) == 3
    finally:
        P._FACTORIES.pop("constant-test")


def test_observation_and_action_tables_are_consistent():
    assert P.OBS_SIZE == len(P.OBS_FIELDS) == len(set(P.OBS_FIELDS))
    assert [f.value for f in P.Obs] == list(range(P.OBS_SIZE))
    assert P.ACTIONS.dtype == np.float32 and P.ACTIONS.shape == (P.N_ACTIONS, 2)
    assert P.ACTIONS[P.REPAIR_ONLY].tolist() == [1.0, 0.0]
    assert (P.ACTIONS[:-1, 1] == 1.0).all() and (np.diff(P.ACTIONS[:-1, 0]) > 0).all()


def _ctx(n_source=8000):
    return P.PolicyContext(n_source, 1280, 108e-6, 32, 0.7)


def _obs(**fields):
    o = np.zeros(P.OBS_SIZE, np.float32)
    o[P.Obs.TIME_LEFT] = 1.0
    o[P.Obs.SOURCE_LEFT] = 0.5
    o[P.Obs.LOSS_RATE] = 0.1
    o[P.Obs.BURST_MEAN] = 0.2
    o[P.Obs.RTT] = 3.0
    o[P.Obs.FEEDBACK_AGE] = 0.5
    for k, v in fields.items():
        o[P.Obs[k.upper()]] = v
    return o


def test_adaptive_admits_with_room_and_stops_when_what_is_owed_fills_the_time():
    a = P.Adaptive()
    a.reset(_ctx())
    plenty = a.act(_obs())
    assert plenty != P.REPAIR_ONLY and P.ACTIONS[plenty, 0] == 0.0  # feedback fresh: reactive
    slots_left = 0.7 / 108e-6
    # 40 slots of sending time left, 30 repairs owed: no room for a new interval of sources
    tight = _obs(time_left=40 / slots_left, owed=30 / 32)
    assert a.act(tight) == P.REPAIR_ONLY
    # everything sent already: nothing to admit, so it does not ask for repair-only
    assert a.act(_obs(time_left=40 / slots_left, owed=30 / 32, source_left=0.0)) != P.REPAIR_ONLY


def test_adaptive_stops_admitting_in_steps_not_a_whole_interval_at_once():
    """As the room before the deadline shrinks below one interval of sources, the repair
    share rises through the table (the interval's sources fit what room is left) before
    repair only: a whole interval stopped early spent up to 32 slots on repairs nothing
    needed."""
    a = P.Adaptive()
    a.reset(_ctx())
    slots_left = 0.7 / 108e-6
    shares = []
    for left in range(120, 0, -1):  # fresh feedback, nothing owed: only the room decides
        act = a.act(_obs(time_left=left / slots_left))
        shares.append(1.0 if act == P.REPAIR_ONLY else float(P.ACTIONS[act, 0]))
    assert shares[0] == 0.0 and shares[-1] == 1.0
    assert (np.diff(shares) >= 0).all()  # never admits more as time runs out
    partial = sorted(set(shares) - {0.0, 1.0})
    assert len(partial) >= 4 and max(partial) == P.REPAIR_SHARES[-1]
    # while it still admits, an interval's sources n (1 - share) shrink one step at a time:
    # no jump from a whole interval of sources to none
    sources = [32 * (1.0 - s) for s in shares if s < 1.0]
    assert min(sources) <= 16.0 + 1e-9


def test_adaptive_protects_proactively_without_fresh_feedback():
    a = P.Adaptive(prior_loss=0.1)
    a.reset(_ctx())
    blind = a.act(_obs(feedback_age=P.OBS_CLIP))
    stale = a.act(_obs(feedback_age=6.0, loss_rate=0.2))
    assert 0.1 <= P.ACTIONS[blind, 0] <= 0.2
    assert P.ACTIONS[stale, 0] >= 0.2


def test_oracle_needs_the_channel_and_reads_its_future():
    o = P.Oracle()
    o.reset(_ctx())
    with pytest.raises(RuntimeError):
        o.act(_obs())


def test_fixed_baselines_ignore_the_observation():
    for name in ("none", "fixed:2/16", "block-rs:2/16", "arq"):
        p = P.make_policy(name)
        p.reset(_ctx())
        assert p.act(_obs()) == p.act(_obs(loss_rate=0.9, time_left=0.01)) == 0
        assert len(p.actions) == 1
