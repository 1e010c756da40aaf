"""GF(2^8) arithmetic for the RFC 8681 sliding-window RLC codec.

The field is the one RFC 8681 (section 3.2 and RFC 5510) prescribes for m=8: polynomial basis
over the primitive polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11D), generator alpha = 2.

Scalar operations (``gf_mul``, ``gf_inv``, ``gf_div``) use log/exp tables. Region operations
over numpy ``uint8`` arrays are the hot loops of the encoder and decoder and use a bit-sliced
kernel: multiplying by a constant c is GF(2)-linear, so

    c * x = XOR over the set bits i of x of (c * 2^i).

Eight bytes are processed at once in a ``uint64`` lane: ``(v >> i) & 0x0101..01`` puts bit i
of every byte into the low bit of that byte, and multiplying that lane by the single byte
``c * 2^i`` (an integer product with no carries, since each byte is 0 or 1 and the constant
is below 256) spreads the constant into exactly the bytes whose bit i was set. The loop has no
table lookups, so LLVM vectorizes it (AVX2/AVX-512 on x86). The 256x256 multiplication table
(``region_muladd_table``) is kept as the slow baseline the benchmark compares against and as a
test oracle.

All region kernels are ``@njit(cache=True, nogil=True)`` and accept 1-D C-contiguous ``uint8``
arrays (any alignment); they process ``min(len(dst), len(src))`` bytes, so a size mismatch can
never write out of bounds. Callers that care about lengths check them before calling.

The uint64 lanes come from ``as_words``, a numba intrinsic that reinterprets a contiguous uint8
array as its whole 8-byte words at no cost. numba's own ``ndarray.view`` costs about 60 ns per
call, which is more than multiplying a 1280-byte symbol takes (about 40 ns), and the decoder
makes many such calls per packet.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

POLY = 0x11D
"""x^8 + x^4 + x^3 + x^2 + 1, the RFC 8681 / RFC 5510 field polynomial for m=8."""


def _build_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Exp/log, full multiplication, inverse and bit-slice tables (built once at import)."""
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    exp[255:510] = exp[0:255]
    exp[510:512] = exp[0:2]
    # Product table through logs: a*b = exp[log a + log b] for a, b != 0.
    nz = np.arange(1, 256)
    mul = np.zeros((256, 256), dtype=np.uint8)
    mul[1:, 1:] = exp[(log[nz][:, None] + log[nz][None, :])]
    inv = np.zeros(256, dtype=np.uint8)
    inv[1:] = exp[(255 - log[nz]) % 255]
    # BITSLICE[c, i] = c * 2^i: the constant XOR-ed into a byte whose bit i is set.
    bitslice = mul[:, [1 << i for i in range(8)]].astype(np.uint64)
    return exp, log, mul, inv, bitslice


EXP_TABLE, LOG_TABLE, MUL_TABLE, INV_TABLE, BITSLICE_TABLE = _build_tables()

_LSB = np.uint64(0x0101010101010101)
_S1 = np.uint64(1)
_S2 = np.uint64(2)
_S3 = np.uint64(3)
_S4 = np.uint64(4)
_S5 = np.uint64(5)
_S6 = np.uint64(6)
_S7 = np.uint64(7)


@intrinsic
def as_words(typingctx, arr):  # noqa: ANN001, ANN201 (numba typing signature)
    """``arr`` (1-D C-contiguous uint8) seen as its ``len(arr) // 8`` whole uint64 words.

    Callable from numba code only. The view shares memory (and ownership) with ``arr``;
    unaligned addresses are fine on the targets numba supports for this (x86-64, AArch64).
    """
    if not (
        isinstance(arr, types.Array)
        and arr.ndim == 1
        and arr.dtype == types.uint8
        and arr.layout == "C"
    ):
        return None
    sig = types.Array(types.uint64, 1, "C", readonly=not arr.mutable)(arr)

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        src = make_array(sig.args[0])(context, builder, args[0])
        dst = make_array(sig.return_type)(context, builder)
        intp = context.get_value_type(types.intp)
        nbytes = builder.extract_value(src.shape, 0)
        populate_array(
            dst,
            data=builder.bitcast(src.data, dst.data.type),
            shape=[builder.ashr(nbytes, ir.Constant(intp, 3))],
            strides=[ir.Constant(intp, 8)],
            itemsize=ir.Constant(intp, 8),
            meminfo=src.meminfo,
            parent=src.parent,
        )
        return impl_ret_borrowed(context, builder, sig.return_type, dst._getvalue())

    return sig, codegen


@njit(cache=True, nogil=True)
def gf_mul(a: int, b: int) -> int:
    """Product of two field elements (ints in 0..255)."""
    if a == 0 or b == 0:
        return 0
    return int(EXP_TABLE[LOG_TABLE[a] + LOG_TABLE[b]])


@njit(cache=True, nogil=True)
def gf_inv(a: int) -> int:
    """Multiplicative inverse; raises ZeroDivisionError for 0."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(INV_TABLE[a])


@njit(cache=True, nogil=True)
def gf_div(a: int, b: int) -> int:
    """a / b; raises ZeroDivisionError for b == 0."""
    if b == 0:
        raise ZeroDivisionError("division by 0 in GF(2^8)")
    if a == 0:
        return 0
    return int(EXP_TABLE[LOG_TABLE[a] + 255 - LOG_TABLE[b]])


@njit(cache=True, nogil=True)
def region_xor(dst: np.ndarray, src: np.ndarray) -> None:
    """dst ^= src (addition in GF(2^8))."""
    n = min(dst.shape[0], src.shape[0])
    n8 = n & ~7
    d = as_words(dst)
    s = as_words(src)
    for j in range(n8 >> 3):
        d[j] ^= s[j]
    for j in range(n8, n):
        dst[j] ^= src[j]


@njit(cache=True, nogil=True)
def region_muladd(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c * src over GF(2^8), bit-sliced in uint64 lanes."""
    cc = np.int64(c) & 0xFF
    if cc == 0:
        return
    # No special case for c == 1 (plain XOR): the branch alone makes LLVM compile the whole
    # function about 3x slower on 1280-byte symbols, and the general loop is as fast.
    n = min(dst.shape[0], src.shape[0])
    n8 = n & ~7
    d = as_words(dst)
    s = as_words(src)
    k = BITSLICE_TABLE[cc]
    k0 = k[0]
    k1 = k[1]
    k2 = k[2]
    k3 = k[3]
    k4 = k[4]
    k5 = k[5]
    k6 = k[6]
    k7 = k[7]
    for j in range(n8 >> 3):
        v = s[j]
        acc = (v & _LSB) * k0
        acc ^= ((v >> _S1) & _LSB) * k1
        acc ^= ((v >> _S2) & _LSB) * k2
        acc ^= ((v >> _S3) & _LSB) * k3
        acc ^= ((v >> _S4) & _LSB) * k4
        acc ^= ((v >> _S5) & _LSB) * k5
        acc ^= ((v >> _S6) & _LSB) * k6
        acc ^= ((v >> _S7) & _LSB) * k7
        d[j] ^= acc
    row = MUL_TABLE[cc]
    for j in range(n8, n):
        dst[j] ^= row[src[j]]


@njit(cache=True, nogil=True)
def region_scale(dst: np.ndarray, c: int) -> None:
    """dst = c * dst in place (bit-sliced like region_muladd)."""
    cc = np.int64(c) & 0xFF
    if cc == 1:
        return
    # c == 0 goes through the general loop too (all constants 0): see region_muladd.
    n = dst.shape[0]
    n8 = n & ~7
    d = as_words(dst)
    k = BITSLICE_TABLE[cc]
    k0 = k[0]
    k1 = k[1]
    k2 = k[2]
    k3 = k[3]
    k4 = k[4]
    k5 = k[5]
    k6 = k[6]
    k7 = k[7]
    for j in range(n8 >> 3):
        v = d[j]
        acc = (v & _LSB) * k0
        acc ^= ((v >> _S1) & _LSB) * k1
        acc ^= ((v >> _S2) & _LSB) * k2
        acc ^= ((v >> _S3) & _LSB) * k3
        acc ^= ((v >> _S4) & _LSB) * k4
        acc ^= ((v >> _S5) & _LSB) * k5
        acc ^= ((v >> _S6) & _LSB) * k6
        acc ^= ((v >> _S7) & _LSB) * k7
        d[j] = acc
    row = MUL_TABLE[cc]
    for j in range(n8, n):
        dst[j] = row[dst[j]]


@njit(cache=True, nogil=True)
def region_dot(out: np.ndarray, symbols: np.ndarray, coefs: np.ndarray) -> None:
    """out = sum over i of coefs[i] * symbols[i] (symbols: 2-D C-contiguous, one per row)."""
    out[:] = 0
    m = min(symbols.shape[0], coefs.shape[0])
    for i in range(m):
        region_muladd(out, symbols[i], coefs[i])


@njit(cache=True, nogil=True)
def region_muladd_table(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c * src through the 256x256 table: the baseline the bit-sliced kernel replaces.

    Eight table lookups per uint64 word: a plain per-byte loop over the table is much slower
    still here, because LLVM turns it into vector gathers.
    """
    cc = np.int64(c) & 0xFF
    if cc == 0:
        return
    row = MUL_TABLE[cc]
    n = min(dst.shape[0], src.shape[0])
    n8 = n & ~7
    d = as_words(dst)
    s = as_words(src)
    for j in range(n8 >> 3):
        v = s[j]
        r = np.uint64(0)
        for b in range(8):
            sh = np.uint64(8 * b)
            r |= np.uint64(row[(v >> sh) & np.uint64(0xFF)]) << sh
        d[j] ^= r
    for j in range(n8, n):
        dst[j] ^= row[src[j]]
