"""A full filesystem under --race-dir, --out or --out-dir loses nothing and crashes
nothing (issue 44, rows 5 and 6): the race mirror is allocated up front
(posix_fallocate) or refused with one logged line, the daemon stays up; a result that
its directory cannot take is kept in the state directory and the failure named.

Needs root (it mounts a small tmpfs); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtransport.daemons.race_share import _allocate

KVT = [sys.executable, "-m", "kvtransport"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs, mode 0700, unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(port: int, size_mb: float) -> subprocess.CompletedProcess:
    return subprocess.run([*KVT, "send", f"127.0.0.1:{port}", "--size-mb", str(size_mb),
                           "--insecure", "--rate-mbps", "400", "--deadline-ms", "8000",
                           "--json"], capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_mirror_that_does_not_fit_is_refused_not_left_sparse(small_fs):
    path = small_fs / "big.tmp"
    with pytest.raises(OSError):
        _allocate(path, 8 << 20)
    assert not path.exists()
    m = _allocate(small_fs / "fits.tmp", 64 << 10)
    m[:] = b"\x01" * len(m)  # every page backed: no SIGBUS
    m.close()


def test_recv_keeps_a_result_its_out_dir_cannot_take(small_fs, tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "KVT_STATE_DIR": str(state)}
    port = _free_port()
    recv = subprocess.Popen([*KVT, "recv", "--listen", f"127.0.0.1:{port}", "--insecure",
                             "--out", str(small_fs), "--timeout", "300", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        time.sleep(3)  # its warm-up; the sender's manifest is re-sent until answered
        sent = _send(port, 3.0)
        out, err = recv.communicate(timeout=400)
    finally:
        recv.kill()
    # the sender is told: the receiver's final report names result_unsaved (exit 4)
    assert sent.returncode == 4, sent.stderr
    assert "result_unsaved" in sent.stderr.strip().splitlines()[-1], sent.stderr
    assert json.loads(sent.stdout.strip().splitlines()[-1])["refused"] == "result_unsaved"
    assert recv.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert "kept in" in last and "Traceback" not in err, err
    kept = list((state / "results").glob("*.result.safetensors"))
    assert len(kept) == 1 and kept[0].stat().st_size > 3_000_000
    assert (kept[0].stat().st_mode & 0o777) == 0o600
    assert json.loads(out.strip().splitlines()[-1])["file"] == str(kept[0])


def test_recv_refuses_an_out_dir_without_room_at_start(small_fs):
    (small_fs / "filler").write_bytes(b"\0" * ((2 << 20) - 4096))
    done = subprocess.run([*KVT, "recv", "--listen", "127.0.0.1:0", "--insecure",
                           "--out", str(small_fs), "--timeout", "1"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "has no room for results" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_receiver_daemon_survives_a_full_race_dir_and_keeps_results(small_fs, tmp_path):
    from kvtransport.embed.client import ReceiverClient, ResultSubscriber

    state = tmp_path / "state"
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "KVT_STATE_DIR": str(state)}
    ctl, pub = f"ipc://{tmp_path}/rx.ipc", f"ipc://{tmp_path}/res.ipc"
    port = _free_port()
    log = tmp_path / "daemon.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([*KVT, "receiver-daemon", "--listen", f"127.0.0.1:{port}",
                                 "--control", ctl, "--publish", pub, "--insecure",
                                 "--race-dir", str(small_fs), "--out-dir", str(out)],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)  # fmt: skip
    client = ReceiverClient(ctl, timeout_s=300)
    try:
        client.ping()
        sub = ResultSubscriber(pub)
        time.sleep(0.2)
        sent = _send(port, 3.0)  # 3 MB: its mirror cannot fit in 2 MiB
        tid = int(json.loads(sent.stdout.strip().splitlines()[-1])["transfer_id"], 16)
        res = sub.wait_for(tid, timeout_s=60)
        assert res.reason == "complete"
        assert proc.poll() is None and client.ping()["role"] == "receiver"
        sub.close()
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "not shared with racers" in text and "Traceback" not in text, text
    assert proc.returncode == 0
    assert not list(Path(small_fs).glob("*.tmp"))
