"""Atomic file replacement: readers see the old file or the new one, never a torn one.

Cache cards and result files are read by other processes while they are being written
(an agent polling ``--out-dir``, a second prefill that reuses a cached card). Writing in
place would let such a reader, or a crash, leave a file that is half old and half new.
:func:`atomic_write` writes to a hidden temporary sibling (same directory, so the same
filesystem and an atomic ``rename``), fsyncs it, renames it over the target and fsyncs
the directory, without which the rename itself may not survive a power cut. The temporary
file is removed on any failure, interrupts included, so a failed write leaves the previous
file byte-identical and no litter. The new file gets the permissions ``open`` would give it
(0666 less the umask), not the temporary file's private 0600: a result file that a daemon
running as root writes must stay readable by the agent that consumes it.

Failures of the filesystem (missing or unwritable directory, disk full, file too large)
raise :class:`AtomicWriteError`, one line naming the file. It is a
:class:`~kvtransport.errors.UserError`, so the CLI prints it without a traceback, and an
:class:`OSError`, so code that already survives I/O failures (the receiver daemon logs a
result it could not write and keeps serving) needs no second ``except``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvtransport.errors import UserError

__all__ = ["AtomicWriteError", "atomic_write"]


class AtomicWriteError(UserError, OSError):
    """A file could not be written; the previous file, if any, is untouched."""


def _error(path: Path, exc: OSError) -> AtomicWriteError:
    err = AtomicWriteError(f"cannot write {path}: {exc.strerror or exc}")
    err.errno = exc.errno
    return err


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` can only be read by
    setting it, which races with other threads creating files); 0o022 if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write(
    path: str | os.PathLike, data: bytes | bytearray | memoryview, *, mode: int | None = None
) -> Path:
    """Replace ``path`` with ``data`` atomically; returns the path. ``mode``: the new
    file's permissions (default: 0666 less the umask, module docstring).

    Raises :class:`AtomicWriteError` if the directory is missing or not writable, the
    target is a directory, or any write, fsync or rename fails. Anything else (a ``data``
    that is not a buffer, KeyboardInterrupt) propagates unchanged, after the cleanup.
    """
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        why = "is not a directory" if directory.exists() else "does not exist"
        raise AtomicWriteError(f"cannot write {path}: directory {directory} {why}")
    if path.is_dir():
        raise AtomicWriteError(f"cannot write {path}: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise _error(path, exc) from exc
    try:
        # mkstemp's 0600 would hide the file from others, unless that is what is asked
        os.fchmod(fd, (0o666 & ~_umask()) if mode is None else mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _error(path, exc) from exc
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:  # the new file is in place, but may not survive a crash
        raise _error(path, exc) from exc
    return path
