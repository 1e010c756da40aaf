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
contiguous ``uint8`` arrays (the region products are kvtransport.codecs.gf256's, GFNI where
the CPU has it); Python only validates arguments and keeps small counters.

numba caches these kernels by this file's content only: after editing gf256 (whose code they
include), change this file too, or clear codecs/__pycache__, so they are rebuilt.

Each row's pivot is its lowest-ESI unknown. Memory is bounded: the decoder holds at most
``max_window`` consecutive ESIs. An ESI beyond the window slides it forward (and
``release_before`` does so explicitly); ESIs leave lowest first, so an unknown that leaves is
the pivot of at most one row and appears in no other: dropping that row keeps exactly what the
remaining equations say about the ESIs still in the window. At most ``max_pending``
equations are pending at once (a repair that finds no room is dropped and counted), so the
coefficient rows take at most ``max_pending * max_window`` bytes whatever arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from kvtransport.codecs.gf256 import (
    as_words,
    gf_inv,
    region_copy,
    region_dot_multi,
    region_muladd,
    region_muladd_multi,
    region_scale,
    region_zero,
)
from kvtransport.codecs.tinymt32 import tinymt32_output, tinymt32_seed, tinymt32_step
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

# The decoder's integer state lives in one int64 array ``ints`` shared with the kernels (fewer
# arguments per call: numba's dispatch costs ~70 ns per array argument):
#   ints[0:_HEADER]                 scalars below
#   ints[_HEADER:_HEADER+W]         out: ESIs the last kernel call recovered
#   ints[_HEADER+W:_HEADER+2W]      colrow: row whose pivot is this column, or -1
#   ints[_HEADER+2W:]               piv: pivot ESI of each row, or -1 for a free row
_BASE = 0  # lowest ESI still in the window
_NACT = 1  # pending equations (active rows)
_MAXREF = 2  # highest ESI any pending equation may involve (-1 when none)
_NOUT = 3  # number of ESIs the last kernel call wrote to ``out`` (recovered symbols)
_THROUGH = 4  # decoded-through, handed to and back from _decode_batch (Python keeps its own)
_MAXPEND = 5  # most pending equations held (RLCDecoder max_pending)
_HEADER = 8

# Counters _decode_batch adds to (the order of RLCDecoder.stats), then the results it wrote.
_C_SOURCES, _C_DUPLICATES, _C_STALE, _C_RECOVERED = 0, 1, 2, 3
_C_REPAIRS, _C_USEFUL, _C_ALL_KNOWN, _C_DEPENDENT = 4, 5, 6, 7
_C_DROPPED = 8
_C_RESULTS = 9

# Return codes of the repair kernel.
_REPAIR_STALE = -1  # references a released ESI with a non-zero coefficient
_REPAIR_ALL_KNOWN = 0  # every source symbol it covers is already known
_REPAIR_ADDED = 1  # stored as a new pivot row (and maybe solved some symbols)
_REPAIR_DEPENDENT = 2  # linearly dependent on what the decoder already had
_NO_BUFFER = object()


def _round8(n: int) -> int:
    return (n + 7) & ~7


def as_byte_view(payload: Any) -> bytes | bytearray | memoryview:
    """The payload as a flat sequence of bytes whose ``len`` is its size in bytes.

    Accepts bytes, bytearray, any C-contiguous buffer (memoryview, array, ...) and uint8
    numpy arrays; bytes and bytearray are returned as they are (the common, fast case).
    """
    kind = type(payload)
    if kind is bytes or kind is bytearray:
        return payload
    if kind is memoryview and payload.ndim == 1 and payload.format == "B":
        return payload  # a datagram's payload: the hot case
    if kind is np.ndarray:
        if payload.dtype != np.uint8:
            raise TypeError(f"payload array must be uint8, got {payload.dtype}")
        if payload.ndim != 1 or not payload.flags.c_contiguous:
            payload = np.ascontiguousarray(payload).reshape(-1)
    try:
        mv = memoryview(payload)
    except TypeError as exc:
        raise TypeError(f"payload must be a bytes-like object, got {kind.__name__}") from exc
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def as_u8_array(payload: object) -> np.ndarray:
    """A 1-D contiguous uint8 numpy array over (or copied from) a bytes-like payload."""
    if isinstance(payload, np.ndarray) and payload.dtype == np.uint8:
        return np.ascontiguousarray(payload).reshape(-1)
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
    s0, s1, s2, s3 = tinymt32_seed(repair_key)
    for i in range(nss):
        if dt < 15:
            s0, s1, s2, s3 = tinymt32_step(s0, s1, s2, s3)
            if np.int64(tinymt32_output(s0, s1, s2, s3) & _M4) > dt:
                out[i] = 0
                continue
        c = np.uint64(0)
        while c == 0:
            s0, s1, s2, s3 = tinymt32_step(s0, s1, s2, s3)
            c = tinymt32_output(s0, s1, s2, s3) & _M8
        out[i] = c


@njit(cache=True, nogil=True, inline="always")
def _draw256(
    s0: np.uint64, s1: np.uint64, s2: np.uint64, s3: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64, np.uint64]:
    """One DT=15 coefficient: the next non-zero tinymt32_rand256, and the state after it."""
    s0, s1, s2, s3 = tinymt32_step(s0, s1, s2, s3)
    c = tinymt32_output(s0, s1, s2, s3) & _M8
    while c == 0:
        s0, s1, s2, s3 = tinymt32_step(s0, s1, s2, s3)
        c = tinymt32_output(s0, s1, s2, s3) & _M8
    return s0, s1, s2, s3, c


@njit(cache=True, nogil=True)
def coefficient_rows(out: np.ndarray, keys: np.ndarray, nss: int, dt: int) -> None:
    """``coefficients_into(out[k], keys[k], nss, dt)`` for every row k: at DT=15 four keys
    at a time, their generators interleaved (four independent dependency chains the CPU
    overlaps, about 3x one after the other)."""
    r = keys.shape[0]
    k = 0
    if dt == 15:
        while k + 4 <= r:
            a0, a1, a2, a3 = tinymt32_seed(keys[k])
            b0, b1, b2, b3 = tinymt32_seed(keys[k + 1])
            c0, c1, c2, c3 = tinymt32_seed(keys[k + 2])
            d0, d1, d2, d3 = tinymt32_seed(keys[k + 3])
            for i in range(nss):
                a0, a1, a2, a3, ca = _draw256(a0, a1, a2, a3)
                b0, b1, b2, b3, cb = _draw256(b0, b1, b2, b3)
                c0, c1, c2, c3, cc = _draw256(c0, c1, c2, c3)
                d0, d1, d2, d3, cd = _draw256(d0, d1, d2, d3)
                out[k, i] = ca
                out[k + 1, i] = cb
                out[k + 2, i] = cc
                out[k + 3, i] = cd
            k += 4
    while k < r:
        coefficients_into(out[k], keys[k], nss, dt)
        k += 1


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
def _encode_repairs(
    flat: np.ndarray,
    stride: int,
    cap: int,
    first_esi: int,
    nss: int,
    keys: np.ndarray,
    dt: int,
    out: np.ndarray,
    size: int,
) -> bool:
    """out[k, :size] = repair of key keys[k] over ESIs first_esi .. first_esi+nss-1, for all
    k in one pass over the sources (gf256.region_dot_multi: each source read once for
    every repair, the accumulators in registers where the kernel allows).

    Source ESI e is flat[(e % cap) * stride :][:size], cut short at the end of ``flat``
    (a short last symbol counts as zero-padded): the encoder's ring (flattened rows of
    ``stride`` bytes, ``cap`` of them) and stream mode (``stride`` = ``size``) alike.
    Returns False, writing nothing, if a key is outside 0..MAX_REPAIR_KEY."""
    r = keys.shape[0]
    for k in range(r):
        if not 0 <= keys[k] <= MAX_REPAIR_KEY:
            return False
    coefs = np.empty((r, nss), dtype=np.uint8)
    coefficient_rows(coefs, keys, nss, dt)
    offsets = np.empty(nss, dtype=np.int64)
    for i in range(nss):
        offsets[i] = ((first_esi + i) % cap) * stride
    n = flat.shape[0]
    full = nss
    while full > 0 and offsets[full - 1] + size > n:
        full -= 1  # a short symbol at the end of a stream: added on its own below
    region_dot_multi(out, flat, offsets, coefs, full, size)
    for i in range(full, nss):
        src = flat[offsets[i] : min(offsets[i] + size, n)]
        for k in range(r):
            region_muladd(out[k, :size], src, coefs[k, i])
    return True


_BAD_PARAMS, _BAD_SPAN, _BAD_ROWS, _BAD_KEY = 1, 2, 3, 4
_INT64 = np.dtype(np.int64)


@njit(cache=True, nogil=True)
def _encode_repairs_checked(
    flat: np.ndarray,
    stride: int,
    cap: int,
    first_esi: int,
    nss: int,
    keys: np.ndarray,
    dt: int,
    out: np.ndarray,
    size: int,
    oldest: int,
    end: int,
) -> int:
    """_encode_repairs after the checks of RLCEncoder.repairs_into (the encoder holds ESIs
    ``oldest`` .. ``end - 1``): 0, or why nothing was written (_BAD_PARAMS: first_esi, nss
    or dt out of range; _BAD_SPAN: ESIs not held; _BAD_ROWS: fewer rows in ``out`` than
    keys; _BAD_KEY)."""
    if not (0 <= first_esi and 1 <= nss <= MAX_NSS and 0 <= dt <= MAX_DT):
        return _BAD_PARAMS
    if first_esi < oldest or first_esi + nss > end:
        return _BAD_SPAN
    if out.shape[0] < keys.shape[0]:
        return _BAD_ROWS
    if not _encode_repairs(flat, stride, cap, first_esi, nss, keys, dt, out, size):
        return _BAD_KEY
    return 0


@njit(cache=True, nogil=True)
def _encode_repair_checked(
    flat: np.ndarray,
    stride: int,
    cap: int,
    first_esi: int,
    nss: int,
    repair_key: int,
    dt: int,
    out: np.ndarray,
    size: int,
    oldest: int,
    end: int,
) -> int:
    """out[:size] = the repair of ``repair_key``: _encode_repairs_checked with one key (the
    same codes; ``out`` holds at least ``size`` bytes)."""
    keys = np.empty(1, dtype=np.int64)
    keys[0] = repair_key
    return _encode_repairs_checked(
        flat, stride, cap, first_esi, nss, keys, dt, out[:size].reshape((1, size)), size,
        oldest, end,
    )  # fmt: skip


class RLCEncoder:
    """RFC 8681 sliding-window RLC encoder over GF(2^8).

    ``window`` is how many of the most recent source symbols are kept (a ring buffer): a
    repair may cover any run of them. Source payloads shorter than ``symbol_size`` are
    zero-padded (the transport carries the true length itself).

    Stream mode (``stream=`` a bytes-like buffer holding the whole source stream, source ESI
    e being its bytes ``e*symbol_size ..``, the last symbol zero-padded): a sender that
    already holds its payload in memory announces what it has sent with
    :meth:`add_stream_sources` instead of copying every symbol into the ring; repairs read
    the stream in place (the buffer must not change while the encoder is in use).
    ``add_source`` is not available in this mode.
    """

    def __init__(self, symbol_size: int, window: int = 256, stream: object = None) -> None:
        if symbol_size < 1:
            raise ValueError(f"symbol_size must be positive, got {symbol_size}")
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.symbol_size = int(symbol_size)
        self.window = int(window)
        self._stride = _round8(self.symbol_size)
        self._zeros = bytes(self._stride)
        self._next_esi = 0
        # the last repair_into buffer validated (an array or a memoryview) and its array;
        # none yet: a private sentinel no caller can pass
        self._out_checked: object = _NO_BUFFER
        self._out_array = np.zeros(0, dtype=np.uint8)
        self._stream: np.ndarray | None = None
        if stream is not None:
            self._stream = as_u8_array(stream)
            self.stream_symbols = -(-self._stream.shape[0] // self.symbol_size)
            self._ring = np.zeros((0, self._stride), dtype=np.uint8)
        else:
            self._ring = np.zeros((self.window, self._stride), dtype=np.uint8)
        self._ring_flat = self._ring.reshape(-1)
        self._ring_mv = memoryview(self._ring_flat)
        # where repairs read source ESI e: flat[(e % cap) * stride :][:symbol_size]
        self._source: tuple[np.ndarray, int, int] = (
            (self._stream, self.symbol_size, max(self.stream_symbols, 1))
            if self._stream is not None
            else (self._ring_flat, self._stride, self.window)
        )
        self._outs_checked: object = None  # last repairs_into array validated

    def add_stream_sources(self, end: int) -> None:
        """Stream mode: the stream's source symbols below ESI ``end`` have been sent (repairs
        may cover them from now on; only the last ``window`` of them, as in ring mode)."""
        if self._stream is None:
            raise ValueError("add_stream_sources needs an encoder built with stream=")
        end = int(end)
        if not self._next_esi <= end <= self.stream_symbols:
            raise ValueError(
                f"stream sources end at {end}: outside {self._next_esi}..{self.stream_symbols}"
            )
        self._next_esi = end

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
        if self._stream is not None:
            raise ValueError("a stream-mode encoder takes sources with add_stream_sources")
        esi = self._next_esi
        view = payload if type(payload) is bytes else as_byte_view(payload)
        n = len(view)
        if n > self.symbol_size or esi > MAX_ESI:
            if esi > MAX_ESI:
                raise ValueError("ESI space exhausted (RFC 8681 ESIs are 32-bit)")
            raise ValueError(f"payload of {n} bytes exceeds symbol_size {self.symbol_size}")
        off = (esi % self.window) * self._stride
        self._ring_mv[off : off + n] = view
        if n < self._stride:
            self._ring_mv[off + n : off + self._stride] = self._zeros[: self._stride - n]
        self._next_esi = esi + 1
        return esi

    def add_sources(self, data: object) -> int:
        """Append the symbols cut from one buffer, ``symbol_size`` bytes each (the last one
        zero-padded); returns the first one's ESI.

        One bulk copy instead of a call per symbol: the fast path for a sender that
        packetizes a whole block at once. Only the last ``window`` of them are kept.
        """
        if self._stream is not None:
            raise ValueError("a stream-mode encoder takes sources with add_stream_sources")
        arr = as_u8_array(data)
        size = self.symbol_size
        count = -(-arr.shape[0] // size)
        first = self._next_esi
        if first + count - 1 > MAX_ESI:
            raise ValueError("ESI space exhausted (RFC 8681 ESIs are 32-bit)")
        full = arr.shape[0] // size
        i = max(0, count - self.window)  # earlier ones would be overwritten at once
        while i < full:
            slot = (first + i) % self.window
            m = min(full - i, self.window - slot)
            self._ring[slot : slot + m, :size] = arr[i * size : (i + m) * size].reshape(m, size)
            i += m
        if full < count:
            row = self._ring[(first + full) % self.window]
            tail = arr[full * size :]
            row[: tail.shape[0]] = tail
            row[tail.shape[0] :] = 0
        self._next_esi = first + count
        return first

    def source(self, esi: int) -> bytes:
        """The (zero-padded) source symbol ``esi``, while it is still in the ring."""
        self._check_span(int(esi), 1)
        if self._stream is not None:
            s = self.symbol_size
            sym = self._stream[esi * s : esi * s + s].tobytes()
            return sym + bytes(s - len(sym))
        off = (esi % self.window) * self._stride
        return self._ring_mv[off : off + self.symbol_size].tobytes()

    def _check_span(self, first_esi: int, nss: int) -> None:
        if first_esi < self.oldest_esi or first_esi + nss > self._next_esi:
            raise ValueError(
                f"ESIs {first_esi}..{first_esi + nss - 1} are not all held by the encoder "
                f"(it holds {self.oldest_esi}..{self._next_esi - 1})"
            )

    def repair_into(
        self, out: Any, first_esi: int, nss: int, repair_key: int, dt: int = 15
    ) -> None:
        """Write the repair symbol into ``out`` (its first ``symbol_size`` bytes).

        ``out`` is a writable uint8 numpy array or a writable buffer (bytearray, memoryview),
        e.g. the payload area of a datagram buffer, so the sender needs no allocation.
        """
        if out is self._out_checked:  # the same packet buffer again: already validated
            arr = self._out_array
        else:
            arr = out if type(out) is np.ndarray else np.frombuffer(out, dtype=np.uint8)
            if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
                raise TypeError("out must be a 1-D contiguous uint8 buffer")
            if not arr.flags.writeable:
                raise TypeError("out must be writable")
            if arr.shape[0] < self.symbol_size:
                raise ValueError(f"out holds {arr.shape[0]} bytes, need {self.symbol_size}")
            if type(out) is np.ndarray or type(out) is memoryview:  # fixed views: keep
                self._out_checked, self._out_array = out, arr
        flat, stride, cap = self._source
        first_esi, nss, repair_key, dt = int(first_esi), int(nss), int(repair_key), int(dt)
        why = _encode_repair_checked(
            flat, stride, cap, first_esi, nss, repair_key, dt, arr, self.symbol_size,
            self._next_esi - self.window, self._next_esi,
        )  # fmt: skip
        if why:  # raise with the reason
            _check_repair_params(first_esi, nss, repair_key, dt)
            self._check_span(first_esi, nss)
            raise ValueError(f"repair refused (code {why})")  # (not reached)

    def repairs_into(
        self, out: np.ndarray, first_esi: int, nss: int, repair_keys: object, dt: int = 15
    ) -> None:
        """Write the repair symbol of each key in ``repair_keys`` over the same source span
        into the rows of ``out`` (a writable 2-D C-contiguous uint8 array, one row of at
        least ``symbol_size`` bytes per key), in one pass over the sources.

        Row k is bit-identical to ``repair(first_esi, nss, repair_keys[k], dt)``; the pass
        reads each source once for all the repairs instead of once per repair (see
        _encode_repairs), the fast path for a sender that needs several repairs of a span.
        """
        # the hot path of a sender: few Python operations, the range checks in the kernel
        keys = repair_keys
        if type(keys) is not np.ndarray or keys.dtype is not _INT64 or keys.ndim != 1:
            keys = np.asarray(repair_keys, dtype=np.int64).reshape(-1)
        if out is not self._outs_checked:  # validated once per output array
            if not (
                type(out) is np.ndarray
                and out.dtype == np.uint8
                and out.ndim == 2
                and out.flags.c_contiguous
                and out.flags.writeable
            ):
                raise TypeError("out must be a writable 2-D C-contiguous uint8 array")
            if out.shape[1] < self.symbol_size:
                raise ValueError(f"out rows hold {out.shape[1]} bytes, need {self.symbol_size}")
            self._outs_checked = out
        flat, stride, cap = self._source
        first_esi, nss, dt = int(first_esi), int(nss), int(dt)
        why = _encode_repairs_checked(
            flat, stride, cap, first_esi, nss, keys, dt, out, self.symbol_size,
            self._next_esi - self.window, self._next_esi,
        )  # fmt: skip
        if why:
            self._repairs_refused(why, out, first_esi, nss, keys, dt)

    def _repairs_refused(
        self, why: int, out: np.ndarray, first_esi: int, nss: int, keys: np.ndarray, dt: int
    ) -> None:
        """Raise the ValueError for _encode_repairs_checked's refusal ``why``."""
        if why == _BAD_PARAMS:
            _check_repair_params(first_esi, nss, 0, dt)
        if why == _BAD_SPAN:
            self._check_span(first_esi, nss)
        if why == _BAD_ROWS:
            raise ValueError(f"out has {out.shape[0]} rows, need {keys.shape[0]} (one per key)")
        raise ValueError(f"repair keys must be in 0..{MAX_REPAIR_KEY}")

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

    def read_into(self, esi: int, out: Any) -> bool:
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
    def store(self, esi: int, view: bytes | bytearray | memoryview) -> None:
        """Write a symbol's bytes into its slot (zero-padded); the caller sets the state."""
        off = (esi % self.capacity) * self.stride
        n = len(view)
        self._sym_mv[off : off + n] = view
        if n < self.stride:
            self._sym_mv[off + n : off + self.stride] = self._zeros[: self.stride - n]

    def widen(self, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Hold ``capacity`` consecutive ESIs from ``base`` on (no change when that is not
        more than today): every held symbol and state keeps its ESI, the new slots are
        UNKNOWN. Returns the old and new slot of each held ESI (None when unchanged)."""
        capacity = int(capacity)
        old = self.capacity
        if capacity <= old:
            return None
        esis = np.arange(self.base, self.base + old, dtype=np.int64)
        src, dst = esis % old, esis % capacity
        sym = np.zeros((capacity, self.stride), dtype=np.uint8)
        sym[dst] = self.sym[src]
        state = np.zeros(capacity, dtype=np.uint8)  # UNKNOWN
        state[dst] = self.state[src]
        self.capacity, self.sym, self.state = capacity, sym, state
        self._sym_mv = memoryview(sym.reshape(-1))
        self._state_mv = memoryview(state)
        return src, dst

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
        base = self.base
        if bound <= base:
            return
        cap = self.capacity
        end = min(bound, base + cap)
        if end - base <= 16:  # the steady state of a sliding window: one ESI at a time
            st = self._state_mv
            for e in range(base, end):
                st[e % cap] = UNKNOWN
        elif end - base >= cap:
            self.state[:] = UNKNOWN
        else:
            lo, hi = base % cap, end % cap
            if lo < hi:
                self.state[lo:hi] = UNKNOWN
            else:
                self.state[lo:] = UNKNOWN
                self.state[:hi] = UNKNOWN
        self.base = bound
        if self._through + 1 >= base:
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
    words = as_words(row)
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
    words = as_words(row)
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


@njit(cache=True, nogil=True, inline="always")
def _split(ints: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out, colrow, piv) sections of the decoder's int64 state."""
    return (
        ints[_HEADER : _HEADER + cap],
        ints[_HEADER + cap : _HEADER + 2 * cap],
        ints[_HEADER + 2 * cap :],
    )


@njit(cache=True, nogil=True)
def _recover_row(
    r: int, sym: np.ndarray, state: np.ndarray, pay: np.ndarray, ints: np.ndarray
) -> None:
    cap = state.shape[0]
    out, colrow, piv = _split(ints, cap)
    esi = piv[r]
    col = esi % cap
    region_copy(sym[col], pay[r])
    state[col] = RECOVERED
    colrow[col] = -1
    piv[r] = -1
    ints[_NACT] -= 1
    out[ints[_NOUT]] = esi
    ints[_NOUT] += 1


@njit(cache=True, nogil=True)
def _pivot_row(
    r: int,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    ints: np.ndarray,
    touched: np.ndarray,
) -> bool:
    """Give row r (reduced against every pivot) a pivot, or drop it if it is all zero."""
    cap = state.shape[0]
    _, colrow, piv = _split(ints, cap)
    col = _lowest_esi_col(coef[r], ints[_BASE], cap)
    if col < 0:
        piv[r] = -1
        ints[_NACT] -= 1
        return False
    c = coef[r, col]
    if c != 1:
        inv = gf_inv(c)
        region_scale(coef[r], inv)
        region_scale(pay[r], inv)
    piv[r] = _esi_of_col(col, ints[_BASE], cap)
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
    ints: np.ndarray,
    touched: np.ndarray,
) -> None:
    """Recover every touched row that has no non-zero coefficient besides its pivot."""
    cap = state.shape[0]
    _, _, piv = _split(ints, cap)
    for r in range(piv.shape[0]):
        if touched[r] and piv[r] >= 0 and _only_nonzero_at(coef[r], piv[r] % cap):
            _recover_row(r, sym, state, pay, ints)
    if ints[_NACT] == 0:
        ints[_MAXREF] = -1


@njit(cache=True, nogil=True)
def _decode_source(
    sym: np.ndarray,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    ints: np.ndarray,
    esi: int,
) -> None:
    """Source ``esi`` became known (bytes already in ``sym``): strip it from the equations."""
    ints[_NOUT] = 0
    cap = state.shape[0]
    _, colrow, piv = _split(ints, cap)
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
        _pivot_row(rp, state, coef, pay, ints, touched)
    _flush_solved(sym, state, coef, pay, ints, touched)


@njit(cache=True, nogil=True)
def _decode_repair(
    sym: np.ndarray,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    ints: np.ndarray,
    first_esi: int,
    nss: int,
    repair_key: int,
    dt: int,
    payload: np.ndarray,
) -> int:
    """Add one repair equation (``payload``: the repair symbol, padded to the row stride)."""
    ints[_NOUT] = 0
    cap = state.shape[0]
    _, colrow, piv = _split(ints, cap)
    base = ints[_BASE]
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
    r = 0
    while piv[r] >= 0:  # the caller guarantees a free row
        r += 1
    ints[_NACT] += 1
    piv[r] = first_esi
    region_zero(coef[r])
    region_copy(pay[r], payload)
    # Strip the known source symbols (in one pass, gf256.region_muladd_multi), keep the
    # unknown ones as coefficients.
    stride = sym.shape[1]
    offs = np.empty(nss, dtype=np.int64)
    known = np.empty((1, nss), dtype=np.uint8)
    m = 0
    for i in range(nss):
        c = coefs[i]
        if c != 0:
            col = (first_esi + i) % cap
            if state[col] != UNKNOWN:
                offs[m] = col * stride
                known[0, m] = c
                m += 1
            else:
                coef[r, col] = c
    region_muladd_multi(pay[r].reshape((1, stride)), sym.reshape(-1), offs, known, m, stride)
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
    added = _pivot_row(r, state, coef, pay, ints, touched)
    if added:
        last = first_esi + nss - 1
        if last > ints[_MAXREF]:
            ints[_MAXREF] = last
    _flush_solved(sym, state, coef, pay, ints, touched)
    return _REPAIR_ADDED if added else _REPAIR_DEPENDENT


@njit(cache=True, nogil=True)
def _decode_release(state: np.ndarray, coef: np.ndarray, ints: np.ndarray, bound: int) -> None:
    """Remove the unknown ESIs below ``bound`` from the pending equations.

    Every row's pivot is its lowest-ESI unknown, and ESIs leave the window lowest first, so
    the only row that can involve a departing ESI is the row whose pivot it is: dropping
    that row keeps exactly the information the other rows hold about the remaining ESIs.
    Should any other row ever involve it, it is dropped too (losing an equation is safe;
    keeping one whose column is about to be reused for another ESI would not be).
    """
    cap = state.shape[0]
    _, colrow, piv = _split(ints, cap)
    base = ints[_BASE]
    end = min(bound, base + cap)
    if ints[_NACT] > 0:
        for e in range(base, end):
            col = e % cap
            if state[col] != UNKNOWN:
                continue
            colrow[col] = -1
            for o in range(piv.shape[0]):
                if piv[o] >= 0 and coef[o, col] != 0:
                    colrow[piv[o] % cap] = -1
                    piv[o] = -1
                    ints[_NACT] -= 1
    if ints[_NACT] == 0:
        ints[_MAXREF] = -1


@njit(cache=True, nogil=True)
def _store_run(
    sym: np.ndarray,
    state: np.ndarray,
    data: np.ndarray,
    lo: int,
    count: int,
    size: int,
    base: int,
    new_base: int,
    through: int,
) -> int:
    """Store sources lo .. lo+count-1 (``size`` bytes each in ``data``) as received, when
    those in the window are all unknown (else change nothing and return -2), first sliding
    the window from ``base`` to ``new_base`` (<= lo; only with no equation pending, so the
    slide just forgets slots); return decoded-through advanced as
    SourceWindow.advance_through would from ``new_base``. The caller checks that no
    pending equation involves the run and that it fits the window after the slide."""
    cap = state.shape[0]
    for i in range(count):
        e = lo + i
        if e < base + cap and state[e % cap] != UNKNOWN:
            return -2
    for e in range(base, min(new_base, base + cap)):
        state[e % cap] = UNKNOWN
    base = new_base
    stride = sym.shape[1]
    for i in range(count):
        col = (lo + i) % cap
        row = sym[col]
        region_copy(row, data[i * size : (i + 1) * size])
        region_zero(row[size:stride])
        state[col] = RECEIVED
    t = through
    if t + 1 < base:
        return t
    top = base + cap
    while t + 1 < top and state[(t + 1) % cap] != UNKNOWN:
        t += 1
    return t


@njit(cache=True, nogil=True)
def _advance_through(state: np.ndarray, base: int, t: int) -> int:
    """SourceWindow.advance_through on the kernel side: decoded-through ``t`` moved over the
    known ESIs that follow it (unchanged once it fell below ``base``)."""
    if t + 1 < base:
        return t
    cap = state.shape[0]
    top = base + cap
    while t + 1 < top and state[(t + 1) % cap] != UNKNOWN:
        t += 1
    return t


@njit(cache=True, nogil=True)
def _release_in(state: np.ndarray, coef: np.ndarray, ints: np.ndarray, bound: int) -> None:
    """RLCDecoder.release_before on the kernel side (decoded-through in ints[_THROUGH])."""
    base = ints[_BASE]
    if bound <= base:
        return
    cap = state.shape[0]
    end = min(bound, base + cap)
    if ints[_NACT] > 0:
        colrow = ints[_HEADER + cap : _HEADER + 2 * cap]
        for e in range(base, end):
            if colrow[e % cap] >= 0:
                _decode_release(state, coef, ints, bound)
                break
    for e in range(base, end):
        state[e % cap] = UNKNOWN
    ints[_BASE] = bound
    if ints[_THROUGH] + 1 >= base:
        ints[_THROUGH] = _advance_through(state, bound, ints[_THROUGH])


@njit(cache=True, nogil=True)
def _count_repairs(meta: np.ndarray, max_nss: int, max_source: int) -> int:
    """The number of repairs among add_packets' rows, or -1 - i for the first invalid row i
    (a checked loop: numpy's vector checks cost more than decoding a short run). A source
    ESI beyond ``max_source`` is invalid."""
    count = 0
    for i in range(meta.shape[0]):
        first, nss, key, dt = meta[i, 0], meta[i, 1], meta[i, 2], meta[i, 3]
        if first < 0 or first + max(nss, 1) - 1 > MAX_ESI:
            return -1 - i
        if nss == 0:
            if key != 0 or dt != 0 or first > max_source:
                return -1 - i
        elif not (1 <= nss <= max_nss and 0 <= key <= MAX_REPAIR_KEY and 0 <= dt <= MAX_DT):
            return -1 - i
        else:
            count += 1
    return count


_NO_ENDS = np.zeros(0, dtype=np.int64)
_NO_SOURCES = np.zeros(0, dtype=np.uint8)


@njit(cache=True, nogil=True)
def _decode_batch(
    sym: np.ndarray,
    state: np.ndarray,
    coef: np.ndarray,
    pay: np.ndarray,
    ints: np.ndarray,
    meta: np.ndarray,
    payloads: np.ndarray,
    counts: np.ndarray,
    results: np.ndarray,
    ends: np.ndarray,
    sources: np.ndarray,
) -> None:
    """Packets i = 0.. in order, exactly as RLCDecoder.add_source / add_repair take them one
    by one: row i of ``meta`` is (esi, 0, 0, 0) for a source symbol, (first_esi, nss,
    repair_key, dt) for a repair (already validated), its bytes row i of ``payloads``. The
    ESIs that became known go to ``results`` (counts[_C_RESULTS] of them; those of packet i
    end at ``ends[i]`` when ``ends`` has a slot per packet), the stats counters are added to
    ``counts``. A source's bytes are ``sources[esi * size:(esi + 1) * size]`` when
    ``sources`` is not empty. The caller guarantees a free equation row for every repair of
    the batch."""
    cap = state.shape[0]
    size = payloads.shape[1]
    stride = sym.shape[1]
    out = ints[_HEADER : _HEADER + cap]
    colrow = ints[_HEADER + cap : _HEADER + 2 * cap]
    stage = np.zeros(stride, dtype=np.uint8)
    nres = counts[_C_RESULTS]
    track = ends.shape[0] == meta.shape[0]
    own = sources.shape[0] > 0
    for i in range(meta.shape[0]):
        if track and i > 0:
            ends[i - 1] = nres
        first = meta[i, 0]
        nss = meta[i, 1]
        ints[_NOUT] = 0
        if nss == 0:  # a source symbol
            counts[_C_SOURCES] += 1
            base = ints[_BASE]
            if first < base:
                counts[_C_STALE] += 1
                continue
            if first >= base + cap:
                if first == base + cap and (ints[_NACT] == 0 or colrow[base % cap] < 0):
                    state[base % cap] = UNKNOWN
                    ints[_BASE] = base + 1
                else:
                    _release_in(state, coef, ints, first - cap + 1)
            col = first % cap
            if state[col] != UNKNOWN:
                counts[_C_DUPLICATES] += 1
                continue
            row = sym[col]
            if own:
                region_copy(row, sources[first * size : first * size + size])
            else:
                region_copy(row, payloads[i])
            region_zero(row[size:])
            results[nres] = first
            nres += 1
            if ints[_NACT] == 0 or first > ints[_MAXREF]:
                state[col] = RECEIVED
                if first == ints[_THROUGH] + 1:
                    ints[_THROUGH] = _advance_through(state, ints[_BASE], first - 1)
                continue
            _decode_source(sym, state, coef, pay, ints, first)
        else:
            counts[_C_REPAIRS] += 1
            last = first + nss - 1
            if last <= ints[_THROUGH] and first >= ints[_BASE]:
                counts[_C_ALL_KNOWN] += 1
                continue
            if last >= ints[_BASE] + cap:
                _release_in(state, coef, ints, last - cap + 1)
            if ints[_NACT] >= ints[_MAXPEND]:
                counts[_C_DROPPED] += 1
                continue
            region_copy(stage, payloads[i])
            code = _decode_repair(
                sym, state, coef, pay, ints, first, nss, meta[i, 2], meta[i, 3], stage
            )
            if code == _REPAIR_ADDED:
                counts[_C_USEFUL] += 1
            elif code == _REPAIR_ALL_KNOWN:
                counts[_C_ALL_KNOWN] += 1
            elif code == _REPAIR_DEPENDENT:
                counts[_C_DEPENDENT] += 1
            else:
                counts[_C_STALE] += 1
        n = ints[_NOUT]
        for k in range(n):
            results[nres + k] = out[k]
        nres += n
        counts[_C_RECOVERED] += n
        ints[_THROUGH] = _advance_through(state, ints[_BASE], ints[_THROUGH])
    if track and meta.shape[0] > 0:
        ends[meta.shape[0] - 1] = nres
    counts[_C_RESULTS] = nres


# --------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------


def decoder_bytes_per_esi(symbol_size: int, max_pending: int) -> int:
    """Bytes an RLCDecoder holds per ESI of its window at most: a ring row (the symbol
    padded to 8 bytes) and one coefficient column in each of ``max_pending`` rows."""
    return _round8(symbol_size) + max_pending


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
    ``stats`` and otherwise ignored. Not thread-safe (one decoder per receiving task).
    """

    def __init__(
        self, symbol_size: int, max_window: int = 1024, max_pending: int | None = None
    ) -> None:
        super().__init__(symbol_size, max_window)
        self.max_window = self.capacity
        self.max_pending = self.capacity if max_pending is None else int(max_pending)
        if not 1 <= self.max_pending <= self.capacity:
            raise ValueError(f"max_pending must be in 1..{self.capacity}, got {max_pending}")
        self._wpad = _round8(self.capacity)
        rows = min(16, self.max_pending)
        self._coef = np.zeros((rows, self._wpad), dtype=np.uint8)
        self._pay = np.zeros((rows, self.stride), dtype=np.uint8)
        header = np.zeros(_HEADER, np.int64)
        header[:4] = [0, 0, -1, 0]
        header[_MAXPEND] = self.max_pending
        self._set_ints(header, rows)
        self._stage = np.zeros(self.stride, dtype=np.uint8)  # incoming repair payload
        self._stage_mv = memoryview(self._stage)
        self._n_sources = self._n_duplicates = self._n_stale = self._n_recovered = 0
        self._n_repairs = self._n_useful = self._n_all_known = self._n_dependent = 0
        self._n_dropped = 0

    def _set_ints(self, header: np.ndarray, rows: int, colrow: int | np.ndarray = -1,
                  piv: np.ndarray | None = None) -> None:  # fmt: skip
        cap = self.capacity
        ints = np.full(_HEADER + 2 * cap + rows, -1, dtype=np.int64)
        ints[:_HEADER] = header
        ints[_HEADER + cap : _HEADER + 2 * cap] = colrow
        if piv is not None:
            ints[_HEADER + 2 * cap : _HEADER + 2 * cap + len(piv)] = piv
        self._ints = ints
        self._ints_mv = memoryview(ints)
        self._out = ints[_HEADER : _HEADER + cap]
        self._colrow = ints[_HEADER + cap : _HEADER + 2 * cap]
        self._piv = ints[_HEADER + 2 * cap :]
        self._colrow_mv = memoryview(self._colrow)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: sources, duplicates, stale (below the window), repairs and what became
        of them (useful, all_known: every symbol already known, dependent, dropped: no
        room left under max_pending), recovered."""
        return {
            "sources": self._n_sources,
            "duplicates": self._n_duplicates,
            "repairs": self._n_repairs,
            "repairs_useful": self._n_useful,
            "repairs_all_known": self._n_all_known,
            "repairs_dependent": self._n_dependent,
            "repairs_dropped": self._n_dropped,
            "stale": self._n_stale,
            "recovered": self._n_recovered,
        }

    @property
    def pending_equations(self) -> int:
        """Repair equations held that still involve unknown source symbols."""
        return self._ints_mv[_NACT]

    def pending_pivots(self) -> np.ndarray:
        """The pivot of each pending equation, ascending (int64 array): its lowest unknown
        ESI. Each lost symbol at or above a pivot may be waiting on that equation, so a
        receiver can tell the sender where equations are still short."""
        piv = self._piv
        return np.sort(piv[piv >= 0])

    def _collect(self, result: list[int]) -> list[int]:
        n = self._ints_mv[_NOUT]
        if n:
            result.extend(self._out[:n].tolist())
            self._n_recovered += n
        if result:
            self.advance_through()
        return result

    def release_before(self, esi: int) -> None:
        """Drop every ESI below ``esi``: their symbols, and the pending equations whose
        lowest unknown they are (those can no longer be solved; the others are kept whole)."""
        bound = int(esi)
        base = self.base
        if bound <= base:
            return
        if self._ints_mv[_NACT] and self._pivot_below(base, min(bound, base + self.capacity)):
            _decode_release(self.state, self._coef, self._ints, bound)
        self._ints_mv[_BASE] = bound
        self.clear_below(bound)

    def _pivot_below(self, base: int, end: int) -> bool:
        """Is any of the ESIs base..end-1 the pivot of a pending equation? Only such ESIs
        appear in pending equations when they leave (each row's pivot is its lowest ESI)."""
        cap = self.capacity
        if end - base > 16:
            return True  # let the kernel look
        colrow = self._colrow_mv
        return any(colrow[e % cap] >= 0 for e in range(base, end))

    def _add_source(self, esi: int, payload: object) -> list[int]:
        """A source symbol arrived; returns the ESIs that became known."""
        # The per-packet hot path of a receiver: kept to few Python operations.
        esi = int(esi)
        view = payload if type(payload) is bytes else as_byte_view(payload)
        n = len(view)
        if n > self.symbol_size or not 0 <= esi <= MAX_ESI:
            self._reject_source(esi, n)
        self._n_sources += 1
        base = self.base
        cap = self.capacity
        if esi < base:
            self._n_stale += 1
            return []
        st = self._state_mv
        ints = self._ints_mv
        if esi >= base + cap:
            if esi == base + cap and (ints[_NACT] == 0 or self._colrow_mv[base % cap] < 0):
                # The steady state of a stream: the oldest ESI leaves, no equation needs it.
                st[base % cap] = UNKNOWN
                self.base = ints[_BASE] = base + 1
            else:
                self.release_before(esi - cap + 1)
        col = esi % cap
        if st[col] != UNKNOWN:
            self._n_duplicates += 1
            return []
        stride = self.stride
        off = col * stride
        self._sym_mv[off : off + n] = view
        if n != stride:
            self._sym_mv[off + n : off + stride] = self._zeros[: stride - n]
        if ints[_NACT] == 0 or esi > ints[_MAXREF]:
            # No pending equation involves it: nothing to eliminate.
            st[col] = RECEIVED
            if esi == self._through + 1:  # advance decoded_through (inline advance_through)
                t, top = esi, self.base + cap
                while t + 1 < top and st[(t + 1) % cap] != UNKNOWN:
                    t += 1
                self._through = t
            return [esi]
        _decode_source(self.sym, self.state, self._coef, self._pay, self._ints, esi)
        return self._collect([esi])

    @property
    def max_involved(self) -> int:
        """The highest ESI a pending equation may involve; -1 when none is pending. No
        ESI above it (or above any repair still to come) can be recovered."""
        ints = self._ints_mv
        return ints[_MAXREF] if ints[_NACT] != 0 else -1

    def involves(self, esi: int) -> bool:
        """Whether a pending equation may involve source ``esi``: only then does the source
        have elimination work to do (otherwise it just fills its slot)."""
        ints = self._ints_mv
        return ints[_NACT] != 0 and esi <= ints[_MAXREF]

    def add_source_run(self, first: int, data: object) -> list[int]:
        """Source symbols ``first``, ``first + 1``, ... arrived, cut from ``data``
        (``symbol_size`` bytes each); returns the ESIs that became known.

        Exactly ``add_source`` once per symbol, in order. When no pending equation involves
        the run (see :meth:`involves`) and it is new and fits the window (sliding it along as
        the calls would, when no equation is pending at all), it is one kernel call (no
        per-symbol Python): the fast path for a receiver that hands its sources over in
        batches.
        """
        arr = as_u8_array(data)
        s = self.symbol_size
        count, rest = divmod(arr.shape[0], s)
        if rest:
            raise ValueError(f"a run of {arr.shape[0]} bytes is not whole {s}-byte symbols")
        lo = int(first)
        hi = lo + count
        if count == 0:
            return []
        base, cap = self.base, self.capacity
        new_base = max(base, hi - cap)  # what the calls would slide the window to
        if (
            not self.involves(lo)
            and 0 <= base <= lo
            and hi - 1 <= MAX_ESI
            and (new_base == base or (self._ints_mv[_NACT] == 0 and count <= cap))
        ):
            t = _store_run(self.sym, self.state, arr, lo, count, s, base, new_base, self._through)
            if t >= -1:  # stored (-2: some ESI of the run was known already)
                if new_base != base:
                    self.base = self._ints_mv[_BASE] = new_base
                self._n_sources += count
                self._through = t
                return list(range(lo, hi))
        got: list[int] = []
        for i in range(count):
            got += self._add_source(lo + i, arr[i * s : (i + 1) * s])
        return got

    add_source = _add_source  # (the public name; add_source_run calls the body directly)

    def _reject_source(self, esi: int, n: int) -> None:
        if not 0 <= esi <= MAX_ESI:
            raise ValueError(f"esi must be in 0..{MAX_ESI}, got {esi}")
        raise ValueError(f"payload of {n} bytes exceeds symbol_size {self.symbol_size}")

    def check_repair(self, first_esi: int, nss: int, repair_key: int, dt: int) -> None:
        """Raise ValueError (with the reason) when ``add_repair`` / ``add_packets`` would
        refuse a repair with these header fields; return None when they would take it."""
        if not (
            0 <= first_esi <= MAX_ESI - nss + 1
            and 1 <= nss <= min(MAX_NSS, self.capacity)
            and 0 <= repair_key <= MAX_REPAIR_KEY
            and 0 <= dt <= MAX_DT
        ):
            _check_repair_params(first_esi, nss, repair_key, dt)  # raises with the reason
            raise ValueError(f"repair covers {nss} symbols, more than max_window {self.capacity}")

    def add_repair(
        self, first_esi: int, nss: int, repair_key: int, dt: int, payload: object
    ) -> list[int]:
        """A repair symbol arrived; returns the ESIs it allowed to recover."""
        first_esi, nss, repair_key, dt = int(first_esi), int(nss), int(repair_key), int(dt)
        self.check_repair(first_esi, nss, repair_key, dt)
        view = payload if type(payload) is bytes else as_byte_view(payload)
        if len(view) != self.symbol_size:
            raise ValueError(f"repair payload has {len(view)} bytes, expected {self.symbol_size}")
        self._n_repairs += 1
        last = first_esi + nss - 1
        if last <= self._through and first_esi >= self.base:
            # Every symbol it covers is known and held: the kernel would find the same
            # without drawing nss coefficients (the common case on a clean stretch).
            self._n_all_known += 1
            return []
        if last >= self.base + self.capacity:
            self.release_before(last - self.capacity + 1)
        if self._ints_mv[_NACT] >= self._piv.shape[0]:
            if self._piv.shape[0] >= self.max_pending:
                self._n_dropped += 1  # bounded state: no room for another equation
                return []
            self._grow_rows()
        self._stage_mv[: self.symbol_size] = view
        code = _decode_repair(
            self.sym,
            self.state,
            self._coef,
            self._pay,
            self._ints,
            first_esi,
            nss,
            repair_key,
            dt,
            self._stage,
        )
        if code == _REPAIR_ADDED:
            self._n_useful += 1
        elif code == _REPAIR_ALL_KNOWN:
            self._n_all_known += 1
        elif code == _REPAIR_DEPENDENT:
            self._n_dependent += 1
        else:
            self._n_stale += 1
        return self._collect([])

    def add_packets(
        self,
        meta: object,
        payloads: object,
        ends: np.ndarray | None = None,
        sources: np.ndarray | None = None,
    ) -> list[int]:
        """A run of packets in arrival order, in one call; returns the ESIs that became known.

        Row i of ``meta`` (n x 4 integers) is ``(esi, 0, 0, 0)`` for a source symbol and
        ``(first_esi, nss, repair_key, dt)`` for a repair (nss >= 1); its bytes are row i of
        ``payloads`` (n x symbol_size uint8, or a bytes-like of n * symbol_size bytes; a
        short source is zero-padded by the caller). The decoder ends exactly as after
        ``add_source`` / ``add_repair`` once per packet, in order, and returns what those
        calls would have, concatenated (each call's ESIs in the order it returns them): one
        kernel call for the whole run, no per-packet Python. ``ends`` (an int64 array of at
        least n), if given, receives where each packet's ESIs end in the returned list:
        packet i's are ``result[ends[i - 1]:ends[i]]`` (from 0 for packet 0). ``sources``
        (a uint8 array), if given, holds every source row's bytes at ``esi * symbol_size``
        instead (as a receiver's output buffer does; those rows of ``payloads`` are then
        not read). Invalid rows raise ValueError before anything changes.
        """
        m = np.ascontiguousarray(meta, dtype=np.int64)
        size = self.symbol_size
        if m.ndim != 2 or m.shape[1] != 4:
            raise ValueError(f"meta must be n x 4 (esi, nss, repair_key, dt), got {m.shape}")
        n = m.shape[0]
        pay = as_u8_array(payloads)
        if pay.size != n * size:
            raise ValueError(f"payloads hold {pay.size} bytes, expected {n} x {size}")
        if ends is not None and (ends.dtype != np.int64 or ends.shape[0] < n):
            raise ValueError(f"ends must be an int64 array of at least {n}")
        if sources is not None:
            if sources.dtype != np.uint8 or sources.ndim != 1:
                raise ValueError("sources must be a flat uint8 array")
        if n == 0:
            return []
        pay = pay.reshape(n, size)
        max_source = MAX_ESI if sources is None else sources.shape[0] // size - 1
        repairs = _count_repairs(m, min(MAX_NSS, self.capacity), max_source)
        if repairs < 0:
            i = -1 - repairs
            raise ValueError(f"packet {i}: invalid (esi, nss, repair_key, dt) {m[i].tolist()}")
        need = min(self.max_pending, self._ints_mv[_NACT] + repairs)
        while self._piv.shape[0] < need:
            self._grow_rows()
        counts = np.zeros(_C_RESULTS + 1, dtype=np.int64)
        results = np.empty(n + self._ints_mv[_NACT] + 1, dtype=np.int64)
        self._ints[_THROUGH] = self._through
        _decode_batch(
            self.sym, self.state, self._coef, self._pay, self._ints, m, pay, counts, results,
            _NO_ENDS if ends is None else ends[:n], _NO_SOURCES if sources is None else sources,
        )  # fmt: skip
        self.base = int(self._ints[_BASE])
        self._through = int(self._ints[_THROUGH])
        c = counts.tolist()
        self._n_sources += c[_C_SOURCES]
        self._n_duplicates += c[_C_DUPLICATES]
        self._n_stale += c[_C_STALE]
        self._n_recovered += c[_C_RECOVERED]
        self._n_repairs += c[_C_REPAIRS]
        self._n_useful += c[_C_USEFUL]
        self._n_all_known += c[_C_ALL_KNOWN]
        self._n_dependent += c[_C_DEPENDENT]
        self._n_dropped += c[_C_DROPPED]
        return results[: c[_C_RESULTS]].tolist()

    def widen(self, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Hold ``capacity`` ESIs from now on (no change when that is not more than
        ``max_window``): the held symbols, their states, every pending equation and
        ``max_pending`` stay as they are, so decoding goes on exactly as before, with the
        window reaching further. For a receiver that learns the window a sender works with
        after its first symbols (kvtransport.core.receiver); costs one copy of the held
        symbols and equations."""
        moved = super().widen(capacity)
        if moved is None:
            return None
        src, dst = moved
        self.max_window = self.capacity
        self._wpad = _round8(self.capacity)
        rows = self._piv.shape[0]
        coef = np.zeros((rows, self._wpad), dtype=np.uint8)
        coef[:, dst] = self._coef[:, src]
        colrow = np.full(self.capacity, -1, dtype=np.int64)
        colrow[dst] = self._colrow[src]
        self._coef = coef
        self._set_ints(self._ints[:_HEADER].copy(), rows, colrow, self._piv.copy())
        return moved

    def _grow_rows(self) -> None:
        rows = self._piv.shape[0]
        new = min(2 * rows, self.max_pending)
        if new <= rows:  # cannot happen: each pending row owns a distinct unknown column
            raise RuntimeError("RLC decoder row storage exhausted")
        coef = np.zeros((new, self._wpad), dtype=np.uint8)
        pay = np.zeros((new, self.stride), dtype=np.uint8)
        coef[:rows] = self._coef
        pay[:rows] = self._pay
        self._coef, self._pay = coef, pay
        self._set_ints(self._ints[:_HEADER].copy(), new, self._colrow.copy(), self._piv.copy())
