"""Transfers in flight shared with racers on the same host: the receiver daemon's mirror
and a racer's view of it.

A receiver daemon run with ``--race-dir DIR`` mirrors every transfer it is receiving into
a file ``DIR/<transfer id>.kvrace`` (mode 0600; DIR must not be writable by other users,
for both sides), so that a model process on the same host
can race it (kvtransport.embed.live_race.race_daemon: compute the context's front while
the rest arrives, load token ranges as their blocks complete) instead of waiting for the
result. The file appears, complete with its header, once the transfer's manifest is
known; then, after every batch of datagrams, the daemon copies the blocks that completed
into it and only then stamps their completion times, so a racer that sees a block's time
reads its final bytes (stores are not reordered with other stores on x86-64; a port to a
weaker memory model needs a release fence there). A racer that mapped the file keeps
reading its map whatever happens to the file.

Lifetime and claims: a racer claims its context before it prepares (loads its model,
measures its speed) and looks: a claim is a file ``DIR/<context digest>.<pid>.<any>.claim``
(:class:`Claim`; the digest is the SHA-256 of the context's token ids that every blocks
manifest carries, kvtransport.kvformat.blocks), removed when the racer is done with it. The
daemon keeps the mirror of a finished transfer while a claim on its context is held by a
live process (at most ``CLAIM_KEEP_S`` after the result), removes it once such a claim,
seen while the mirror existed, is gone (used), and otherwise removes it ``KEEP_S`` after
the result; finished mirrors beyond ``KEEP_BYTES`` in all are removed oldest first
(unclaimed ones first). Every mirror is removed when the daemon stops, with the claim
files of dead processes.

Layout (little-endian): ``MAGIC`` (8 bytes), the header's length (u32), the header (JSON:
``transfer_id``, ``num_blocks``, ``payload_len``, ``symbol_size``, ``deadline_s``,
``first_packet`` on the daemon's monotonic clock, which is the host's, ``app_metadata`` in
hex), zero padding to a multiple of 8, per block its completion time (f64, inf until it is
complete), the payload (its complete blocks' bytes; zeros elsewhere).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("kvtransport.race-share")

MAGIC = b"KVRACE01"
SUFFIX = ".kvrace"
CLAIM_SUFFIX = ".claim"
KEEP_S = 120.0
"""How long a finished transfer's file stays when no racer has claimed its context."""
CLAIM_KEEP_S = 600.0
"""How long a finished transfer's file stays at most while a racer's claim holds it."""
KEEP_BYTES = 1 << 30
"""Bytes of finished transfers' files kept in all (the oldest go first beyond it)."""
CLAIM_POLL_S = 0.2
"""How often the daemon reads the claims in its race directory."""
_PREFIX = struct.Struct("<8sI")


def _layout(header: bytes, num_blocks: int) -> tuple[int, int]:
    """Offsets of the completion times and of the payload."""
    times = -(-(_PREFIX.size + len(header)) // 8) * 8
    return times, times + 8 * num_blocks


class TransferMirror:
    """One transfer's file, written by the receiver daemon (module docstring)."""

    def __init__(self, directory: Path, transfer_id: int, session: Any) -> None:
        tm = session.manifest
        b = tm.blocks
        self.transfer_id = transfer_id
        self.path = directory / f"{self.transfer_id:016x}{SUFFIX}"
        header = json.dumps({
            "transfer_id": f"{self.transfer_id:016x}",
            "num_blocks": len(b),
            "payload_len": int(tm.payload_len),
            "symbol_size": int(tm.symbol_size),
            "deadline_s": float(tm.deadline_s),
            "first_packet": float(session.timings.get("first_packet", session.created)),
            "app_metadata": bytes(tm.app_metadata or b"").hex(),
        }).encode()  # fmt: skip
        times, payload = _layout(header, len(b))
        size = payload + int(tm.payload_len)
        tmp = self.path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # a previous run's; never opened through a link
        self._map = _allocate(tmp, max(size, 1))
        self._map[: _PREFIX.size + len(header)] = _PREFIX.pack(MAGIC, len(header)) + header
        self._times = np.frombuffer(self._map, np.float64, len(b), times)
        self._times[:] = np.inf
        self._payload = np.frombuffer(self._map, np.uint8, int(tm.payload_len), payload)
        os.replace(tmp, self.path)  # racers see the file whole or not at all
        self._offsets = b.offsets.astype(np.int64)
        self._ends = self._offsets + b.lengths.astype(np.int64)
        self._copied = np.zeros(len(b), dtype=bool)
        self._n_copied = 0
        self.size = size
        self.digest = _context_digest(tm.app_metadata)  # "" for no KV cache's transfer
        self.finished_at: float | None = None
        self.claimed = False  # a racer's claim on its context was seen

    def update(self, session: Any) -> None:
        """Copy the blocks completed since the last call, then stamp their times (a
        session with no block completed since costs one comparison: this runs after every
        batch of datagrams)."""
        if session.blocks_complete == self._n_copied:
            return
        new = np.flatnonzero(session.complete & ~self._copied)
        src = session.payload_buffer
        for i in new.tolist():
            lo, hi = self._offsets[i], self._ends[i]
            self._payload[lo:hi] = src[lo:hi]
        self._times[new] = session.complete_at[new]
        self._copied[new] = True
        self._n_copied += new.size

    def close(self) -> None:
        """Remove the file (a racer's map of it stays readable)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        del self._times, self._payload
        self._map.close()


def _allocate(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes at ``path``, every block of it allocated on the
    filesystem (``posix_fallocate``: a sparse file would SIGBUS the daemon when a write
    through the map finds the filesystem full), mapped. OSError (the file removed) when
    the space is not there."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def private_dir(directory: str, what: str) -> Path:
    """``directory``, checked to be a folder that no other user may write to (a mirror
    planted there would be loaded as the sender's cache); UserError otherwise."""
    from kvtransport.errors import UserError

    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"{what} {directory} is not a directory")
    if path.stat().st_mode & 0o022:
        raise UserError(f"{what} {directory} is writable by other users (chmod 700 it)")
    return path


def _context_digest(app_metadata: bytes | None) -> str:
    """The SHA-256 of the token ids whose cache a transfer carries ("" if none)."""
    from kvtransport.kvformat import blocks

    try:
        return blocks.Manifest.from_bytes(bytes(app_metadata or b"")).token_ids_sha256
    except blocks.ManifestError:
        return ""


def context_digest(token_ids: Any) -> str:
    """The digest a claim names a context by: the SHA-256 of its token ids, as a blocks
    manifest carries it (kvtransport.kvformat.blocks)."""
    from kvtransport.kvformat import blocks

    return blocks._token_hash(np.asarray(token_ids, dtype=np.int64))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host's process table)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # it exists, as another user
    except (ProcessLookupError, OverflowError):
        return False
    return True


def held_claims(directory: Path, reap: bool = False) -> set[str]:
    """The context digests that live processes hold claims on in ``directory``
    (``reap``: remove the claim files of processes that are gone)."""
    held: set[str] = set()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return held
    for e in entries:
        if not e.name.endswith(CLAIM_SUFFIX):
            continue
        digest, _, rest = e.name.partition(".")
        pid = rest.partition(".")[0]
        if pid.isdigit() and _alive(int(pid)):
            held.add(digest)
        elif reap:
            try:
                os.unlink(e.path)
            except OSError:
                pass
    return held


class Claim:
    """A racer's claim on the transfer of its context (module docstring): while it is
    held, a receiver daemon keeps that transfer's mirror in ``directory`` after the
    result, up to ``CLAIM_KEEP_S``. A context manager; :meth:`release` removes it (once
    the racer is done with the mirror), as does its process's end, for the daemon."""

    def __init__(self, directory: Path, token_ids: Any) -> None:
        import tempfile

        digest = context_digest(token_ids)
        fd, name = tempfile.mkstemp(prefix=f"{digest}.{os.getpid()}.", suffix=CLAIM_SUFFIX,
                                    dir=directory)  # fmt: skip
        os.close(fd)
        self.path: Path | None = Path(name)

    def release(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RaceDir:
    """The daemon's side: one :class:`TransferMirror` per transfer with a manifest; its
    mirrors' lifetime as the module docstring says (``keep_s``, ``claim_keep_s``,
    ``keep_bytes``: the bounds, KEEP_S, CLAIM_KEEP_S and KEEP_BYTES by default)."""

    def __init__(
        self,
        directory: str,
        *,
        keep_s: float = KEEP_S,
        claim_keep_s: float = CLAIM_KEEP_S,
        keep_bytes: int = KEEP_BYTES,
    ) -> None:
        self.directory = private_dir(directory, "--race-dir")
        self.mirrors: dict[int, TransferMirror] = {}
        self._unshared: set[int] = set()  # transfers whose mirror could not be made
        self.keep_s, self.claim_keep_s, self.keep_bytes = keep_s, claim_keep_s, keep_bytes
        self._claims: set[str] = set()
        self._claims_read = -np.inf

    def update(self, host: Any, now: float) -> None:
        """After a batch (and on the daemon's timers): mirror the transfers that have a
        manifest, note the finished ones, remove those whose time is up (module
        docstring)."""
        for tid, inc in host.active.items():
            s = inc.session
            if s.manifest is None or s.complete.shape != (len(s.manifest.blocks),):
                continue
            mirror = self.mirrors.get(tid)
            if mirror is None:
                if tid in self._unshared:
                    continue
                try:
                    mirror = self.mirrors[tid] = TransferMirror(self.directory, tid, s)
                except OSError as exc:
                    self._unshared.add(tid)
                    log.error("transfer %016x: not shared with racers: %s", tid, exc)
                    continue
            mirror.update(s)
        for tid, mirror in list(self.mirrors.items()):
            if tid in host.active:
                continue
            if mirror.finished_at is None:  # its last blocks, then the countdown
                inc = host.get(tid)
                if inc is not None:
                    mirror.update(inc.session)
                mirror.finished_at = now
        if self._unshared:
            self._unshared.intersection_update(host.active)
        if self.mirrors and now - self._claims_read >= CLAIM_POLL_S:
            self._claims_read = now
            self._expire(now, held_claims(self.directory))

    def _expire(self, now: float, claims: set[str]) -> None:
        """Note the claims seen on each mirror; remove the finished mirrors whose time is
        up: used (claimed, no longer), unclaimed for ``keep_s``, claimed for
        ``claim_keep_s``, or the oldest beyond ``keep_bytes``."""
        finished = []
        for tid, mirror in list(self.mirrors.items()):
            held = bool(mirror.digest) and mirror.digest in claims
            if mirror.finished_at is None:
                mirror.claimed |= held
                continue
            age = now - mirror.finished_at
            if held:
                mirror.claimed = True
                done = age > self.claim_keep_s
                why = f"claimed for {self.claim_keep_s:g} s"
            elif mirror.claimed:
                done, why = True, "used by the racer that claimed it"
            else:
                done, why = age > self.keep_s, f"unclaimed for {self.keep_s:g} s"
            if done:
                self._remove(tid, why)
            else:
                finished.append((held, mirror.finished_at, tid))
        total = sum(self.mirrors[tid].size for _, _, tid in finished)
        for _, _, tid in sorted(finished):  # unclaimed first, then the oldest
            if total <= self.keep_bytes:
                break
            total -= self.mirrors[tid].size
            self._remove(tid, f"finished mirrors over {self.keep_bytes} bytes")

    def _remove(self, tid: int, why: str) -> None:
        log.debug("transfer %016x: mirror removed (%s)", tid, why)
        self.mirrors.pop(tid).close()

    def close(self) -> None:
        for mirror in self.mirrors.values():
            mirror.close()
        self.mirrors.clear()
        held_claims(self.directory, reap=True)


@dataclass
class _SharedManifest:
    """What a racer reads of the transport manifest (kvtransport.core.transfer)."""

    blocks: range
    app_metadata: bytes
    deadline_s: float
    symbol_size: int


@dataclass
class SharedTransfer:
    """A racer's read-only view of a mirrored transfer, shaped as the receiver session
    that kvtransport.embed.live_race.LiveArrivals reads."""

    path: Path
    transfer_id: str
    manifest: _SharedManifest
    complete_at: np.ndarray
    payload_buffer: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    created: float = 0.0

    @property
    def complete(self) -> np.ndarray:
        return np.isfinite(self.complete_at)


def open_shared(path: Path) -> SharedTransfer | None:
    """Map one mirror file read-only (None: not one, or gone)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _PREFIX.size:
                return None
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    magic, n = _PREFIX.unpack_from(m, 0)
    if magic != MAGIC or _PREFIX.size + n > size:
        return None
    try:
        h = json.loads(bytes(m[_PREFIX.size : _PREFIX.size + n]))
        nb, plen = int(h["num_blocks"]), int(h["payload_len"])
        times, payload = _layout(bytes(n), nb)
        if payload + plen > size:
            return None
        manifest = _SharedManifest(range(nb), bytes.fromhex(h["app_metadata"]),
                                   float(h["deadline_s"]), int(h["symbol_size"]))  # fmt: skip
        first = float(h["first_packet"])
    except (ValueError, KeyError, TypeError):
        return None
    return SharedTransfer(
        path,
        str(h["transfer_id"]),
        manifest,
        np.frombuffer(m, np.float64, nb, times),
        np.frombuffer(m, np.uint8, plen, payload),
        {"first_packet": first},
        first,
    )


class SharedTransfers:
    """A racer's search of a race directory for the transfer of its context: the newest
    mirror whose blocks manifest is the cache of ``token_ids``
    (kvtransport.kvformat.blocks.is_cache_of), mapped when first found and kept from then on
    (:attr:`found`), even once the daemon removes its file. Call it as the race's session
    source; :meth:`claim` asks the daemon to keep the mirror until released."""

    def __init__(self, directory: str, token_ids: Any) -> None:
        self.directory = private_dir(directory, "the race directory")
        self.token_ids = token_ids
        self._rejected: set[Path] = set()
        self.found: SharedTransfer | None = None

    def claim(self) -> Claim:
        """A :class:`Claim` on this context's transfer (release it once raced)."""
        from kvtransport.errors import UserError

        try:
            return Claim(self.directory, self.token_ids)
        except OSError as exc:
            raise UserError(f"cannot claim a transfer in {self.directory}: {exc}") from None

    def __call__(self) -> SharedTransfer | None:
        if self.found is None:
            self.found = self._search()
        return self.found

    def _search(self) -> SharedTransfer | None:
        from kvtransport.kvformat import blocks

        try:
            paths = sorted(self.directory.glob(f"*{SUFFIX}"), key=_mtime, reverse=True)
        except OSError:
            return None
        for path in paths:
            if path in self._rejected:
                continue
            shared = open_shared(path)
            if shared is None:
                continue
            try:
                m = blocks.Manifest.from_bytes(shared.manifest.app_metadata)
            except blocks.ManifestError:
                m = None
            if m is not None and blocks.is_cache_of(m, self.token_ids):
                return shared
            self._rejected.add(path)
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
