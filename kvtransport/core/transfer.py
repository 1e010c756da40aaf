"""What the transport moves: a transfer, its transport manifest, and the receiver's result.

A :class:`Transfer` is the transport-level view of one handoff: opaque application
metadata (for KV caches, kvtransport.kvformat.blocks' manifest; the transport never parses it), what
its producer declares of the stream (``whole_ranges``), the
payload (a uint8 stream already in utility order) and the :class:`BlockTable` (per block:
byte offset, length and utility, utilities summing to at most 1). The transport cuts the
payload into fixed-size source symbols; a block is delivered only if every byte of it is.

The :class:`TransportManifest` is what the receiver needs before the payload makes sense:
symbol size, payload size, block table, application metadata, the deadline relative to
the transfer's first datagram and the decoder window the sender works with. Its
serialization (:meth:`TransportManifest.to_bytes`) is little-endian::

    0   4  magic b"KVTM"
    4   2  version (3; version 2 had no decoder window)
    6   2  flags (0)
    8   4  symbol size
    12  8  payload length (bytes)
    20  4  block count n
    24  8  deadline: seconds from the transfer's first datagram (float64; 0 = none)
    32  8  sent at: the sender's wall clock (Unix seconds, float64) when it made this
           manifest (0 = not given); a daemon receiver refuses a manifest that is not
           fresh or that it accepted before (kvtransport.core.replay)
    40  4  application metadata length A
    44  4  compressed block table length Z
    48  4  decoder window: source ESIs the receiver's window decoder must hold (0 = not
           given: its own default); a receiver refuses one beyond its limit
    52  Z  zlib(offsets u64[n] | lengths u64[n] | utilities f64[n])
    ..  A  application metadata
    ..  4  CRC-32 of everything before

The session sends these bytes as their own symbols with heavy protection (see
kvtransport.core.manifest_fec). :class:`TransferResult` is what a receiver yields at the deadline or
when everything is decoded: every complete block's bytes, a completeness mask, the exact
list of missing blocks, the utility recovered and timings.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from kvtransport.bounds import MAX_DEADLINE_S
from kvtransport.core.wire import BadPayload

UTILITY_PROFILES = ("zipf", "flat", "linear")
MANIFEST_MAGIC = b"KVTM"
MANIFEST_VERSION = 3
MAX_BLOCKS = 1 << 22
MAX_PAYLOAD_BYTES = 1 << 48
"""The largest payload, block offset or block length a transfer may name (256 TiB): far
beyond any cache, and small enough that an offset plus a length never wraps a u64."""
_MANIFEST_FIXED = struct.Struct("<4sHHIQIddIII")
_CRC = struct.Struct("<I")
_UTILITY_SLACK = 1e-6


@dataclass(frozen=True)
class BlockTable:
    """Per-block byte ranges of the payload and their utilities, in stream order.

    Blocks do not overlap and appear in increasing offset order (the stream order);
    utilities are finite, non-negative and sum to at most 1.
    """

    offsets: np.ndarray  # uint64 [n]
    lengths: np.ndarray  # uint64 [n]
    utilities: np.ndarray  # float64 [n]

    def __post_init__(self) -> None:
        off = np.ascontiguousarray(self.offsets, dtype=np.uint64).reshape(-1)
        ln = np.ascontiguousarray(self.lengths, dtype=np.uint64).reshape(-1)
        ut = np.ascontiguousarray(self.utilities, dtype=np.float64).reshape(-1)
        object.__setattr__(self, "offsets", off)
        object.__setattr__(self, "lengths", ln)
        object.__setattr__(self, "utilities", ut)
        n = off.shape[0]
        if ln.shape[0] != n or ut.shape[0] != n:
            raise ValueError("offsets, lengths and utilities must have one entry per block")
        if n > MAX_BLOCKS:
            raise ValueError(f"{n} blocks > {MAX_BLOCKS}")
        if n and (ln == 0).any():
            raise ValueError("blocks must not be empty")
        if n and (off.max() > MAX_PAYLOAD_BYTES or ln.max() > MAX_PAYLOAD_BYTES):
            raise ValueError(f"block offsets and lengths must be at most {MAX_PAYLOAD_BYTES}")
        if n > 1 and (off[1:] < off[:-1] + ln[:-1]).any():
            raise ValueError("blocks must be in increasing offset order and must not overlap")
        if not np.isfinite(ut).all() or (ut < 0).any() or ut.sum() > 1.0 + _UTILITY_SLACK:
            raise ValueError("utilities must be finite, >= 0 and sum to at most 1")

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def end(self) -> int:
        """One past the last byte any block covers."""
        return int(self.offsets[-1] + self.lengths[-1]) if len(self) else 0

    def symbol_ranges(self, symbol_size: int) -> tuple[np.ndarray, np.ndarray]:
        """First and one-past-last source symbol (ESI) of every block."""
        s = np.uint64(symbol_size)
        first = (self.offsets // s).astype(np.int64)
        last = ((self.offsets + self.lengths + s - np.uint64(1)) // s).astype(np.int64)
        return first, last

    def equals(self, other: BlockTable) -> bool:
        return (
            np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.lengths, other.lengths)
            and np.array_equal(self.utilities, other.utilities)
        )


@dataclass(frozen=True)
class Transfer:
    """One handoff as the transport sees it (see the module docstring)."""

    payload: np.ndarray  # uint8 [n bytes], blocks in utility (stream) order
    blocks: BlockTable
    app_metadata: bytes = b""
    whole_ranges: bool = False
    """Declared by the producer: the stream sends its units (a KV cache's token ranges)
    one after another, and a unit is worth something only once all its blocks arrived.
    The sender's host reads it to choose a policy (kvtransport.hosts.policy_choice);
    nothing in the transport parses the application's metadata to learn it."""

    def __post_init__(self) -> None:
        p = np.ascontiguousarray(self.payload, dtype=np.uint8).reshape(-1)
        object.__setattr__(self, "payload", p)
        object.__setattr__(self, "app_metadata", bytes(self.app_metadata))
        if self.blocks.end > p.shape[0]:
            raise ValueError(f"block table covers {self.blocks.end} bytes > payload {p.size}")

    @property
    def nbytes(self) -> int:
        return int(self.payload.shape[0])


def utility_profile(name: str, n_blocks: int, zipf_s: float = 1.0) -> np.ndarray:
    """Decreasing block utilities summing to 1: zipf (1/rank^s), flat, or linear."""
    if n_blocks < 1:
        raise ValueError("need at least one block")
    rank = np.arange(1, n_blocks + 1, dtype=np.float64)
    if name == "zipf":
        u = rank**-zipf_s
    elif name == "flat":
        u = np.ones(n_blocks)
    elif name == "linear":
        u = (n_blocks + 1 - rank).astype(np.float64)
    else:
        raise ValueError(f"utility profile must be one of {', '.join(UTILITY_PROFILES)}")
    return u / u.sum()


def synthetic_transfer(
    size_bytes: int,
    n_blocks: int,
    profile: str = "zipf",
    seed: int = 0,
    app_metadata: bytes = b"",
) -> Transfer:
    """A random payload of ``size_bytes`` cut into ``n_blocks`` near-equal blocks, in
    utility order (highest first), utilities from :func:`utility_profile`. Seeded."""
    if size_bytes < n_blocks or n_blocks < 1:
        raise ValueError("need 1 <= n_blocks <= size_bytes")
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, size_bytes, dtype=np.uint8)
    edges = (np.arange(n_blocks + 1, dtype=np.int64) * size_bytes) // n_blocks
    blocks = BlockTable(edges[:-1], np.diff(edges), utility_profile(profile, n_blocks))
    return Transfer(payload, blocks, app_metadata)


@dataclass(frozen=True)
class TransportManifest:
    """Everything the receiver needs to interpret the source symbols."""

    symbol_size: int
    payload_len: int
    blocks: BlockTable
    app_metadata: bytes = b""
    deadline_s: float = 0.0  # seconds from the transfer's first datagram; 0 = not given
    sent_at: float = 0.0  # the sender's wall clock (Unix s) when it made the manifest
    # source ESIs the sender's window spans (kvtransport.core.protocol.ProtocolConfig.
    # window_for), which the receiver's decoder must hold; 0 = not given (its own default)
    decoder_window: int = 0

    @property
    def n_source(self) -> int:
        """Number of source symbols (the last one zero-padded to the symbol size)."""
        return -(-self.payload_len // self.symbol_size)

    def to_bytes(self) -> bytes:
        table = zlib.compress(
            self.blocks.offsets.astype("<u8").tobytes()
            + self.blocks.lengths.astype("<u8").tobytes()
            + self.blocks.utilities.astype("<f8").tobytes(),
            6,
        )
        head = _MANIFEST_FIXED.pack(
            MANIFEST_MAGIC,
            MANIFEST_VERSION,
            0,
            self.symbol_size,
            self.payload_len,
            len(self.blocks),
            float(self.deadline_s),
            float(self.sent_at),
            len(self.app_metadata),
            len(table),
            self.decoder_window,
        )
        body = head + table + self.app_metadata
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TransportManifest:
        """Parse and validate; raises :class:`kvtransport.core.wire.BadPayload` on any defect."""
        data = bytes(data)
        fixed = _MANIFEST_FIXED.size
        if len(data) < fixed + _CRC.size:
            raise BadPayload("transport manifest truncated")
        body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
        if zlib.crc32(body) != crc:
            raise BadPayload("transport manifest CRC mismatch")
        fields = _MANIFEST_FIXED.unpack_from(body)
        magic, version, _flags, sym, plen, n, deadline, sent_at, alen, zlen, window = fields
        if magic != MANIFEST_MAGIC or version != MANIFEST_VERSION:
            raise BadPayload(f"not a version-{MANIFEST_VERSION} transport manifest")
        if fixed + zlen + alen != len(body) or not 0 < sym <= 65535 or n > MAX_BLOCKS:
            raise BadPayload("transport manifest lengths are inconsistent")
        if plen > MAX_PAYLOAD_BYTES:
            raise BadPayload(f"transport manifest payload of {plen} bytes > {MAX_PAYLOAD_BYTES}")
        if not (0.0 <= deadline <= MAX_DEADLINE_S):
            raise BadPayload(
                f"transport manifest deadline is not a time in 0..{MAX_DEADLINE_S:g} s"
            )
        if not (0.0 <= sent_at < 1e11):  # also rejects NaN; 1e11 s is year 5138
            raise BadPayload("transport manifest send time is not a Unix time")
        want = 24 * n
        try:
            z = zlib.decompressobj()
            table = z.decompress(body[fixed : fixed + zlen], want + 1)
        except zlib.error as exc:
            raise BadPayload(f"transport manifest block table: {exc}") from None
        if len(table) != want or not z.eof:
            raise BadPayload("transport manifest block table has the wrong size")
        cols = np.frombuffer(table, dtype="<u8", count=2 * n)
        util = np.frombuffer(table, dtype="<f8", offset=16 * n, count=n)
        try:
            blocks = BlockTable(cols[:n], cols[n:], util)
        except ValueError as exc:
            raise BadPayload(f"transport manifest block table: {exc}") from None
        if blocks.end > plen:
            raise BadPayload("transport manifest blocks run past the payload")
        return cls(sym, plen, blocks, body[fixed + zlen :], deadline, sent_at, window)


@dataclass
class TransferResult:
    """What a receiver yields (at the deadline, on abort, or when everything decoded).

    ``payload`` holds every complete block's bytes at its offset (zeros elsewhere; bytes of
    incomplete blocks that happened to arrive are kept too but carry no guarantee).
    ``manifest`` is None when the transport manifest never arrived: then nothing is known
    about blocks and ``complete``/``missing`` are empty.
    """

    transfer_id: int
    manifest: TransportManifest | None
    payload: np.ndarray
    complete: np.ndarray  # bool [blocks]
    missing: np.ndarray  # int64 indices of incomplete blocks, ascending
    utility_recovered: float
    reason: str  # "complete", "deadline", "abort", "fin", "idle"
    timings: dict[str, float] = field(default_factory=dict)
    # per block: the session time at which it became complete (inf: never)
    complete_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))

    @property
    def app_metadata(self) -> bytes | None:
        return self.manifest.app_metadata if self.manifest is not None else None

    @property
    def complete_age_s(self) -> np.ndarray:
        """Per block: seconds from its completion to the result (inf: never complete)."""
        finished = self.timings.get("finished")
        if finished is None or self.complete_at.size != self.complete.size:
            return np.full(self.complete.size, np.inf)
        return finished - self.complete_at

    def block_bytes(self, index: int) -> np.ndarray:
        """The bytes of block ``index`` (meaningful only if it is complete)."""
        if self.manifest is None:
            raise ValueError("no manifest arrived: no block is complete")
        b = self.manifest.blocks
        o = int(b.offsets[index])
        return self.payload[o : o + int(b.lengths[index])]
