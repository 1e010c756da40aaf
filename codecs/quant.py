"""KV-cache quantization: per-token group-wise int8/int4, and a mixed-precision allocator.

Quantization (asymmetric, KIVI/QKVShare style, but per token for both K and V): the last
axis (head_dim) of every token's head vector is cut into groups of ``group_size``
elements; each group gets its own ``scale`` and ``zero`` (its minimum), both stored as
float16 so that a group of 32 costs 4 extra bytes. Codes are unsigned,
``q = round((x - zero) / scale)`` in ``[0, 2**bits - 1]``; int4 codes are packed two per
byte (element ``2i`` in the low nibble, ``2i + 1`` in the high nibble).

The exact bound. ``zero`` is the group minimum rounded *down* to float16 and ``scale`` is
``(max - zero) / qmax`` rounded *up* to float16, so every element lies inside
``[zero, zero + qmax * scale]`` in exact arithmetic and its nearest code is never clipped.
Codes are computed in float64 (exact for float32/float16 inputs), hence the dequantized
value ``q * scale + zero`` is within ``scale / 2`` of ``x`` in exact arithmetic; producing it
as float32 adds at most half a float32 ulp of the result:
``|x - dequantize(quantize(x))| <= scale / 2 + spacing(|result|) / 2`` for every element.

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
    scales, zeros: float16 ``[..., head_dim // group_size]``.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    group_size: int

    @property
    def head_dim(self) -> int:
        return int(self.scales.shape[-1] * self.group_size)


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
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise ValueError("cannot quantize non-finite values")
    if lo.size and (lo.min() < -_F16_MAX or hi.max() > _F16_MAX):
        raise ValueError("values exceed the float16 range of scales and zero points")
    zeros = _f16_round(lo, up=False)
    z64 = zeros.astype(np.float64)
    scales = _f16_round((hi - z64) / qmax, up=True)
    # A constant group whose minimum is exactly representable needs no scale: any
    # positive value keeps its codes at 0 and the result exact.
    scales[scales == 0] = np.float16(1.0)
    codes = _group_codes(g, z64, scales.astype(np.float64), qmax, bits == 4)
    return Quantized(
        codes=codes.reshape(*lead, -1),
        scales=scales.reshape(*lead, groups),
        zeros=zeros.reshape(*lead, groups),
        bits=bits,
        group_size=group_size,
    )


def dequantize(q: Quantized, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Inverse of :func:`quantize`: ``codes * scale + zero`` per group, as ``dtype``."""
    codes = unpack_int4(q.codes) if q.bits == 4 else q.codes
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


@njit(cache=True, nogil=True)
def dequantize_blocks_into(
    buf: np.ndarray,
    offsets: np.ndarray,
    layers: np.ndarray,
    starts: np.ndarray,
    count: int,
    bits: int,
    group_size: int,
    keys: np.ndarray,
    values: np.ndarray,
) -> None:  # pragma: no cover - numba
    """Dequantize serialized blocks (kvtransport.model.blocks layout) straight into a cache.

    buf: uint8 stream; block ``j`` starts at ``offsets[j]``, holds ``count`` tokens of
    layer ``layers[j]`` from token ``starts[j]``: codes ``[2, H, count, D * bits / 8]``,
    then little-endian float16 scales and zeros ``[2, H, count, D / group_size]`` each.
    keys, values: float32 ``[L, H, N, D]``, written in place. One pass over the bytes, no
    temporaries; the arithmetic (float32 ``q * scale``, then ``+ zero``) is the same as
    :func:`dequantize`, so both give identical bits.
    """
    heads = keys.shape[1]
    dim = keys.shape[3]
    per_row = dim * bits // 8
    groups = dim // group_size
    n_codes = 2 * heads * count * per_row
    n_groups = 2 * heads * count * groups
    for j in range(offsets.size):
        o = offsets[j]
        so = o + n_codes
        zo = so + 2 * n_groups
        layer = layers[j]
        t0 = starts[j]
        for kv in range(2):
            out = keys if kv == 0 else values
            for h in range(heads):
                for t in range(count):
                    row = (kv * heads + h) * count + t
                    base = o + row * per_row
                    for g in range(groups):
                        gi = row * groups + g
                        sc = _half_to_float(buf[so + 2 * gi] | (buf[so + 2 * gi + 1] << 8))
                        zr = _half_to_float(buf[zo + 2 * gi] | (buf[zo + 2 * gi + 1] << 8))
                        for d in range(g * group_size, (g + 1) * group_size):
                            if bits == 8:
                                q = buf[base + d]
                            elif d % 2 == 0:
                                q = buf[base + d // 2] & 0x0F
                            else:
                                q = buf[base + d // 2] >> 4
                            out[layer, h, t0 + t, d] = np.float32(q) * sc + zr


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


def quantized_nbytes(num_elements: int, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes of codes plus float16 scales and zeros for ``num_elements`` values."""
    _check_bits(bits)
    groups = num_elements // group_size
    return num_elements * bits // 8 + 4 * groups


def to_bytes(q: Quantized) -> np.ndarray:
    """Serialize as uint8 rows: ``[leading..., codes | scales (LE f16) | zeros (LE f16)]``.

    The first axis is kept (one row per block), everything after it is flattened, so a
    stack of blocks becomes ``[blocks, bytes_per_block]`` in one vectorized step.
    """
    n = q.codes.shape[0]
    parts = [
        q.codes.reshape(n, -1),
        np.ascontiguousarray(q.scales, dtype="<f2").view(np.uint8).reshape(n, -1),
        np.ascontiguousarray(q.zeros, dtype="<f2").view(np.uint8).reshape(n, -1),
    ]
    return np.concatenate(parts, axis=1)


def from_bytes(
    rows: np.ndarray, shape: Sequence[int], bits: int, group_size: int = DEFAULT_GROUP_SIZE
) -> Quantized:
    """Inverse of :func:`to_bytes` for rows of blocks whose float shape is ``shape``."""
    _check_bits(bits)
    check_group(shape[-1], group_size)
    n = rows.shape[0]
    inner = tuple(shape[1:]) if len(shape) and shape[0] == n else tuple(shape)
    code_last = inner[-1] * bits // 8
    n_codes = int(np.prod(inner[:-1], dtype=np.int64)) * code_last
    n_groups = int(np.prod(inner[:-1], dtype=np.int64)) * (inner[-1] // group_size)
    if rows.shape[1] != n_codes + 4 * n_groups:
        raise ValueError(f"rows of {rows.shape[1]} bytes do not hold {inner} at {bits} bits")
    codes = rows[:, :n_codes].reshape(n, *inner[:-1], code_last)
    sz = rows[:, n_codes:].copy()  # contiguous so the float16 view is aligned
    scales = sz[:, : 2 * n_groups].view("<f2").reshape(n, *inner[:-1], -1)
    zeros = sz[:, 2 * n_groups :].view("<f2").reshape(n, *inner[:-1], -1)
    return Quantized(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=group_size)


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
