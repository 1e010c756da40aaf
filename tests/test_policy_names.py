"""Policy names: the deployable registry and the simulators' resolver, which adds the oracle."""

import json
import subprocess
import sys

import pytest

from kvtransport.errors import UserError
from kvtransport.policies.heuristics import Adaptive
from kvtransport.policies.registry import make_policy
from kvtransport.sim.oracle import Oracle, make_sim_policy


def test_the_oracle_is_a_simulation_name_only():
    """A daemon's registry refuses the clairvoyant oracle by name (it reads a simulated
    channel's future); the simulators' resolver builds it and every deployable name."""
    with pytest.raises(UserError, match="unknown policy 'oracle'"):
        make_policy("oracle")
    assert isinstance(make_sim_policy("oracle"), Oracle)
    assert isinstance(make_sim_policy(" adaptive "), Adaptive)
    with pytest.raises(UserError, match="unknown policy"):
        make_sim_policy("no-such-policy")


def test_simulate_runs_the_oracle_and_send_refuses_it(tmp_path):
    """`kvtransport simulate --policy oracle` simulates; `send --policy oracle` is a
    one-line error before anything is sent."""
    cli = [sys.executable, "-m", "kvtransport"]
    sim = subprocess.run(
        [*cli, "simulate", "--policy", "oracle", "--size-mb", "0.3", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["policy"] == "oracle"
    send = subprocess.run(
        [*cli, "send", "127.0.0.1:9", "--size-mb", "0.1", "--policy", "oracle", "--insecure"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert send.returncode == 2
    lines = send.stderr.strip().splitlines()
    assert "unknown policy 'oracle'" in lines[-1] and "Traceback" not in send.stderr
