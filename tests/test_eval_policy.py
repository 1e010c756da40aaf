"""A small run of scripts/eval_policy.py: the shipped DDQN on held-out ge-heavy episodes."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_policy.py"


def test_shipped_ddqn_beats_no_fec_on_held_out_ge_heavy(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--channels", "ge-heavy", "--rhos", "0.8",
         "--episodes", "4", "--schemes", "none,adaptive,ddqn", "--out", str(tmp_path),
         "--quiet"],
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
