"""An entropy-coded KV block codec: per-channel prediction, uniform quantization, rANS.

One block is one layer's K and V for a token range, ``[2, H, T, D]`` float. Every block is
coded on its own (its frequency table travels with it), so a block decodes without any
other: loss recovery and recompute stay per block.

Encoding, per half (K, V) and head:

1. **Quantization**: ``q = rint(x / step)`` with one step per (half, head): the half's
   relative step (the quality knob: ``rel_step``) times the head's root mean square over
   the block, rounded up to float16 (the step travels as float16). Every element is then
   within ``step / 2`` of ``q * step`` in exact arithmetic (the float32 product adds at most
   half an ulp). One step for all channels is what minimises the squared error at a given
   rate (every component gets the same distortion); the entropy coder, not the step,
   adapts to each channel's spread.
2. **Prediction across tokens**: per channel, an anchor (the median of the channel's codes
   over the block's tokens, a CacheGen-style anchor that one odd token, the attention
   sink, cannot move) is subtracted from every token's code. Keys sit on per-channel
   offsets (the outlier channels KIVI quantizes per channel for); the residuals around
   the anchor are small and peaked whatever the offset.
3. **Entropy coding**: anchors then residuals, as zig-zag symbols (``0, -1, 1, -2, ...``
   -> ``0, 1, 2, 3, ...``); a value whose symbol would be 255 or more is sent as the escape
   symbol 255 and its zig-zag value as a LEB128 varint in a side stream. The symbols go
   through a static rANS coder (32-bit states in ``[2**16, 2**32)``, renormalised by
   16-bit words, at most one per symbol, so the decoder's renormalisation is a select
   rather than a loop; ``SCALE_BITS``-bit frequencies) with ``LANES`` interleaved states,
   symbol ``i`` on state ``i % LANES``, so decoding has independent dependency chains.
   The frequency table is the block's own histogram, normalised to ``2**SCALE_BITS``,
   every used symbol kept.

The entropy stage is lossless: decoding gives back exactly the quantized codes, so the
error of a coded block is the quantization's alone (``|x - decoded| <= step / 2`` plus
float32 rounding).

Coded block layout (little-endian)::

    0      1   format byte (FORMAT)
    1      4H  float16 steps, K's heads then V's
    ..     1   last used symbol M (0..255)
    ..     ..  frequencies of symbols 0..M, LEB128 varints (sum 2**SCALE_BITS)
    ..     4   escape stream length E
    ..     4   rANS stream length R
    ..     E   escape varints
    ..     R   rANS: LANES u32 final states (big-endian), then the renormalisation words
               (u16), in decoding order

**int8 blocks without loss** (kvtransport.kvformat.blocks' ``int8r``): an int8 block
(kvtransport.codecs.quant.quantize_kv's row: codes ``[2, H, T, D]``, then float16 scales
and zeros) goes through steps 2 and 3 only, its codes as they are: anchors less 128, then
each code less its channel's anchor, entropy-coded as above; the scales and zeros follow
as they are. Decoding gives back the row bit for bit::

    0      1   format byte (FORMAT_INT8)
    ..     ..  the entropy-coded part, as above from "last used symbol"
    ..     S   the row's scales and zeros (S: the row's bytes after its codes)

Encoding runs in compiled loops with no per-symbol Python: each channel's median by rank
(branch-free comparisons, vectorised across channels), one pass for the symbols, their
histogram and the escapes, and the rANS division by a symbol's frequency as a
multiplication by its reciprocal.

Decoding untrusted bytes (a forged or truncated block) never reads outside the block:
every length, frequency and state is checked, and a stream whose states do not end where
the encoder began, or that leaves bytes unread, or an int8 code outside 0..255, is
refused (:class:`CodecError`; for int8 blocks a status per block).
"""

from __future__ import annotations

import numpy as np
from numba import njit

FORMAT = 1
"""The coded layout's format byte."""
FORMAT_INT8 = 2
"""The format byte of an int8 block coded losslessly (:func:`encode_int8_rows`)."""
LANES = 4
"""Interleaved rANS states."""
SCALE_BITS = 12
"""Frequencies sum to ``2**SCALE_BITS``."""
ESCAPE = 255
"""The symbol that sends its value in the escape stream."""
_RANS_L = 1 << 16
_TOTAL = 1 << SCALE_BITS
MAX_CODE = 1 << 40
"""The largest magnitude of an anchor or a residual (codes then stay exact in float32
products up to 2**41 times a float16 step, finite)."""
_F16_MAX = float(np.finfo(np.float16).max)
# decode_blocks_into's status codes (0: ok)
_ERRORS = {
    1: "truncated",
    2: "unknown format",
    3: "bad step",
    4: "bad frequency table",
    5: "bad stream lengths",
    6: "bad rANS state",
    7: "rANS stream overrun",
    8: "escape stream overrun",
    9: "stream does not end where it began",
    10: "trailing bytes",
    11: "decoded value out of range",
}


class CodecError(ValueError):
    """Coded bytes that do not decode: truncated, forged or corrupted."""


def header_nbytes(heads: int) -> int:
    """Bytes before the frequency table: the format byte and the float16 steps."""
    return 1 + 4 * heads


# ---------------------------------------------------------------------------------------
# Encoding


def steps_of(kv: np.ndarray, rel_step: tuple[float, float]) -> np.ndarray:
    """``[n, 2, H]`` float16 steps of ``[n, 2, H, T, D]`` blocks: each half's relative step
    times each head's root mean square over the block, rounded up to float16 (a zero head
    gets step 1: every code is then 0). Raises ValueError for non-finite values, a
    non-positive relative step, or a step beyond float16."""
    rel = np.asarray(rel_step, dtype=np.float64)
    if rel.shape != (2,) or not np.all(rel > 0) or not np.all(np.isfinite(rel)):
        raise ValueError(f"rel_step must be two positive numbers (K, V), not {rel_step}")
    x = np.ascontiguousarray(kv, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot code non-finite values")
    rms = np.sqrt(_mean_squares(x.reshape(-1, x.shape[3] * x.shape[4])).reshape(x.shape[:3]))
    step = rms * rel[None, :, None]
    if np.any(step > _F16_MAX):
        raise ValueError("values too large for a float16 step")
    h = step.astype(np.float16)
    low = h.astype(np.float64) < step
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    h[h == 0] = np.float16(1.0)
    return h


@njit(cache=True, nogil=True)
def _mean_squares(rows: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """Each float32 row's mean square, accumulated in float64."""
    out = np.empty(rows.shape[0], np.float64)
    for i in range(rows.shape[0]):
        acc = 0.0
        for v in rows[i]:
            acc += np.float64(v) * np.float64(v)
        out[i] = acc / rows.shape[1]
    return out


def encode_blocks(kv: np.ndarray, rel_step: tuple[float, float]) -> list[np.ndarray]:
    """``[n, 2, H, T, D]`` float blocks -> n coded blocks (uint8 arrays, the module's
    layout); ``rel_step``: the (K, V) quantization step relative to each head's RMS."""
    kv = np.ascontiguousarray(kv, dtype=np.float32)
    if kv.ndim != 5 or kv.shape[1] != 2 or min(kv.shape[2:]) < 1:
        raise ValueError(f"blocks must be [n, 2, heads, tokens, dim], not {kv.shape}")
    steps = steps_of(kv, rel_step)
    heads16 = np.ascontiguousarray(steps.reshape(kv.shape[0], -1), dtype="<f2").view(np.uint8)
    out = []
    for j in range(kv.shape[0]):
        codes = _codes(kv[j], steps[j].astype(np.float32))
        if np.any(np.abs(codes) > MAX_CODE):
            raise ValueError("values too large against their step")
        out.append(_encode_block(FORMAT, heads16[j], codes.reshape(-1), b""))
    return out


def _encode_block(fmt: int, head: np.ndarray, values: np.ndarray, tail: bytes) -> np.ndarray:
    """One coded block: the format byte, ``head`` (bytes), the entropy-coded ``values``
    (int64, :func:`_entropy_encode`), then ``tail`` (bytes, sent as they are)."""
    body = _entropy_encode(values)
    out = np.empty(1 + head.size + body.size + len(tail), np.uint8)
    out[0] = fmt
    out[1 : 1 + head.size] = head
    out[1 + head.size : 1 + head.size + body.size] = body
    out[1 + head.size + body.size :] = np.frombuffer(tail, np.uint8)
    return out


@njit(cache=True, nogil=True)
def _codes(x: np.ndarray, steps: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """``[2, H, T, D]`` -> int64 ``[2, H, T + 1, D]``: row 0 the per-channel anchors (the
    median code), rows 1.. each token's code less its channel's anchor."""
    two, heads, tokens, dim = x.shape
    out = np.empty((two, heads, tokens + 1, dim), np.int64)
    q = np.empty((tokens, dim), np.int64)
    rank = np.empty(dim, np.int64)
    for s in range(two):
        for h in range(heads):
            st = np.float64(steps[s, h])
            for t in range(tokens):
                for d in range(dim):
                    q[t, d] = np.int64(np.rint(np.float64(x[s, h, t, d]) / st))
            _anchored(q, rank, out[s, h])
    return out


@njit(cache=True, nogil=True, inline="always")
def _anchored(q: np.ndarray, rank: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """Codes ``q`` ``[T, D]`` (a contiguous integer array) -> ``out`` ``[T + 1, D]``: row
    0 each channel's lower median code (the anchor), rows 1.. the codes less it. The
    median is found by rank (the code with ``(T - 1) // 2`` codes before it, ties by
    token), every channel at once: T * T branch-free comparisons per channel, which the
    compiler vectorises across channels, the narrower ``q``'s type the wider (``rank``: a
    ``[D]`` scratch array of that type)."""
    tokens, dim = q.shape
    mid = (tokens - 1) // 2
    for t in range(tokens):
        rank[:] = 0
        for u in range(t):
            for d in range(dim):
                rank[d] += q[u, d] <= q[t, d]
        for u in range(t + 1, tokens):
            for d in range(dim):
                rank[d] += q[u, d] < q[t, d]
        for d in range(dim):
            if rank[d] == mid:
                out[0, d] = q[t, d]
    for t in range(tokens):
        for d in range(dim):
            out[t + 1, d] = q[t, d] - out[0, d]


@njit(cache=True, nogil=True)
def _entropy_encode(values: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """int64 ``values`` -> the layout's entropy-coded part: the last used symbol, the
    frequency varints, the escape and rANS stream lengths (u32), the escape varints, the
    rANS stream. One pass builds the symbols, the histogram and the escapes."""
    n = values.size
    sym = np.empty(n, np.uint8)
    counts = np.zeros(256, np.int64)
    esc = np.empty(10 * n + 1, np.uint8)
    e = 0
    for i in range(n):
        v = values[i]
        zz = np.uint64((v << 1) ^ (v >> 63))
        if zz >= ESCAPE:
            sym[i] = ESCAPE
            e = _put_varint(esc, e, zz)
        else:
            sym[i] = np.uint8(zz)
        counts[sym[i]] += 1
    freq = _normalized(counts)
    last = 255
    while freq[last] == 0:
        last -= 1
    table = np.empty(2 * (last + 1), np.uint8)
    t = 0
    for s in range(last + 1):
        t = _put_varint(table, t, np.uint64(freq[s]))
    rans = _rans_encode(sym, freq)
    out = np.empty(1 + t + 8 + e + rans.size, np.uint8)
    out[0] = last
    out[1 : 1 + t] = table[:t]
    p = 1 + t
    for b in range(4):
        out[p + b] = (e >> (8 * b)) & 0xFF
        out[p + 4 + b] = (rans.size >> (8 * b)) & 0xFF
    p += 8
    out[p : p + e] = esc[:e]
    out[p + e :] = rans
    return out


@njit(cache=True, nogil=True, inline="always")
def _put_varint(buf: np.ndarray, pos: int, v: np.uint64) -> int:  # pragma: no cover
    """LEB128 of ``v`` at ``pos``; the next position."""
    while v >= 0x80:
        buf[pos] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        pos += 1
        v = v >> np.uint64(7)
    buf[pos] = np.uint8(v)
    return pos + 1


def normalized_frequencies(counts: np.ndarray) -> np.ndarray:
    """Counts of 256 symbols -> frequencies summing to ``2**SCALE_BITS``, every counted
    symbol at least 1, each within one rounding of its share (the largest ones absorb
    the rest). Raises ValueError for no counts."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (256,) or np.any(counts < 0):
        raise ValueError("counts must be 256 non-negative integers")
    if int(counts.sum()) == 0:
        raise ValueError("no symbols to count")
    return _normalized(counts)


@njit(cache=True, nogil=True)
def _normalized(counts: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """:func:`normalized_frequencies` of non-empty counts."""
    n = counts.sum()
    freq = np.zeros(256, np.int64)
    total = 0
    for s in range(256):
        if counts[s] > 0:
            freq[s] = max(1, (counts[s] * _TOTAL + n // 2) // n)
            total += freq[s]
    excess = total - _TOTAL
    while excess != 0:
        i = np.argmax(freq)
        if excess < 0:
            freq[i] -= excess
            break
        take = min(excess, freq[i] - 1)
        freq[i] -= take
        excess -= take
    return freq


@njit(cache=True, nogil=True)
def _rans_encode(sym: np.ndarray, freq: np.ndarray) -> np.ndarray:  # pragma: no cover
    """Interleaved rANS of ``sym`` (uint8) under ``freq`` (summing to 2**SCALE_BITS): the
    LANES final states (big-endian, lane 0 first) then the renormalisation words, in
    decoding order. The division by a symbol's frequency is a multiplication by its
    reciprocal, exact for the states and frequencies the coder meets."""
    cum = np.zeros(257, np.int64)
    for s in range(256):
        cum[s + 1] = cum[s] + freq[s]
    # x // f == (x * rcp) >> 44 for every state x < f * 2**20 the coder divides and every
    # f <= 2**12 (the rounding error stays below 1 / f; the product below 2**64)
    rcp = np.zeros(256, np.uint64)
    bound = np.zeros(256, np.int64)
    for s in range(256):
        f = freq[s]
        if f:
            rcp[s] = np.uint64(((1 << 44) + f - 1) // f)
            bound[s] = ((_RANS_L >> SCALE_BITS) << 16) * f
    n = sym.size
    cap = n * 2 + 4 * LANES + 16
    buf = np.empty(cap, np.uint8)
    pos = cap
    state = np.full(LANES, _RANS_L, np.int64)
    for i in range(n - 1, -1, -1):
        lane = i & (LANES - 1)
        s = sym[i]
        x = state[lane]
        if x >= bound[s]:  # one 16-bit word out
            pos -= 2
            buf[pos] = x & 0xFF
            buf[pos + 1] = (x >> 8) & 0xFF
            x >>= 16
        q = np.int64((np.uint64(x) * rcp[s]) >> np.uint64(44))
        state[lane] = (q << SCALE_BITS) + (x - q * freq[s]) + cum[s]
    for lane in range(LANES - 1, -1, -1):
        x = state[lane]
        for b in range(4):  # big-endian in decoding order, lane 0 first
            pos -= 1
            buf[pos] = (x >> (8 * b)) & 0xFF
    return buf[pos:].copy()


# ---------------------------------------------------------------------------------------
# Decoding


def decode_block(coded: np.ndarray | bytes, heads: int, tokens: int, dim: int) -> np.ndarray:
    """One coded block -> float32 ``[2, heads, tokens, dim]``. Raises CodecError for bytes
    that are not such a block."""
    buf = np.frombuffer(bytes(coded), np.uint8) if isinstance(coded, bytes) else coded
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    keys = np.empty((1, heads, tokens, dim), np.float32)
    values = np.empty_like(keys)
    decode_blocks_into(buf, np.zeros(1, np.int64), np.array([buf.size]), np.zeros(1, np.int64),
                       np.zeros(1, np.int64), tokens, keys, values)  # fmt: skip
    return np.stack([keys[0], values[0]])


def decode_blocks_into(
    buf: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    layers: np.ndarray,
    starts: np.ndarray,
    count: int,
    keys: np.ndarray,
    values: np.ndarray,
) -> None:
    """Decode coded blocks straight into a cache: block ``j`` is ``buf[offsets[j]:
    offsets[j] + lengths[j]]``, ``count`` tokens of layer ``layers[j]`` from token
    ``starts[j]``; keys, values float32 ``[L, H, N, D]``, written in place. Raises
    CodecError naming the first block that does not decode (blocks before it are written)
    and ValueError for offsets outside ``buf`` or slots outside the cache."""
    offsets = np.asarray(offsets, np.int64)
    lengths = np.asarray(lengths, np.int64)
    layers = np.asarray(layers, np.int64)
    starts = np.asarray(starts, np.int64)
    if np.any(offsets < 0) or np.any(lengths < 0) or np.any(offsets + lengths > buf.size):
        raise ValueError("coded blocks outside the buffer")
    if keys.dtype != np.float32 or values.shape != keys.shape or keys.ndim != 4:
        raise ValueError("keys and values must be float32 [layers, heads, tokens, dim]")
    if np.any(layers < 0) or np.any(layers >= keys.shape[0]) or count < 1:
        raise ValueError("blocks outside the cache's layers")
    if np.any(starts < 0) or np.any(starts + count > keys.shape[2]):
        raise ValueError("blocks outside the cache's tokens")
    status, j = _decode_blocks(buf, offsets, lengths, layers, starts, count, keys, values)
    if status:
        raise CodecError(f"coded block {j}: {_ERRORS[status]}")


@njit(cache=True, nogil=True, inline="always")
def _varint(buf: np.ndarray, pos: int, end: int) -> tuple[int, int]:  # pragma: no cover
    """(value, next position) of the LEB128 at ``pos``; next position -1 when it runs past
    ``end`` or beyond 63 bits."""
    v = 0
    shift = 0
    while True:
        if pos >= end or shift > 56:
            return 0, -1
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


@njit(cache=True, nogil=True, inline="always")
def _rans_symbol(
    tab: np.ndarray, buf: np.ndarray, x: int, rp: int, last: int
) -> tuple[int, int, int]:  # pragma: no cover - numba
    """One symbol off state ``x``: (symbol, next state, next read position). The refill
    word is read at ``min(rp, last)``, so a forged stream never reads past the block; the
    caller refuses a stream whose position ends anywhere but its end."""
    p = tab[x & (_TOTAL - 1)]
    x = ((p >> 20) + 1) * (x >> SCALE_BITS) + ((p >> 8) & (_TOTAL - 1))
    at = min(rp, last)
    w = int(buf[at]) | (int(buf[at + 1]) << 8)
    if x < _RANS_L:
        x = (x << 16) | w
        rp += 2
    return int(p & 0xFF), x, rp


@njit(cache=True, nogil=True)
def _rans_run(
    tab: np.ndarray, buf: np.ndarray, state: np.ndarray, rp: int, last: int, sym: np.ndarray
) -> int:  # pragma: no cover - numba
    """Decode ``sym.size`` symbols into ``sym``, symbol ``i`` off lane ``i % LANES``
    (LANES is 4: the lanes' states stay in registers); ``state`` holds the lanes' states
    in and out. Returns the next read position."""
    n = sym.size
    x0, x1, x2, x3 = state[0], state[1], state[2], state[3]
    i = 0
    while i + 4 <= n:
        s0, x0, rp = _rans_symbol(tab, buf, x0, rp, last)
        s1, x1, rp = _rans_symbol(tab, buf, x1, rp, last)
        s2, x2, rp = _rans_symbol(tab, buf, x2, rp, last)
        s3, x3, rp = _rans_symbol(tab, buf, x3, rp, last)
        sym[i] = s0
        sym[i + 1] = s1
        sym[i + 2] = s2
        sym[i + 3] = s3
        i += 4
    if i < n:
        sym[i], x0, rp = _rans_symbol(tab, buf, x0, rp, last)
    if i + 1 < n:
        sym[i + 1], x1, rp = _rans_symbol(tab, buf, x1, rp, last)
    if i + 2 < n:
        sym[i + 2], x2, rp = _rans_symbol(tab, buf, x2, rp, last)
    state[0], state[1], state[2], state[3] = x0, x1, x2, x3
    return rp


@njit(cache=True, nogil=True)
def _entropy_decode(
    buf: np.ndarray,
    pos: int,
    end: int,
    freq: np.ndarray,
    tab: np.ndarray,
    state: np.ndarray,
    sym: np.ndarray,
) -> tuple[int, int, int]:  # pragma: no cover - numba
    """The entropy-coded part of a block, ``buf[pos:end]``, into ``sym`` (``sym.size``
    symbols; ``freq``, ``tab``, ``state``: scratch). Returns (status, escape stream start,
    escape stream end): status 0, or an _ERRORS code for a table, lengths or stream that
    does not hold. The escape varints are the caller's to read, from the start to exactly
    the end."""
    if pos + 1 > end:
        return 1, 0, 0
    top = buf[pos]
    pos += 1
    total = 0
    freq[:] = 0
    for s in range(top + 1):
        f, pos = _varint(buf, pos, end)
        if pos < 0:
            return 1, 0, 0
        if f > _TOTAL:
            return 4, 0, 0
        freq[s] = f
        total += f
    if total != _TOTAL:
        return 4, 0, 0
    c = 0
    for s in range(256):
        for k in range(freq[s]):
            tab[c + k] = ((freq[s] - 1) << 20) | (k << 8) | s
        c += freq[s]
    if pos + 8 > end:
        return 1, 0, 0
    e_len = 0
    r_len = 0
    for b in range(4):
        e_len |= int(buf[pos + b]) << (8 * b)
        r_len |= int(buf[pos + 4 + b]) << (8 * b)
    pos += 8
    if e_len + r_len != end - pos:
        return 5, 0, 0
    esc = pos
    esc_end = pos + e_len
    rp = esc_end
    if r_len < 4 * LANES or r_len % 2:
        return 5, 0, 0
    for lane in range(LANES):
        x = 0
        for b in range(4):
            x = (x << 8) | buf[rp + b]
        rp += 4
        if x < _RANS_L:
            return 6, 0, 0
        state[lane] = x
    rp = _rans_run(tab, buf, state, rp, end - 2, sym)
    if rp > end:
        return 7, 0, 0
    for lane in range(LANES):
        if state[lane] != _RANS_L:
            return 9, 0, 0
    if rp != end:
        return 10, 0, 0
    return 0, esc, esc_end


@njit(cache=True, nogil=True)
def _decode_blocks(
    buf: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    layers: np.ndarray,
    starts: np.ndarray,
    count: int,
    keys: np.ndarray,
    values: np.ndarray,
) -> tuple[int, int]:  # pragma: no cover - numba
    heads = keys.shape[1]
    dim = keys.shape[3]
    freq = np.zeros(256, np.int64)
    tab = np.empty(_TOTAL, np.int64)  # per slot: (freq - 1) << 20 | (slot - cum) << 8 | sym
    steps = np.empty(2 * heads, np.float32)
    anchor = np.empty(dim, np.int64)
    state = np.empty(LANES, np.int64)
    sym = np.empty(2 * heads * (count + 1) * dim, np.uint8)
    for j in range(offsets.size):
        o = offsets[j]
        end = o + lengths[j]
        if o + 1 + 4 * heads > end:
            return 1, j
        if buf[o] != FORMAT:
            return 2, j
        for i in range(2 * heads):
            h = buf[o + 1 + 2 * i] | (buf[o + 2 + 2 * i] << 8)
            if (h >> 10) & 0x1F == 31 or h & 0x8000 or h & 0x7FFF == 0:
                return 3, j  # not finite, negative or zero
            steps[i] = _half(h)
        status, esc, esc_end = _entropy_decode(buf, o + 1 + 4 * heads, end, freq, tab, state,
                                               sym)  # fmt: skip
        if status:
            return status, j
        layer = layers[j]
        t0 = starts[j]
        i = 0
        for half in range(2):
            out = keys if half == 0 else values
            for h in range(heads):
                st = steps[half * heads + h]
                for r in range(count + 1):
                    for d in range(dim):
                        s = int(sym[i])
                        i += 1
                        zz = s
                        if s == ESCAPE:
                            zz, esc = _varint(buf, esc, esc_end)
                            if esc < 0:
                                return 8, j
                            if zz > 2 * MAX_CODE:
                                return 11, j
                        v = (zz >> 1) ^ -(zz & 1)
                        if r == 0:
                            anchor[d] = v
                        else:
                            out[layer, h, t0 + r - 1, d] = np.float32(anchor[d] + v) * st
        if esc != esc_end:
            return 10, j
    return 0, 0


@njit(cache=True, nogil=True, inline="always")
def _half(h: int) -> np.float32:  # pragma: no cover - numba
    """IEEE binary16 bits -> float32 (exact; callers exclude inf and NaN)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = m * 2.0**-24
    else:
        v = (1024 + m) * 2.0 ** (e - 25)
    return np.float32(-v if h & 0x8000 else v)


# ---------------------------------------------------------------------------------------
# int8 blocks, losslessly


def int8_codes_nbytes(heads: int, tokens: int, dim: int) -> int:
    """Bytes of an int8 block's codes (K's then V's ``[H, T, D]``), before its scales."""
    return 2 * heads * tokens * dim


def encode_int8_rows(
    rows: np.ndarray, heads: int, tokens: int, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """int8 blocks (uint8 ``[n, bytes]`` rows: ``2 * heads * tokens * dim`` codes, then
    their scales and zeros, kvtransport.codecs.quant.quantize_kv's layout) -> (the coded
    blocks back to back, uint8; each one's length, int64 ``[n]``), each in the int8
    layout (FORMAT_INT8, module docstring): :func:`decode_int8_rows` gives the rows back
    bit for bit."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    if rows.ndim != 2 or rows.shape[1] < int8_codes_nbytes(heads, tokens, dim) or rows.size < 1:
        raise ValueError(f"int8 rows {rows.shape} do not hold [{heads}, {tokens}, {dim}] blocks")
    return _encode_int8(rows, heads, tokens, dim)


@njit(cache=True, nogil=True)
def _encode_int8(
    rows: np.ndarray, heads: int, tokens: int, dim: int
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - numba
    n, width = rows.shape
    codes = 2 * heads * tokens * dim
    q = np.empty((tokens, dim), np.int16)
    rank = np.empty(dim, np.int16)
    vals = np.empty((2 * heads, tokens + 1, dim), np.int64)
    parts = []
    lengths = np.empty(n, np.int64)
    for j in range(n):
        for i in range(2 * heads):
            for t in range(tokens):
                for d in range(dim):
                    q[t, d] = rows[j, (i * tokens + t) * dim + d]
            _anchored(q, rank, vals[i])
            for d in range(dim):
                vals[i, 0, d] -= 128
        body = _entropy_encode(vals.reshape(-1))
        part = np.empty(1 + body.size + width - codes, np.uint8)
        part[0] = FORMAT_INT8
        part[1 : 1 + body.size] = body
        part[1 + body.size :] = rows[j, codes:]
        parts.append(part)
        lengths[j] = part.size
    out = np.empty(lengths.sum(), np.uint8)
    o = 0
    for j in range(n):
        out[o : o + lengths[j]] = parts[j]
        o += lengths[j]
    return out, lengths


def decode_int8_rows(
    buf: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    heads: int,
    tokens: int,
    dim: int,
    rows: np.ndarray,
) -> np.ndarray:
    """Decode coded int8 blocks (block ``j``: ``buf[offsets[j]:offsets[j] + lengths[j]]``)
    into ``rows`` (uint8 ``[n, bytes]``, the int8 layout's rows, written in place). Returns
    each block's status (int64 ``[n]``): 0 decoded, else the code of what did not hold
    (:func:`error_name`); a refused block's row is left unspecified. Raises ValueError for
    blocks outside ``buf`` or rows of the wrong shape."""
    offsets = np.asarray(offsets, np.int64)
    lengths = np.asarray(lengths, np.int64)
    width = int8_codes_nbytes(heads, tokens, dim)
    if offsets.shape != lengths.shape or rows.shape[0] != offsets.size:
        raise ValueError("one row per coded block")
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] < width:
        raise ValueError(f"rows must be uint8 [n, >= {width}]")
    if np.any(offsets < 0) or np.any(lengths < 0) or np.any(offsets + lengths > buf.size):
        raise ValueError("coded blocks outside the buffer")
    status = np.zeros(offsets.size, np.int64)
    _decode_int8(buf, offsets, lengths, heads, tokens, dim, rows, status)
    return status


def error_name(status: int) -> str:
    """What a non-zero decoding status means."""
    return _ERRORS.get(int(status), f"status {status}")


@njit(cache=True, nogil=True)
def _decode_int8(
    buf: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    heads: int,
    tokens: int,
    dim: int,
    rows: np.ndarray,
    status: np.ndarray,
) -> None:  # pragma: no cover - numba
    codes = 2 * heads * tokens * dim
    tail = rows.shape[1] - codes
    freq = np.zeros(256, np.int64)
    tab = np.empty(_TOTAL, np.int64)
    state = np.empty(LANES, np.int64)
    sym = np.empty(2 * heads * (tokens + 1) * dim, np.uint8)
    anchor = np.empty(dim, np.int64)
    for j in range(offsets.size):
        o = offsets[j]
        end = o + lengths[j] - tail  # the entropy-coded part ends where the tail begins
        if end < o + 1:
            status[j] = 1
            continue
        if buf[o] != FORMAT_INT8:
            status[j] = 2
            continue
        st, esc, esc_end = _entropy_decode(buf, o + 1, end, freq, tab, state, sym)
        if st:
            status[j] = st
            continue
        i = 0
        for half_head in range(2 * heads):
            for r in range(tokens + 1):
                for d in range(dim):
                    s = int(sym[i])
                    i += 1
                    zz = s
                    if s == ESCAPE:
                        zz, esc = _varint(buf, esc, esc_end)
                        if esc < 0 or zz > 1024:  # no int8 residual comes near
                            st = 8 if esc < 0 else 11
                            break
                    v = (zz >> 1) ^ -(zz & 1)
                    if r == 0:
                        v += 128
                        anchor[d] = v
                    else:
                        v += anchor[d]
                        rows[j, (half_head * tokens + r - 1) * dim + d] = v
                    if v < 0 or v > 255:
                        st = 11
                        break
                if st:
                    break
            if st:
                break
        if not st and esc != esc_end:
            st = 10
        status[j] = st
        if not st:
            rows[j, codes:] = buf[end : end + tail]


# ---------------------------------------------------------------------------------------
# Whole caches


def code_cache(
    keys: np.ndarray, values: np.ndarray, block_tokens: int, rel_step: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A cache ``[L, H, N, D]`` (K and V) through the codec, cut in blocks of
    ``block_tokens`` tokens per layer (the last of a layer may be shorter), each coded and
    decoded on its own: (keys, values) as the receiver decodes them (float32) and the coded
    bytes of every block ``[L, token blocks]``."""
    layers, heads, n, dim = keys.shape
    out_k = np.zeros((layers, heads, n, dim), np.float32)
    out_v = np.zeros_like(out_k)
    nb = -(-n // block_tokens)
    sizes = np.zeros((layers, nb), np.int64)
    for b in range(nb):
        lo, hi = b * block_tokens, min((b + 1) * block_tokens, n)
        kv = np.stack([keys[:, :, lo:hi], values[:, :, lo:hi]], axis=1)  # [L, 2, H, T, D]
        coded = encode_blocks(kv, rel_step)
        sizes[:, b] = [c.size for c in coded]
        buf = np.concatenate(coded)
        offsets = np.concatenate([[0], np.cumsum(sizes[:-1, b])])
        decode_blocks_into(buf, offsets, sizes[:, b], np.arange(layers), np.full(layers, lo),
                           hi - lo, out_k, out_v)  # fmt: skip
    return out_k, out_v, sizes
