"""Block Reed-Solomon baseline on ``reedsolo`` (the comparison point for the RLC codec).

The stream is cut into blocks of ``k`` consecutive source symbols (block b holds ESIs
b*k .. b*k+k-1) and each block gets ``p`` repair symbols. The code is symbol-wise: byte
position j of the k source symbols is one systematic RS(k+p, k) codeword over GF(2^8) (the same
field as RFC 8681, polynomial 0x11D) whose p parity bytes are byte j of the p repair symbols.
Any k of the k+p symbols of a block give back the whole block by erasure decoding, one
``reedsolo`` call per byte position. That is slow (pure Python) and is exactly what the
benchmark is meant to show.

The API mirrors the RLC codec so a session can swap one for the other: a repair symbol is named
by the same RFC 8681 repair fields, with ``first_esi`` the block's first ESI, ``nss == k`` and
``repair_key`` the parity index 0..p-1 (``dt`` is accepted and ignored). A transfer whose last
block is short pads it with empty source symbols.
"""

from __future__ import annotations

import numpy as np
import reedsolo
from kvtransport.codecs.rlc import (
    MAX_ESI,
    RECEIVED,
    RECOVERED,
    UNKNOWN,
    SourceWindow,
    as_byte_view,
    as_u8_array,
)

MAX_CODEWORD = 255
"""k + p may not exceed 255 symbols (one RS codeword over GF(2^8))."""


def _check_code(k: int, p: int) -> None:
    if k < 1 or p < 1 or k + p > MAX_CODEWORD:
        raise ValueError(f"need k >= 1, p >= 1 and k + p <= {MAX_CODEWORD}, got k={k}, p={p}")


def _codec(p: int) -> reedsolo.RSCodec:
    # prim=0x11D, generator 2, fcr 0: the RFC 8681 field (reedsolo's default, made explicit).
    return reedsolo.RSCodec(nsym=p, nsize=MAX_CODEWORD, fcr=0, prim=0x11D, generator=2)


class BlockRSEncoder:
    """Systematic block RS encoder: ``add_source`` then ``repair`` for complete blocks."""

    def __init__(self, symbol_size: int, k: int, p: int, max_blocks: int = 4) -> None:
        _check_code(k, p)
        if symbol_size < 1 or max_blocks < 1:
            raise ValueError("symbol_size and max_blocks must be positive")
        self.symbol_size, self.k, self.p = int(symbol_size), int(k), int(p)
        self.max_blocks = int(max_blocks)
        self._window = SourceWindow(self.symbol_size, self.max_blocks * self.k)
        self._rs = _codec(self.p)
        self._parity: dict[int, np.ndarray] = {}
        self._next_esi = 0

    @property
    def next_esi(self) -> int:
        return self._next_esi

    def add_source(self, payload: object) -> int:
        """Append a source symbol (zero-padded to symbol_size); returns its ESI."""
        esi = self._next_esi
        if esi > MAX_ESI:
            raise ValueError("ESI space exhausted (ESIs are 32-bit)")
        view = as_byte_view(payload)
        if len(view) > self.symbol_size:
            raise ValueError(f"payload of {len(view)} bytes exceeds symbol_size")
        w = self._window
        if esi >= w.base + w.capacity:
            w.clear_below(esi - w.capacity + 1)
            lowest_block = w.base // self.k
            for b in [b for b in self._parity if b < lowest_block]:
                del self._parity[b]
        w.store(esi, view)
        w.state[esi % w.capacity] = RECEIVED
        self._next_esi = esi + 1
        return esi

    def _block_parity(self, block: int) -> np.ndarray:
        parity = self._parity.get(block)
        if parity is not None:
            return parity
        first = block * self.k
        if first + self.k > self._next_esi:
            raise ValueError(f"block {block} is not complete yet")
        if first < self._window.base:
            raise ValueError(f"block {block} has left the encoder's window")
        w = self._window
        rows = np.arange(first, first + self.k) % w.capacity
        columns = np.ascontiguousarray(w.sym[rows, : self.symbol_size].T)  # one codeword per byte
        parity = np.empty((self.p, self.symbol_size), dtype=np.uint8)
        for j in range(self.symbol_size):
            parity[:, j] = np.frombuffer(self._rs.encode(columns[j].tobytes())[self.k :], np.uint8)
        self._parity[block] = parity
        return parity

    def _check_repair(self, first_esi: int, nss: int, repair_key: int) -> int:
        if first_esi % self.k or nss != self.k or not 0 <= repair_key < self.p:
            raise ValueError(
                f"a block RS repair has first_esi a multiple of k={self.k}, nss == k and "
                f"repair_key in 0..{self.p - 1}; got {first_esi}, {nss}, {repair_key}"
            )
        return first_esi // self.k

    def repair(self, first_esi: int, nss: int, repair_key: int, dt: int = 15) -> bytes:
        """Parity symbol ``repair_key`` of the block starting at ``first_esi``."""
        block = self._check_repair(int(first_esi), int(nss), int(repair_key))
        return self._block_parity(block)[int(repair_key)].tobytes()

    def repair_into(
        self, out: object, first_esi: int, nss: int, repair_key: int, dt: int = 15
    ) -> None:
        """Like ``repair`` but writes into a caller buffer of >= symbol_size bytes."""
        data = self.repair(first_esi, nss, repair_key, dt)
        memoryview(out).cast("B")[: self.symbol_size] = data  # type: ignore[arg-type]

    def repairs(self, block: int) -> list[bytes]:
        """All p repair symbols of a complete block."""
        return [row.tobytes() for row in self._block_parity(int(block))]


class BlockRSDecoder(SourceWindow):
    """Block RS decoder with the RLC decoder's interface (see ``RLCDecoder``).

    A block is decoded once any k of its k+p symbols are in; the window holds ``max_blocks``
    blocks and slides forward by whole blocks when a later ESI arrives.
    """

    def __init__(self, symbol_size: int, k: int, p: int, max_blocks: int = 16) -> None:
        _check_code(k, p)
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        super().__init__(symbol_size, max_blocks * k)
        self.k, self.p, self.max_blocks = int(k), int(p), int(max_blocks)
        self._rs = _codec(self.p)
        self._repairs: dict[int, np.ndarray] = {}  # block -> (p, symbol_size) parity
        self._have: dict[int, np.ndarray] = {}  # block -> bool[p]
        self.stats = {"sources": 0, "duplicates": 0, "repairs": 0, "stale": 0, "recovered": 0}

    def release_before(self, esi: int) -> None:
        """Drop every ESI below ``esi``; a block cut by the bound can no longer be decoded."""
        bound = int(esi)
        if bound <= self.base:
            return
        self.clear_below(bound)
        for b in [b for b in self._repairs if b * self.k < bound]:
            del self._repairs[b], self._have[b]

    def _slide_for(self, esi: int) -> None:
        if esi >= self.base + self.capacity:
            self.release_before((esi // self.k - self.max_blocks + 1) * self.k)

    def add_source(self, esi: int, payload: object) -> list[int]:
        """A source symbol arrived; returns the ESIs that became known."""
        esi = int(esi)
        if not 0 <= esi <= MAX_ESI:
            raise ValueError(f"esi must be in 0..{MAX_ESI}, got {esi}")
        view = as_byte_view(payload)
        if len(view) > self.symbol_size:
            raise ValueError(f"payload of {len(view)} bytes exceeds symbol_size")
        self.stats["sources"] += 1
        if esi < self.base:
            self.stats["stale"] += 1
            return []
        self._slide_for(esi)
        if self.state[esi % self.capacity] != UNKNOWN:
            self.stats["duplicates"] += 1
            return []
        self.store(esi, view)
        self.state[esi % self.capacity] = RECEIVED
        result = [esi] + self._try_decode(esi // self.k)
        self.advance_through()
        return result

    def add_repair(
        self, first_esi: int, nss: int, repair_key: int, dt: int, payload: object
    ) -> list[int]:
        """Parity symbol ``repair_key`` of the block at ``first_esi`` arrived."""
        first_esi, nss, repair_key = int(first_esi), int(nss), int(repair_key)
        if first_esi < 0 or first_esi % self.k or nss != self.k or not 0 <= repair_key < self.p:
            raise ValueError(
                f"a block RS repair has first_esi a multiple of k={self.k}, nss == k and "
                f"repair_key in 0..{self.p - 1}; got {first_esi}, {nss}, {repair_key}"
            )
        arr = as_u8_array(payload)
        if arr.shape[0] != self.symbol_size:
            raise ValueError(f"repair payload has {arr.shape[0]} bytes, need {self.symbol_size}")
        self.stats["repairs"] += 1
        if first_esi < self.base:
            self.stats["stale"] += 1
            return []
        self._slide_for(first_esi + self.k - 1)
        block = first_esi // self.k
        if block not in self._repairs:
            self._repairs[block] = np.zeros((self.p, self.symbol_size), dtype=np.uint8)
            self._have[block] = np.zeros(self.p, dtype=bool)
        if self._have[block][repair_key]:
            self.stats["duplicates"] += 1
            return []
        self._repairs[block][repair_key] = arr
        self._have[block][repair_key] = True
        result = self._try_decode(block)
        self.advance_through()
        return result

    def _try_decode(self, block: int) -> list[int]:
        have = self._have.get(block)
        if have is None:
            return []
        first = block * self.k
        cols = np.arange(first, first + self.k) % self.capacity
        known = self.state[cols] != UNKNOWN
        if known.all():
            del self._repairs[block], self._have[block]
            return []
        if int(known.sum()) + int(have.sum()) < self.k:
            return []
        # Codeword positions 0..k-1 are the sources, k..k+p-1 the parity symbols.
        word = np.zeros((self.k + self.p, self.symbol_size), dtype=np.uint8)
        word[: self.k][known] = self.sym[cols[known], : self.symbol_size]
        word[self.k :] = self._repairs[block]
        erasures = np.flatnonzero(~np.concatenate([known, have])).tolist()
        columns = np.ascontiguousarray(word.T)
        decoded = np.empty((self.symbol_size, self.k), dtype=np.uint8)
        for j in range(self.symbol_size):
            msg = self._rs.decode(
                bytearray(columns[j].tobytes()), erase_pos=erasures, only_erasures=True
            )[0]
            decoded[j] = np.frombuffer(bytes(msg), dtype=np.uint8)
        recovered = []
        for i in np.flatnonzero(~known).tolist():
            esi = first + i
            self.sym[cols[i], : self.symbol_size] = decoded[:, i]
            self.sym[cols[i], self.symbol_size :] = 0
            self.state[cols[i]] = RECOVERED
            recovered.append(esi)
        self.stats["recovered"] += len(recovered)
        del self._repairs[block], self._have[block]
        return recovered
