"""scripts/evaluate.py --small: every figure of the full evaluation, on a small budget.

One run of the script (real model, real sessions over the simulator, the real benchmark
scripts) feeds all the checks below; each asserts a property of the measured data that a
broken pipeline would violate, not just that files appear.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "evaluate.py"
NAMES = {1: "utility", 2: "f1", 3: "ablation", 4: "overhead", 5: "ttft", 6: "multiuser"}

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--quiet", "--out", str(out), "--data", str(out)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    docs = {n: json.loads((out / f"fig{n}_{name}.json").read_text()) for n, name in NAMES.items()}
    return out, docs, p.stdout


def _ci_ok(stat, n):
    """A summary with n samples: finite mean; a finite non-negative half-width when n > 1."""
    assert stat["n"] == n
    assert math.isfinite(stat["mean"])
    if n > 1:
        assert math.isfinite(stat["ci95"]) and stat["ci95"] >= 0.0


def test_every_figure_states_command_seeds_and_machine(small):
    out, docs, stdout = small
    for n, doc in docs.items():
        assert "--small" in doc["command"] and doc["command"].startswith(".venv/bin/python")
        assert doc["machine"]["before"]["cores"] >= 1 and doc["machine"]["before"]["cpu"]
        assert doc["seeds"]
        md = (out / f"fig{n}_{NAMES[n]}.md").read_text()
        assert "command: `.venv/bin/python scripts/evaluate.py --small" in md
        assert "machine: " in md and "seeds: " in md
    for n in (1, 2, 3, 4, 5):
        png = (out / f"fig{n}_{NAMES[n]}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "fig 1, utility at rho" in stdout


def test_fig1_rlc_schemes_beat_no_fec_on_every_episode(small):
    _, docs, _ = small
    d = docs[1]
    for rho, cell in d["utilities"].items():
        for name in ("fixed:4/32", "ddqn", "tail-rule"):
            assert all(u > n + 0.05 for u, n in zip(cell[name], cell["none"], strict=True)), (
                rho, name)  # fmt: skip
        for stat in d["summary"][rho].values():
            _ci_ok(stat, d["episodes"])
            assert 0.0 <= stat["mean"] <= 1.0
    # the DDQN's decisions were counted, and the paired table compares it with action 0
    assert sum(d["ddqn_actions"]["counts"]) > 0
    assert "ddqn - tail-rule" in next(iter(d["paired"].values()))


def test_fig2_fec_delivers_more_and_answers_are_scored(small):
    _, docs, _ = small
    d = docs[2]
    rows = d["rows"]
    assert len(rows) == len(d["cases"]) * 2 * 2  # cases x rhos x schemes (1 channel seed)
    for s in d["summary"].values():
        assert 0.0 <= s["full_cache"]["f1"]["mean"] <= 1.0
        for rho in ("0.6", "1"):
            assert s[f"ddqn@{rho}"]["utility"]["mean"] > s[f"none@{rho}"]["utility"]["mean"] + 0.2
    for r in rows:
        assert 0.0 <= r["f1"] <= 1.0 and 0 <= r["blocks_missing"] <= r["blocks_total"]
        # F1 is scored against the gold answer, not the full cache's answer
        case = d["cases"][r["case"]]
        if r["answer"] == case["full_answer"]:
            assert r["f1_vs_full"] == 1.0


def test_fig3_ablation_fec_and_utility_order(small):
    _, docs, _ = small
    d = docs[3]
    a = d["all_rhos"]
    # with FEC, utility order keeps more of the cache's utility than position order at
    # every rho, and the model agrees with its full-cache answer at least as well
    for key, p in d["paired"].items():
        if key.startswith("ddqn@"):
            assert p["utility"]["mean"] > 0.1, key
    assert a["utility/ddqn"]["top1"]["mean"] >= a["position/ddqn"]["top1"]["mean"]
    # adaptive FEC restores what no FEC loses (same prompts, same channel seeds)
    assert a["utility/ddqn"]["top1"]["mean"] > a["utility/none"]["top1"]["mean"] + 0.1
    for stat in a.values():
        _ci_ok(stat["top1"], stat["top1"]["n"])
        assert 0.0 <= stat["top1"]["mean"] <= 1.0


def test_fig4_overhead_stages_add_up(small):
    """The stages are a partition of the measured total; how fast they are is the
    benchmark's business (bench_policy, fig 4 itself), not a timed assertion here."""
    _, docs, _ = small
    d = docs[4]
    assert d["runs"] == 2 and not d["errors"]
    st = d["stages_ms_per_1000_packets"]
    parts = ("state/feedback handling", "policy (DDQN)", "encoding", "decoding")
    assert st["total"]["mean"] == pytest.approx(sum(st[k]["mean"] for k in parts), rel=1e-9)
    for k in parts:
        _ci_ok(st[k], 2)
    lat = d["control_latency_us"]
    for part in ("in_situ", "warm"):
        for stat in ("mean_us", "p99_us"):
            _ci_ok(lat[f"{part}.{stat}"], 2)


def test_fig5_handoff_ttft_parts(small):
    _, docs, _ = small
    (row,) = docs[5]["rows"]
    _ci_ok(row["reprefill"], 2)
    h1, h8 = row["handoff"]["fp16@1"], row["handoff"]["fp16@0.8"]
    # the link time is the deadline (rho x the loss-free send time) or earlier, so the
    # shorter deadline ends sooner and delivers less
    assert h8["transfer"]["mean"] < h1["transfer"]["mean"]
    assert h8["utility"]["mean"] < h1["utility"]["mean"] <= 1.0
    for h in (h1, h8):
        for t, a, b, c in zip(h["ttft_s"], h["transfer_s"], h["rebuild_s"], h["first_token_s"],
                              strict=True):  # fmt: skip
            assert t == pytest.approx(a + b + c) and b > 0 and c > 0


def test_fig6_multiuser_is_run_or_marked_pending(small):
    out, docs, _ = small
    d = docs[6]
    md = (out / "fig6_multiuser.md").read_text()
    if not (ROOT / "scripts" / "eval_multiuser.py").is_file():
        assert d["status"] == "pending" and "Pending" in md
        return
    assert d["status"] == "ok", d.get("reason")
    for cell in d["summary"].values():
        for p in d["policies"]:
            assert 0.0 <= cell[p]["mean"] <= cell["ceiling"]["mean"] + 1e-9


def test_bad_figure_list_is_one_line():
    p = subprocess.run([sys.executable, str(SCRIPT), "--only", "2,9"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert p.returncode != 0
    assert p.stderr.strip() == "--only: the figures are 1..6, not '2,9'"
