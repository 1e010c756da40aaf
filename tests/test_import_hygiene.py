"""The data plane loads no training, evaluation or simulation stack; no import cycles.

A fresh interpreter goes through what ``kvtransport sender-daemon`` and
``receiver-daemon`` load before they serve: the CLI, both daemon modules, the policy a
shell defaults to (``ddqn``, the shipped runtime), the warm-up of every kernel they use
and a request's deadline given as ``rho``. None of gymnasium, scipy, torch,
stable-baselines3, matplotlib, transformers, the simulator or the channel models may be
imported on the way (each cost seconds of start-up and pulls an extra the core install
lacks). Only what numba loads for itself is exempt: where scipy is installed, importing
numba imports scipy's package (a version check) and compiling or loading a first kernel
imports ``scipy.linalg.cython_blas`` (numba's BLAS); nothing beyond that may load.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import kvtransport
from kvtransport.kernel_cache import package_dirs

FORBIDDEN = (
    "gymnasium",
    "scipy",
    "torch",
    "stable_baselines3",
    "matplotlib",
    "transformers",
    "kvtransport.sim.simulator",
    "kvtransport.sim.multisim",
    "kvtransport.netem",
    "kvtransport.agents.env",
    "kvtransport.agents.episodes",
    "kvtransport.agents.training",
)

_PROBE = f"""
import json, sys
import numba
numba.njit(lambda x: x + 1)(1)  # numba's own start: where scipy is installed, it loads
numba_loaded = set(sys.modules)  # scipy (a version check) and scipy.linalg's BLAS
import kvtransport.cli
import kvtransport.commands.receiver_daemon
import kvtransport.commands.sender_daemon
import kvtransport.daemons.daemon_receiver
import kvtransport.daemons.daemon_sender
from kvtransport.policies.ddqn import DDQNPolicy
from kvtransport.daemons.daemon import warm_up
from kvtransport.daemons.daemon_sender import deadline_from
from kvtransport.policies.registry import default_policy, make_policy

policy = make_policy("ddqn")
assert isinstance(policy, DDQNPolicy), type(policy)
default_policy()
warm_up(policies=("ddqn", "fixed:1/4"), allocator=True)
deadline_from({{"rho": 1.5}}, 1 << 20, 1e8, 1280, False)
bad = {FORBIDDEN!r}
new = set(sys.modules) - numba_loaded
loaded = [m for m in new if any(m == b or m.startswith(b + ".") for b in bad)]
print(json.dumps(sorted(loaded)))
"""


def test_daemons_and_ddqn_runtime_import_no_training_or_simulation_stack():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=240, check=True
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"the data plane imported {loaded}"


def _package_modules() -> dict[str, Path]:
    """Every module of the package (its mapped subpackages included): name -> file."""
    out: dict[str, Path] = {}
    for prefix, folder in package_dirs(Path(kvtransport.__file__).resolve().parent).items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.setdefault(".".join([prefix, *parts]), path)
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports anywhere: at the top, inside functions, under
    TYPE_CHECKING, or by name through importlib.import_module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        found.update(n for n in names if n in known)
    return found


def test_no_import_cycles_among_the_package_modules():
    modules = _package_modules()
    graph = {m: _imports(path, modules) - {m} for m, path in modules.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert len(modules) > 50 and graph["kvtransport.daemons.daemon_sender"]  # the scan sees them
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
