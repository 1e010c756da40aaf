"""`kvtransport fit-utility`: points file in, utility table (and plot) out; bad files rejected."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kvtransport.cli import main
from kvtransport.scheduling.utility_model import SigmoidUtility, UtilityTable

TRUE = {
    ("m-small", 2048): SigmoidUtility(0.9, 14.0, 0.3),
    ("m-small", 8192): SigmoidUtility(0.75, 10.0, 0.42, 0.12),
}


def _points_csv(path, seed=0):
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, 21)
    lines = ["# measured on the synthetic task", "fraction,accuracy,model,context_tokens"]
    for (model, ctx), u in TRUE.items():
        y = np.clip(u(x) + rng.normal(0, 0.008, x.size), 0, 1)
        lines += [f"{a:.4f},{b:.5f},{model},{ctx}" for a, b in zip(x, y, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def test_fit_utility_writes_table_and_plot(tmp_path):
    pts, out, png = tmp_path / "p.csv", tmp_path / "u.json", tmp_path / "fit.png"
    _points_csv(pts)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtransport", "fit-utility", "--points", str(pts)]
        + ["--out", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "concave" in proc.stdout and "R^2" in proc.stdout
    t = UtilityTable.load(out)
    assert len(t) == 2
    for (model, ctx), u in TRUE.items():
        got = t.get(model, ctx)
        assert got.r2 > 0.99
        assert abs(got.utility.c - u.c) < 0.03
        assert got.concave_start == pytest.approx(got.utility.c)
        assert got.floor == (u.d > 0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_fit_utility_updates_an_existing_table_and_prints_json(tmp_path, capsys):
    out = tmp_path / "u.json"
    pts = tmp_path / "p.json"
    x = np.linspace(0, 1, 11)
    u = SigmoidUtility(0.8, 12.0, 0.35)
    pts.write_text(json.dumps({"points": [[a, float(u(a))] for a in x]}))
    assert (
        main(
            [
                "fit-utility",
                "--points",
                str(pts),
                "--model",
                "a",
                "--context-tokens",
                "512",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    pts.write_text(
        json.dumps(
            [
                {
                    "model": "b",
                    "context_tokens": 1024,
                    "fraction": x.tolist(),
                    "accuracy": u(x).tolist(),
                }
            ]
        )
    )
    capsys.readouterr()
    assert main(["fit-utility", "--points", str(pts), "--out", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in rows] == ["b"]
    assert rows[0]["c"] == pytest.approx(0.35, abs=1e-4)
    t = UtilityTable.load(out)
    assert {(c.model, c.context_tokens) for c in t} == {("a", 512), ("b", 1024)}


BAD = [
    ("p.csv", None, "no such points file"),
    ("p.json", "{oops", "not valid JSON"),
    ("p.csv", "fraction,acc\n0.1,0.2\n", "lacks a 'accuracy' column"),
    ("p.csv", "fraction,accuracy\n0.1,high\n", "accuracy must be a number"),
    ("p.csv", "fraction,accuracy\n0.1\n", "wrong number of fields"),
    ("p.csv", "fraction,accuracy\n0.1,87\n", "divide percentages by 100"),
    ("p.csv", "fraction,accuracy\n1.5,0.5\n", "fraction 1.5 is outside"),
    ("p.csv", "fraction,accuracy\n0.1,0.2\n0.2,0.3\n0.5,0.6\n", "at least 5 distinct"),
    ("p.json", '{"points": [[0.1]]}', "expected [fraction, accuracy]"),
    ("p.json", '{"points": "x"}', "'points' must be a list"),
    (
        "p.json",
        '[{"model": "m", "context_tokens": -3, "points": [[0.1, 0.2]]}]',
        "positive integer",
    ),
    ("p.csv", "", "no data"),
]


@pytest.mark.parametrize("name, content, msg", BAD)
def test_bad_points_file_is_a_one_line_error(tmp_path, capsys, name, content, msg):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    out = tmp_path / "u.json"
    rc = main(
        [
            "fit-utility",
            "--points",
            str(path),
            "--model",
            "m",
            "--context-tokens",
            "64",
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()  # nothing written on bad input


def test_missing_model_and_corrupt_table_are_one_line_errors(tmp_path, capsys):
    pts = tmp_path / "p.csv"
    pts.write_text("fraction,accuracy\n" + "".join(f"{a},{a}\n" for a in np.linspace(0, 1, 9)))
    assert main(["fit-utility", "--points", str(pts), "--out", str(tmp_path / "u.json")]) == 2
    assert "no model" in capsys.readouterr().err
    table = tmp_path / "bad.json"
    table.write_text("[1, 2]")
    rc = main(
        [
            "fit-utility",
            "--points",
            str(pts),
            "--model",
            "m",
            "--context-tokens",
            "8",
            "--out",
            str(table),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "not a utility table" in err and len(err.strip().splitlines()) == 1
    assert table.read_text() == "[1, 2]"  # the user's file is left alone


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--measure", "--context-tokens", "0"], "positive integers"),
        (["--measure", "--context-tokens", "abc"], "positive integers"),
        (["--measure", "--fractions", "0,0.5,1"], "at least 5 distinct"),
        (["--measure", "--fractions", "0,0.2,0.4,0.6,1.5"], "numbers in [0, 1]"),
        (["--measure", "--samples", "0"], "--samples must be at least 1"),
        (["--points", "p.csv", "--context-tokens", "256,512"], "takes one length"),
    ],
)
def test_bad_measure_arguments_are_one_line_errors(tmp_path, capsys, monkeypatch, args, msg):
    """Refused before any model is loaded (these return in well under a second)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.csv").write_text("fraction,accuracy\n0.1,0.2\n")
    rc = main(["fit-utility", *args, "--out", str(tmp_path / "u.json")])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "u.json").exists()


def test_points_and_measure_exclude_each_other(capsys):
    assert main(["fit-utility", "--points", "p.csv", "--measure"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_saved_measure_points_refit_by_metric_and_record_the_command(tmp_path, capsys):
    """--save-points output (one entry per measure) read back with --points --metric."""
    from kvtransport.commands.fit_utility import save_points
    from kvtransport.scheduling.utility_model import MeasuredCurve

    x = np.linspace(0, 1, 11)
    curves = [
        MeasuredCurve("m", 256, x, SigmoidUtility(0.9, 8.0, 0.25)(x), "measured", "accuracy", 4),
        MeasuredCurve("m", 256, x, SigmoidUtility(0.7, 12.0, 0.15)(x), "measured", "f1", 4),
    ]
    pts = tmp_path / "pts.json"
    save_points(str(pts), curves)
    out = tmp_path / "u.json"
    args = ["fit-utility", "--points", str(pts), "--metric", "f1", "--out", str(out)]
    assert main(args) == 0
    row = UtilityTable.load(out).get("m", 256)
    assert row.metric == "f1" and abs(row.utility.c - 0.15) < 1e-3
    assert row.command == f"kvtransport fit-utility --points {pts} --metric f1 --out {out}"
    assert len(row.points) == 11
    capsys.readouterr()
    assert main(["fit-utility", "--points", str(pts), "--metric", "top1", "--out", str(out)]) == 2
    assert "no points for the 'top1' measure" in capsys.readouterr().err
