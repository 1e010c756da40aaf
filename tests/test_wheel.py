"""The package builds quietly and ships its data: a wheel built from the source tree (in a
copy, so the checkout gains no build/ folder) holds every file of the data folders and
py.typed, and setuptools prints no "Package would be ignored" warning while building it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = {"kvtransport/data": "kvtransport/data", "agents/data": "kvtransport/agents/data",
        "kvtransport/policies/data": "kvtransport/policies/data",
        "netem/data": "kvtransport/netem/data"}  # fmt: skip


def test_wheel_ships_the_data_files_without_packaging_warnings(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("pyproject.toml's build backend needs setuptools>=77 (no network here)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("kvtransport", "codecs", "agents", "netem"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "would be ignored" not in log and "BuildBackendWarning" not in log, log[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvtransport-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kvtransport/py.typed" in names
    for folder, packaged in DATA.items():
        files = [p.name for p in (ROOT / folder).iterdir() if p.is_file()]
        assert files, folder
        for name in files:
            assert f"{packaged}/{name}" in names, (folder, name)
