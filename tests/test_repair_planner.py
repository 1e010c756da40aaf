"""The clairvoyant planner (kvtransport.sim.repair_planner) against causal policies on the same
realizations: never below any of them, never above the genie bound, and its clairvoyant
plans find more than the causal ones do where feedback comes late."""

from functools import partial

import pytest
from kvtransport.agents.episodes import build_simulation, eval_spec

from kvtransport.policies.registry import make_policy
from kvtransport.sim.repair_planner import CAUSAL_SEARCH, SEARCH, candidate, clairvoyant_plan, play

EPISODES = [("ge-heavy", 0.7, None, i) for i in range(2)] + [
    ("ge-heavy", 0.7, 80.0, i) for i in range(3)
] + [("bernoulli-5", 0.7, 40.0, 2)]  # fmt: skip


def _build(channel, rho, delay, i):
    return partial(build_simulation, eval_spec(channel, rho, i, delay_ms=delay))


def test_planner_at_least_every_causal_policy_and_at_most_the_genie_bound():
    gains = []
    for ep in EPISODES:
        build = _build(*ep)
        plan = clairvoyant_plan(build)
        assert set(plan.scores) == set(SEARCH)
        # each causal policy played on its own, on the same realization (a fresh build)
        causal = {name: play(build, candidate(name)) for name in CAUSAL_SEARCH}
        causal["ddqn"] = play(build, make_policy("ddqn"))
        for name in CAUSAL_SEARCH:  # the same realization: the search scored it alike
            assert plan.scores[name] == causal[name], (ep, name)
            assert plan.utility >= causal[name], (ep, name)
        bound = build(make_policy("none")).meta["utility_bound"]
        assert plan.utility <= bound + 1e-12, ep
        # the DDQN joins the search as a known result (nothing is played again), and then
        # never beats the planner
        with_ddqn = clairvoyant_plan(build, known={**plan.scores, "ddqn": causal["ddqn"]})
        assert with_ddqn.utility == max(plan.utility, causal["ddqn"])
        gains.append(plan.utility - max(causal[n] for n in CAUSAL_SEARCH))
    # on a long link the clairvoyant plans beat every causal one somewhere, clearly
    assert max(gains) > 0.01


def test_known_results_are_not_replayed_and_an_empty_search_is_refused():
    build = _build("ge-heavy", 0.7, None, 0)
    plan = clairvoyant_plan(build, known={"tail-rule": 2.0}, search=("tail-rule",))
    assert plan.best == "tail-rule" and plan.utility == 2.0
    with pytest.raises(ValueError):
        clairvoyant_plan(build, search=())
    with pytest.raises(ValueError):
        candidate("oracle:x=1")
