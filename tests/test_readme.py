"""Every code snippet in the README runs: the ```python blocks in order, in one fresh
interpreter (the later ones continue the first: its model, cache and prompt), and the
```bash blocks a CI machine can run (the daemon walk-through, making a key file) as they
are written; the rest (`make`, the vLLM engines) are named here as not run, and a new
block must be put in one list or the other. A snippet edited to be wrong fails here."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```$", README, flags=re.M | re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]

# bash blocks not run by the suite, by a line they hold: why
NOT_RUN = {
    "make demo": "the demo and the whole suite: minutes; the suite runs their parts",
    "vllm.entrypoints.openai.api_server": "needs the separate vLLM environment and a model dir",
    "--model ~/models/": "needs the user's own model directory (tests/test_model_cli.py runs "
    "--model with a tiny model it builds)",
    "scp TX:": "needs two hosts (tests/test_readme.py::test_the_identity_commands_work_on_one_host "
    "runs the same commands with two homes on loopback)",
}


def _bash(marker: str) -> str:
    (code,) = [b for b in BASH if marker in b]
    return code


def test_every_bash_block_is_run_or_named_as_not_run():
    run = {"kvtransport submit", "secrets.token_hex"}
    for code in BASH:
        kinds = [m for m in (*NOT_RUN, *run) if m in code]
        assert len(kinds) == 1, f"classify this README block in tests/test_readme.py:\n{code}"
    assert PYTHON, "the README's Python example is gone"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)  # conftest's private KVT_KEY_FILE / KVT_RUN_DIR / KVT_STATE_DIR
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def test_the_key_file_snippet_makes_a_key_both_ends_accept(tmp_path):
    """The README's commands make the default key file where kvtransport looks for it
    (mode 0600, a 32-byte key), and running them again keeps the key the peer holds."""
    from kvtransport.core.keys import read_key_file

    env = _env(HOME=str(tmp_path))
    env.pop("KVT_KEY_FILE")
    env.pop("XDG_CONFIG_HOME", None)
    code = _bash("secrets.token_hex")
    for _ in range(2):
        out = subprocess.run(["bash", "-euc", code], env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        if _ == 0:
            key = (tmp_path / ".config/kvtransport/key").read_bytes()
    path = tmp_path / ".config/kvtransport/key"
    assert path.read_bytes() == key  # not overwritten
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_key_file(path)) == 32
    probe = "from kvtransport.core.keys import default_key_path as p; print(p())"
    where = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                           text=True, timeout=60).stdout.strip()  # fmt: skip
    assert Path(where) == path


@pytest.mark.model
@pytest.mark.timeout(600)  # a model load (prefill) and two daemons' first start
def test_the_daemon_walk_through_runs_as_written(tmp_path):
    """The README's daemon example, run by bash as written (in a scratch directory, with
    this run's private key and control sockets): every command succeeds, the card arrives
    whole, the bulk transfer is cancelled, both daemons are listed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("127.0.0.1", 9400))
        except OSError:
            pytest.skip("UDP port 9400 (the README's) is in use here")
    code = _bash("kvtransport submit")
    # on a failing line bash exits: the daemons it started go with it (they hold the pipes)
    script = 'trap "kill $(jobs -p) 2>/dev/null || true" EXIT\n' + code + "wait\n"
    out = subprocess.run(["bash", "-euxc", script], cwd=tmp_path, env=_env(), text=True,
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=550)  # fmt: skip
    log = f"{out.stdout}\n{out.stderr[-4000:]}"
    assert out.returncode == 0, log
    assert re.search(r"transfer [0-9a-f]{16} to 127\.0\.0\.1:9400: receiver done", out.stdout)
    assert re.search(r"transfer ([0-9a-f]{16}) cancelled", out.stdout), log
    assert "sender daemon at ipc://" in out.stdout and "receiver daemon at ipc://" in out.stdout
    assert re.search(r"\[bulk\] to 127\.0\.0\.1:9400: cancelled", out.stdout), log
    assert list(tmp_path.glob("*.result.safetensors")), "the receiver daemon wrote no result"


@pytest.mark.model
@pytest.mark.timeout(600)
def test_the_python_snippets_run_in_order(tmp_path):
    runner = (
        "import sys\n"
        "blocks = sys.argv[1:]\n"
        "ns = {'__name__': '__main__'}\n"
        "for i, code in enumerate(blocks):\n"
        "    print(f'--- README python block {i}', flush=True)\n"
        "    exec(compile(code, f'README.md python block {i}', 'exec'), ns)\n"
        "print('--- README done')\n"
    )
    out = subprocess.run([sys.executable, "-c", runner, *PYTHON], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    parts = out.stdout.split("--- README python block ")[1:]
    assert len(parts) == len(PYTHON) and out.stdout.rstrip().endswith("--- README done")
    # the handoff printed its reason and utility; the race its tokens computed and loaded
    assert re.search(r"^\S.* \d\.\d{3} ", parts[0].split("\n", 1)[1], flags=re.M), out.stdout
    assert re.search(r"\d+ tokens computed, \d+ loaded: \S", out.stdout), out.stdout


def test_the_identity_commands_work_on_one_host(tmp_path):
    """The README's identity commands, the two hosts played by two homes on loopback (scp
    by a copy, RX:9400 by the receiver's own port): keygen on both, the receiver allows the
    sender's .pub, the sender names the receiver's, and the transfer arrives complete."""
    lines = [ln for ln in _bash("scp TX:").splitlines() if ln and not ln.startswith("#")]
    keygen, scp_tx, recv, scp_rx, send = lines
    assert keygen == "kvtransport keygen" and scp_tx.startswith("scp TX:")
    assert scp_rx.startswith("scp RX:") and "RX:9400" in send
    import kvtransport  # noqa: F401  (sets NUMBA_CACHE_DIR: the homes share the kernels)

    env = {}
    for host in ("RX", "TX"):
        home = tmp_path / host
        home.mkdir()
        env[host] = _env(HOME=str(home))
        env[host].pop("XDG_CONFIG_HOME", None)
        assert subprocess.run(keygen.split(), env=env[host], timeout=60).returncode == 0
    for line, here, there in ((scp_tx, "RX", "TX"), (scp_rx, "TX", "RX")):
        _, src, dst = line.split()
        (tmp_path / here / dst).write_bytes((tmp_path / there / src.split(":", 1)[1]).read_bytes())
    rx = subprocess.Popen([*recv.split(), "--listen", "127.0.0.1:0", "--timeout", "120",
                           "--json"], cwd=tmp_path / "RX", env=env["RX"], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        line = rx.stderr.readline()
        while line and "listening on" not in line:  # a kernel compile is announced first
            line = rx.stderr.readline()
        port = int(line.rsplit(":", 1)[1])
        sent = subprocess.run(send.replace("RX:9400", f"127.0.0.1:{port}").split(),
                              cwd=tmp_path / "TX", env=env["TX"], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert sent.returncode == 0, sent.stdout + sent.stderr
        out, err = rx.communicate(timeout=120)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert rx.returncode == 0, err
    assert '"complete"' in out, out
    assert list((tmp_path / "RX").glob("*.result.safetensors"))
