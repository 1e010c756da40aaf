"""The layer table in docs/architecture.md is a contract: every import goes down it.

The table (section "Layers") lists the layers bottom first, each with the folders or files
it holds, and what it must never import even though it sits above it. This test parses
every import of every module of the package (top-level, inside functions, under
``TYPE_CHECKING``: a lazy or type-only import is an edge all the same), maps both ends to
their layers and fails on an edge that goes up the table or breaks a "never". A module in
no layer of the table fails too, so a new folder is placed in the table before it lands.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE_DIRS = {  # module prefix -> folder (pyproject's package-dir)
    "kvtransport.codecs": ROOT / "codecs",
    "kvtransport.agents": ROOT / "agents",
    "kvtransport.netem": ROOT / "netem",
    "kvtransport": ROOT / "kvtransport",
}
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\w[\w-]*)\s*\|(.*?)\|(.*?)\|")
_PATH = re.compile(r"`([\w./-]+)`")


@dataclass(frozen=True)
class Layer:
    rank: int
    name: str
    paths: tuple[str, ...]  # repository paths: a folder ends in "/"
    never: frozenset[str]  # layer names it must not import although they sit below it


def layer_table(text: str) -> list[Layer]:
    """The rows of the "Layers" section's table: ``| rank | name | paths | never | job |``."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            never = frozenset(re.findall(r"\b[\w-]+\b", m.group(4))) - {"none", "-"}
            layers.append(
                Layer(int(m.group(1)), m.group(2), tuple(_PATH.findall(m.group(3))), never)
            )
    return layers


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of the package and its mapped folders."""
    out: dict[str, Path] = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if prefix == "kvtransport" and rel[0] in ("codecs", "agents", "netem"):
                continue  # a regular (non-editable) layout; the mapped folders win
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((prefix, *parts))] = path
    return out


def imported_modules(source: str, modules: dict[str, Path]) -> set[tuple[str, int]]:
    """(module, line) for every package module ``source`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a import b``: the submodule a.b where there is one, else a
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("kvtransport"):
                out.add((name, node.lineno))
    return out


def layer_of(rel: str, layers: list[Layer]) -> Layer | None:
    """The layer whose longest path holds ``rel`` (a repository path), None if none does."""
    best: tuple[str, Layer] | None = None
    for layer in layers:
        for p in layer.paths:
            hit = rel.startswith(p) if p.endswith("/") else rel == p
            if hit and (best is None or len(p) > len(best[0])):
                best = (p, layer)
    return best[1] if best else None


def violations(
    layers: list[Layer], extra: dict[str, tuple[str, str]] | None = None
) -> tuple[list[str], list[str]]:
    """(modules in no layer, upward or forbidden edges), each a line of text. ``extra``:
    more modules, name -> (repository path, source), checked as if they were files."""
    modules = module_files()
    sources = {
        name: (path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
        for name, path in modules.items()
    }
    sources.update(extra or {})
    unplaced, bad = [], []
    for name, (rel, source) in sorted(sources.items()):
        src = layer_of(rel, layers)
        if src is None:
            unplaced.append(rel)
            continue
        for target, line in sorted(imported_modules(source, modules)):
            dst = layer_of(modules[target].relative_to(ROOT).as_posix(), layers)
            if dst is None or dst is src:
                continue
            if dst.rank > src.rank or dst.name in src.never:
                why = "up" if dst.rank > src.rank else "never"
                bad.append(f"{name}:{line} ({src.name}) -> {target} ({dst.name}): {why}")
    return unplaced, bad


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    table = layer_table(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(table) >= 10, "docs/architecture.md's Layers table was not found"
    assert [la.rank for la in table] == sorted(la.rank for la in table)
    return table


def test_every_module_is_in_a_layer(layers):
    unplaced, _ = violations(layers)
    assert unplaced == [], "place these in docs/architecture.md's Layers table"


def test_imports_go_down_the_layer_table(layers):
    _, bad = violations(layers)
    assert bad == []


def test_the_check_sees_lazy_type_only_and_forbidden_imports(layers):
    """An upward import inside a function, one under TYPE_CHECKING, and a downward one that
    a "never" forbids (model -> hosts) are all caught; a new folder is unplaced."""
    probe = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvtransport.daemons import udp\n"
        "def f():\n    from kvtransport.model import hf\n"
    )
    extra = {
        "kvtransport.core._probe": ("kvtransport/core/_probe.py", probe),
        "kvtransport.model._probe": (
            "kvtransport/model/_probe.py",
            "from kvtransport.hosts.sender_host import SenderHost\n",
        ),
        "kvtransport.newfolder.x": ("kvtransport/newfolder/x.py", ""),
    }
    unplaced, bad = violations(layers, extra)
    mine = sorted(b for b in bad if "_probe" in b)
    assert mine == [
        "kvtransport.core._probe:3 (core) -> kvtransport.daemons.udp (daemons): up",
        "kvtransport.core._probe:5 (core) -> kvtransport.model.hf (model): up",
        "kvtransport.model._probe:1 (model) -> kvtransport.hosts.sender_host (hosts): never",
    ]
    assert unplaced == ["kvtransport/newfolder/x.py"]


def sibling_imports(source: str, siblings: set[str]) -> list[str]:
    """What a script does instead of importing the package: ``sys.path`` edits, and
    imports of a sibling script (``import eval_policy``) as a library."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path":
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                out.append(f"{node.lineno}: sys.path")
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        out += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in siblings]
    return sorted(out)


def test_scripts_are_entries_over_the_eval_package():
    """The scripts share code through kvtransport.eval, never through each other."""
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    siblings = {p.stem for p in scripts}
    bad = {
        p.name: found
        for p in scripts
        if (found := sibling_imports(p.read_text(encoding="utf-8"), siblings))
    }
    assert bad == {}
    probe = "import sys\nsys.path.insert(0, '.')\nfrom eval_policy import mean_ci\n"
    assert sibling_imports(probe, siblings) == ["2: sys.path", "3: import eval_policy"]


def test_the_eval_package_sits_above_the_demo(layers):
    """kvtransport.eval drives the demo's steps; the demo importing it is an upward edge."""
    extra = {
        "kvtransport.demo._probe": (
            "kvtransport/demo/_probe.py",
            "def f():\n    from kvtransport.eval import harness\n",
        ),
    }
    _, bad = violations(layers, extra)
    assert [b for b in bad if "_probe" in b] == [
        "kvtransport.demo._probe:2 (demo) -> kvtransport.eval.harness (eval): up"
    ]
