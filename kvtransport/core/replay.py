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
kvtransport.atomic (a crash leaves the previous record or the new one, never a torn one);
the receiver engine persists after every receive batch that accepted a manifest, before
that batch's results go out. A missing file is a first start (empty record); a corrupt
one is replaced by a floor at the current time (everything sent before this start is
refused), with a warning; an unreadable one is a one-line :class:`UserError`.

File layout (little-endian): ``b"KVTR"``, version u16 (1), reserved u16, floor f64, count
u32, count x (transfer id u64, sent_at f64), CRC-32 of everything before.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import struct
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
        if self.path is not None:
            self._load(now)
        self._forget(now)

    # ------------------------------------------------------------------ decisions

    def admit(self, transfer_id: int, sent_at: float, now: float) -> str | None:
        """None, and ``transfer_id`` recorded as sent at ``sent_at``, when the manifest is
        fresh and new; else the refusal's reason (counted in ``refused``)."""
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
        """Write the record if it changed (atomically); False, logged and counted in
        ``persist_errors``, when the write failed (the record stays in memory, and is
        written again with the next change)."""
        if not self.dirty or self.path is None:
            return True
        try:
            atomic_write(self.path, self.to_bytes())
        except OSError as exc:
            self.persist_errors += 1
            log.error("replay record not saved (a restart may accept a replay): %s", exc)
            return False
        self.dirty = False
        return True

    def _load(self, now: float) -> None:
        p = self.path
        if p is None:  # in memory only
            return
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            data = p.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise UserError(f"cannot read replay record {p}: {exc.strerror}") from None
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
