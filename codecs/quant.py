"""KV-cache quantization: group-wise int8/int4, keys per channel, and a mixed-precision allocator.

Quantization (asymmetric): the last axis (head_dim) of every token's head vector is cut
into groups of ``group_size`` elements; each group gets its own ``scale`` and ``zero``
(its minimum), both stored as float16 so that a group of 32 costs 4 extra bytes. Codes
are unsigned, ``q = round((x - zero) / scale)`` in ``[0, 2**bits - 1]``; int4 codes are
packed two per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high nibble).
:func:`quantize_channels` groups the other way (KIVI's keys): one scale and zero per
channel (head_dim position) over a block's tokens, because a key cache's outliers sit in
a few fixed channels, which per-token groups must stretch over every other value (on
SmolLM2 at int4 this cuts the answer's KL to the full cache 2.7-fold: docs/results.md,
"int4 keys per channel"). The codes keep the token-major layout either way.

The exact bound. ``zero`` is the group minimum rounded *down* to float16 and ``scale`` is
``(max - zero) / qmax`` rounded *up* to float16, so every element lies inside
``[zero, zero + qmax * scale]`` in exact arithmetic and its nearest code is never clipped.
Codes are computed in float64 (exact for float32/float16 inputs), hence the dequantized
value ``q * scale + zero`` is within ``scale / 2`` of ``x`` in exact arithmetic; producing it
as float32 adds at most half a float32 ulp of the result:
``|x - dequantize(quantize(x))| <= scale / 2 + spacing(|result|) / 2`` for every element.

A quantized KV block (:func:`quantize_kv`, the layout kvtransport.kvformat.blocks sends):
codes of ``[2, H, T, D]`` (K then V), then the float16 scales of K then V, then their
zeros; K's scales are ``[H, T, D / G]`` per token, or ``[H, D]`` with keys per channel.

Mixed precision (the QKVShare way): given each block's utility and a byte budget, choose
each block's precision among fp16 / int8 / int4 / dropped so the kept utility is maximal;
see :func:`allocate_precision` for the objective and why greedy is the right solver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

DEFAULT_GROUP_SIZE = 32
_F16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Quantized:
    """Quantized tensor: codes plus one float16 scale and zero point per group.

    codes: uint8, ``[..., head_dim]`` for 8 bits, ``[..., head_dim // 2]`` packed for 4 bits.
    scales, zeros: float16 ``[..., head_dim // group_size]``; per channel
    (:func:`quantize_channels`, ``group_size`` 0) ``[..., 1, head_dim]``, one per position
    of the last axis over the second-to-last.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    group_size: int

    @property
    def per_channel(self) -> bool:
        return self.group_size == 0


def _check_bits(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    return (1 << bits) - 1


def check_group(last_dim: int, group_size: int, name: str = "group_size") -> None:
    """Raise ValueError (naming the value ``name``) unless ``group_size`` is a positive
    even divisor of ``last_dim``: the values that share a scale and zero tile the last
    axis, in pairs for int4's packing."""
    if group_size <= 0 or group_size % 2 or last_dim % group_size:
        raise ValueError(
            f"{name} {group_size} must be a positive even divisor of the last axis ({last_dim})"
        )


def _f16_round(x: np.ndarray, up: bool) -> np.ndarray:
    """Round float64 ``x`` to float16, toward +inf if ``up`` else toward -inf."""
    h = x.astype(np.float16)
    back = h.astype(np.float64)
    wrong = back < x if up else back > x
    if np.any(wrong):
        target = np.float16(np.inf) if up else np.float16(-np.inf)
        h[wrong] = np.nextafter(h[wrong], target)
    return h


@njit(cache=True, nogil=True)
def _group_min_max(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    n = g.shape[0]
    lo = np.empty(n, np.float64)
    hi = np.empty(n, np.float64)
    for i in range(n):
        a = g[i, 0]
        b = g[i, 0]
        for j in range(1, g.shape[1]):
            v = g[i, j]
            if v < a:
                a = v
            if v > b:
                b = v
        lo[i] = a
        hi[i] = b
    return lo, hi


@njit(cache=True, nogil=True)
def _group_codes(
    g: np.ndarray, zeros: np.ndarray, scales: np.ndarray, qmax: int, pack: bool
) -> np.ndarray:  # pragma: no cover
    n, gs = g.shape
    out = np.empty((n, gs // 2 if pack else gs), np.uint8)
    for i in range(n):
        z = zeros[i]
        s = scales[i]
        for j in range(gs):
            q = np.rint((np.float64(g[i, j]) - z) / s)
            q = min(max(q, 0.0), float(qmax))
            c = np.uint8(q)
            if pack:
                if j % 2 == 0:
                    out[i, j // 2] = c
                else:
                    out[i, j // 2] |= c << 4
            else:
                out[i, j] = c
    return out


def _scales_zeros(lo: np.ndarray, hi: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 (scales, zeros) of groups spanning ``[lo, hi]`` (float64): the exact bound's
    rounding (module docstring). Raises ValueError for non-finite values or values beyond
    float16's range."""
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise ValueError("cannot quantize non-finite values")
    if lo.size and (lo.min() < -_F16_MAX or hi.max() > _F16_MAX):
        raise ValueError("values exceed the float16 range of scales and zero points")
    zeros = _f16_round(lo, up=False)
    scales = _f16_round((hi - zeros.astype(np.float64)) / qmax, up=True)
    # A constant group whose minimum is exactly representable needs no scale: any
    # positive value keeps its codes at 0 and the result exact.
    scales[scales == 0] = np.float16(1.0)
    return scales, zeros


def quantize(x: np.ndarray, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> Quantized:
    """Quantize ``x`` (float16/32, any leading shape) group-wise along its last axis.

    Raises ValueError when values are not finite or exceed the float16 range (scales and
    zero points are float16, as in every fp16 KV cache). The per-element work is two
    numba passes (min/max, codes) in float64 without temporaries; the per-group float16
    rounding is numpy.
    """
    qmax = _check_bits(bits)
    check_group(x.shape[-1], group_size)
    lead = x.shape[:-1]
    groups = x.shape[-1] // group_size
    g = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, group_size)
    lo, hi = _group_min_max(g) if g.shape[0] else (np.zeros(0), np.zeros(0))
    scales, zeros = _scales_zeros(lo, hi, qmax)
    codes = _group_codes(g, zeros.astype(np.float64), scales.astype(np.float64), qmax, bits == 4)
    return Quantized(
        codes=codes.reshape(*lead, -1),
        scales=scales.reshape(*lead, groups),
        zeros=zeros.reshape(*lead, groups),
        bits=bits,
        group_size=group_size,
    )


def quantize_channels(x: np.ndarray, bits: int) -> Quantized:
    """Quantize ``x`` ``[..., T, D]`` (float16/32) per channel: each of the last axis's D
    positions gets one scale and zero over the T rows of the second-to-last axis (a
    block's tokens). Codes keep ``x``'s layout (int4 packed along D, which must be even);
    the exact bound and the errors are :func:`quantize`'s."""
    qmax = _check_bits(bits)
    if x.ndim < 2 or x.shape[-2] < 1 or (bits == 4 and x.shape[-1] % 2):
        raise ValueError(f"per-channel int{bits} needs [..., tokens, even channels], not {x.shape}")
    *lead, t, d = x.shape
    g = np.ascontiguousarray(np.swapaxes(x, -1, -2), dtype=np.float32).reshape(-1, t)
    lo, hi = _group_min_max(g) if g.shape[0] else (np.zeros(0), np.zeros(0))
    scales, zeros = _scales_zeros(lo, hi, qmax)
    codes = _group_codes(g, zeros.astype(np.float64), scales.astype(np.float64), qmax, False)
    codes = np.ascontiguousarray(np.swapaxes(codes.reshape(*lead, d, t), -1, -2))
    return Quantized(
        codes=pack_int4(codes) if bits == 4 else codes,
        scales=scales.reshape(*lead, 1, d),
        zeros=zeros.reshape(*lead, 1, d),
        bits=bits,
        group_size=0,
    )


def dequantize(q: Quantized, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Inverse of :func:`quantize` and :func:`quantize_channels`: ``codes * scale + zero``
    per group, as ``dtype``."""
    codes = unpack_int4(q.codes) if q.bits == 4 else q.codes
    if q.per_channel:
        out = codes.astype(np.float32) * q.scales.astype(np.float32)
        out += q.zeros.astype(np.float32)
        return out.astype(dtype, copy=False)
    shape = codes.shape
    g = codes.reshape(*shape[:-1], shape[-1] // q.group_size, q.group_size)
    out = g.astype(np.float32) * q.scales.astype(np.float32)[..., None]
    out += q.zeros.astype(np.float32)[..., None]
    return out.reshape(shape).astype(dtype, copy=False)


@njit(cache=True, nogil=True, inline="always")
def _half_to_float(h: int) -> np.float32:  # pragma: no cover - numba
    """IEEE binary16 bits -> float32 (exact)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = m * 2.0**-24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = (1024 + m) * 2.0 ** (e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True, nogil=True, inline="always")
def _half_at(buf: np.ndarray, at: int) -> np.float32:  # pragma: no cover - numba
    """The little-endian float16 at byte ``at`` of ``buf``, as float32."""
    return _half_to_float(buf[at] | (buf[at + 1] << 8))


@njit(cache=True, nogil=True, inline="always")
def _code(buf: np.ndarray, base: int, d: int, bits: int) -> np.float32:  # pragma: no cover
    """Element ``d``'s code of the code row at byte ``base``."""
    if bits == 8:
        return np.float32(buf[base + d])
    if d % 2 == 0:
        return np.float32(buf[base + d // 2] & 0x0F)
    return np.float32(buf[base + d // 2] >> 4)


@njit(cache=True, nogil=True)
def dequantize_blocks_into(
    buf: np.ndarray,
    offsets: np.ndarray,
    layers: np.ndarray,
    starts: np.ndarray,
    count: int,
    bits: int,
    group_size: int,
    channel_keys: bool,
    keys: np.ndarray,
    values: np.ndarray,
) -> None:  # pragma: no cover - numba
    """Dequantize serialized blocks (:func:`quantize_kv`'s layout) straight into a cache:
    :func:`dequantize_mixed_blocks_into` with K and V at the same bits and group."""
    dequantize_mixed_blocks_into(buf, offsets, layers, starts, count, bits, group_size,
                                 channel_keys, bits, group_size, keys, values)  # fmt: skip


@njit(cache=True, nogil=True)
def dequantize_mixed_blocks_into(
    buf: np.ndarray,
    offsets: np.ndarray,
    layers: np.ndarray,
    starts: np.ndarray,
    count: int,
    k_bits: int,
    k_group: int,
    channel_keys: bool,
    v_bits: int,
    v_group: int,
    keys: np.ndarray,
    values: np.ndarray,
) -> None:  # pragma: no cover - numba
    """Dequantize serialized blocks (:func:`quantize_kv_mixed`'s layout) straight into a
    cache.

    buf: uint8 stream; block ``j`` starts at ``offsets[j]``, holds ``count`` tokens of
    layer ``layers[j]`` from token ``starts[j]``: K's codes ``[H, count, D * k_bits / 8]``,
    V's ``[H, count, D * v_bits / 8]``, then little-endian float16 scales and zeros, each
    K's (``[H, count, D / k_group]``, or ``[H, D]`` with ``channel_keys``) then V's
    ``[H, count, D / v_group]``.
    keys, values: float32 ``[L, H, N, D]``, written in place. One pass over the bytes, no
    temporaries beyond one head's channel scales; the arithmetic (float32 ``q * scale``,
    then ``+ zero``) is the same as :func:`dequantize`, so both give identical bits.
    """
    heads = keys.shape[1]
    dim = keys.shape[3]
    k_row = dim * k_bits // 8
    v_row = dim * v_bits // 8
    k_groups_tok = dim // k_group
    v_groups_tok = dim // v_group
    n_codes = heads * count * (k_row + v_row)
    v_groups = heads * count * v_groups_tok
    k_groups = heads * dim if channel_keys else heads * count * k_groups_tok
    n_groups = k_groups + v_groups
    ch_scale = np.empty(dim, np.float32)
    ch_zero = np.empty(dim, np.float32)
    for j in range(offsets.size):
        o = offsets[j]
        so = o + n_codes
        zo = so + 2 * n_groups
        layer = layers[j]
        t0 = starts[j]
        for kv in range(2):
            out = keys if kv == 0 else values
            first = 0 if kv == 0 else k_groups  # this half's first group
            bits = k_bits if kv == 0 else v_bits
            per_row = k_row if kv == 0 else v_row
            gsize = k_group if kv == 0 else v_group
            groups = k_groups_tok if kv == 0 else v_groups_tok
            codes0 = o if kv == 0 else o + heads * count * k_row
            for h in range(heads):
                if kv == 0 and channel_keys:
                    for d in range(dim):
                        ch_scale[d] = _half_at(buf, so + 2 * (h * dim + d))
                        ch_zero[d] = _half_at(buf, zo + 2 * (h * dim + d))
                    for t in range(count):
                        base = codes0 + (h * count + t) * per_row
                        for d in range(dim):
                            q = _code(buf, base, d, bits)
                            out[layer, h, t0 + t, d] = q * ch_scale[d] + ch_zero[d]
                    continue
                for t in range(count):
                    base = codes0 + (h * count + t) * per_row
                    for g in range(groups):
                        gi = first + (h * count + t) * groups + g
                        sc = _half_at(buf, so + 2 * gi)
                        zr = _half_at(buf, zo + 2 * gi)
                        for d in range(g * gsize, (g + 1) * gsize):
                            out[layer, h, t0 + t, d] = _code(buf, base, d, bits) * sc + zr


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes (uint8 values 0..15) two per byte along the last axis."""
    if codes.shape[-1] % 2:
        raise ValueError("int4 packing needs an even last axis")
    return (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_int4`."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def kv_nbytes(
    heads: int, tokens: int, dim: int, bits: int, group_size: int, channel_keys: bool
) -> int:
    """Bytes of one quantized KV block (:func:`quantize_kv`): codes plus float16 scales and
    zeros, K's per channel when ``channel_keys``."""
    return kv_nbytes_mixed(heads, tokens, dim, bits, group_size, channel_keys, bits, group_size)


def kv_nbytes_mixed(
    heads: int, tokens: int, dim: int, k_bits: int, k_group: int, channel_keys: bool,
    v_bits: int, v_group: int,
) -> int:  # fmt: skip
    """Bytes of one KV block with K and V at their own bits and groups
    (:func:`quantize_kv_mixed`)."""
    _check_bits(k_bits)
    _check_bits(v_bits)
    k_groups = heads * dim if channel_keys else heads * tokens * (dim // k_group)
    v_groups = heads * tokens * (dim // v_group)
    codes = heads * tokens * dim * (k_bits + v_bits) // 8
    return codes + 4 * (k_groups + v_groups)


def quantize_kv(kv: np.ndarray, bits: int, group_size: int, channel_keys: bool) -> np.ndarray:
    """``[n, 2, H, T, D]`` float blocks (K then V) -> ``[n, bytes]`` uint8 rows in the KV
    block layout (module docstring): V in groups of ``group_size`` per token, K the same
    or, with ``channel_keys``, per channel over the block's T tokens."""
    return quantize_kv_mixed(kv, bits, group_size, channel_keys, bits, group_size)


def quantize_kv_mixed(
    kv: np.ndarray, k_bits: int, k_group: int, channel_keys: bool, v_bits: int, v_group: int
) -> np.ndarray:
    """:func:`quantize_kv` with K at ``k_bits`` in groups of ``k_group`` (or per channel
    with ``channel_keys``) and V at ``v_bits`` in groups of ``v_group`` per token (keys int8
    with values int4 is kvtransport.kvformat.blocks' ``k8v4``). The layout is
    :func:`quantize_kv`'s: K's codes, V's codes, K's and V's scales, K's and V's zeros."""
    keys = kv[:, 0]
    if channel_keys:
        k = quantize_channels(keys, k_bits)
    else:
        k = quantize(keys, k_bits, k_group)
    v = quantize(kv[:, 1], v_bits, v_group)
    n = kv.shape[0]

    def f16(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype="<f2").view(np.uint8).reshape(n, -1)

    parts = [k.codes.reshape(n, -1), v.codes.reshape(n, -1)]
    parts += [f16(k.scales), f16(v.scales), f16(k.zeros), f16(v.zeros)]
    return np.concatenate(parts, axis=1)


def dequantize_kv(
    rows: np.ndarray,
    shape: Sequence[int],
    bits: int,
    group_size: int,
    channel_keys: bool,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """Inverse of :func:`quantize_kv`: rows -> ``shape`` ``[n, 2, H, T, D]`` as ``dtype``.
    Rows of the wrong size raise ValueError."""
    return dequantize_kv_mixed(rows, shape, bits, group_size, channel_keys, bits, group_size,
                               dtype)  # fmt: skip


def dequantize_kv_mixed(
    rows: np.ndarray,
    shape: Sequence[int],
    k_bits: int,
    k_group: int,
    channel_keys: bool,
    v_bits: int,
    v_group: int,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """Inverse of :func:`quantize_kv_mixed`: rows -> ``shape`` ``[n, 2, H, T, D]`` as
    ``dtype``. Rows of the wrong size raise ValueError."""
    n, _, heads, tokens, dim = shape
    check_group(dim, k_group)
    check_group(dim, v_group)
    size = kv_nbytes_mixed(heads, tokens, dim, k_bits, k_group, channel_keys, v_bits, v_group)
    if rows.shape != (n, size):
        raise ValueError(f"rows {rows.shape} do not hold {tuple(shape)} at {k_bits}/{v_bits} bits")
    k_codes = heads * tokens * dim * k_bits // 8
    v_codes = heads * tokens * dim * v_bits // 8
    kc = rows[:, :k_codes].reshape(n, heads, tokens, dim * k_bits // 8)
    vc = rows[:, k_codes : k_codes + v_codes].reshape(n, heads, tokens, dim * v_bits // 8)
    halves = rows[:, k_codes + v_codes :].copy().view("<f2")  # contiguous: the view is aligned
    v_shape: tuple[int, ...] = (n, heads, tokens, dim // v_group)
    k_shape = (n, heads, 1, dim) if channel_keys else (n, heads, tokens, dim // k_group)
    k_n, v_n = int(np.prod(k_shape[1:])), int(np.prod(v_shape[1:]))
    k_scales, v_scales, k_zeros, v_zeros = np.split(halves, np.cumsum([k_n, v_n, k_n])[:3], axis=1)
    k_scales, k_zeros = k_scales.reshape(k_shape), k_zeros.reshape(k_shape)
    v_scales, v_zeros = v_scales.reshape(v_shape), v_zeros.reshape(v_shape)
    k = Quantized(kc, k_scales, k_zeros, k_bits, 0 if channel_keys else k_group)
    v = Quantized(vc, v_scales, v_zeros, v_bits, v_group)
    return np.stack([dequantize(k, dtype), dequantize(v, dtype)], axis=1)


# ---------------------------------------------------------------------------------------
# Mixed precision


@dataclass(frozen=True)
class Allocation:
    """Result of :func:`allocate_precision`.

    level: ``[blocks]`` index into the given levels, -1 for a dropped block.
    nbytes: total bytes of the chosen blocks (<= budget).
    kept_utility: ``sum(utility * fidelity[level])`` over kept blocks.
    """

    level: np.ndarray
    nbytes: int
    kept_utility: float


def allocate_precision(
    utility: np.ndarray,
    cost: np.ndarray,
    fidelity: np.ndarray,
    budget: int,
) -> Allocation:
    """Choose one precision level per block (or drop it) under a byte budget.

    ``utility``: ``[n]`` block utilities. ``cost``: ``[n, k]`` bytes of each block at each
    level. ``fidelity``: ``[k]`` or ``[n, k]``, the share of a block's utility that survives
    at that level (1 for lossless). A block kept at level ``j`` is worth
    ``utility * fidelity[j]``; a dropped block costs 0 and is worth 0. The objective is
    the total kept utility, ``sum_i utility_i * fidelity[level_i]``, subject to the
    total cost staying within ``budget``.

    This is a multiple-choice knapsack. Greedy on each block's upper convex hull
    (successive upgrades sorted by marginal utility per marginal byte) solves its LP
    relaxation exactly, and the integral answer it returns loses at most one upgrade
    against the true optimum; blocks are small against any useful budget (one block is
    ~0.01-0.1% of a cache), so that gap is negligible while a DP over bytes would cost
    ``O(n * budget)``. A final pass spends leftover bytes on the best upgrades that still
    fit. Ties go to the higher-utility block, then to the lower index (deterministic).
    """
    utility = np.asarray(utility, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.int64)
    n, k = cost.shape
    fid = np.broadcast_to(np.asarray(fidelity, dtype=np.float64), (n, k))
    value = utility[:, None] * fid
    # Options per block: "dropped" (0, 0) plus each level; build the upper convex hull of
    # (cost, value) from the origin, levels taken by increasing cost (k is 3: fp16, int8,
    # int4). Python loops over blocks: ~0.1 s for the 7680 blocks of a 4K-token cache.
    by_cost = np.argsort(cost, axis=1, kind="stable")
    c_sorted = np.take_along_axis(cost, by_cost, axis=1)
    v_sorted = np.take_along_axis(value, by_cost, axis=1)
    steps = []  # (block, level, d_cost, d_value) of hull upgrades, in per-block order
    for i in range(n):
        hull_c, hull_v, hull_l = [0], [0.0], [-1]
        for j in range(k):
            c, v = int(c_sorted[i, j]), float(v_sorted[i, j])
            if v <= hull_v[-1]:
                continue  # dominated: costs more, worth no more
            while len(hull_c) >= 2:
                # pop the last point if it lies on/below the chord to the new point
                c1, v1, c0, v0 = hull_c[-1], hull_v[-1], hull_c[-2], hull_v[-2]
                if (v1 - v0) * (c - c0) <= (v - v0) * (c1 - c0):
                    hull_c.pop(), hull_v.pop(), hull_l.pop()
                else:
                    break
            hull_c.append(c)
            hull_v.append(v)
            hull_l.append(int(by_cost[i, j]))
        for a in range(1, len(hull_c)):
            steps.append((i, hull_l[a], hull_c[a] - hull_c[a - 1], hull_v[a] - hull_v[a - 1]))
    level = np.full(n, -1, dtype=np.int64)
    if not steps:
        return Allocation(level=level, nbytes=0, kept_utility=0.0)
    blk = np.array([s[0] for s in steps], dtype=np.int64)
    lvl = np.array([s[1] for s in steps], dtype=np.int64)
    dc = np.array([s[2] for s in steps], dtype=np.int64)
    dv = np.array([s[3] for s in steps], dtype=np.float64)
    ratio = np.where(dc > 0, dv / np.maximum(dc, 1), np.inf)
    # Hull ratios fall along each block's steps, so this global order respects every
    # block's upgrade sequence; the stable sort keeps a block's own steps in order.
    order = np.lexsort((blk, -utility[blk], -ratio))
    spent = 0
    taken = np.zeros(n, dtype=np.int64)  # hull steps taken per block
    step_no = np.zeros(len(steps), dtype=np.int64)
    starts = np.r_[0, np.flatnonzero(np.diff(blk)) + 1]
    step_no[:] = np.arange(len(steps)) - np.repeat(starts, np.diff(np.r_[starts, len(steps)]))
    for s in order:  # one pass: take every upgrade that fits and whose predecessor is taken
        i = blk[s]
        if taken[i] != step_no[s] or spent + dc[s] > budget:
            continue
        spent += int(dc[s])
        taken[i] += 1
        level[i] = lvl[s]
    kept = np.flatnonzero(level >= 0)
    kept_utility = float(np.sum(value[kept, level[kept]]))
    nbytes = int(np.sum(cost[kept, level[kept]]))
    return Allocation(level=level, nbytes=nbytes, kept_utility=kept_utility)
