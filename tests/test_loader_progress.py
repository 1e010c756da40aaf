"""Model-loading progress bars stay out of redirected logs: with stderr a file or a pipe,
loading the model prints no "Loading weights" bar (nor a GGUF's de-quantization bar);
with stderr a terminal the bars show as before."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

LOAD = "from kvtransport.model.loader import load_model; load_model(threads=1); print('LOADED')"


@pytest.mark.model
def test_loading_weights_bar_only_on_a_terminal(tmp_path):
    log = tmp_path / "err.log"
    with open(log, "w") as err:
        out = subprocess.run([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=err,
                             text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0 and "LOADED" in out.stdout, log.read_text()[-2000:]
    assert "Loading weights" not in log.read_text()

    # the same load with stderr a pseudo-terminal (24x100: tqdm draws nothing 0 wide)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE,
                                stderr=slave, text=True)  # fmt: skip
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        proc.wait(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0, seen[-2000:]
    assert b"Loading weights" in seen


def test_the_gguf_de_quantization_bar_is_off_while_stderr_is_redirected(monkeypatch):
    """transformers' GGUF bar is a plain tqdm: inside the loader's guard it writes nothing
    to a redirected stderr, and it is back as it was afterwards."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    from kvtransport.model.loader import progress_bars_on_a_terminal

    err = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", err)
    before = gguf_utils.tqdm
    with progress_bars_on_a_terminal():
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors"):
            pass
    assert err.getvalue() == ""
    assert gguf_utils.tqdm is before
    for _ in gguf_utils.tqdm(range(3), desc="after"):
        pass
    assert "after" in err.getvalue()  # a control: the same bar outside the guard writes
