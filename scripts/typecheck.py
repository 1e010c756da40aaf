"""Type-check the package as it installs: mypy over every package in pyproject's package-dir.

mypy knows nothing of setuptools' ``package-dir`` (``codecs/`` installs as
``kvtransport.codecs``, ``agents/`` and ``netem/`` likewise), and the editable install's
import hook is invisible to it. So this script lays the installed layout out as symlinks
under ``.mypy_cache/layout/`` (rebuilt on every run, so new modules are seen), runs
``mypy -p kvtransport`` there with pyproject's ``[tool.mypy]`` and the cache in
``.mypy_cache/``, and prints mypy's report with every path mapped back to the repository.
Exit status: mypy's (0: clean). ``make lint`` runs it; extra arguments go to mypy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mypy_cache"
LAYOUT = CACHE / "layout"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Top package and every remapped subpackage: dotted name -> source folder."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: root / path for name, path in setup.get("package-dir", {}).items()}
    return dirs or {"kvtransport": root / "kvtransport"}


def build_layout(dirs: dict[str, Path], layout: Path = LAYOUT) -> dict[str, Path]:
    """Symlink each package folder's entries at its installed place under ``layout``;
    returns layout-relative folder -> repository folder (deepest first), to map paths."""
    if layout.exists():
        shutil.rmtree(layout)
    mapping = {}
    for name in sorted(dirs, key=lambda n: n.count(".")):
        target = layout.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in dirs[name].iterdir():
            if entry.name != "__pycache__" and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
        mapping[os.path.relpath(target, layout) + os.sep] = dirs[name]
    return dict(sorted(mapping.items(), key=lambda kv: -len(kv[0])))


def to_repo(line: str, mapping: dict[str, Path], root: Path = ROOT) -> str:
    """A mypy report line with its layout path replaced by the repository path."""
    for prefix, folder in mapping.items():
        if line.startswith(prefix):
            return os.path.relpath(folder, root) + os.sep + line[len(prefix) :]
    return line


def main(argv: list[str]) -> int:
    top = "kvtransport"
    mapping = build_layout(package_dirs())
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(CACHE), "-p", top, *argv]
    proc = subprocess.run(cmd, cwd=LAYOUT, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        print(to_repo(line, mapping))
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
