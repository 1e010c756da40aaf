"""Shared pytest fixtures.

Model fixtures are session-scoped: the real model loads once per test run (about 2 s from
the cached safetensors copy; the very first run converts the GGUF, about 20 s). Tests that
use them carry ``@pytest.mark.model``. torch runs on one thread in tests, so parallel
suites on a 2-core machine do not fight over cores.

To add a fixture: put it here if several test files need it (keep it cheap, or
session-scoped and documented), otherwise in the test file that uses it.
"""

import atexit
import os
import shutil
import tempfile

import pytest

# Keys, control sockets and replay records of everything the tests start (in this process and in the
# daemons they spawn, which inherit the environment) stay in a private directory of this
# run: the default key file is made there on first use, never in the user's home.
_PRIVATE = tempfile.mkdtemp(prefix="kvt-test-")
os.environ.setdefault("KVT_KEY_FILE", os.path.join(_PRIVATE, "key"))
os.environ.setdefault("KVT_RUN_DIR", os.path.join(_PRIVATE, "run"))
os.environ.setdefault("KVT_STATE_DIR", os.path.join(_PRIVATE, "state"))
atexit.register(shutil.rmtree, _PRIVATE, True)


@pytest.fixture(scope="session")
def smollm():
    """The default model (SmolLM2-135M-Instruct) as a kvtransport.model.loader.LoadedModel.

    ``model, tokenizer = smollm`` unpacks it; ``smollm.model_id`` names it. Shared by
    every test in the session: do not mutate it (switch attention implementations or set
    layer masks only inside a try/finally or a context manager that restores them).
    """
    from kvtransport.model.loader import load_model

    return load_model(threads=1)


@pytest.fixture
def tail_rule_network(tmp_path):
    """A DDQN weights file (the shipped network's layers) whose last layer makes action 0,
    the tail rule, score highest in every state: played as ``ddqn`` it plays exactly the
    ``tail-rule`` scheme, so an evaluation script's ``--weights`` is seen to take effect."""
    import numpy as np

    from kvtransport.policies.ddqn import SHIPPED_WEIGHTS

    layers = dict(np.load(SHIPPED_WEIGHTS))
    layers["W2"] = np.zeros_like(layers["W2"])
    layers["b2"] = np.eye(len(layers["b2"]), dtype=layers["b2"].dtype)[0]
    path = tmp_path / "tail-rule.npz"
    np.savez(path, **layers)
    return path


# Files whose tests measure wall-clock behaviour (real sockets with deadlines, daemons,
# the live race): `make test` runs them after the CPU-heavy rest, so that they never share
# the cores with training or evaluation runs, two files at a time (scripts/run_tests.sh).
# A test outside these files that does carries ``@pytest.mark.serial``. Tests of the netns
# testbed (kernel shaping: rates, loss, queues) and of EXCLUSIVE_FILES are ``exclusive``:
# they run last, one at a time, with the machine to themselves.
SERIAL_FILES = frozenset({
    "test_answer_race_dir.py", "test_control_fuzz.py", "test_curve.py", "test_daemon.py",
    "test_daemon_robustness.py", "test_fuzz_datagrams.py", "test_hosts.py",
    "test_inprocess.py", "test_integration_netns.py", "test_keys.py", "test_live_race.py",
    "test_loss_report.py", "test_reservations.py", "test_result_unsaved.py",
    "test_manifest_budget.py",
    "test_memory_bounds.py", "test_operability.py", "test_peer_binding.py", "test_race.py",
    "test_readme.py",
    "test_replay.py", "test_full_filesystem.py", "test_replay_failclosed.py",
    "test_submit_cli.py", "test_tcp_baseline.py", "test_tcp_baseline_netns.py",
    "test_testbed.py", "test_udp.py", "test_vllm_blocks.py", "test_vllm_connector.py",
})  # fmt: skip


# Files of wall-clock tests that also run last and alone: their margins (the layered tail's
# arrival against the question's pass; a daemon's peak memory while forged manifests
# arrive) failed when another wall-clock file ran beside them.
EXCLUSIVE_FILES = frozenset({"test_live_race.py", "test_manifest_budget.py"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("netns") or item.path.name in EXCLUSIVE_FILES:
            item.add_marker(pytest.mark.exclusive)
        elif item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
