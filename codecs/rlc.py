"""Sliding-window Random Linear Codes over GF(2^8), compatible with RFC 8681.

Encoder: every source symbol gets the next ESI (0, 1, 2, ...) and is kept in a bounded ring.
A repair symbol covers the ``nss`` consecutive source symbols starting at ``first_esi``; its
coding coefficients come from ``coding_coefficients(repair_key, nss, dt)`` (RFC 8681 section
3.6, TinyMT32 seeded with the repair key), so the receiver rebuilds them from the repair FEC
payload id alone (repair_key 16 bits, DT 4 bits, NSS 12 bits, first ESI 32 bits).

Decoder: on-the-fly Gaussian elimination. The pending equations (repair symbols that still
involve unknown source symbols) are kept in reduced row echelon form over a ring of columns,
one column per ESI of the decoding window: every stored row has a pivot column with
coefficient 1, and no other row has a non-zero coefficient in a pivot column. A new equation
is first stripped of the source symbols already known, then reduced against the pivot rows,
and becomes a new pivot row (or is dropped as linearly dependent). In this form a source
symbol is determined by the equations received exactly when some row has no non-zero
coefficient besides its pivot, so each lost symbol is returned as soon as the equations allow,
whatever the arrival order. Everything that touches bytes runs in numba kernels over
contiguous ``uint8`` arrays; Python only validates arguments and keeps small counters.

Each row's pivot is its lowest-ESI unknown. Memory is bounded: the decoder holds at most
``max_window`` consecutive ESIs. An ESI beyond the window slides it forward (and
``release_before`` does so explicitly); ESIs leave lowest first, so an unknown that leaves is
the pivot of at most one row and appears in no other: dropping that row keeps exactly what the
remaining equations say about the ESIs still in the window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from kvtransport.codecs.gf256 import gf_inv, region_muladd, region_scale
from kvtransport.codecs.tinymt32 import tinymt32_generate_uint32, tinymt32_init
from numba import njit

MAX_ESI = 0xFFFFFFFF
"""ESIs are 32-bit in RFC 8681 FEC payload ids."""
MAX_NSS = 0xFFF
"""NSS (number of source symbols a repair covers) is 12 bits."""
MAX_REPAIR_KEY = 0xFFFF
MAX_DT = 15

_M4 = np.uint64(0xF)
_M8 = np.uint64(0xFF)

# Slot states in the decoder's window.
UNKNOWN = 0
RECEIVED = 1
RECOVERED = 2

# Layout of the decoder's int64 ``meta`` array shared with the kernels.
_BASE = 0  # lowest ESI still in the window
_NACT = 1  # pending equations (active rows)
_MAXREF = 2  # highest ESI any pending equation may involve (-1 when none)
_NOUT = 3  # number of ESIs the last kernel call wrote to ``out`` (recovered symbols)

# Return codes of the repair kernel.
_REPAIR_STALE = -1  # references a released ESI with a non-zero coefficient
_REPAIR_ALL_KNOWN = 0  # every source symbol it covers is already known
_REPAIR_ADDED = 1  # stored as a new pivot row (and maybe solved some symbols)
_REPAIR_DEPENDENT = 2  # linearly dependent on what the decoder already had


def _round8(n: int) -> int:
    return (n + 7) & ~7


def as_byte_view(payload: object) -> memoryview:
    """A flat unsigned-byte view of bytes, bytearray, memoryview or a uint8 numpy array."""
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8:
            raise TypeError(f"payload array must be uint8, got {payload.dtype}")
        payload = np.ascontiguousarray(payload).reshape(-1)
    try:
        mv = memoryview(payload)  # type: ignore[arg-type]
    except TypeError as exc:
        kind = type(payload).__name__
        raise TypeError(f"payload must be a bytes-like object, got {kind}") from exc
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def as_u8_array(payload: object) -> np.ndarray:
    """A 1-D contiguous uint8 numpy array over (or copied from) a bytes-like payload."""
    if isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1:
        return np.ascontiguousarray(payload)
    return np.frombuffer(as_byte_view(payload), dtype=np.uint8)


def _check_repair_params(first_esi: int, nss: int, repair_key: int, dt: int) -> None:
    if not 0 <= first_esi <= MAX_ESI:
        raise ValueError(f"first_esi must be in 0..{MAX_ESI}, got {first_esi}")
    if not 1 <= nss <= MAX_NSS:
        raise ValueError(f"nss must be in 1..{MAX_NSS}, got {nss}")
    if first_esi + nss - 1 > MAX_ESI:
        raise ValueError(f"repair window {first_esi}+{nss} runs past ESI {MAX_ESI}")
    if not 0 <= repair_key <= MAX_REPAIR_KEY:
        raise ValueError(f"repair_key must be in 0..{MAX_REPAIR_KEY}, got {repair_key}")
    if not 0 <= dt <= MAX_DT:
        raise ValueError(f"dt must be in 0..{MAX_DT}, got {dt}")


# --------------------------------------------------------------------------------------------
# Coding coefficients (RFC 8681 section 3.6, m = 8)
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def coefficients_into(out: np.ndarray, repair_key: int, nss: int, dt: int) -> None:
    """Write the ``nss`` RFC 8681 coding coefficients of ``repair_key`` into ``out[:nss]``.

    DT=15: every coefficient is drawn uniformly in 1..255 (tinymt32_rand256, redrawing zeros).
    DT<15: each coefficient is non-zero when tinymt32_rand16 <= DT, i.e. with probability
    (DT+1)/16, and then drawn in 1..255 as above; otherwise it is 0.
    """
    status = np.empty(4, dtype=np.uint64)
    tinymt32_init(status, repair_key)
    if dt == 15:
        for i in range(nss):
            c = np.int64(0)
            while c == 0:
                c = np.int64(tinymt32_generate_uint32(status) & _M8)
            out[i] = c
    else:
        for i in range(nss):
            if np.int64(tinymt32_generate_uint32(status) & _M4) <= dt:
                c = np.int64(0)
                while c == 0:
                    c = np.int64(tinymt32_generate_uint32(status) & _M8)
                out[i] = c
            else:
                out[i] = 0


def coding_coefficients(repair_key: int, nss: int, dt: int = 15) -> np.ndarray:
    """RFC 8681 generate_coding_coefficients for m=8, as a uint8 array of length ``nss``."""
    _check_repair_params(0, int(nss), int(repair_key), int(dt))
    out = np.empty(int(nss), dtype=np.uint8)
    coefficients_into(out, int(repair_key), int(nss), int(dt))
    return out


# --------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _encode_repair(
    ring: np.ndarray, first_esi: int, nss: int, repair_key: int, dt: int, out: np.ndarray
) -> None:
    coefs = np.empty(nss, dtype=np.uint8)
    coefficients_into(coefs, repair_key, nss, dt)
    cap = ring.shape[0]
    out[:] = 0
    for i in range(nss):
        c = coefs[i]
        if c != 0:
            region_muladd(out, ring[(first_esi + i) % cap], c)


class RLCEncoder:
    """RFC 8681 sliding-window RLC encoder over GF(2^8).

    ``window`` is how many of the most recent source symbols are kept (a ring buffer): a
    repair may cover any run of them. Source payloads shorter than ``symbol_size`` are
    zero-padded (the transport carries the true length itself).
    """

    def __init__(self, symbol_size: int, window: int = 256) -> None:
        if symbol_size < 1:
            raise ValueError(f"symbol_size must be positive, got {symbol_size}")
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.symbol_size = int(symbol_size)
        self.window = int(window)
        self._stride = _round8(self.symbol_size)
        self._ring = np.zeros((self.window, self._stride), dtype=np.uint8)
        self._ring_mv = memoryview(self._ring.reshape(-1))
        self._zeros = bytes(self._stride)
        self._next_esi = 0

    @property
    def next_esi(self) -> int:
        """The ESI the next ``add_source`` will return."""
        return self._next_esi

    @property
    def oldest_esi(self) -> int:
        """The lowest ESI still held (a repair may start there)."""
        return max(0, self._next_esi - self.window)

    def add_source(self, payload: object) -> int:
        """Append a source symbol; returns its ESI."""
        esi = self._next_esi
        if esi > MAX_ESI:
            raise ValueError("ESI space exhausted (RFC 8681 ESIs are 32-bit)")
        view = as_byte_view(payload)
        n = view.nbytes
        if n > self.symbol_size:
            raise ValueError(f"payload of {n} bytes exceeds symbol_size {self.symbol_size}")
        off = (esi % self.window) * self._stride
        self._ring_mv[off : off + n] = view
        if n < self._stride:
            self._ring_mv[off + n : off + self._stride] = self._zeros[: self._stride - n]
        self._next_esi = esi + 1
        return esi

    def source(self, esi: int) -> bytes:
        """The (zero-padded) source symbol ``esi``, while it is still in the ring."""
        self._check_span(int(esi), 1)
        off = (esi % self.window) * self._stride
        return self._ring_mv[off : off + self.symbol_size].tobytes()

    def _check_span(self, first_esi: int, nss: int) -> None:
        if first_esi < self.oldest_esi or first_esi + nss > self._next_esi:
            raise ValueError(
                f"ESIs {first_esi}..{first_esi + nss - 1} are not all held by the encoder "
                f"(it holds {self.oldest_esi}..{self._next_esi - 1})"
            )

    def repair_into(
        self, out: object, first_esi: int, nss: int, repair_key: int, dt: int = 15
    ) -> None:
        """Write the repair symbol into ``out`` (its first ``symbol_size`` bytes).

        ``out`` is a writable uint8 numpy array or a writable buffer (bytearray, memoryview),
        e.g. the payload area of a datagram buffer, so the sender needs no allocation.
        """
        first_esi, nss, repair_key, dt = int(first_esi), int(nss), int(repair_key), int(dt)
        _check_repair_params(first_esi, nss, repair_key, dt)
        self._check_span(first_esi, nss)
        arr = out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.uint8)
        if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
            raise TypeError("out must be a 1-D contiguous uint8 buffer")
        if not arr.flags.writeable:
            raise TypeError("out must be writable")
        if arr.shape[0] < self.symbol_size:
            raise ValueError(f"out holds {arr.shape[0]} bytes, need {self.symbol_size}")
        _encode_repair(self._ring, first_esi, nss, repair_key, dt, arr[: self.symbol_size])

    def repair(self, first_esi: int, nss: int, repair_key: int, dt: int = 15) -> bytes:
        """The repair symbol sum_i c_i * S[first_esi + i] over GF(2^8)."""
        out = np.empty(self.symbol_size, dtype=np.uint8)
        self.repair_into(out, first_esi, nss, repair_key, dt)
        return out.tobytes()


# --------------------------------------------------------------------------------------------
# Source-symbol window shared by the decoders (this one and the block RS baseline)
# --------------------------------------------------------------------------------------------


class RecoveredView:
    """Set-like view of the ESIs in a decoder's window that were recovered by decoding."""

    def __init__(self, window: SourceWindow) -> None:
        self._w = window

    def __contains__(self, esi: object) -> bool:
        return isinstance(esi, int | np.integer) and self._w.state_of(int(esi)) == RECOVERED

    def __iter__(self) -> Iterator[int]:
        return iter(self._w.esis_in_state(RECOVERED))

    def __len__(self) -> int:
        return len(self._w.esis_in_state(RECOVERED))

    def __repr__(self) -> str:
        return f"RecoveredView({sorted(self)})"


class SourceWindow:
    """The source symbols a decoder holds: a ring of ``capacity`` consecutive ESIs.

    ``base`` is the lowest ESI held; ESIs ``base .. base+capacity-1`` map one-to-one onto ring
    slots (``esi % capacity``). Each slot has a state (UNKNOWN, RECEIVED, RECOVERED) and, once
    known, the symbol bytes (rows padded to a multiple of 8 bytes for the uint64 kernels).
    """

    def __init__(self, symbol_size: int, capacity: int) -> None:
        if symbol_size < 1:
            raise ValueError(f"symbol_size must be positive, got {symbol_size}")
        if capacity < 1:
            raise ValueError(f"window capacity must be positive, got {capacity}")
        self.symbol_size = int(symbol_size)
        self.capacity = int(capacity)
        self.stride = _round8(self.symbol_size)
        self.sym = np.zeros((self.capacity, self.stride), dtype=np.uint8)
        self.state = np.zeros(self.capacity, dtype=np.uint8)
        self._sym_mv = memoryview(self.sym.reshape(-1))
        self._state_mv = memoryview(self.state)
        self._zeros = bytes(self.stride)
        self.base = 0
        self._through = -1
        self.recovered = RecoveredView(self)

    # -- queries -------------------------------------------------------------------------
    def state_of(self, esi: int) -> int:
        if self.base <= esi < self.base + self.capacity:
            return self._state_mv[esi % self.capacity]
        return UNKNOWN

    def known(self, esi: int) -> bool:
        """True when ``esi`` is in the window and received or recovered."""
        esi = int(esi)
        return (
            self.base <= esi < self.base + self.capacity
            and self._state_mv[esi % self.capacity] != UNKNOWN
        )

    def get(self, esi: int) -> bytes | None:
        """The symbol (``symbol_size`` bytes, zero-padded) if known and still held, else None."""
        esi = int(esi)
        if not self.known(esi):
            return None
        off = (esi % self.capacity) * self.stride
        return self._sym_mv[off : off + self.symbol_size].tobytes()

    def read_into(self, esi: int, out: object) -> bool:
        """Copy the symbol into ``out`` (writable, >= symbol_size bytes); False if unknown."""
        esi = int(esi)
        if not self.known(esi):
            return False
        off = (esi % self.capacity) * self.stride
        memoryview(out).cast("B")[: self.symbol_size] = self._sym_mv[off : off + self.symbol_size]
        return True

    @property
    def decoded_through(self) -> int:
        """Highest ESI such that every ESI <= it is known (-1 if none).

        An ESI released while still unknown stops it for good.
        """
        return self._through

    def missing(self, lo: int, hi: int) -> list[int]:
        """The unknown ESIs in [lo, hi) that lie in the window (ESIs below ``base`` are
        released and no longer tracked; they are not reported)."""
        a = max(int(lo), self.base)
        b = min(int(hi), self.base + self.capacity)
        if a >= b:
            return []
        esis = np.arange(a, b, dtype=np.int64)
        return esis[self.state[esis % self.capacity] == UNKNOWN].tolist()

    def esis_in_state(self, st: int) -> list[int]:
        cols = np.flatnonzero(self.state == st)
        bcol = self.base % self.capacity
        return sorted((self.base + (cols - bcol) % self.capacity).tolist())

    # -- updates -------------------------------------------------------------------------
    def store(self, esi: int, view: memoryview) -> None:
        """Write a symbol's bytes into its slot (zero-padded); the caller sets the state."""
        off = (esi % self.capacity) * self.stride
        n = view.nbytes
        self._sym_mv[off : off + n] = view
        if n < self.stride:
            self._sym_mv[off + n : off + self.stride] = self._zeros[: self.stride - n]

    def advance_through(self) -> None:
        """Move ``decoded_through`` over newly known ESIs (amortized O(1) per ESI)."""
        t = self._through
        if t + 1 < self.base:
            return
        top = self.base + self.capacity
        st = self._state_mv
        cap = self.capacity
        while t + 1 < top and st[(t + 1) % cap] != UNKNOWN:
            t += 1
        self._through = t

    def clear_below(self, bound: int) -> None:
        """Forget the slots of ESIs below ``bound`` and move ``base`` up to it."""
        if bound <= self.base:
            return
        end = min(bound, self.base + self.capacity)
        if end - self.base >= self.capacity:
            self.state[:] = UNKNOWN
        else:
            cols = np.arange(self.base, end) % self.capacity
            self.state[cols] = UNKNOWN
        self.base = bound
        self.advance_through()


# --------------------------------------------------------------------------------------------
# Decoder kernels
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _first_nonzero_in(row: np.ndarray, lo: int, hi: int) -> int:
    """Index of the first non-zero byte of row[lo:hi], or -1 (uint64 scan for the bulk)."""
    j = lo
    while j < hi and (j & 7) != 0:
        if row[j] != 0:
            return j
        j += 1
    words = row.view(np.uint64)
    w = j >> 3
    while w < (hi >> 3):
        if words[w] != 0:
            for b in range(8):
                if row[w * 8 + b] != 0:
                    return w * 8 + b
        w += 1
    j = max(j, (hi >> 3) << 3)
    while j < hi:
        if row[j] != 0:
            return j
        j += 1
    return -1


@njit(cache=True, nogil=True)
def _lowest_esi_col(row: np.ndarray, base: int, cap: int) -> int:
    """Column of the lowest ESI with a non-zero coefficient (ring order from ``base``)."""
    bcol = base % cap
    col = _first_nonzero_in(row, bcol, cap)
    if col < 0:
        col = _first_nonzero_in(row, 0, bcol)
    return col


@njit(cache=True, nogil=True)
def _only_nonzero_at(row: np.ndarray, col: int) -> bool:
    saved = row[col]
    row[col] = 0
    words = row.view(np.uint64)
    alone = True
    for w in range(words.shape[0]):
        if words[w] != 0:
            alone = False
            break
    row[col] = saved
    return alone


@njit(cache=True, nogil=True)
def _esi_of_col(col: int, base: int, cap: int) -> int:
    return base + (col - base % cap) % cap


@njit(cache=True, nogil=True)
def _recover_row(
    r: int,
    sym: np.ndarray,
    state: np.ndarray,
    pay: np.ndarray,
    piv: np.ndarray,
    colrow: np.ndarray,
    meta: np.ndarray,
    out: np.ndarray,
) -> None:
    esi = piv[r]
    col = esi % state.shape[0]
    sym[col, :] = pay[r, :]
    state[col] = RECOVERED
    colrow[col] = -1
    piv[r] = -1
    meta[_NACT] -= 1
    out[meta[_NOUT]] = esi
    meta[_NOUT] += 1


@njit(cache=True, nogil=True)
def _pivot_row(
    r: int,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    piv: np.ndarray,
    colrow: np.ndarray,
    meta: np.ndarray,
    touched: np.ndarray,
) -> bool:
    """Give row r (reduced against every pivot) a pivot, or drop it if it is all zero."""
    cap = state.shape[0]
    col = _lowest_esi_col(coef[r], meta[_BASE], cap)
    if col < 0:
        piv[r] = -1
        meta[_NACT] -= 1
        return False
    c = coef[r, col]
    if c != 1:
        inv = gf_inv(c)
        region_scale(coef[r], inv)
        region_scale(pay[r], inv)
    piv[r] = _esi_of_col(col, meta[_BASE], cap)
    colrow[col] = r
    touched[r] = True
    for o in range(piv.shape[0]):
        if o != r and piv[o] >= 0:
            f = coef[o, col]
            if f != 0:
                region_muladd(coef[o], coef[r], f)
                region_muladd(pay[o], pay[r], f)
                touched[o] = True
    return True


@njit(cache=True, nogil=True)
def _flush_solved(
    sym: np.ndarray,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    piv: np.ndarray,
    colrow: np.ndarray,
    meta: np.ndarray,
    out: np.ndarray,
    touched: np.ndarray,
) -> None:
    cap = state.shape[0]
    for r in range(piv.shape[0]):
        if touched[r] and piv[r] >= 0 and _only_nonzero_at(coef[r], piv[r] % cap):
            _recover_row(r, sym, state, pay, piv, colrow, meta, out)
    if meta[_NACT] == 0:
        meta[_MAXREF] = -1


@njit(cache=True, nogil=True)
def _decode_source(
    sym: np.ndarray,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    piv: np.ndarray,
    colrow: np.ndarray,
    meta: np.ndarray,
    out: np.ndarray,
    esi: int,
) -> None:
    """Source ``esi`` became known (bytes already in ``sym``): strip it from the equations."""
    meta[_NOUT] = 0
    cap = state.shape[0]
    col = esi % cap
    state[col] = RECEIVED
    touched = np.zeros(piv.shape[0], dtype=np.bool_)
    src = sym[col]
    for o in range(piv.shape[0]):
        if piv[o] >= 0:
            f = coef[o, col]
            if f != 0:
                region_muladd(pay[o], src, f)
                coef[o, col] = 0
                touched[o] = True
    rp = colrow[col]
    if rp >= 0:
        # It was the pivot of row rp: that row now needs another pivot.
        colrow[col] = -1
        _pivot_row(rp, state, coef, pay, piv, colrow, meta, touched)
    _flush_solved(sym, state, coef, pay, piv, colrow, meta, out, touched)


@njit(cache=True, nogil=True)
def _decode_repair(
    sym: np.ndarray,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    piv: np.ndarray,
    colrow: np.ndarray,
    meta: np.ndarray,
    out: np.ndarray,
    first_esi: int,
    nss: int,
    repair_key: int,
    dt: int,
    payload: np.ndarray,
) -> int:
    meta[_NOUT] = 0
    cap = state.shape[0]
    base = meta[_BASE]
    coefs = np.empty(nss, dtype=np.uint8)
    coefficients_into(coefs, repair_key, nss, dt)
    any_unknown = False
    for i in range(nss):
        if coefs[i] != 0:
            e = first_esi + i
            if e < base:
                return _REPAIR_STALE
            if state[e % cap] == UNKNOWN:
                any_unknown = True
    if not any_unknown:
        return _REPAIR_ALL_KNOWN
    r = -1
    for k in range(piv.shape[0]):
        if piv[k] < 0:
            r = k
            break
    # (The caller guarantees a free row.)
    meta[_NACT] += 1
    piv[r] = first_esi
    coef[r, :] = 0
    n = payload.shape[0]
    pay[r, :n] = payload
    pay[r, n:] = 0
    # Strip known source symbols, keep unknown ones as coefficients.
    for i in range(nss):
        c = coefs[i]
        if c != 0:
            col = (first_esi + i) % cap
            if state[col] != UNKNOWN:
                region_muladd(pay[r], sym[col], c)
            else:
                coef[r, col] = c
    # Reduce against the pivot rows. A pivot row is zero in every other pivot column, so one
    # pass over the columns of this repair suffices.
    for i in range(nss):
        col = (first_esi + i) % cap
        rp = colrow[col]
        if rp >= 0:
            f = coef[r, col]
            if f != 0:
                region_muladd(coef[r], coef[rp], f)
                region_muladd(pay[r], pay[rp], f)
    touched = np.zeros(piv.shape[0], dtype=np.bool_)
    added = _pivot_row(r, state, coef, pay, piv, colrow, meta, touched)
    if added:
        last = first_esi + nss - 1
        if last > meta[_MAXREF]:
            meta[_MAXREF] = last
    _flush_solved(sym, state, coef, pay, piv, colrow, meta, out, touched)
    return _REPAIR_ADDED if added else _REPAIR_DEPENDENT


@njit(cache=True, nogil=True)
def _decode_release(
    state: np.ndarray,
    coef: np.ndarray,
    piv: np.ndarray,
    colrow: np.ndarray,
    meta: np.ndarray,
    bound: int,
) -> None:
    """Remove the unknown ESIs below ``bound`` from the pending equations.

    Every row's pivot is its lowest-ESI unknown, and ESIs leave the window lowest first, so
    the only row that can involve a departing ESI is the row whose pivot it is: dropping
    that row keeps exactly the information the other rows hold about the remaining ESIs.
    Should any other row ever involve it, it is dropped too (losing an equation is safe;
    keeping one whose column is about to be reused for another ESI would not be).
    """
    cap = state.shape[0]
    base = meta[_BASE]
    end = min(bound, base + cap)
    if meta[_NACT] > 0:
        for e in range(base, end):
            col = e % cap
            if state[col] != UNKNOWN:
                continue
            colrow[col] = -1
            for o in range(piv.shape[0]):
                if piv[o] >= 0 and coef[o, col] != 0:
                    colrow[piv[o] % cap] = -1
                    piv[o] = -1
                    meta[_NACT] -= 1
    if meta[_NACT] == 0:
        meta[_MAXREF] = -1


# --------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------


class RLCDecoder(SourceWindow):
    """RFC 8681 sliding-window RLC decoder (on-the-fly Gaussian elimination).

    ``add_source`` and ``add_repair`` return the ESIs that became known through that call: the
    source itself if new, plus every symbol recovered by elimination, in no particular order.
    ``get(esi)`` returns a known symbol, ``known(esi)``, ``recovered`` (set-like),
    ``decoded_through`` and ``missing(lo, hi)`` describe progress, and ``release_before``
    drops state below a bound. An ESI at or beyond ``base + max_window`` slides the window
    forward on its own. Duplicates and any arrival order are fine.

    Invalid arguments (sizes, field ranges, a repair wider than the window) raise ValueError
    or TypeError and leave the decoder unchanged; stale or useless input is counted in
    ``stats`` and otherwise ignored.
    """

    def __init__(self, symbol_size: int, max_window: int = 1024) -> None:
        super().__init__(symbol_size, max_window)
        self.max_window = self.capacity
        self._wpad = _round8(self.capacity)
        rows = min(16, self.capacity)
        self._coef = np.zeros((rows, self._wpad), dtype=np.uint8)
        self._pay = np.zeros((rows, self.stride), dtype=np.uint8)
        self._piv = np.full(rows, -1, dtype=np.int64)
        self._colrow = np.full(self.capacity, -1, dtype=np.int64)
        self._meta = np.array([0, 0, -1, 0], dtype=np.int64)
        self._meta_mv = memoryview(self._meta)
        self._out = np.zeros(self.capacity, dtype=np.int64)
        self.stats = {
            "sources": 0,
            "duplicates": 0,
            "repairs": 0,
            "repairs_useful": 0,
            "repairs_all_known": 0,
            "repairs_dependent": 0,
            "stale": 0,
            "recovered": 0,
        }

    @property
    def pending_equations(self) -> int:
        """Repair equations held that still involve unknown source symbols."""
        return self._meta_mv[_NACT]

    def _kernel_args(self) -> tuple:
        return (
            self.sym,
            self.state,
            self._coef,
            self._pay,
            self._piv,
            self._colrow,
            self._meta,
            self._out,
        )

    def _collect(self, result: list[int]) -> list[int]:
        n = self._meta_mv[_NOUT]
        if n:
            rec = self._out[:n].tolist()
            self.stats["recovered"] += n
            result.extend(rec)
        if result:
            self.advance_through()
        return result

    def release_before(self, esi: int) -> None:
        """Drop every ESI below ``esi``: their symbols, and the pending equations whose
        lowest unknown they are (those can no longer be solved; the others are kept whole)."""
        bound = int(esi)
        if bound <= self.base:
            return
        _decode_release(self.state, self._coef, self._piv, self._colrow, self._meta, bound)
        self._meta[_BASE] = bound
        self.clear_below(bound)

    def add_source(self, esi: int, payload: object) -> list[int]:
        """A source symbol arrived; returns the ESIs that became known."""
        esi = int(esi)
        if not 0 <= esi <= MAX_ESI:
            raise ValueError(f"esi must be in 0..{MAX_ESI}, got {esi}")
        view = as_byte_view(payload)
        if view.nbytes > self.symbol_size:
            raise ValueError(
                f"payload of {view.nbytes} bytes exceeds symbol_size {self.symbol_size}"
            )
        self.stats["sources"] += 1
        if esi < self.base:
            self.stats["stale"] += 1
            return []
        if esi >= self.base + self.capacity:
            self.release_before(esi - self.capacity + 1)
        col = esi % self.capacity
        if self._state_mv[col] != UNKNOWN:
            self.stats["duplicates"] += 1
            return []
        self.store(esi, view)
        result = [esi]
        meta = self._meta_mv
        if meta[_NACT] == 0 or esi > meta[_MAXREF]:
            # No pending equation involves it: nothing to eliminate.
            self._state_mv[col] = RECEIVED
            self.advance_through()
            return result
        _decode_source(*self._kernel_args(), esi)
        return self._collect(result)

    def add_repair(
        self, first_esi: int, nss: int, repair_key: int, dt: int, payload: object
    ) -> list[int]:
        """A repair symbol arrived; returns the ESIs it allowed to recover."""
        first_esi, nss, repair_key, dt = int(first_esi), int(nss), int(repair_key), int(dt)
        _check_repair_params(first_esi, nss, repair_key, dt)
        if nss > self.capacity:
            raise ValueError(f"repair covers {nss} symbols, more than max_window {self.capacity}")
        arr = as_u8_array(payload)
        if arr.shape[0] != self.symbol_size:
            raise ValueError(
                f"repair payload has {arr.shape[0]} bytes, expected {self.symbol_size}"
            )
        self.stats["repairs"] += 1
        last = first_esi + nss - 1
        if last >= self.base + self.capacity:
            self.release_before(last - self.capacity + 1)
        if self._meta_mv[_NACT] >= self._piv.shape[0]:
            self._grow_rows()
        code = _decode_repair(*self._kernel_args(), first_esi, nss, repair_key, dt, arr)
        if code == _REPAIR_STALE:
            self.stats["stale"] += 1
        elif code == _REPAIR_ALL_KNOWN:
            self.stats["repairs_all_known"] += 1
        elif code == _REPAIR_DEPENDENT:
            self.stats["repairs_dependent"] += 1
        else:
            self.stats["repairs_useful"] += 1
        return self._collect([])

    def _grow_rows(self) -> None:
        rows = self._piv.shape[0]
        new = min(2 * rows, self.capacity)
        if new <= rows:  # cannot happen: each pending row owns a distinct unknown column
            raise RuntimeError("RLC decoder row storage exhausted")
        coef = np.zeros((new, self._wpad), dtype=np.uint8)
        pay = np.zeros((new, self.stride), dtype=np.uint8)
        piv = np.full(new, -1, dtype=np.int64)
        coef[:rows] = self._coef
        pay[:rows] = self._pay
        piv[:rows] = self._piv
        self._coef, self._pay, self._piv = coef, pay, piv
