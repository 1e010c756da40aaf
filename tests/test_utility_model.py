"""The sigmoid utility: closed forms, the fit and the table file the daemon reads."""

import json

import numpy as np
import pytest

from kvtransport.errors import UserError
from kvtransport.model import metrics
from kvtransport.model.utility_fit import MEASURE_SEED, fit_sigmoid, measure_sample
from kvtransport.scheduling.utility_model import (
    SigmoidUtility,
    UtilityCurve,
    UtilityTable,
    packaged_model_ids,
)

X = np.linspace(0.0, 1.0, 41)


def _noisy(u, seed, sigma=0.01):
    rng = np.random.default_rng(seed)
    return u(X) + rng.normal(0.0, sigma, X.size)


def test_fit_recovers_a_sigmoid_without_floor():
    true = SigmoidUtility(a=0.85, b=12.0, c=0.35)
    floors = 0
    for seed in range(5):
        fit = fit_sigmoid(X, _noisy(true, seed))
        u = fit.utility
        assert fit.r2 > 0.995
        assert abs(u.a + u.d - (true.a + true.d)) < 0.02  # the ceiling
        assert abs(u.b - true.b) / true.b < 0.12
        assert abs(u.c - true.c) < 0.015
        assert abs(u.d) < 0.03
        assert abs(fit.concave_start - true.c) < 0.015
        assert fit.rmse < 0.015  # the noise is 0.01
        floors += fit.floor
    # AICc with a margin of 2 wrongly picks a floor rarely (about 5% of the time).
    assert floors <= 1


def test_fit_adds_the_floor_only_when_the_data_have_one():
    true = SigmoidUtility(a=0.7, b=15.0, c=0.4, d=0.15)
    for seed in range(5):
        fit = fit_sigmoid(X, _noisy(true, seed))
        assert fit.floor
        assert fit.aicc < fit.aicc_alternative - 2.0
        u = fit.utility
        assert abs(u.d - true.d) < 0.03
        assert abs(u.c - true.c) < 0.02
        assert abs(u.a - true.a) < 0.04
        assert fit.r2 > 0.99
        # Forcing no floor on floored data fits worse.
        assert fit_sigmoid(X, _noisy(true, seed), floor="no").r2 < fit.r2


def test_fit_is_exact_on_noise_free_data_and_prefers_no_floor():
    true = SigmoidUtility(a=0.9, b=20.0, c=0.25)
    fit = fit_sigmoid(X, true(X))
    assert not fit.floor
    assert fit.r2 > 1 - 1e-10
    assert np.allclose([fit.utility.a, fit.utility.b, fit.utility.c], [0.9, 20.0, 0.25], rtol=1e-5)


def test_r2_reports_data_that_are_no_sigmoid():
    y = 0.5 + 0.4 * np.sin(2 * np.pi * X)  # rises, then falls
    fit = fit_sigmoid(X, y)
    assert fit.r2 < 0.7


def test_concave_region_starts_at_c():
    u = SigmoidUtility(a=0.8, b=14.0, c=0.3, d=0.05)
    assert u.concave_start == 0.3
    assert u.second_derivative(0.29) > 0 > u.second_derivative(0.31)
    xs = np.linspace(0.3, 1.0, 50)
    assert np.all(u.second_derivative(xs[1:]) < 0)
    assert SigmoidUtility(1.0, 5.0, -0.2).concave_start == 0.0
    assert SigmoidUtility(1.0, 5.0, 1.3).concave_start == 1.0


def test_inverse_derivative_is_the_concave_branch():
    u = SigmoidUtility(a=0.9, b=17.0, c=0.33)
    xs = np.linspace(0.33, 1.0, 200)
    back = u.inverse_derivative(u.derivative(xs))
    assert np.allclose(back, xs, atol=1e-9)
    assert u.inverse_derivative(u.max_slope * 2) == pytest.approx(u.c)
    assert u.inverse_derivative(0.0) == np.inf


def test_tangent_gives_the_concave_envelope():
    u = SigmoidUtility(a=0.9, b=15.0, c=0.4)
    for x0 in (0.0, 0.2, 0.39):
        xt, slope = u.tangent_from(x0)
        assert xt > u.c
        # Tangent: the line's slope is U'(x_t) ...
        assert slope == pytest.approx(float(u.derivative(xt)), rel=1e-9)
        # ... and the line lies above U on [x0, 1] (a majorant), touching at x_t.
        xs = np.linspace(x0, 1.0, 500)
        line = u(x0) + slope * (xs - x0)
        assert np.all(line >= u(xs) - 1e-12)
        # No better average utility per unit of fraction exists from x0.
        avg = (u(xs[1:]) - u(x0)) / (xs[1:] - x0)
        assert avg.max() <= slope + 1e-12
    # A curve too shallow to bend before x = 1: the chord to 1.
    flat = SigmoidUtility(a=1.0, b=3.0, c=0.9)
    xt, slope = flat.tangent_from(0.0)
    assert xt == 1.0
    assert slope == pytest.approx(float(flat(1.0) - flat(0.0)))


@pytest.mark.parametrize(
    "x, y, msg",
    [
        ([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], "at least 5 distinct"),
        ([0.0, 0.2, 0.4, 0.6, 0.8, 1.2], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "[0, 1]"),
        ([0.0, 0.2, 0.4, 0.6, 0.8, 1.0], [0.5] * 6, "same at every fraction"),
        ([0.0, 0.2, 0.4, 0.6, 0.8, 1.0], [0.1, np.nan, 0.3, 0.4, 0.5, 0.6], "finite"),
    ],
)
def test_fit_rejects_unfittable_input(x, y, msg):
    with pytest.raises(UserError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        fit_sigmoid(x, y)


def _curve(model, ctx, c):
    return UtilityCurve(model, ctx, SigmoidUtility(0.9, 12.0, c, 0.02), 0.995, 21, True, 0.01)


def test_table_round_trip_and_nearest_context(tmp_path):
    t = UtilityTable()
    for ctx, c in ((1024, 0.2), (4096, 0.3), (16384, 0.4)):
        t.put(_curve("m", ctx, c))
    t.put(_curve("other", 2048, 0.5))
    path = tmp_path / "u.json"
    t.save(path)
    back = UtilityTable.load(path)
    assert len(back) == 4
    got = back.get("m", 4096)
    assert got.utility == SigmoidUtility(0.9, 12.0, 0.3, 0.02)
    assert got.r2 == 0.995 and got.floor and got.n_points == 21
    doc = json.loads(path.read_text())
    assert doc["curves"][0]["concave_start"] == pytest.approx(0.2)
    # Nearest on a log scale: 2500 is nearer 4096 (x1.64) than 1024 (x2.44).
    assert back.lookup("m", 2500).context_tokens == 4096
    assert back.lookup("m", 1500).context_tokens == 1024
    assert back.lookup("m", 10**6).context_tokens == 16384
    with pytest.raises(KeyError):
        back.lookup("missing", 1024)
    assert not list(tmp_path.glob(".u.json*"))  # no temp file left behind


@pytest.mark.parametrize(
    "content, msg",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other", "curves": []}', "not a utility table"),
        ('{"format": "kvtransport.utility/1", "curves": {}}', "must be a list"),
        ('{"format": "kvtransport.utility/1", "curves": [{"model": "m"}]}', "lacks"),
        (
            '{"format": "kvtransport.utility/1", "curves": [{"model": "m", '
            '"context_tokens": 10, "a": 1, "b": -2, "c": 0.3}]}',
            "b > 0",
        ),
        (
            '{"format": "kvtransport.utility/1", "curves": [{"model": "m", '
            '"context_tokens": "10", "a": 1, "b": 2, "c": 0.3}]}',
            "positive integer",
        ),
        (
            '{"format": "kvtransport.utility/1", "curves": [{"model": "m", '
            '"context_tokens": 10, "a": 1, "b": 2, "c": "x"}]}',
            "must be a number",
        ),
    ],
)
def test_corrupt_table_is_a_one_line_user_error(tmp_path, content, msg):
    path = tmp_path / "u.json"
    path.write_text(content)
    with pytest.raises(UserError, match=msg) as exc:
        UtilityTable.load(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_missing_table_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such utility table"):
        UtilityTable.load(tmp_path / "absent.json")


def test_table_keeps_the_provenance_of_each_curve(tmp_path):
    row = UtilityCurve(
        "m", 512, SigmoidUtility(0.7, 9.0, 0.14), 0.96, 3, False, 0.04,
        source="measured", metric="accuracy", samples=20,
        points=((0.0, 0.2), (0.5, 0.6), (1.0, 0.7)), command="kvtransport fit-utility --measure",
    )  # fmt: skip
    t = UtilityTable()
    t.put(row)
    t.save(tmp_path / "u.json")
    back = UtilityTable.load(tmp_path / "u.json").get("m", 512)
    assert back == row
    assert back.ceiling == pytest.approx(float(row.utility(1.0)))
    bad = json.loads((tmp_path / "u.json").read_text())
    bad["curves"][0]["points"] = [[0.1, "x"]]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="points must be a list of"):
        UtilityTable.load(tmp_path / "bad.json")


def test_the_packaged_table_was_measured_and_says_how():
    models = packaged_model_ids()
    assert "SmolLM2-135M-Instruct.Q4_1" in models
    table = UtilityTable.packaged("SmolLM2-135M-Instruct.Q4_1")
    assert UtilityTable.packaged("no-such-model") is None
    assert sorted(cv.context_tokens for cv in table) == [256, 512]
    for cv in table:
        assert cv.metric == "accuracy" and cv.samples >= 16
        assert cv.command.startswith("kvtransport fit-utility --measure")
        assert len(cv.points) == cv.n_points >= 15
        # The fit describes the points it was fitted to (R^2 recomputed from them).
        x, y = np.array(cv.points).T
        sse = float(np.sum((cv.utility(x) - y) ** 2))
        assert 1 - sse / float(np.sum((y - y.mean()) ** 2)) == pytest.approx(cv.r2, abs=1e-9)
        assert cv.r2 > 0.9
        assert 0.0 < cv.concave_start < 0.5  # utility order: useful early
        assert 0.5 < cv.ceiling <= 1.0


@pytest.mark.model
def test_measuring_with_the_real_model_reproduces_the_full_answer_at_x_1(smollm):
    """The measurement's two ends: the whole cache is the reference, none of it is not."""
    from kvtransport.model import tasks

    model, tok = smollm
    sample = tasks.generate("niah_single", tok, target_tokens=160, seed=MEASURE_SEED)
    calls = []
    m = measure_sample(model, tok, sample, (0.0, 1.0), max_answer_tokens=16, progress=calls.append)
    assert calls == [1, 1]
    assert m.fractions.tolist() == [0.0, 1.0]
    assert m.values["top1"][1] == 1.0  # the full cache agrees with itself
    assert m.values["top1"][0] < 1.0  # nothing delivered: another answer
    assert m.values["accuracy"][1] == metrics.contains_all(m.answer, sample.answers)
    assert m.generated == 1  # only x = 0 needed decoding (x = 1 is the reference)
    assert m.values["accuracy"][0] == 0.0  # a 7-digit needle is not guessed
