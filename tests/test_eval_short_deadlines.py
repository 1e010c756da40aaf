"""A small run of scripts/eval_short_deadlines.py: the product's pick under and over two
round trips of a long link, episode by episode, through the script's own episodes."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_short_deadlines.py"


def test_the_pick_is_the_heuristic_under_two_round_trips_and_the_ddqn_above(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--bands", "1,1.5:3,5", "--episodes", "4",
         "--schemes", "adaptive,ddqn,auto", "--workers", "1", "--out", str(tmp_path),
         "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    bands = json.loads((tmp_path / "eval_short_deadlines.json").read_text())["bands"]
    short, long_ = bands["1-1.5"]["utilities"], bands["3-5"]["utilities"]
    assert short["auto"] == short["adaptive"] != short["ddqn"]  # the rule took adaptive
    assert long_["auto"] == long_["ddqn"] != long_["adaptive"]  # and left the DDQN
    assert "| 1-1.5 |" in (tmp_path / "eval_short_deadlines.md").read_text()


def test_a_bad_band_is_a_one_line_usage_error(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--bands", "2,1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "--bands" in out.stderr.strip().splitlines()[-1]


def test_weights_name_the_network_the_ddqn_scheme_plays(tmp_path, tail_rule_network):
    """``--weights``: a network that always picks the tail rule plays exactly the tail
    rule's episodes (the shipped DDQN does not: the first test's band)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--bands", "1,1.5", "--episodes", "4",
         "--schemes", "adaptive,tail-rule,ddqn", "--weights", str(tail_rule_network),
         "--workers", "1", "--out", str(tmp_path), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    band = json.loads((tmp_path / "eval_short_deadlines.json").read_text())["bands"]["1-1.5"]
    assert band["utilities"]["ddqn"] == band["utilities"]["tail-rule"]
    bad = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--weights",
            str(tmp_path / "no.npz"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no such DDQN weights file" in bad.stderr.splitlines()[-1]
