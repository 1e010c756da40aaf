"""scripts/eval_fast_links.py, small: each scheme on the same transfers, the product's pick
(auto) resolved per link, differences paired by seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import eval_fast_links  # noqa: E402


def test_the_pick_follows_the_link_and_differences_are_paired(tmp_path, capsys):
    argv = ["--channels", "loss 2%", "--rates", "100,2000", "--delays", "80", "--rhos", "1",
            "--seeds", "2", "--schemes", "adaptive,ddqn,auto", "--out", str(tmp_path),
            "--quiet"]  # fmt: skip
    assert eval_fast_links.main(argv) == 0
    cells = json.loads((tmp_path / "eval_fast_links.json").read_text())["cells"]
    slow, fast = cells["loss 2% 100Mbps+80ms@1"], cells["loss 2% 2000Mbps+80ms@1"]
    # within the DDQN's trained bandwidth-delay product the pick is the DDQN, beyond it
    # the heuristic, episode for episode
    assert slow["utilities"]["auto"] == slow["utilities"]["ddqn"]
    assert fast["utilities"]["auto"] == fast["utilities"]["adaptive"]
    u = fast["utilities"]
    diffs = [d - a for d, a in zip(u["ddqn"], u["adaptive"], strict=True)]
    m, ci = fast["vs"]["ddqn"]
    assert m == pytest.approx(sum(diffs) / 2) and m + ci < 0  # the loss the pick avoids
    assert "loss 2% 2000Mbps+80ms@1" in capsys.readouterr().out


def test_bad_arguments_get_one_line(capsys):
    with pytest.raises(SystemExit):
        eval_fast_links.main(["--rates", "fast"])
    assert "--rates must be comma-separated numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_fast_links.main(["--schemes", "adaptive", "--against", "ddqn"])
    assert "is not among --schemes" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a deadline shorter than the path: no traceback
        eval_fast_links.main(["--rates", "5000", "--delays", "80", "--rhos", "1",
                              "--size-mb", "1", "--schemes", "adaptive", "--seeds", "1",
                              "--workers", "1", "--quiet", "--out", "/nonexistent"])  # fmt: skip
    assert "leaves no time to send" in capsys.readouterr().err.strip().splitlines()[-1]


def test_weights_name_the_network_the_ddqn_scheme_plays(tmp_path, tail_rule_network, capsys):
    """``--weights``: a network that always picks the tail rule plays exactly the tail
    rule's transfers, where the shipped DDQN plays others."""
    cell = ["--channels", "ge-heavy", "--rates", "400", "--delays", "80", "--rhos", "2",
            "--seeds", "2", "--size-mb", "5", "--workers", "1", "--quiet"]  # fmt: skip
    got = {}
    for name, extra in (("shipped", []), ("constant", ["--weights", str(tail_rule_network)])):
        out = tmp_path / name
        argv = [*cell, "--schemes", "tail-rule,ddqn", "--against", "tail-rule", "--out", str(out)]
        assert eval_fast_links.main([*argv, *extra]) == 0
        (u,) = [c["utilities"] for c in json.loads((out / "eval_fast_links.json").read_text())[
            "cells"].values()]  # fmt: skip
        got[name] = u
    assert got["constant"]["ddqn"] == got["constant"]["tail-rule"]
    assert got["shipped"]["ddqn"] != got["shipped"]["tail-rule"]
    with pytest.raises(SystemExit):
        eval_fast_links.main([*cell, "--weights", str(tmp_path / "missing.npz")])
    assert "no such DDQN weights file" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_prior_reaches_the_senders(tmp_path):
    """``--prior``: the senders start from a loss prior (agents.episodes.episode_prior), so
    adaptive plays other transfers than as a first transfer with none."""
    cell = ["--channels", "bernoulli-5", "--rates", "400", "--delays", "80", "--rhos", "2",
            "--seeds", "2", "--size-mb", "5", "--workers", "1", "--quiet",
            "--schemes", "adaptive"]  # fmt: skip
    got = {}
    for prior in ("none", "profile"):
        out = tmp_path / prior
        assert eval_fast_links.main([*cell, "--prior", prior, "--out", str(out)]) == 0
        cells = json.loads((out / "eval_fast_links.json").read_text())["cells"]
        (got[prior],) = [c["utilities"]["adaptive"] for c in cells.values()]
    assert got["none"] != got["profile"]
