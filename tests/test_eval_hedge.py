"""scripts/eval_hedge.py, small: on the modelled clock the demo's plan with its hedge lets
a receiver slower than it measured finish sooner, and costs one on time at most a call."""

import importlib.util
from pathlib import Path

import pytest

from kvtransport.model.cache_builder import ComputeSpeed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_hedge.py"
pytestmark = pytest.mark.model


def _script():
    spec = importlib.util.spec_from_file_location("eval_hedge", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_hedge_pays_for_a_slow_receiver_and_costs_at_most_a_call_on_time(smollm):
    mod = _script()
    speed = ComputeSpeed(per_call_s=0.005, per_token_s=0.003)  # calls cheap: a hedge at 512
    prep = mod.prepare(smollm, 512, 1, 100.0, speed)
    plan = prep["plans"][True][0]
    assert plan.hedge > 0 and prep["plans"][False][0].hedge == 0
    doc = mod.run([prep], [1.0, 1.5], [1.0])
    on_time, slow = (c["seeds"][0] for c in doc["cells"])
    assert on_time["hedged_s"] <= on_time["bare_s"] + speed.per_call_s + 1e-9
    assert slow["hedged_s"] < 0.95 * slow["bare_s"] and slow["hedge_loaded"] > 0
