"""The small version of scripts/eval_multiuser.py: real sessions, every policy, the bound."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_multiuser.py"


@pytest.fixture(scope="module")
def eval_multiuser():
    spec = importlib.util.spec_from_file_location("eval_multiuser", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_small_evaluation_writes_table_json_and_plot(eval_multiuser, tmp_path, capsys):
    out = tmp_path / "mu"
    rc = eval_multiuser.main(
        ["--users", "2,4", "--rates", "100", "--arrivals", "together,staggered:0.05"]
        + ["--seeds", "1", "--window-ms", "100", "--bytes-per-token", "2000"]
        + ["--out", str(out), "--json"]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((out / "multiuser.json").read_text())
    assert (out / "multiuser.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(doc["scenarios"]) == 4 and len(doc["summary"]) == 4
    assert doc["meta"]["metric"] == ["accuracy"] and doc["meta"]["contexts"] == [256, 512]
    for row in doc["scenarios"]:
        n = row["users"]
        assert len(row["contexts"]) == n and len(row["arrival_times"]) == n
        assert 0.8 < row["efficiency"] < 1.0  # headers (and a few repairs) cost a little
        assert row["clairvoyant_found"] <= row["clairvoyant"] + 1e-9
        assert row["clairvoyant"] <= row["ceiling"] + 1e-9
        pols = row["policies"]
        assert set(pols) == {"equal-share", "proportional", "edf", "water-filling"}
        for p in pols.values():
            assert 0.0 <= p["accuracy"] <= row["ceiling"] + 1e-9
            # The bound counts the capacity the best sessions achieved (a fluid model of
            # them): no policy beats it by more than the protocol's noise.
            assert p["ratio"] <= 1.01
        wf = pols["water-filling"]
        assert wf["ratio"] >= 0.95
        assert wf["accuracy"] >= max(p["accuracy"] for p in pols.values()) - 0.01
    for s in doc["summary"]:
        assert s["water-filling"]["ratio_min"] <= s["water-filling"]["ratio"]


def test_bad_arrival_pattern_is_refused(eval_multiuser, tmp_path):
    with pytest.raises(SystemExit, match="staggered:SECONDS"):
        eval_multiuser.main(["--arrivals", "bursty", "--out", str(tmp_path)])
