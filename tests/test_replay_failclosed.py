"""The replay record fails closed and is only ever a regular file (issue 44, row 4).

A record that cannot be saved refuses new transfers until a save succeeds; saving runs
on a background writer, and a generation is reported durable only once on disk; the
record's path is refused at start when it is a FIFO (no hang), a device node, a link or
an unrelated file.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from kvtransport.core.replay import UNSAVED, ReplayRecord
from kvtransport.errors import UserError


def _wait(cond, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_an_unsaveable_record_refuses_new_transfers_until_a_save_succeeds(tmp_path):
    state = tmp_path / "state"
    path = state / "replay"
    now = time.time()
    r = ReplayRecord(path, now=now)
    assert r.admit(1, now, now) is None
    gen = r.save_soon()
    assert _wait(lambda: r.durable(gen)) and path.exists()
    shutil.rmtree(state)  # the record's directory is gone: every save fails
    assert r.admit(2, now + 0.1, now + 0.1) is None  # not known yet to fail
    gen = r.save_soon()
    assert _wait(lambda: r.failing)
    assert not r.durable(gen) and r.persist_errors >= 1
    assert r.admit(3, now + 0.2, now + 0.2) == UNSAVED
    assert r.refused[UNSAVED] == 1 and 3 not in r.entries
    state.mkdir()  # the writer's retry saves it; admission resumes
    assert _wait(lambda: r.durable(gen), timeout_s=5)
    assert not r.failing and r.admit(3, now + 0.3, now + 0.3) is None
    assert r.close()
    assert ReplayRecord(path, now=now + 1).entries.keys() == {1, 2, 3}
    assert (path.stat().st_mode & 0o777) == 0o600


def test_close_reports_a_record_that_could_not_be_saved(tmp_path):
    state = tmp_path / "state"
    now = time.time()
    r = ReplayRecord(state / "replay", now=now)
    shutil.rmtree(state)
    assert r.admit(1, now, now) is None
    gen = r.save_soon()
    assert not r.close() and not r.durable(gen) and r.failing


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file but a FIFO"):
        ReplayRecord(fifo, now=time.time())


def test_a_link_to_a_device_and_an_unrelated_file_are_never_written_over(tmp_path):
    link = tmp_path / "link"
    link.symlink_to("/dev/null")
    with pytest.raises(UserError, match="symbolic link"):
        ReplayRecord(link, now=time.time())
    with pytest.raises(UserError, match="character device"):
        ReplayRecord("/dev/null", now=time.time())
    other = tmp_path / "notes.txt"
    other.write_bytes(b"precious notes\n" * 10)
    with pytest.raises(UserError, match="not a replay record"):
        ReplayRecord(other, now=time.time())
    assert other.read_bytes() == b"precious notes\n" * 10
