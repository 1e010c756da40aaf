"""Protecting the transport manifest: its own symbols, its own RLC code, heavy repetition.

Without the manifest the receiver cannot tell blocks apart, so it must arrive even under
heavy bursty loss. The sender cuts ``u32 length | manifest bytes`` into M symbols of the
transfer's symbol size (zero-padded) and sends them as MANIFEST datagrams in their own ESI
space, followed by MANIFEST_REPAIR datagrams: dense RLC repairs (DT=15) over all M symbols,
so *any* M of the datagrams received decode it (with probability about 1 - 1/256 per try,
one more datagram otherwise).

Schedule, in data-path slots from the start of the transfer:

- an initial run of ``M + max(4, M)`` manifest datagrams (100% redundancy, at least four
  spares), interleaved one for one with data, starting at slot 0: spacing them out keeps a
  single loss burst (ge-heavy's last about 3 datagrams) from taking several;
- then one more repair after 16 slots, 32, 64, ... (doubling, at most every 1024 slots)
  until a feedback report says the manifest is decoded: with feedback the repetition ends
  within an RTT; with no feedback at all it costs a logarithmic trickle.

The receiver side (:class:`ManifestReceiver`) decodes with an RLCDecoder over the M symbols
and parses the result; anything inconsistent raises kvtransport.core.wire.BadPayload.

Bounded: a manifest takes at most ``MAX_MANIFEST_BYTES`` in symbols (M times the symbol
size; the sender refuses to make a larger one, the receiver to decode one), and
:attr:`ManifestReceiver.nbytes` counts the symbol bytes its decoder has taken in so far,
so a host can charge a manifest being decoded to its memory budget as its datagrams
arrive, not as its first datagram claims.
"""

from __future__ import annotations

import struct

import numpy as np

from kvtransport.codecs.rlc import RLCDecoder, RLCEncoder
from kvtransport.core.transfer import TransportManifest
from kvtransport.core.wire import MAX_NSS, BadPayload, Datagram, DatagramType, Framer, pack_dt_nss

_LEN = struct.Struct("!I")
INITIAL_SPACING = 2
FIRST_REPEAT_GAP = 16
MAX_REPEAT_GAP = 1024
MAX_MANIFEST_BYTES = 8 << 20
"""The most a manifest may take in symbols (M x symbol size): above the largest one of
the standard symbol size (MAX_NSS symbols of 1280 bytes), far below what a forged first
datagram could otherwise claim (MAX_NSS symbols of 64 KiB, 268 MB)."""


def manifest_symbols(manifest: bytes, symbol_size: int) -> int:
    """How many symbols the manifest takes (M)."""
    return -(-(_LEN.size + len(manifest)) // symbol_size)


class ManifestSender:
    """The manifest's symbols, their repairs, and when the next one is due."""

    def __init__(self, manifest: bytes, symbol_size: int) -> None:
        stream = _LEN.pack(len(manifest)) + manifest
        self.m = manifest_symbols(manifest, symbol_size)
        if self.m > MAX_NSS:
            raise ValueError(
                f"manifest of {len(manifest)} bytes needs {self.m} symbols > {MAX_NSS}; "
                "use a larger symbol size or a smaller block table"
            )
        if self.m * symbol_size > MAX_MANIFEST_BYTES:
            raise ValueError(
                f"manifest of {len(manifest)} bytes takes {self.m} symbols of {symbol_size} "
                f"bytes > {MAX_MANIFEST_BYTES} (a receiver refuses it); use a smaller block "
                "table or application metadata"
            )
        self.symbol_size = symbol_size
        padded = np.zeros(self.m * symbol_size, dtype=np.uint8)
        padded[: len(stream)] = np.frombuffer(stream, dtype=np.uint8)
        self._symbols = padded
        self._encoder = RLCEncoder(symbol_size, window=self.m)
        for i in range(self.m):
            self._encoder.add_source(padded[i * symbol_size : (i + 1) * symbol_size])
        self.initial = self.m + max(4, self.m)
        self.sent = 0
        self.acked = False
        self.next_slot = 0
        self._gap = FIRST_REPEAT_GAP

    def emit(self, framer: Framer, seq: int, slot: int) -> bytes:
        """The next manifest datagram (source symbols first, then fresh repairs)."""
        i = self.sent
        s = self.symbol_size
        view = framer.payload_view(s)
        if i < self.m:
            view[:] = self._symbols[i * s : (i + 1) * s]
            out = framer.finish(DatagramType.MANIFEST, seq, s, esi=i, key=self.m)
        else:
            key = (i - self.m) & 0xFFFF
            self._encoder.repair_into(view, 0, self.m, key, 15)
            out = framer.finish(
                DatagramType.MANIFEST_REPAIR, seq, s, esi=0, key=key, dt_nss=pack_dt_nss(15, self.m)
            )
        self.sent = i + 1
        if self.sent < self.initial:
            self.next_slot = slot + INITIAL_SPACING
        else:
            self.next_slot = slot + self._gap
            self._gap = min(2 * self._gap, MAX_REPEAT_GAP)
        return out


class ManifestReceiver:
    """Collects MANIFEST / MANIFEST_REPAIR datagrams until the manifest decodes."""

    def __init__(self, max_symbols: int = MAX_NSS, max_bytes: int = MAX_MANIFEST_BYTES) -> None:
        self.max_symbols = max_symbols
        self.max_bytes = max_bytes
        self.m = 0
        self.symbol_size = 0
        self._decoder: RLCDecoder | None = None
        self._known = 0
        self.nbytes = 0
        """Symbol bytes the decoder has taken in (0 once decoded or reset): what it holds,
        at most two rows per manifest symbol (sources and pending repairs)."""
        self.manifest: TransportManifest | None = None

    def add(self, d: Datagram) -> TransportManifest | None:
        """Feed one datagram; returns the manifest the moment it is complete."""
        if self.manifest is not None:
            return None
        if d.type == DatagramType.MANIFEST:
            m, first = d.key, d.esi
        else:
            m, first = d.nss, d.esi
            if first != 0 or d.dt > 15:
                raise BadPayload("manifest repair must cover the whole manifest")
        size = len(d.payload)
        if self._decoder is None:
            if not 1 <= m <= self.max_symbols or size == 0:
                raise BadPayload(f"manifest of {m} symbols of {size} bytes")
            if m * size > self.max_bytes:
                raise BadPayload(f"manifest of {m} symbols of {size} bytes > {self.max_bytes}")
            self.m, self.symbol_size = m, size
            self._decoder = RLCDecoder(size, max_window=m)
        elif m != self.m or size != self.symbol_size:
            raise BadPayload("manifest datagrams disagree on its size")
        if d.type == DatagramType.MANIFEST:
            if first >= m:
                raise BadPayload(f"manifest ESI {first} >= {m}")
            got = self._decoder.add_source(first, d.payload)
        else:
            got = self._decoder.add_repair(0, m, d.key, d.dt, d.payload)
        self._known += len(got)
        self.nbytes = min(self.nbytes + size, 2 * self.m * size)
        if self._known < self.m:
            return None
        parts = []
        for i in range(self.m):
            sym = self._decoder.get(i)
            assert sym is not None  # m symbols known: the decoder holds every one
            parts.append(sym)
        stream = b"".join(parts)
        (n,) = _LEN.unpack_from(stream)
        if n > len(stream) - _LEN.size:
            self._reset()
            raise BadPayload("manifest length prefix runs past its symbols")
        try:
            self.manifest = TransportManifest.from_bytes(stream[_LEN.size : _LEN.size + n])
        except BadPayload:
            self._reset()
            raise
        self._decoder = None  # free the symbols
        self.nbytes = 0
        return self.manifest

    def _reset(self) -> None:
        self._decoder = None
        self._known = 0
        self.nbytes = 0
        self.m = 0
