"""kvtransport.daemons.heap: a daemon's buffers reuse the pages of the transfers before it
(and of its start-up prefault) instead of faulting in fresh ones. Each case runs in its
own interpreter, since the settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtransport.daemons import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="needs glibc")

BUFFER = 48_000_000  # above glibc's largest mmap threshold (32 MB): mapped afresh by default

CHILD = """
import json, resource, sys
import numpy as np
from kvtransport.daemons import heap

keep, prefault = sys.argv[1] == "keep", int(sys.argv[2])
if keep:
    assert heap.keep_freed_memory()
    heap.prefault(prefault)

def buffer_faults():
    # a transfer's output buffer (np.zeros, as the receiver's) written in full, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = np.zeros(BUFFER, np.uint8)
    out[:] = 7
    got = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del out
    return got

print(json.dumps([buffer_faults() for _ in range(3)]))
""".replace("BUFFER", str(BUFFER))


def faults(mode: str, prefault: int = 0) -> list[int]:
    """Page faults of three buffers in turn in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(prefault)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_kept_memory_serves_the_next_buffer_without_faults():
    default, kept = faults("default"), faults("keep")
    # glibc's default maps each buffer afresh: every one faults its pages in again (at
    # least one fault per 2 MB huge page, more with 4 KB pages)
    assert min(default) >= BUFFER // (2 << 20), default
    # kept: the first buffer faults as before, the later ones reuse its pages
    assert kept[0] >= BUFFER // (2 << 20), kept
    assert max(kept[1:]) < 10, kept


def test_a_prefault_serves_the_first_buffer():
    assert max(faults("keep", prefault=BUFFER + (4 << 20))) < 10
    # less than one buffer prefaulted: the first buffer still faults in the rest
    assert faults("keep", prefault=BUFFER // 4)[0] >= BUFFER // (4 << 20)


def test_keeping_memory_needs_glibc_and_says_so(monkeypatch):
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.keep_freed_memory() is False
