"""scripts/eval_long.py, small: one 128-token handoff on the emulated link answers like
the full cache and reports a speed-up that is the ratio of the TTFTs it measured; the
mismeasured speeds it plans on are the measured one slowed, trusted or not as their
spread says, and each TTFT ratio pairs a plan's round with the measured plan's round."""

import importlib.util
from pathlib import Path

import pytest

from kvtransport.model.cache_builder import TRUST_LIMIT, ComputeSpeed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_long.py"


def _script():
    spec = importlib.util.spec_from_file_location("eval_long", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.model
def test_a_small_run_answers_like_the_full_cache_and_reports_its_ttfts(smollm, tmp_path):
    from kvtransport.model.loader import set_threads

    try:
        run = _script().one(128, 1, 100.0, str(tmp_path), None, questions=1,
                            max_new_tokens=4, loaded=smollm)  # fmt: skip
    finally:
        set_threads(1)
    assert not run["error"]
    assert run["matches"] == run["questions"] == 1  # the answer the full cache gives
    assert run["speedup"] == pytest.approx(run["reprefill_s"] / run["ttft_s"])
    assert run["computed"] + run["loaded"] == run["context_tokens"]
    assert run["receiver_bytes"] > 0 and run["card_bytes"] > 0


def test_the_mismeasured_speeds_and_the_ttft_ratios():
    mod = _script()
    s = ComputeSpeed(0.01, 0.002, 1e-6)
    speeds = dict(mod.mis_speeds(s, 10.0, [0.0, 1.0]))
    assert list(speeds) == ["measured", "mis0", "mis1"]
    measured, trusted, shaky = (ComputeSpeed(*speeds[k]) for k in speeds)
    assert measured == s
    assert trusted.per_token_s == pytest.approx(10 * s.per_token_s) and trusted.trusted
    assert shaky.per_pair_s == 79e-6 and shaky.spread > TRUST_LIMIT and not shaky.trusted
    out = {"measured": [{"ttft_s": 2.0}, {"ttft_s": 4.0}, {"ttft_s": 1.0}],
           "mis1": [{"ttft_s": 3.0}, {"ttft_s": 4.0}, {"ttft_s": 2.0}],
           "speed": {"per_call_s": 0.01}}  # fmt: skip
    assert mod.ttft_ratios(out) == {"mis1": pytest.approx(1.5)}  # median of 1.5, 1, 2
