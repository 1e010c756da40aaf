"""scripts/compare_allocators.py: the allocator of a git revision against this tree's."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_allocators.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_allocators", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_differences_have_a_t_interval(compare):
    d = compare.paired([0.001, 0.003, 0.002, 0.002])
    assert d["mean"] == pytest.approx(0.002) and d["n"] == 4
    # sd 0.000816, t(0.975, 3) = 3.182: half width 0.0013
    assert d["hi"] - d["mean"] == pytest.approx(3.1824 * 0.000816497 / 2, rel=1e-3)
    assert d["mean"] - d["lo"] == pytest.approx(d["hi"] - d["mean"])


def test_a_clean_link_runs_both_allocators_alike(compare, tmp_path, capsys):
    # Without reported loss the guard's tails are not touched, so any revision since the
    # guard gives byte-identical outcomes on a clean link; both share one bound.
    out = tmp_path / "cmp"
    rc = compare.main(
        ["--before", "HEAD", "--channel", "clean", "--users", "2", "--rates", "1000"]
        + ["--arrivals", "together", "--seeds", "1", "--baselines", "equal-share"]
        + ["--out", str(out)]
    )
    assert rc == 0
    assert "(identical)" in capsys.readouterr().out
    doc = json.loads((out / "compare.json").read_text())
    (s,) = doc["summary"]
    assert s["identical"] and s["after_minus_before"]["mean"] == 0.0
    row = doc["scenarios"][0]["policies"]
    assert set(row) == {"equal-share", "wf-before", "wf-after"}
    assert row["wf-before"]["ratio"] == row["wf-after"]["ratio"] > 0.95


def test_an_unknown_revision_is_one_line(compare, tmp_path):
    with pytest.raises(SystemExit, match="--before no-such-rev"):
        compare.main(["--before", "no-such-rev", "--out", str(tmp_path)])
