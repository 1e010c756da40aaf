"""scripts/typecheck.py: mypy sees the package as it installs, and reports repository paths.

The run itself is part of ``make lint``; these check the layout it builds (package-dir
remaps ``codecs/`` to ``kvtransport.codecs`` and so on) and the path mapping of its report,
on a small tree of their own.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import typecheck  # noqa: E402


def _tree(root: Path) -> dict[str, Path]:
    for folder, files in {
        "pkg": ["__init__.py", "a.py"],
        "codecs": ["__init__.py", "rlc.py"],
    }.items():
        (root / folder).mkdir(parents=True)
        for name in files:
            (root / folder / name).write_text("")
    (root / "pkg" / "__pycache__").mkdir()
    return {"pkg": root / "pkg", "pkg.codecs": root / "codecs"}


def test_the_layout_puts_each_remapped_package_at_its_installed_place(tmp_path):
    dirs = _tree(tmp_path / "src")
    layout = tmp_path / "layout"
    mapping = typecheck.build_layout(dirs, layout)
    assert (layout / "pkg" / "a.py").resolve() == dirs["pkg"] / "a.py"
    assert (layout / "pkg" / "codecs" / "rlc.py").resolve() == dirs["pkg.codecs"] / "rlc.py"
    assert not (layout / "pkg" / "__pycache__").exists()
    # a module added later is seen: the layout is rebuilt from the folders every run
    (dirs["pkg.codecs"] / "new.py").write_text("")
    typecheck.build_layout(dirs, layout)
    assert (layout / "pkg" / "codecs" / "new.py").is_symlink()
    # deepest package first, so kvtransport/codecs/ maps to codecs/, not kvtransport/
    root = tmp_path / "src"
    assert typecheck.to_repo("pkg/codecs/rlc.py:3: error: x", mapping, root) == (
        "codecs/rlc.py:3: error: x"
    )
    assert typecheck.to_repo("pkg/a.py:1: note: y", mapping, root) == "pkg/a.py:1: note: y"
    assert typecheck.to_repo("Found 2 errors", mapping, root) == "Found 2 errors"


def test_the_package_dirs_come_from_pyproject():
    dirs = typecheck.package_dirs()
    assert dirs["kvtransport"] == ROOT / "kvtransport"
    assert all(path.is_dir() for path in dirs.values())
