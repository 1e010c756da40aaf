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

Decoding untrusted bytes (a forged or truncated block) never reads outside the block:
every length, frequency and state is checked, and a stream whose states do not end where
the encoder began, or that leaves bytes unread, is refused (:class:`CodecError`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

FORMAT = 1
"""The coded layout's format byte."""
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
    x = np.asarray(kv, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot code non-finite values")
    rms = np.sqrt(np.mean(x * x, axis=(3, 4)))  # [n, 2, H]
    step = rms * rel[None, :, None]
    if np.any(step > _F16_MAX):
        raise ValueError("values too large for a float16 step")
    h = step.astype(np.float16)
    low = h.astype(np.float64) < step
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    h[h == 0] = np.float16(1.0)
    return h


def encode_blocks(kv: np.ndarray, rel_step: tuple[float, float]) -> list[np.ndarray]:
    """``[n, 2, H, T, D]`` float blocks -> n coded blocks (uint8 arrays, the module's
    layout); ``rel_step``: the (K, V) quantization step relative to each head's RMS."""
    kv = np.ascontiguousarray(kv, dtype=np.float32)
    if kv.ndim != 5 or kv.shape[1] != 2 or min(kv.shape[2:]) < 1:
        raise ValueError(f"blocks must be [n, 2, heads, tokens, dim], not {kv.shape}")
    steps = steps_of(kv, rel_step)
    out = []
    for j in range(kv.shape[0]):
        codes = _codes(kv[j], steps[j].astype(np.float32))
        if np.any(np.abs(codes) > MAX_CODE):
            raise ValueError("values too large against their step")
        out.append(_encode_codes(codes, steps[j]))
    return out


@njit(cache=True, nogil=True)
def _codes(x: np.ndarray, steps: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """``[2, H, T, D]`` -> int64 ``[2, H, T + 1, D]``: row 0 the per-channel anchors (the
    median code), rows 1.. each token's code less its channel's anchor."""
    two, heads, tokens, dim = x.shape
    out = np.empty((two, heads, tokens + 1, dim), np.int64)
    col = np.empty(tokens, np.int64)
    for s in range(two):
        for h in range(heads):
            st = np.float64(steps[s, h])
            for d in range(dim):
                for t in range(tokens):
                    col[t] = np.int64(np.rint(np.float64(x[s, h, t, d]) / st))
                srt = np.sort(col)
                anchor = srt[(tokens - 1) // 2]
                out[s, h, 0, d] = anchor
                for t in range(tokens):
                    out[s, h, t + 1, d] = col[t] - anchor
    return out


def _encode_codes(codes: np.ndarray, steps: np.ndarray) -> np.ndarray:
    zz = _zigzag(codes.reshape(-1))
    sym = np.minimum(zz, ESCAPE).astype(np.uint8)
    escapes = _varints(zz[zz >= ESCAPE])
    freq = normalized_frequencies(np.bincount(sym, minlength=256))
    last = int(np.flatnonzero(freq)[-1])
    table = _varints(freq[: last + 1].astype(np.uint64))
    rans = _rans_encode(sym, freq.astype(np.int64))
    head = np.ascontiguousarray(steps.reshape(-1), dtype="<f2").view(np.uint8)
    lens = np.array([escapes.size, rans.size], dtype="<u4").view(np.uint8)
    return np.concatenate([np.array([FORMAT, *head, last], np.uint8), table, lens, escapes, rans])


def _zigzag(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.int64)
    return ((v << 1) ^ (v >> 63)).astype(np.uint64)


def _varints(values: np.ndarray) -> np.ndarray:
    """LEB128 of every value, back to back."""
    out = bytearray()
    for v in values.tolist():
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return np.frombuffer(bytes(out), np.uint8)


def normalized_frequencies(counts: np.ndarray) -> np.ndarray:
    """Counts of 256 symbols -> frequencies summing to ``2**SCALE_BITS``, every counted
    symbol at least 1, each within one rounding of its share (the largest ones absorb
    the rest)."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        raise ValueError("no symbols to count")
    freq = np.where(counts > 0, np.maximum(1, (counts * _TOTAL + n // 2) // n), 0)
    excess = int(freq.sum()) - _TOTAL
    while excess:
        i = int(np.argmax(freq))
        if excess < 0:
            freq[i] -= excess
            break
        take = min(excess, int(freq[i]) - 1)
        freq[i] -= take
        excess -= take
    return freq


@njit(cache=True, nogil=True)
def _rans_encode(sym: np.ndarray, freq: np.ndarray) -> np.ndarray:  # pragma: no cover
    """Interleaved rANS of ``sym`` (uint8) under ``freq`` (summing to 2**SCALE_BITS): the
    LANES final states (u32 little-endian) then the bytes, in decoding order."""
    cum = np.zeros(257, np.int64)
    for s in range(256):
        cum[s + 1] = cum[s] + freq[s]
    n = sym.size
    cap = n * 4 + 64
    buf = np.empty(cap, np.uint8)
    pos = cap
    state = np.full(LANES, _RANS_L, np.int64)
    for i in range(n - 1, -1, -1):
        lane = i & (LANES - 1)
        s = sym[i]
        f = freq[s]
        x = state[lane]
        if x >= ((_RANS_L >> SCALE_BITS) << 16) * f:  # one 16-bit word out
            pos -= 2
            buf[pos] = x & 0xFF
            buf[pos + 1] = (x >> 8) & 0xFF
            x >>= 16
        state[lane] = ((x // f) << SCALE_BITS) + (x % f) + cum[s]
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
    n = 2 * heads * (count + 1) * dim
    sym = np.empty(n, np.uint8)
    for j in range(offsets.size):
        o = offsets[j]
        end = o + lengths[j]
        pos = o + 1 + 4 * heads
        if pos + 1 > end:
            return 1, j
        if buf[o] != FORMAT:
            return 2, j
        for i in range(2 * heads):
            h = buf[o + 1 + 2 * i] | (buf[o + 2 + 2 * i] << 8)
            if (h >> 10) & 0x1F == 31 or h & 0x8000 or h & 0x7FFF == 0:
                return 3, j  # not finite, negative or zero
            steps[i] = _half(h)
        top = buf[pos]
        pos += 1
        total = 0
        freq[:] = 0
        for s in range(top + 1):
            f, pos = _varint(buf, pos, end)
            if pos < 0:
                return 1, j
            if f > _TOTAL:
                return 4, j
            freq[s] = f
            total += f
        if total != _TOTAL:
            return 4, j
        c = 0
        for s in range(256):
            for k in range(freq[s]):
                tab[c + k] = ((freq[s] - 1) << 20) | (k << 8) | s
            c += freq[s]
        if pos + 8 > end:
            return 1, j
        e_len = 0
        r_len = 0
        for b in range(4):
            e_len |= int(buf[pos + b]) << (8 * b)
            r_len |= int(buf[pos + 4 + b]) << (8 * b)
        pos += 8
        if e_len + r_len != end - pos:
            return 5, j
        esc = pos
        esc_end = pos + e_len
        rp = esc_end
        if r_len < 4 * LANES or r_len % 2:
            return 5, j
        for lane in range(LANES):
            x = 0
            for b in range(4):
                x = (x << 8) | buf[rp + b]
            rp += 4
            if x < _RANS_L:
                return 6, j
            state[lane] = x
        rp = _rans_run(tab, buf, state, rp, end - 2, sym)
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
        if rp > end:
            return 7, j
        for lane in range(LANES):
            if state[lane] != _RANS_L:
                return 9, j
        if rp != end or esc != esc_end:
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
