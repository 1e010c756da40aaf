"""Safe defaults: a key is required (made 0600 on first use), short or open keys are
refused, running without one needs --insecure; control endpoints are private (owner-only
ipc:// directories, loopback tcp://) and their socket files go away on SIGTERM."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvtransport.cli import main
from kvtransport.core import keys
from kvtransport.daemons.api import check_endpoint
from kvtransport.embed.client import SenderClient
from kvtransport.errors import UserError

CLI = [sys.executable, "-m", "kvtransport"]


@pytest.fixture
def key_path(tmp_path, monkeypatch):
    path = tmp_path / "cfg" / "kvtransport" / "key"
    monkeypatch.setenv("KVT_KEY_FILE", str(path))
    return path


def test_no_key_given_makes_an_owner_only_key_file_once(key_path):
    assert not key_path.exists()
    key = keys.resolve_key()
    assert len(key) == 32 and key_path.is_file()
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_path.parent.stat().st_mode) == 0o700
    assert key_path.read_text().strip() == key.hex()
    assert keys.resolve_key() == key  # read back, not made again
    assert keys.resolve_key(key_file=str(key_path)) == key
    assert keys.resolve_key(key=str(key_path)) == key


def test_processes_starting_together_agree_on_the_generated_key(key_path):
    got = []
    threads = [threading.Thread(target=lambda: got.append(keys.resolve_key())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert sorted(p.name for p in key_path.parent.iterdir()) == ["key"]  # no leftovers


def test_short_empty_and_open_keys_are_refused_in_one_line(tmp_path, key_path):
    for spec in ("", "00" * 15, "ab"):
        with pytest.raises(UserError, match="16..64 bytes"):
            keys.resolve_key(key=spec)
    short = tmp_path / "short"
    short.write_text("00" * 8)
    short.chmod(0o600)
    with pytest.raises(UserError, match="16..64 bytes"):
        keys.resolve_key(key_file=str(short))
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    empty.chmod(0o600)
    with pytest.raises(UserError, match="got 0"):
        keys.resolve_key(key_file=str(empty))
    shared = tmp_path / "shared"
    shared.write_text("ab" * 32)
    shared.chmod(0o644)
    with pytest.raises(UserError, match="chmod 600"):
        keys.resolve_key(key_file=str(shared))
    with pytest.raises(UserError, match="cannot read key file"):
        keys.resolve_key(key_file=str(tmp_path / "missing"))
    raw = tmp_path / "raw"  # a passphrase or binary: refused, not used as raw bytes
    raw.write_bytes(b"\xff\xfe a raw binary secret")
    raw.chmod(0o600)
    with pytest.raises(UserError, match="not a key in hex digits"):
        keys.resolve_key(key_file=str(raw))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(UserError, match="not a regular file"):  # no hang
        keys.resolve_key(key_file=str(fifo))
    assert keys.resolve_key(key="5e" * 16) == b"\x5e" * 16
    with pytest.raises(UserError, match="neither a key file nor hex"):
        keys.resolve_key(key="zz")
    assert not key_path.exists()  # an explicit (bad) key never falls back to the default


def test_insecure_is_explicit_and_loud(key_path, caplog):
    with caplog.at_level("WARNING"):
        assert keys.resolve_key(insecure=True) is None
    assert "INSECURE" in caplog.text and not key_path.exists()
    with pytest.raises(UserError, match="--insecure"):
        keys.resolve_key(key="5e" * 16, insecure=True)


def test_cli_refuses_short_keys_and_a_plaintext_sender_reaches_nobody(key_path, capsys, caplog):
    """`send` with a 15-byte key: one line, exit 2. An --insecure sender against a default
    (keyed) receiver delivers nothing: each of its datagrams is dropped as bad_tag."""
    from test_udp import _start_recv

    assert main(["send", "127.0.0.1:9", "--key", "00" * 32]) == 2  # a key in argv: ps shows it
    err = capsys.readouterr().err.strip().splitlines()
    assert "visible to every user in ps" in err[-1] and "Traceback" not in "".join(err)
    os.environ["KVT_KEY"] = "00" * 15
    try:
        assert main(["send", "127.0.0.1:9"]) == 2
    finally:
        del os.environ["KVT_KEY"]
    err = capsys.readouterr().err.strip().splitlines()
    assert "16..64 bytes" in err[-1] and "Traceback" not in "".join(err)

    rx, port = _start_recv("--timeout", "5", "--idle-timeout", "0.5")
    try:
        args = ["send", f"127.0.0.1:{port}", "--insecure", "--size-mb", "0.2", "--rho", "1"]
        assert main([*args, "--json", "--rate-mbps", "100"]) == 4  # nothing delivered
        out, err = rx.communicate(timeout=30)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert key_path.exists()  # the receiver made the default key; the sender used none
    assert "INSECURE" in caplog.text
    # the receiver never adopted the transfer: nothing arrived that it could open
    assert rx.returncode == 2 and "no transfer arrived" in err.strip().splitlines()[-1]


def test_control_endpoints_must_be_private(tmp_path):
    for bad in (
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://10.1.2.3:5555",
        "tcp://127.0.0.1:5555",
    ):
        with pytest.raises(UserError, match="needs CURVE with a client allowlist"):
            check_endpoint(bad)
    made = tmp_path / "run" / "deeper"
    check_endpoint(f"ipc://{made}/x.ipc")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UserError, match="not private"):
        check_endpoint(f"ipc://{open_dir}/x.ipc")
    with pytest.raises(UserError, match="not private"):  # a client refuses it too
        SenderClient(f"ipc://{open_dir}/x.ipc")
    with pytest.raises(UserError, match="not private"):  # /tmp itself: anyone may squat
        check_endpoint("ipc:///tmp/kvtransport-sender.ipc")
    assert main(["sender-daemon", "--control", "tcp://0.0.0.0:0"]) == 2


@pytest.fixture
def short_dir():
    """A fresh folder with a short path: an ipc socket's path must fit sockaddr_un's 107
    bytes, which pytest's tmp_path under a worker's folder can exceed."""
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_default_sockets_live_in_a_private_runtime_dir_and_go_away_on_sigterm(short_dir):
    run = short_dir / "xdg" / "kvtransport"
    env = {k: v for k, v in os.environ.items() if k != "KVT_RUN_DIR"}
    env["XDG_RUNTIME_DIR"] = str(short_dir / "xdg")
    (short_dir / "xdg").mkdir(mode=0o700)
    proc = subprocess.Popen(
        [*CLI, "receiver-daemon", "--listen", "127.0.0.1:0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        want = {"kvtransport-receiver.ipc", "kvtransport-results.ipc"}
        while not (run.is_dir() and want <= {p.name for p in run.iterdir()}):
            assert proc.poll() is None and time.monotonic() < end, proc.stderr.read()
            time.sleep(0.1)
        assert stat.S_IMODE(run.stat().st_mode) == 0o700 and run.stat().st_uid == os.getuid()
        for p in run.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [p.name for p in run.iterdir()] == []  # socket files removed
