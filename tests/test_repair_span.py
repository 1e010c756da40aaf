"""A small run of scripts/eval_repair_span.py: the proactive repair span cap it patches
reaches the real sender, and only where a round trip holds more slots than the cap."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_repair_span.py"


def test_span_cap_binds_only_when_a_round_trip_exceeds_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--cells", "ge-heavy+40ms@0.85,ge-heavy+80ms@0.85",
         "--schemes", "fixed:4/32", "--spans", "1024,2048", "--episodes", "2",
         "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "eval_repair_span.json").read_text())
    runs = doc["runs"]
    # 100 Mbit/s, one-way 40 ms: a round trip is ~770 slots, under both caps -> the same runs
    short = runs["ge-heavy+40ms@0.85 fixed:4/32 1024"], runs["ge-heavy+40ms@0.85 fixed:4/32 2048"]
    for a, b in zip(*short, strict=True):
        assert a["final_span"] == b["final_span"] < 1024
        assert a["utility"] == b["utility"] and a["packets"] == b["packets"]
    # one-way 80 ms: ~1540 slots; the 1024 cap binds, the 2048 one does not
    long = runs["ge-heavy+80ms@0.85 fixed:4/32 1024"], runs["ge-heavy+80ms@0.85 fixed:4/32 2048"]
    for a, b in zip(*long, strict=True):
        assert a["final_span"] == 1024 and 1400 < b["final_span"] < 2048
    cpu = doc["summary"]["ge-heavy+80ms@0.85 fixed:4/32"]["cpu"]
    assert cpu["2048"]["mean_wide_nss_sent"] > cpu["1024"]["mean_wide_nss_sent"] > 64
    table = (tmp_path / "eval_repair_span.md").read_text()
    assert table.startswith("| cell | scheme | utility @1024 | 2048 - 1024 |")
    assert "| ge-heavy+40ms@0.85 | fixed:4/32 |" in table and "(2=)" in table
