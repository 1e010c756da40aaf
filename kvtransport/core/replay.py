"""Replay protection for a receiver: fresh manifests only, each transfer accepted once.

A captured transfer (every sealed datagram of it, recorded off the wire) opens under the
pre-shared key as well as it did the first time, so authentication alone does not stop
it being played again. Two checks on the transport manifest do (kvtransport.core.transfer: it
carries ``sent_at``, the sender's wall clock when it made the manifest):

- freshness: ``sent_at`` must be within ``window_s`` of this host's wall clock, either
  way (the hosts' clocks must agree to well within the window: run NTP);
- once: the :class:`ReplayRecord` keeps, per transfer id, the newest ``sent_at`` it
  accepted; a manifest of a recorded id must be newer (a sender that restarts the
  manifest for a restarted receiver makes a new one, kvtransport.core.sender), so the same
  manifest played again is refused.

Bounded: an entry older than the window is forgotten (its manifest is refused as stale
anyway), and beyond ``capacity`` entries the oldest go first. Every forgotten entry raises
the ``floor``: no manifest sent at or before the floor is accepted, whatever its id, so
forgetting never lets a replay in (and a wall clock stepped back cannot make an old
manifest fresh again). Refusals are named ``stale_manifest`` (outside the window or at
or below the floor) and ``replayed_manifest`` (this id, not newer).

Survives restarts: :meth:`ReplayRecord.persist` writes the record with
kvtransport.atomic (a crash leaves the previous record or the new one, never a torn one).
A receiver engine does not write on its data path: :meth:`ReplayRecord.save_soon` hands a
snapshot to a background writer thread and returns its generation; a result is handed on
only once :meth:`ReplayRecord.durable` says that generation (or a later one) is on disk.

Fails closed: while the latest save failed (``failing``), :meth:`ReplayRecord.admit`
refuses every new transfer (reason ``replay_record_unsaved``); the writer retries every
``RETRY_S`` and admission resumes with the first save that succeeds. Each failure streak
is logged once, at its start.

Only ever a regular file: at start-up the path is checked with ``lstat``; a directory,
device node, FIFO, socket or symbolic link, or a regular file that is not a replay record
(other magic), is a one-line :class:`UserError` and is never written over. A missing file
is a first start (empty record); a damaged record (its magic right, its CRC or layout
wrong) is replaced by a floor at the current time (everything sent before this start is
refused), with a warning; an unreadable one is a one-line :class:`UserError`.

File layout (little-endian): ``b"KVTR"``, version u16 (1), reserved u16, floor f64, count
u32, count x (transfer id u64, sent_at f64), CRC-32 of everything before.
"""

from __future__ import annotations

import errno
import heapq
import logging
import math
import os
import stat
import struct
import threading
import time
import zlib
from pathlib import Path

from kvtransport.atomic import atomic_write
from kvtransport.errors import UserError

log = logging.getLogger("kvtransport.replay")

DEFAULT_WINDOW_S = 120.0
"""How far a manifest's send time may be from the receiver's wall clock. It covers clock
disagreement between hosts plus the time until the receiver decodes the manifest."""
DEFAULT_CAPACITY = 8192
"""Transfer ids remembered (128 KiB on disk): enough for 68 new transfers a second, every
second of a 120 s window; beyond that the floor rises ahead of the window."""
MAX_WINDOW_S = 3600.0

_MAGIC = b"KVTR"
_VERSION = 1
_HEAD = struct.Struct("<4sHHdI")
_ENTRY = struct.Struct("<Qd")
_CRC = struct.Struct("<I")

STALE = "stale_manifest"
REPLAYED = "replayed_manifest"
UNSAVED = "replay_record_unsaved"
RETRY_S = 1.0
"""Time between the writer's tries while the record cannot be saved."""


def default_state_dir() -> Path:
    """Where receivers keep their replay records: ``$KVT_STATE_DIR``, else
    ``$XDG_STATE_HOME/kvtransport``, else ``~/.local/state/kvtransport``."""
    env = os.environ.get("KVT_STATE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "kvtransport"


def default_record_path(port: int) -> Path:
    """The default replay record of a receiver listening on UDP ``port`` (one per port, so
    two receivers on one host keep apart)."""
    return default_state_dir() / f"replay-{port}"


def open_record(
    path: str | os.PathLike | None, port: int, window_s: float = DEFAULT_WINDOW_S
) -> ReplayRecord:
    """The replay record of a receiver about to bind UDP ``port``: the file ``path``, else
    :func:`default_record_path` of the port, else (port 0, an ephemeral port that a
    restart would not get again) one in memory only. Opened before the receiver's slow
    start-up work, so a bad file is a one-line error at once."""
    if path is None and port != 0:
        path = default_record_path(port)
    return ReplayRecord(path, now=time.time(), window_s=window_s)


class ReplayRecord:
    """Which transfers a receiver accepted, and since when it accepts any (module
    docstring). ``path`` None keeps it in memory only (tests, tools).

    :meth:`admit` decides and records in memory; :meth:`persist` writes the record if
    :meth:`admit` changed it. ``now`` is always the wall clock (Unix seconds).
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        *,
        now: float,
        window_s: float = DEFAULT_WINDOW_S,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if not 0 < window_s <= MAX_WINDOW_S or capacity < 1:
            raise UserError(
                f"the replay window must be in (0, {MAX_WINDOW_S:g}] s and the capacity >= 1"
            )
        self.path = None if path is None else Path(path)
        self.window_s = float(window_s)
        self.capacity = int(capacity)
        self.floor = 0.0
        self.entries: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []  # (sent_at, id); stale pairs skipped
        self.dirty = False
        self.refused: dict[str, int] = {}
        self.persist_errors = 0
        self.failing = False  # the latest save failed: admit() refuses (module docstring)
        self.generation = 0  # snapshots handed to the writer (save_soon)
        self.saved_generation = 0  # the newest of them on disk
        self._cond = threading.Condition()
        self._pending: tuple[int, bytes] | None = None  # (generation, snapshot) to write
        self._writer: threading.Thread | None = None
        self._closing = False
        if self.path is not None:
            self._load(now)
        self._forget(now)

    # ------------------------------------------------------------------ decisions

    def admit(self, transfer_id: int, sent_at: float, now: float) -> str | None:
        """None, and ``transfer_id`` recorded as sent at ``sent_at``, when the manifest is
        fresh and new; else the refusal's reason (counted in ``refused``)."""
        if self.failing:
            return self._refuse(UNSAVED)
        w = self.window_s
        if not (now - w <= sent_at <= now + w) or sent_at <= self.floor:
            return self._refuse(STALE)
        prev = self.entries.get(transfer_id)
        if prev is not None and sent_at <= prev:
            return self._refuse(REPLAYED)
        self.entries[transfer_id] = sent_at
        heapq.heappush(self._heap, (sent_at, transfer_id))
        self.dirty = True
        self._forget(now)
        return None

    def _refuse(self, reason: str) -> str:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return reason

    def _forget(self, now: float) -> None:
        """Drop entries older than the window, then the oldest beyond ``capacity``; the
        floor rises to each one dropped."""
        heap, entries = self._heap, self.entries
        horizon = now - self.window_s
        while heap and (heap[0][0] < horizon or len(entries) > self.capacity):
            sent_at, tid = heapq.heappop(heap)
            if entries.get(tid) != sent_at:
                continue  # superseded by a newer manifest of the same id
            del entries[tid]
            self.floor = max(self.floor, sent_at)
            self.dirty = True
        if len(heap) > 2 * len(entries) + 64:  # superseded pairs pile up: rebuild
            self._heap = [(t, i) for i, t in entries.items()]
            heapq.heapify(self._heap)

    # ------------------------------------------------------------------ the file

    def to_bytes(self) -> bytes:
        body = _HEAD.pack(_MAGIC, _VERSION, 0, self.floor, len(self.entries)) + b"".join(
            _ENTRY.pack(tid, t) for tid, t in self.entries.items()
        )
        return body + _CRC.pack(zlib.crc32(body))

    def persist(self) -> bool:
        """Write the record now if it changed (atomically, on the calling thread); False
        when the write failed (``failing`` set: :meth:`admit` refuses until a save
        succeeds; the record stays dirty and in memory)."""
        if not self.dirty or self.path is None:
            return self.durable(self.generation)
        self.generation += 1
        gen, data = self.generation, self.to_bytes()
        self.dirty = False
        if self._write(gen, data):
            return True
        self.dirty = True
        return False

    def _write(self, gen: int, data: bytes) -> bool:
        """Write snapshot ``gen``; the outcome goes to ``failing``/``saved_generation``."""
        assert self.path is not None
        try:
            atomic_write(self.path, data, mode=0o600)
        except OSError as exc:
            self.persist_errors += 1
            if not self.failing:
                log.error(
                    "replay record %s not saved: refusing new transfers until it is (%s)",
                    self.path,
                    exc,
                )
            self.failing = True
            return False
        if self.failing:
            log.warning("replay record %s saved again: accepting transfers", self.path)
        self.failing = False
        with self._cond:
            self.saved_generation = max(self.saved_generation, gen)
        return True

    def durable(self, generation: int) -> bool:
        """Whether snapshot ``generation`` (or a newer one) is on disk; always true for
        a record kept in memory only."""
        return self.path is None or self.saved_generation >= generation

    def save_soon(self) -> int:
        """Hand the record, if it changed, to the background writer (a thread that runs
        while snapshots wait); returns the generation a result must wait for
        (:meth:`durable`)."""
        if self.path is None or not self.dirty:
            return self.generation
        self.generation += 1
        self.dirty = False
        with self._cond:
            self._pending = (self.generation, self.to_bytes())
            self._cond.notify()
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="kvtransport-replay-writer", daemon=True
                )
                self._writer.start()
        return self.generation

    def _write_loop(self) -> None:
        """The writer thread: the newest pending snapshot to disk; a failed one is tried
        again every RETRY_S unless a newer snapshot replaces it. Ends when nothing waits
        (or at :meth:`close`)."""
        while True:
            with self._cond:
                job, self._pending = self._pending, None
                if job is None or self._closing:
                    self._pending = job  # close() writes it on its own thread
                    self._writer = None
                    self._cond.notify_all()
                    return
            if not self._write(*job):
                with self._cond:
                    if self._pending is None:
                        self._pending = job
                    if not self._closing:
                        self._cond.wait(RETRY_S)

    def close(self) -> bool:
        """Stop the writer and save whatever is left on this thread; whether everything
        handed out is on disk."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._writer is not None:
                self._cond.wait()
            job, self._pending = self._pending, None
            self._closing = False
        if job is not None and not self._write(*job):
            self.dirty = True
        self.persist()
        return self.durable(self.generation)

    def _load(self, now: float) -> None:
        p = self.path
        if p is None:  # in memory only
            return
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            data = read_regular_file(p)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise UserError(f"cannot read replay record {p}: {exc.strerror}") from None
        if data[: len(_MAGIC)] != _MAGIC:
            raise UserError(
                f"{p} is not a replay record (it does not start with {_MAGIC!r}): "
                "refusing to write over it; name another --replay-file"
            )
        try:
            self._parse(data)
        except ValueError as exc:
            self.entries.clear()
            self._heap.clear()
            self.floor = now
            self.dirty = True
            log.warning(
                "replay record %s is damaged (%s): refusing every transfer sent before now",
                p,
                exc,
            )

    def _parse(self, data: bytes) -> None:
        if len(data) < _HEAD.size + _CRC.size:
            raise ValueError("truncated")
        body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
        if zlib.crc32(body) != crc:
            raise ValueError("CRC mismatch")
        magic, version, _, floor, n = _HEAD.unpack_from(body)
        if magic != _MAGIC or version != _VERSION or len(body) != _HEAD.size + n * _ENTRY.size:
            raise ValueError("not a version-1 replay record")
        if not math.isfinite(floor):
            raise ValueError("floor is not a time")
        self.floor = floor
        for tid, t in _ENTRY.iter_unpack(body[_HEAD.size :]):
            if math.isfinite(t) and t > self.entries.get(tid, -math.inf):
                self.entries[tid] = t
        self._heap = [(t, i) for i, t in self.entries.items()]
        heapq.heapify(self._heap)


def read_regular_file(path: os.PathLike | str) -> bytes:
    """The bytes of ``path``, which must be a regular file (checked with ``lstat``, and
    opened without following a link or waiting on a FIFO). FileNotFoundError when it is
    missing; any other OSError (``strerror`` naming what the path is instead) otherwise."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"not a regular file but {_file_kind(st.st_mode)}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the lstat
            raise OSError(errno.EINVAL, "not a regular file")
        return fh.read()


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"
