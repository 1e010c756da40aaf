"""kvtransport.eval's statistics (the intervals every evaluation table prints) and its
missing-extra error."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvtransport.errors import UserError
from kvtransport.eval.args import parse_seeds
from kvtransport.eval.statistics import ci_cell, mean_ci, paired, significant, summary


def test_mean_ci_is_the_students_t_half_width():
    m, h = mean_ci([1.0, 2.0, 3.0, 4.0])
    # t(0.975, 3) = 3.182446, s = 1.290994, n = 4
    assert m == 2.5 and h == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-6)
    m1, h1 = mean_ci([0.7])
    assert m1 == 0.7 and h1 != h1  # one sample: no interval
    assert ci_cell(summary([0.7])) == "0.700"


def test_paired_differences_and_their_significance():
    a, b = [0.9, 0.8, 0.95, 0.9, 1.0], [0.5, 0.6, 0.5, 0.55, 0.5]
    d = paired(a, b + [0.0])  # the episodes both played
    assert d["n"] == 5 and d["mean"] == pytest.approx(np.mean(np.subtract(a, b)))
    assert significant(d) == 1 and significant(paired(b, a)) == -1
    assert significant(paired(a, a)) == 0 and paired(a, a)["equal"] == 5


def test_seed_ranges_include_both_ends():
    assert parse_seeds("3-5") == [3, 4, 5] and parse_seeds("1,7") == [1, 7]


def test_without_scipy_the_error_names_the_eval_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    with pytest.raises(UserError, match=r"kvtransport\[eval\]"):
        mean_ci([1.0, 2.0])
