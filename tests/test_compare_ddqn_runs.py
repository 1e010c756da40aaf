"""scripts/compare_ddqn_runs.py: a candidate DDQN against the shipped one and the best
heuristic, paired episode by episode, from two eval_policy.py results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvtransport.eval.statistics import significant

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs():
    """A baseline (shipped DDQN and two heuristics, with the references) and a candidate
    run of the same held-out episodes whose "DDQN" is the constant tail rule's result."""
    ev = _module("eval_policy")
    import kvtransport.agents  # noqa: F401  (registers ddqn)

    kw = dict(channel="ge-heavy", rho=0.8, n=3, n_rs=0, weights=None, utility="measured",
              delay_ms=40.0)  # fmt: skip
    base = ev.run_cell(schemes=["tail-rule", "adaptive", "ddqn"], **kw)
    cand = {"ddqn": list(base["tail-rule"])}
    doc = {"stream": "utility", "utility": "measured", "prior": "none"}
    key = ev.cell_key("ge-heavy", 0.8, 40.0)
    return {**doc, "utilities": {key: cand}}, {**doc, "utilities": {key: base}}, key


def test_differences_are_paired_over_the_same_episodes(runs):
    cmp = _module("compare_ddqn_runs")
    cand, base, key = runs
    (row,), problems = cmp.compare(cand, base)
    assert not problems and row["cell"] == key and row["n"] == 3
    b = base["utilities"][key]
    new = np.array(b["tail-rule"])
    d = new - np.array(b["ddqn"])
    assert row["new_minus_shipped"]["mean"] == pytest.approx(d.mean())
    if np.ptp(d) > 0:  # paired: the interval is that of the per-episode differences
        half = row["new_minus_shipped"]["ci95"]
        assert half == pytest.approx(4.303 * d.std(ddof=1) / np.sqrt(3), rel=1e-3)
    best = max(("tail-rule", "adaptive"), key=lambda m: np.mean(b[m]))
    assert row["best"] == best  # the shipped DDQN is not a heuristic
    assert row["new_minus_best"]["mean"] == pytest.approx((new - np.array(b[best])).mean())
    ref = np.maximum(b["clairvoyant"], new)
    assert row["share"]["new"] == pytest.approx(new.mean() / ref.mean())
    assert row["share"]["shipped"] == pytest.approx(np.mean(b["ddqn"]) / ref.mean())
    table = cmp.markdown([row])
    assert f"| {key} | 3 |" in table and "1 cells:" in table
    # the count: long-link cells (this one is at 40 ms) significantly above adaptive
    a = np.array(b["adaptive"])
    assert row["new_minus_adaptive"]["mean"] == pytest.approx((new - a).mean())
    assert row["shipped_minus_adaptive"]["mean"] == pytest.approx((np.array(b["ddqn"]) - a).mean())
    wins = [int(significant(row[f"{w}_minus_adaptive"]) > 0) for w in ("new", "shipped")]
    assert f"above adaptive: new {wins[0]}, shipped {wins[1]} (of 1)." in table
    won = {**row, "new_minus_adaptive": {"mean": 0.01, "ci95": 0.005}}
    assert "above adaptive: new 1," in cmp.markdown([won])
    short = {**won, "cell": "ge-heavy@0.8"}  # a short-link cell is not counted
    assert "above adaptive" not in cmp.markdown([short])


def test_runs_of_other_episodes_are_refused(runs, tmp_path, capsys):
    cmp = _module("compare_ddqn_runs")
    cand, base, key = runs
    short = {**cand, "utilities": {key: {"ddqn": cand["utilities"][key]["ddqn"][:2]}}}
    assert cmp.compare(short, base) == ([], [f"{key}: 2 vs 3 episodes"])
    other = tmp_path / "handoff.json"
    other.write_text(json.dumps({**cand, "stream": "handoff"}))
    mine = tmp_path / "base.json"
    mine.write_text(json.dumps(base))
    with pytest.raises(SystemExit, match="differ in stream"):
        cmp.main([str(other), str(mine)])
    with pytest.raises(SystemExit, match="not an eval_policy.py result"):
        cmp.main([str(tmp_path / "missing.json"), str(mine)])


def test_the_products_choice_is_compared_as_a_candidate(runs):
    """``--candidate-scheme auto``: the candidate run's ``auto`` (the product's default
    choice) against the shipped DDQN and the best heuristic; ``auto`` is no heuristic."""
    cmp = _module("compare_ddqn_runs")
    cand, base, key = runs
    b = base["utilities"][key]
    auto = {**cand, "utilities": {key: {"auto": list(b["adaptive"])}}}
    (row,), _ = cmp.compare(auto, base, "auto")
    d = np.array(b["adaptive"]) - np.array(b["ddqn"])
    assert row["new_minus_shipped"]["mean"] == pytest.approx(d.mean())
    both = {**base, "utilities": {key: {**b, "auto": [1.0] * 3}}}  # auto is never "best"
    (row,), _ = cmp.compare(auto, both, "auto")
    assert row["best"] in ("tail-rule", "adaptive")
    assert cmp.compare(cand, base, "auto") == ([], [f"{key}: not in both runs with a ddqn "
                                                    "(candidate: auto)"])  # fmt: skip
    assert "| auto | shipped DDQN |" in cmp.markdown([row], "auto")


def test_an_episode_range_compares_those_episodes_only(runs, tmp_path, capsys):
    """``--episodes 1:3``: each cell's episodes 1 and 2 of both runs, paired (the ones a
    candidate chosen on episode 0 never saw)."""
    cmp = _module("compare_ddqn_runs")
    cand, base, key = runs
    paths = []
    for name, doc in (("cand", cand), ("base", base)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "cmp.md"
    assert cmp.main([*map(str, paths), "--episodes", "1:3", "--out", str(out)]) == 0
    b = base["utilities"][key]
    d = np.array(b["tail-rule"][1:3]) - np.array(b["ddqn"][1:3])
    (row,), _ = cmp.compare(*(cmp.episode_range(doc, 1, 3) for doc in (cand, base)))
    assert row["n"] == 2 and row["new_minus_shipped"]["mean"] == pytest.approx(d.mean())
    assert f"| {key} | 2 |" in out.read_text()
    for bad in ("3:2", "1:2", "x:3", "2"):
        with pytest.raises(SystemExit):
            cmp.main([*map(str, paths), "--episodes", bad])
        assert "--episodes" in capsys.readouterr().err


def test_runs_whose_heuristics_differ_are_warned_about(runs, tmp_path, capsys):
    """A candidate run that also played a heuristic, which recovered differently than in
    the baseline (the code changed between the runs): the table says that its heuristic
    columns are the baseline's. The same heuristic results: no warning."""
    cmp = _module("compare_ddqn_runs")
    cand, base, key = runs
    b = base["utilities"][key]
    same = {**cand, "utilities": {key: {**cand["utilities"][key], "tail-rule": b["tail-rule"]}}}
    moved = [u + 0.001 for u in b["tail-rule"]]
    other = {**cand, "utilities": {key: {**cand["utilities"][key], "tail-rule": moved}}}
    assert cmp.heuristics_differ(same, base) == []
    assert cmp.heuristics_differ(other, base) == [f"{key}: tail-rule"]
    mine = tmp_path / "base.json"
    mine.write_text(json.dumps(base))
    for doc, warned in ((same, False), (other, True)):
        path = tmp_path / "cand.json"
        path.write_text(json.dumps(doc))
        out = tmp_path / "cmp.md"
        assert cmp.main([str(path), str(mine), "--out", str(out)]) == 0
        captured = capsys.readouterr()
        assert ("heuristics differ in 1 cells" in out.read_text()) is warned
        assert ("heuristics differ" in captured.err) is warned
