"""A small run of scripts/eval_policy.py: the shipped DDQN on held-out ge-heavy episodes,
over the profile's own 5 ms link and over a 40 ms (high-RTT) one."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_policy.py"


def _script():
    """scripts/eval_policy.py as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("eval_policy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_ddqn_beats_no_fec_on_held_out_ge_heavy(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--channels", "ge-heavy", "--rhos", "0.8",
         "--episodes", "4", "--schemes", "none,adaptive,ddqn", "--out", str(tmp_path),
         "--high-rtt-channels", "ge-heavy", "--high-rtt-delays", "40",
         "--high-rtt-rhos", "0.85", "--high-rtt-episodes", "4", "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "eval_policy.json").read_text())
    cell = doc["utilities"]["ge-heavy@0.8"]
    ddqn, none, adaptive = (cell[k] for k in ("ddqn", "none", "adaptive"))
    assert len(ddqn) == len(none) == 4
    # every held-out episode, not just on average: FEC scheduling must beat no FEC
    assert all(d > n + 0.1 for d, n in zip(ddqn, none, strict=True))
    assert sum(ddqn) / 4 > 0.9 * sum(adaptive) / 4
    s = doc["summary"]["ge-heavy@0.8"]
    assert s["ddqn_minus_best_other"]["scheme"] == "adaptive"
    assert (tmp_path / "eval_policy.png").stat().st_size > 10_000
    table = (tmp_path / "eval_policy.md").read_text()
    assert table.startswith("| channel | rho | none | adaptive | ddqn |")
    assert "| ge-heavy | 0.8 |" in table

    # the high-RTT cell: the same held-out episodes over a 40 ms link, with the paired
    # differences of the DDQN against always-action-0 (tail-rule) and adaptive
    hi = doc["utilities"]["ge-heavy+40ms@0.85"]
    assert set(hi) == {"tail-rule", "adaptive", "ddqn", "auto", "oracle", "genie",
                       "clairvoyant", "clairvoyant_best"}  # fmt: skip
    assert all(len(v) == 4 for v in hi.values())
    assert hi["adaptive"] != cell["adaptive"]
    sh = doc["summary"]["ge-heavy+40ms@0.85"]
    for other in ("tail-rule", "adaptive"):
        d = np.array(hi["ddqn"]) - np.array(hi[other])
        assert np.isclose(sh["ddqn_minus"][other]["mean"], d.mean())
        assert sh["ddqn_minus"][other]["ci95"] > 0 or np.all(d == d[0])
    best = max(("tail-rule", "adaptive"), key=lambda m: np.mean(hi[m]))
    assert sh["oracle_headroom"]["over"] == best
    assert np.isclose(sh["oracle_headroom"]["mean"], np.mean(hi["oracle"]) - np.mean(hi[best]))
    checks = {k for k, c in doc["targets"].items() if c.get("high_rtt")}
    assert checks == {
        "ddqn > tail-rule on ge-heavy+40ms@0.85 (paired CI)",
        "ddqn > adaptive on ge-heavy+40ms@0.85 (paired CI)",
    }
    assert "| ge-heavy+40ms@0.85 |" in table and "High-RTT cells" in table

    # the references: per episode, the clairvoyant planner is at least every scheme and
    # at most the genie bound; each scheme's gap to both is paired over the episodes
    for key, c in doc["utilities"].items():
        schemes = [m for m in c if m not in ("genie", "clairvoyant", "clairvoyant_best")]
        for i, (cv, g) in enumerate(zip(c["clairvoyant"], c["genie"], strict=True)):
            assert all(cv >= c[m][i] for m in schemes), key
            assert cv <= g + 1e-12, key
        gap = doc["summary"][key]["gap"]
        assert set(gap) == set(schemes)
        for m in schemes:
            d = np.array(c["clairvoyant"]) - np.array(c[m])
            assert np.isclose(gap[m]["clairvoyant"]["mean"], d.mean())
            assert gap[m]["genie"]["mean"] >= gap[m]["clairvoyant"]["mean"]
            assert gap[m]["of_clairvoyant"] <= 1.0
    assert "ddqn >= 95% of clairvoyant on ge-heavy+40ms@0.85" in doc["targets"]
    # the product's pick (a high-RTT default scheme) is held to the same share
    share = doc["targets"]["auto >= 95% of clairvoyant on ge-heavy+40ms@0.85"]
    assert share["ratio"] == doc["summary"]["ge-heavy+40ms@0.85"]["gap"]["auto"]["of_clairvoyant"]
    assert share["ok"] == (share["ratio"] >= 0.95)
    assert table.count("Gaps to the references") == 2

    # DDQN minus the best heuristic per cell: the table's last line counts the paired wins
    # and losses over every heuristic; the figure is written
    vs = s["ddqn_vs"]
    assert set(vs) == {"none", "adaptive"}
    for m, d in vs.items():
        assert np.isclose(d["mean"], np.mean(np.array(ddqn) - np.array(cell[m])))
    wins = sum(
        d["mean"] - d["ci95"] > 0 for k in doc["summary"].values() for d in k["ddqn_vs"].values()
    )
    assert wins >= 1  # every episode beats no FEC by 0.1: significant
    assert f"| 2 cells | | | | {wins} wins / " in table
    assert (tmp_path / "eval_policy_margin.png").stat().st_size > 5_000
    assert (tmp_path / "eval_policy_high_rtt.png").stat().st_size > 10_000


def test_handoff_stream_cells_play_the_planned_stream():
    """``--stream handoff``: a cell's episodes are the planned handoff streams
    (kvtransport.agents.episodes.handoff_table), with both references on them."""
    mod = _script()
    import kvtransport.agents  # noqa: F401  (registers ddqn)

    kw = dict(channel="ge-heavy", rho=1.0, schemes=["tail-rule", "ddqn"], n=2, n_rs=0,
              weights=None, utility="measured")  # fmt: skip
    hand = mod.run_cell(**kw, stream="handoff")
    plain = mod.run_cell(**kw, references=False)
    assert hand["tail-rule"] != plain["tail-rule"]
    for i in range(2):
        assert (
            hand["genie"][i] >= hand["clairvoyant"][i] >= max(hand["tail-rule"][i], hand["ddqn"][i])
        )


def test_auto_plays_the_products_choice_per_episode():
    """``auto``: on a handoff over a long link the heuristic the product picks
    (kvtransport.hosts.policy_choice.default_policy_for), on a short one the DDQN, episode by
    episode; a utility stream over the long link keeps the DDQN."""
    from kvtransport.hosts.policy_choice import LONG_LINK_HANDOFF_POLICY, LONG_LINK_ONE_WAY_S

    mod = _script()
    import kvtransport.agents  # noqa: F401  (registers ddqn)

    long_ms = 1e3 * LONG_LINK_ONE_WAY_S
    # ge-heavy: a channel where the two picks differ on these episodes (with the rlc
    # last-round margin they tie on bernoulli-5 at 40 ms)
    kw = dict(channel="ge-heavy", rho=1.0, schemes=["auto", LONG_LINK_HANDOFF_POLICY, "ddqn"],
              n=2, n_rs=0, weights=None, utility="measured", references=False)  # fmt: skip
    far = mod.run_cell(**kw, delay_ms=2 * long_ms, stream="handoff")
    near = mod.run_cell(**kw, delay_ms=0.5 * long_ms, stream="handoff")
    plain = mod.run_cell(**{**kw, "n": 1}, delay_ms=2 * long_ms)
    assert far["auto"] == far[LONG_LINK_HANDOFF_POLICY] != far["ddqn"]
    assert near["auto"] == near["ddqn"]
    assert plain["auto"] == plain["ddqn"]


def test_held_out_profiles_come_from_the_profiles_file(tmp_path):
    """``--profiles FILE``: a cell named after one of the file's profiles plays that
    profile's channel (the same utilities as its loss notation given directly, not those of
    a built-in profile); a trace keeps its own delays (a long-link cell on one is refused);
    a missing file is one line of error before any cell runs."""
    import pytest
    from kvtransport.agents.episodes import eval_spec
    from kvtransport.netem.profiles import ProfileError

    held_out = SCRIPT.parents[1] / "netem" / "data" / "held-out.toml"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--profiles", str(held_out), "--set", "original",
         "--channels", "gilbert-long", "--rhos", "0.85", "--episodes", "3",
         "--schemes", "tail-rule", "--no-references", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "eval_policy.json").read_text())["utilities"]
    assert set(got) == {"gilbert-long@0.85"}

    mod = _script()
    kw = dict(rho=0.85, schemes=["tail-rule"], n=3, n_rs=0, weights=None, utility="measured",
              references=False)  # fmt: skip
    same = mod.run_cell("gemodel 0.5% 5% 100% 0%", **kw)
    other = mod.run_cell("bernoulli-5", **kw)
    assert got["gilbert-long@0.85"]["tail-rule"] == same["tail-rule"] != other["tail-rule"]

    trace = str(held_out.parent / "sample-trace.csv.gz")
    assert eval_spec(trace, 1.0, 0).channel.is_trace
    with pytest.raises(ProfileError, match="takes its delay from the trace"):
        eval_spec(trace, 1.0, 0, delay_ms=40.0)

    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--profiles", str(tmp_path / "none.toml"),
         "--channels", "x", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "no such profiles file" in bad.stderr
    assert "Traceback" not in bad.stderr
