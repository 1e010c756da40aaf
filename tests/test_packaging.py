"""Packaging: the licence, the light core install, the extras and their one-line errors.

The core-install checks run the data plane in a subprocess in which every package outside
the core (torch, transformers, gymnasium, scipy, ...) fails to import, as on a machine
with ``pip install kvtransport`` alone.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CORE = {"numpy", "numba", "pyzmq", "safetensors", "cryptography", "reedsolo"}

BLOCKER = """
import importlib.abc, sys
from kvtransport.extras import EXTRA_OF

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in EXTRA_OF:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _NotInstalled())
for name in [m for m in sys.modules if m.split(".")[0] in EXTRA_OF]:
    del sys.modules[name]
"""


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _core_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


def test_licence_file_and_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_core_dependencies_are_the_data_plane_only():
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert core == CORE
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"model", "train", "eval", "testbed", "metrics", "dev"} <= set(extras)
    names = {e: {_name(r) for r in reqs} for e, reqs in extras.items()}
    assert {"torch", "transformers", "gguf", "accelerate"} <= names["model"]
    assert {"gymnasium", "stable-baselines3"} <= names["train"]
    # torch is a range (setup_env.sh installs the CPU build first), never a pin
    torch = [r for r in extras["model"] + extras["train"] if _name(r) == "torch"]
    assert torch and not any("==" in r for r in torch)
    # the n-step replay buffer (and its samples' discounts) arrived in SB3 2.7
    (sb3,) = [r for r in extras["train"] if _name(r) == "stable-baselines3"]
    assert sb3.replace(" ", "") == "stable-baselines3>=2.7"
    # dev pulls every other extra, so setup_env.sh's `-e .[dev]` installs everything
    assert "kvtransport[all]" in extras["dev"]
    (all_,) = extras["all"]
    listed = set(all_.split("[", 1)[1].rstrip("]").split(","))
    assert listed == set(extras) - {"all", "dev"}


def test_every_optional_module_maps_to_an_extra_that_installs_it():
    from kvtransport.extras import EXTRA_OF

    extras = PYPROJECT["project"]["optional-dependencies"]

    def installs(extra: str) -> set[str]:
        out = set()
        for r in extras[extra]:
            if r.startswith("kvtransport["):
                for sub in r.split("[", 1)[1].rstrip("]").split(","):
                    out |= installs(sub)
            else:
                out.add(_name(r).replace("-", "_"))
        return out

    for module, extra in EXTRA_OF.items():
        assert module in installs(extra), (module, extra)


def test_data_plane_imports_and_runs_without_the_extras():
    """Daemons, clients, CLI and the shipped DDQN policy on a core-only install."""
    proc = _core_python(
        """
        import kvtransport, kvtransport.daemons.daemon_sender, kvtransport.daemons.daemon_receiver
        import kvtransport.embed.client, kvtransport.cli, kvtransport.daemons.api
        from kvtransport.policies.registry import default_policy, make_policy
        assert default_policy() == "ddqn", default_policy()
        make_policy("ddqn")
        from kvtransport.cli import main
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in EXTRA_OF)
        assert not heavy, heavy
        print("CORE-OK")
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CORE-OK" in proc.stdout
    assert "sender-daemon" in proc.stdout  # the full --help, every subcommand listed


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["train", "--steps", "10", "--out", "{tmp}"], "train"),
        (["simulate", "--size-mb", "1", "--plot", "{tmp}/p.png"], "eval"),
        (["receiver-daemon", "--metrics-port", "0", "--listen", "127.0.0.1:0"], "metrics"),
    ],
)
def test_a_command_missing_its_extra_says_which_in_one_line(tmp_path, argv, extra):
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = _core_python(
        """
        from kvtransport.cli import main
        sys.exit(main(sys.argv[1:]))
        """,
        *argv,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"pip install 'kvtransport[{extra}]'" in lines[0]


def test_train_cli_defaults_equal_train_config_defaults():
    from kvtransport.agents.training import TrainConfig

    from kvtransport.cli import build_parser

    args = build_parser().parse_args(["train"])
    cfg = TrainConfig()
    for name in ("steps", "seed", "demo_steps", "eval_every", "eval_episodes"):
        assert getattr(args, name) == getattr(cfg, name), name
    assert tuple(int(h) for h in args.hidden.split(",")) == cfg.hidden
    assert args.eval_hard == cfg.eval_hard_episodes
    assert args.shortfall_weight == cfg.shortfall_weight
