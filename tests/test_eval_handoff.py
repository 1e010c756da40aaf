"""scripts/eval_handoff.py, small: the prefix stream order concentrates a lost tail in
few token ranges (what the receiver recomputes), the utility order scatters it; and the
summary table is computed from the runs it is given."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_handoff.py"


def _script():
    spec = importlib.util.spec_from_file_location("eval_handoff", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.model
def test_prefix_order_concentrates_what_a_lost_tail_costs(smollm):
    conc = _script().concentration(smollm, tokens=256, seed=2)
    pos, util = conc["position"], conc["utility"]
    # the last 10 % of the stream: one or two token ranges in prefix order, most of the
    # context in utility order (a layer's block in nearly every range)
    assert pos["token_ranges"] <= 2 < util["token_ranges"]
    assert pos["share"] < 0.15 < util["share"]


def test_summary_rows_are_the_runs_statistics():
    mod = _script()
    run = lambda seed, sp, m: {  # noqa: E731
        "seed": seed, "context_tokens": 500, "reprefill_ttft_s": 2.0, "budget_s": 0.6,
        "plan": {}, "rows": {"DDQN": {"ttft_s": 2.0 / sp, "speedup": sp, "matches": m,
                                      "questions": 5, "computed": 40, "utility": 1.0}},
    }  # fmt: skip
    doc = {"budget": 0.3, "seeds": [1, 2, 3], "configs": {"512@100": {
        "tokens": 512, "rate_mbps": 100.0,
        "runs": [run(1, 2.0, 5), run(2, 3.0, 4), run(3, 4.0, 5)]}}}  # fmt: skip
    table = mod.render(doc)
    row = next(line for line in table.splitlines() if "| DDQN |" in line)
    assert "3.00x [2.00, 4.00]" in row and "4/5, 4.7" in row


def test_plan_variants_are_compared_paired_by_seed():
    """--hedges 0.25,0 (or --tails 1,0): each seed runs once per variant; the second
    variant's row shows the median over seeds of its speed-up over the first's on the same
    seed."""
    mod = _script()
    assert mod.variant_name("position", 0.25, True, (0.25, 0.0), (True,)) == "position, hedge 0.25"
    assert mod.variant_name("back", 0.25, True, (0.25,), (True,)) == "back"
    assert (
        mod.variant_name("back", 0.0, False, (0.25, 0.0), (True, False)) == "back, hedge 0, no tail"
    )
    names = ["position, hedge 0.25", "position, hedge 0"]
    run = lambda seed, variant, sp: {  # noqa: E731
        "seed": seed, "variant": variant, "context_tokens": 500, "plan": {},
        "rows": {"adaptive": {"speedup": sp, "matches": 5, "questions": 5, "computed": 40}},
    }  # fmt: skip
    runs = [run(1, names[0], 4.0), run(1, names[1], 3.0), run(2, names[0], 2.0),
            run(2, names[1], 3.0), run(3, names[0], 5.0), run(3, names[1], 4.0)]  # fmt: skip
    doc = {"budget": 0.3, "seeds": [1, 2, 3], "variants": names, "speed_error": 0.8,
           "configs": {"2048@100": {"tokens": 2048, "rate_mbps": 100.0, "runs": runs}}}  # fmt: skip
    table = mod.render(doc)
    row = next(line for line in table.splitlines() if "| position, hedge 0 | adaptive |" in line)
    assert "| 0.800 [0.750, 1.500] |" in row  # per seed 3/4, 3/2, 4/5
    assert "believes its compute takes 0.8 of what it measured" in table
