"""Processes the tests start and stop: a real receiver daemon on loopback, and a finished
child's exit status and output (never a process left behind)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kvtransport.daemons.api import ApiError
from kvtransport.embed.client import ReceiverClient


def receiver_daemon(
    tmp_path: Path, key: bytes, budget_mb: int
) -> tuple[subprocess.Popen, ReceiverClient, int]:
    """A `kvtransport receiver-daemon` on 127.0.0.1 (any port) with ``key`` (mode 0600),
    ``budget_mb`` and a replay record under ``tmp_path``, once it answers its control
    socket: (process, control client, UDP port). Waits out a cold kernel cache."""
    key_file = tmp_path / "key"
    key_file.write_text(key.hex())
    key_file.chmod(0o600)
    ctl = f"ipc://{tmp_path}/rx.ipc"
    argv = [sys.executable, "-m", "kvtransport", "receiver-daemon", "--listen", "127.0.0.1:0",
            "--control", ctl, "--publish", f"ipc://{tmp_path}/pub.ipc", "--key-file",
            str(key_file), "--budget-mb", str(budget_mb), "--replay-file",
            str(tmp_path / "replay")]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_end = time.monotonic() + 300  # a cold kernel cache compiles first
    while True:
        client = ReceiverClient(ctl, timeout_s=2)
        try:
            return proc, client, int(client.ping()["udp"].rsplit(":", 1)[1])
        except ApiError:
            client.close()
            if proc.poll() is not None or time.monotonic() > t_end:
                proc.kill()
                raise


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """Wait for ``proc`` (killed after ``timeout`` s): (exit status, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err
