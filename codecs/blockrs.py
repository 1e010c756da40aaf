"""Block Reed-Solomon baseline: ``reedsolo``'s code at numba speed (the comparison point for
the RLC codec).

The stream is cut into blocks of ``k`` consecutive source symbols (block b holds ESIs
b*k .. b*k+k-1) and each block gets ``p`` repair symbols. The code is symbol-wise: byte
position j of the k source symbols is one systematic RS(k+p, k) codeword of ``reedsolo``
(``RSCodec(nsym=p)`` over GF(2^8) with polynomial 0x11D, the RFC 8681 field; generator 2,
fcr 0) whose p parity bytes are byte j of the p repair symbols. Any k of the k+p symbols of a
block give back the whole block.

Running ``reedsolo`` once per byte position is pure Python (10 to 25 s of CPU for a 10 MB
transfer), so the codec runs the same code as matrices instead. The code is linear: the
parities are ``P @ sources`` for a p x k ``parity_matrix(k, p)`` whose column c is reedsolo's
encoding of the unit vector e_c (derived once per (k, p) and cached), and encoding is p
``region_dot`` products over whole symbols. Decoding solves for the e lost sources from the
received sources and e received parities: the rows of the inverse of the received k x k
submatrix of the generator matrix [I; P] that give the lost sources are
``[A^-1 B | A^-1]`` with A (e x e) the chosen parities' columns of P at the lost sources and B
their columns at the known ones, so only an e x e matrix is inverted (Gauss-Jordan in numba).
The repairs are byte-for-byte reedsolo's (the tests check it); ``reedsolo_encode_block`` and
``reedsolo_decode_block`` keep the direct per-byte path as the source of truth for the matrix
and as the baseline the benchmark times.

The API mirrors the RLC codec so a session can swap one for the other: a repair symbol is named
by the same RFC 8681 repair fields, with ``first_esi`` the block's first ESI, ``nss == k`` and
``repair_key`` the parity index 0..p-1 (``dt`` is accepted and ignored). A transfer whose last
block is short pads it with empty source symbols.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import reedsolo
from kvtransport.codecs.gf256 import INV_TABLE, MUL_TABLE, region_dot
from kvtransport.codecs.rlc import (
    MAX_ESI,
    RECEIVED,
    RECOVERED,
    UNKNOWN,
    SourceWindow,
    as_byte_view,
    as_u8_array,
)
from numba import njit

MAX_CODEWORD = 255
"""k + p may not exceed 255 symbols (one RS codeword over GF(2^8))."""


def _check_code(k: int, p: int) -> None:
    if k < 1 or p < 1 or k + p > MAX_CODEWORD:
        raise ValueError(f"need k >= 1, p >= 1 and k + p <= {MAX_CODEWORD}, got k={k}, p={p}")


# ---------------------------------------------------------------------------------------------
# The direct reedsolo path: the definition of the code
# ---------------------------------------------------------------------------------------------


def reedsolo_codec(p: int) -> reedsolo.RSCodec:
    """reedsolo's codec with p parity bytes in the RFC 8681 field (prim 0x11D, generator 2,
    fcr 0: reedsolo's defaults, made explicit)."""
    return reedsolo.RSCodec(nsym=p, nsize=MAX_CODEWORD, fcr=0, prim=0x11D, generator=2)


def reedsolo_encode_block(sources: np.ndarray, p: int) -> np.ndarray:
    """The p parity symbols of a block of k source symbols (``sources``: uint8, shape (k, n)),
    one reedsolo encoding per byte position. Slow (pure Python): the reference path."""
    src = np.asarray(sources, dtype=np.uint8)
    k, n = src.shape
    _check_code(k, p)
    rs = reedsolo_codec(p)
    columns = np.ascontiguousarray(src.T)  # one codeword's message per byte position
    parity = np.empty((p, n), dtype=np.uint8)
    for j in range(n):
        parity[:, j] = np.frombuffer(bytes(rs.encode(columns[j].tobytes())[k:]), np.uint8)
    return parity


def reedsolo_decode_block(word: np.ndarray, erasures: list[int], k: int) -> np.ndarray:
    """The k source symbols of a block from its k+p symbols (``word``: uint8, shape (k+p, n),
    sources then parities; rows listed in ``erasures`` are ignored), one reedsolo erasure
    decoding per byte position. Slow (pure Python): the reference path."""
    w = np.asarray(word, dtype=np.uint8)
    p = w.shape[0] - k
    _check_code(k, p)
    rs = reedsolo_codec(p)
    columns = np.ascontiguousarray(w.T)
    out = np.empty((w.shape[1], k), dtype=np.uint8)
    for j in range(w.shape[1]):
        msg = rs.decode(bytearray(columns[j].tobytes()), erase_pos=erasures, only_erasures=True)
        out[j] = np.frombuffer(bytes(msg[0]), dtype=np.uint8)
    return np.ascontiguousarray(out.T)


@lru_cache(maxsize=64)
def parity_matrix(k: int, p: int) -> np.ndarray:
    """P (uint8, p x k, read-only) with parity i = sum over c of P[i, c] * source c.

    Column c is reedsolo's parity of the unit vector e_c: encoding the k x k identity as a
    block of k one-byte-per-position symbols gives all columns in one pass."""
    m = reedsolo_encode_block(np.eye(k, dtype=np.uint8), p)
    m.flags.writeable = False
    return m


# ---------------------------------------------------------------------------------------------
# The matrix path (numba)
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _gf_invert(a: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix over GF(2^8) by Gauss-Jordan elimination.

    Raises ValueError for a singular matrix (never for the square submatrices of an MDS
    code's parity matrix, which is what the decoder passes)."""
    n = a.shape[0]
    m = a.copy()
    inv = np.zeros((n, n), dtype=np.uint8)
    for i in range(n):
        inv[i, i] = 1
    for col in range(n):
        piv = col
        while piv < n and m[piv, col] == 0:
            piv += 1
        if piv == n:
            raise ValueError("singular matrix over GF(2^8)")
        if piv != col:
            for c in range(n):
                t = m[col, c]
                m[col, c] = m[piv, c]
                m[piv, c] = t
                t = inv[col, c]
                inv[col, c] = inv[piv, c]
                inv[piv, c] = t
        scale = MUL_TABLE[INV_TABLE[m[col, col]]]
        for c in range(n):
            m[col, c] = scale[m[col, c]]
            inv[col, c] = scale[inv[col, c]]
        for r in range(n):
            f = m[r, col]
            if r == col or f == 0:
                continue
            row = MUL_TABLE[f]
            for c in range(n):
                m[r, c] ^= row[m[col, c]]
                inv[r, c] ^= row[inv[col, c]]
    return inv


@njit(cache=True, nogil=True)
def _erasure_coefficients(
    pm: np.ndarray, lost: np.ndarray, known: np.ndarray, chosen: np.ndarray
) -> np.ndarray:
    """Coefficients (e x k) of each lost source over the received symbols ordered as the
    ``known`` sources then the ``chosen`` parities (e = len(lost) = len(chosen)).

    With y the chosen parities, A = pm[chosen][:, lost] and B = pm[chosen][:, known]:
    y = A m_lost + B m_known, so m_lost = A^-1 B m_known + A^-1 y (char 2: minus is plus)."""
    e = lost.shape[0]
    nk = known.shape[0]
    a = np.empty((e, e), dtype=np.uint8)
    for i in range(e):
        for j in range(e):
            a[i, j] = pm[chosen[i], lost[j]]
    ainv = _gf_invert(a)
    out = np.zeros((e, nk + e), dtype=np.uint8)
    for r in range(e):
        for i in range(e):
            c = ainv[r, i]
            out[r, nk + i] = c
            if c == 0:
                continue
            row = MUL_TABLE[c]
            prow = pm[chosen[i]]
            for j in range(nk):
                out[r, j] ^= row[prow[known[j]]]
    return out


@njit(cache=True, nogil=True)
def _combine(out: np.ndarray, rows: np.ndarray, symbols: np.ndarray, coefs: np.ndarray) -> None:
    """out[rows[i]] = sum over j of coefs[i, j] * symbols[j], for each i."""
    for i in range(rows.shape[0]):
        region_dot(out[rows[i]], symbols, coefs[i])


class BlockRSEncoder:
    """Systematic block RS encoder: ``add_source`` then ``repair`` for complete blocks."""

    def __init__(self, symbol_size: int, k: int, p: int, max_blocks: int = 4) -> None:
        _check_code(k, p)
        if symbol_size < 1 or max_blocks < 1:
            raise ValueError("symbol_size and max_blocks must be positive")
        self.symbol_size, self.k, self.p = int(symbol_size), int(k), int(p)
        self.max_blocks = int(max_blocks)
        self._window = SourceWindow(self.symbol_size, self.max_blocks * self.k)
        self._pm = parity_matrix(self.k, self.p)
        self._prows = np.arange(self.p)
        self._parity: dict[int, np.ndarray] = {}  # block -> (p, stride) parity symbols
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
        if esi >= w.base + w.capacity:  # the first ESI of a new block: the oldest block leaves
            w.clear_below(esi - w.capacity + self.k)
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
        start = first % w.capacity  # a block's slots are contiguous: capacity is a multiple of k
        parity = np.empty((self.p, w.stride), dtype=np.uint8)
        _combine(parity, self._prows, w.sym[start : start + self.k], self._pm)
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
        return self._block_parity(block)[int(repair_key), : self.symbol_size].tobytes()

    def repair_into(
        self, out: object, first_esi: int, nss: int, repair_key: int, dt: int = 15
    ) -> None:
        """Like ``repair`` but writes into a caller buffer of >= symbol_size bytes."""
        data = self.repair(first_esi, nss, repair_key, dt)
        memoryview(out).cast("B")[: self.symbol_size] = data  # type: ignore[arg-type]

    def repairs(self, block: int) -> list[bytes]:
        """All p repair symbols of a complete block."""
        return [row.tobytes() for row in self._block_parity(int(block))[:, : self.symbol_size]]


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
        self._pm = parity_matrix(self.k, self.p)
        self._repairs: dict[int, np.ndarray] = {}  # block -> (p, stride) parity, zero-padded
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
        block = esi // self.k
        result = [esi] + self._try_decode(block) if block in self._have else [esi]
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
            self._repairs[block] = np.zeros((self.p, self.stride), dtype=np.uint8)
            self._have[block] = np.zeros(self.p, dtype=bool)
        if self._have[block][repair_key]:
            self.stats["duplicates"] += 1
            return []
        self._repairs[block][repair_key, : self.symbol_size] = arr
        self._have[block][repair_key] = True
        result = self._try_decode(block)
        self.advance_through()
        return result

    def _try_decode(self, block: int) -> list[int]:
        have = self._have.get(block)
        if have is None:
            return []
        first = block * self.k
        start = first % self.capacity  # the block's slots are contiguous (see the encoder)
        known = self.state[start : start + self.k] != UNKNOWN
        lost = np.flatnonzero(~known)
        if lost.size == 0:
            del self._repairs[block], self._have[block]
            return []
        chosen = np.flatnonzero(have)[: lost.size]  # any e parities will do (MDS)
        if chosen.size < lost.size:
            return []
        present = np.flatnonzero(known)
        coefs = _erasure_coefficients(self._pm, lost, present, chosen)
        symbols = np.concatenate([self.sym[start + present], self._repairs[block][chosen]])
        rows = start + lost
        _combine(self.sym, rows, symbols, coefs)  # zero padding in gives zero padding out
        self.state[rows] = RECOVERED
        recovered = (first + lost).tolist()
        self.stats["recovered"] += len(recovered)
        del self._repairs[block], self._have[block]
        return recovered
