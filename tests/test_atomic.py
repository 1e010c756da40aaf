"""Atomic file replacement (kvtransport.atomic) and its two users: cards and result files."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvtransport.atomic import AtomicWriteError, atomic_write
from kvtransport.core.transfer import BlockTable, TransferResult, TransportManifest
from kvtransport.daemons.api import read_result_file, write_result_file
from kvtransport.errors import UserError
from kvtransport.kvformat import card
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import encoding


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_new_file_is_written_whole_and_nothing_else_is_left(tmp_path):
    data = os.urandom(200_000)
    assert atomic_write(tmp_path / "a.bin", memoryview(data)) == tmp_path / "a.bin"
    assert (tmp_path / "a.bin").read_bytes() == data
    assert _names(tmp_path) == ["a.bin"]


def test_replacement_is_a_new_inode_so_open_readers_keep_the_old_bytes(tmp_path):
    path = tmp_path / "a.bin"
    old, new = os.urandom(300_000), os.urandom(100_000)
    path.write_bytes(old)
    with open(path, "rb") as reader:
        atomic_write(path, new)
        assert reader.read() == old  # not truncated or overwritten under the reader
    assert path.read_bytes() == new and _names(tmp_path) == ["a.bin"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_file_gets_the_permissions_open_would_give_not_the_temp_files(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "a.bin", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_concurrent_readers_never_see_a_torn_file(tmp_path):
    path = tmp_path / "a.bin"
    versions = [bytes([i]) * 400_000 for i in range(24)]
    atomic_write(path, versions[0])
    seen, stop = [], threading.Event()

    def read_forever():
        while not stop.is_set():
            seen.append(path.read_bytes())

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        for v in versions[1:]:
            atomic_write(path, v)
    finally:
        stop.set()
        reader.join()
    whole = set(versions)
    torn = [len(s) for s in seen if s not in whole]
    assert seen and not torn, f"{len(torn)} of {len(seen)} reads saw a partial file"
    assert path.read_bytes() == versions[-1]


_FILL_PAST_LIMIT = r"""
import resource, sys
from kvtransport.atomic import AtomicWriteError, atomic_write
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    atomic_write(sys.argv[1], b"n" * (4 * limit))
except AtomicWriteError as exc:
    print(exc.errno, exc)
"""


def test_write_failing_half_way_keeps_the_old_file_and_removes_the_temp(tmp_path):
    # A real half-way failure: the file-size limit lets the first 64 KiB reach the temp
    # file, then write() fails with EFBIG (Python ignores SIGXFSZ).
    path = tmp_path / "a.bin"
    before = os.urandom(10_000)
    path.write_bytes(before)
    out = subprocess.run(
        [sys.executable, "-c", _FILL_PAST_LIMIT, str(path), str(64 * 1024)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    errno_, message = out.strip().split(" ", 1)
    assert int(errno_) == 27 and message == f"cannot write {path}: File too large"
    assert path.read_bytes() == before
    assert _names(tmp_path) == ["a.bin"]


def test_fsync_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)  # after the data, before the rename
    with pytest.raises(AtomicWriteError, match=r"^cannot write .*a\.bin: Input/output error$"):
        atomic_write(path, b"new content")
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and _names(tmp_path) == ["a.bin"]


def test_a_bug_in_the_caller_keeps_its_own_exception_and_leaves_nothing(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        atomic_write(path, "text, not bytes")
    assert path.read_bytes() == b"old" and _names(tmp_path) == ["a.bin"]


def test_bad_targets_give_one_line_user_errors_and_create_nothing(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    cases = [
        (tmp_path / "nodir" / "a.bin", "directory .*nodir does not exist"),
        (tmp_path / "plain" / "a.bin", "directory .*plain is not a directory"),
        (tmp_path / "folder", "it is a directory"),
    ]
    for target, why in cases:
        with pytest.raises(AtomicWriteError, match=f"^cannot write {target}: {why}$") as err:
            atomic_write(target, b"data")
        assert isinstance(err.value, UserError) and isinstance(err.value, OSError)
        assert "\n" not in str(err.value)
    assert _names(tmp_path) == ["folder", "plain"] and not any((tmp_path / "folder").iterdir())


def test_unwritable_directory_gives_a_user_error(tmp_path):
    if os.geteuid() == 0:
        directory = "/sys/kernel"  # sysfs: no new files, not even for root
    else:
        directory = tmp_path / "ro"
        directory.mkdir(mode=0o555)
    target = os.path.join(directory, "a.bin")
    with pytest.raises(AtomicWriteError, match=f"^cannot write {target}: ") as err:
        atomic_write(target, b"data")
    assert err.value.errno is not None and not os.path.exists(target)


# ------------------------------------------------------------------ the two users


def _stream():
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((2, 2, 40, 32)).astype(np.float32) for _ in range(2))
    cache = KVCache(k, v, rng.integers(0, 1000, 40), "toy", rng.random((2, 40)))
    return encoding.encode_cache(cache, created={"by": "test"})


def test_write_card_replaces_atomically_and_reports_a_missing_directory(tmp_path):
    path = tmp_path / "a.card"
    path.write_bytes(b"not yet a card")
    stream = _stream()
    assert card.write_card(path, stream) == path
    assert np.array_equal(card.read_card(path).payload, stream.payload)
    assert _names(tmp_path) == ["a.card"]
    missing = tmp_path / "nodir" / "b.card"
    with pytest.raises(UserError, match=f"^cannot write {missing}: directory .* does not exist"):
        card.write_card(missing, stream)


def _result(tid, payload):
    n = payload.size // 100
    blocks = BlockTable(
        np.arange(n, dtype=np.uint64) * 100,
        np.full(n, 100, np.uint64),
        np.full(n, 1.0 / n),
    )
    manifest = TransportManifest(symbol_size=64, payload_len=payload.size, blocks=blocks)
    complete = np.arange(n) % 3 != 2
    return TransferResult(
        transfer_id=tid,
        manifest=manifest,
        payload=payload,
        complete=complete,
        missing=np.flatnonzero(~complete),
        utility_recovered=0.5,
        reason="deadline",
    )


def test_write_result_file_replaces_a_redelivered_result(tmp_path):
    tid = 0x0123456789ABCDEF
    first = np.frombuffer(os.urandom(1000), np.uint8)
    second = np.frombuffer(os.urandom(1000), np.uint8)
    path = write_result_file(tmp_path, _result(tid, first), {"n": 1})
    assert path == tmp_path / "0123456789abcdef.result.safetensors"
    assert write_result_file(str(tmp_path), _result(tid, second), {"n": 2}) == path
    got = read_result_file(path)
    assert np.array_equal(got.payload, second) and got.stats == {"n": 2}
    assert got.missing.tolist() == [2, 5, 8] and _names(tmp_path) == [path.name]


def test_write_result_file_into_a_missing_directory_is_an_oserror_and_a_user_error(tmp_path):
    # the receiver daemon catches OSError (logs, keeps serving); the CLI shows UserErrors
    res = _result(7, np.zeros(500, np.uint8))
    with pytest.raises(OSError, match="does not exist") as err:
        write_result_file(tmp_path / "gone", res, {})
    assert isinstance(err.value, UserError) and _names(tmp_path) == []
