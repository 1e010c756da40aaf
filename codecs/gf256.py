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

On x86 CPUs with GFNI and AVX-512 (``HAVE_GFNI``), ``region_muladd`` and ``region_scale`` use
one instruction per 64 bytes instead: multiplying by c is an 8x8 bit matrix over GF(2) (its
column j is c * 2^j, the bit-slice constants above), and ``vgf2p8affineqb`` applies such a
matrix to every byte of a 64-byte vector, whatever the field polynomial (the instruction's own
multiply, ``vgf2p8mulb``, is fixed to AES's 0x11B and cannot serve here). About 2x the
bit-sliced kernel on 1280-byte symbols.

Without GFNI, on x86 CPUs with AVX2 (``HAVE_SHUFFLE``), the split-nibble shuffle kernel:
c * b = T_lo[b & 15] ^ T_hi[b >> 4] with the constant's two 16-byte tables
(``NIBBLE_TABLE``), each lookup one ``vpshufb`` over 32 bytes. About 10x the bit-sliced
kernel (see scripts/bench_codec.py). Every variant stays callable by name
(``region_muladd_gfni``, ``region_muladd_shuffle``, ``region_muladd_bitsliced``, ... and
``KERNELS``) for tests and benchmarks; the plain names are the one the host runs
(``KERNEL``), picked once at import: the fastest of ``AVAILABLE`` (the portable bit-sliced
one when NUMBA_CPU_NAME or NUMBA_CPU_FEATURES make numba compile for another CPU), or the one
the environment variable KVTRANSPORT_GF_KERNEL names. numba keys its on-disk cache by CPU
features, so a cache built here is not reused on a CPU without GFNI or AVX2, and
kvtransport.kernel_cache puts the kernels compiled under a forced choice in a folder of
their own. Like any numba cache, it does not notice edits to this file from the
cached kernels of other modules that call these (touch them, or clear their __pycache__).

All region kernels are ``@njit(cache=True, nogil=True)`` and accept 1-D C-contiguous ``uint8``
arrays (any alignment); they process ``min(len(dst), len(src))`` bytes, so a size mismatch can
never write out of bounds. Callers that care about lengths check them before calling.

The uint64 lanes come from ``as_words``, a numba intrinsic that reinterprets a contiguous uint8
array as its whole 8-byte words at no cost. numba's own ``ndarray.view`` costs about 60 ns per
call, which is more than multiplying a 1280-byte symbol takes (about 40 ns), and the decoder
makes many such calls per packet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.imputils import impl_ret_borrowed
from numba.np.arrayobj import make_array, populate_array

if TYPE_CHECKING:
    # numba types an @intrinsic's call with its typing context as the first argument;
    # compiled code calls it without, so to mypy an intrinsic is untyped.
    def intrinsic(func: Callable[..., Any]) -> Any: ...
else:
    from numba.extending import intrinsic

from kvtransport.errors import UserError

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


def _affine_matrices() -> np.ndarray:
    """Per constant c, multiplication by c as the 8x8 bit matrix ``vgf2p8affineqb`` takes:
    output bit i is the parity of (matrix byte 7-i) AND x, so byte 7-i holds row i, whose
    bit j is bit i of c * 2^j."""
    out = np.zeros(256, dtype=np.uint64)
    for c in range(256):
        q = 0
        for i in range(8):
            row = sum(1 << j for j in range(8) if (int(BITSLICE_TABLE[c, j]) >> i) & 1)
            q |= row << (8 * (7 - i))
        out[c] = q
    return out


AFFINE_TABLE = _affine_matrices()


def _nibble_tables() -> np.ndarray:
    """Per constant c, 32 bytes: c * x for x in 0..15, then c * (x << 4) for x in 0..15.
    c * b is their two entries for b's low and high nibble XOR-ed (multiplying by c is
    GF(2)-linear): the two 16-byte shuffle tables of the split-nibble kernel."""
    x = np.arange(16)
    return np.ascontiguousarray(np.concatenate([MUL_TABLE[:, x], MUL_TABLE[:, x << 4]], axis=1))


NIBBLE_TABLE = _nibble_tables()


def _host_features() -> dict[str, bool]:
    """The host CPU's features, or {} when numba compiles for another CPU (NUMBA_CPU_NAME,
    NUMBA_CPU_FEATURES) or the host cannot be queried: then only portable kernels run."""
    if os.environ.get("NUMBA_CPU_NAME", "host") != "host" or os.environ.get("NUMBA_CPU_FEATURES"):
        return {}
    try:
        from llvmlite import binding

        return dict(binding.get_host_cpu_features())
    except Exception:  # noqa: BLE001 (no host feature query: take the portable kernels)
        return {}


_FEATURES = _host_features()
HAVE_GFNI = all(_FEATURES.get(f, False) for f in ("gfni", "avx512f", "avx512bw"))
"""The host runs the GFNI region kernels (see the module docstring)."""
HAVE_SHUFFLE = bool(_FEATURES.get("avx2", False))
"""The host runs the split-nibble shuffle kernels (AVX2 ``vpshufb``)."""

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


def _affine_codegen(context, builder, sig, args, with_xor):  # noqa: ANN001, ANN202
    """dst[off:off+64] (^)= matrix applied to src[off:off+64]: one vgf2p8affineqb."""
    dst = make_array(sig.args[0])(context, builder, args[0])
    src = make_array(sig.args[1])(context, builder, args[1])
    off, mat = args[2], args[3]
    v64 = ir.VectorType(ir.IntType(8), 64)
    dptr = builder.bitcast(builder.gep(dst.data, [off]), v64.as_pointer())
    sptr = builder.bitcast(builder.gep(src.data, [off]), v64.as_pointer())
    x = builder.load(sptr, align=1)
    m = ir.Constant(ir.VectorType(ir.IntType(64), 8), ir.Undefined)
    for i in range(8):
        m = builder.insert_element(m, mat, ir.Constant(ir.IntType(32), i))
    fnty = ir.FunctionType(v64, [v64, v64, ir.IntType(8)])
    fn = builder.module.declare_intrinsic("llvm.x86.vgf2p8affineqb.512", fnty=fnty)
    r = builder.call(fn, [x, builder.bitcast(m, v64), ir.Constant(ir.IntType(8), 0)])
    if with_xor:
        r = builder.xor(r, builder.load(dptr, align=1))
    builder.store(r, dptr, align=1)
    return context.get_dummy_value()


def _u8_c_array(t) -> bool:  # noqa: ANN001
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.uint8 and t.layout == "C"


@intrinsic
def _affine_xor64(typingctx, dst, src, off, mat):  # noqa: ANN001, ANN201
    """dst[off:off+64] ^= mat . src[off:off+64] (numba code only; the caller checks bounds)."""
    if not (_u8_c_array(dst) and dst.mutable and _u8_c_array(src)):
        return None
    sig = types.void(dst, src, types.intp, types.uint64)
    return sig, lambda c, b, s, a: _affine_codegen(c, b, s, a, True)


@intrinsic
def _affine64(typingctx, dst, src, off, mat):  # noqa: ANN001, ANN201
    """dst[off:off+64] = mat . src[off:off+64] (numba code only; the caller checks bounds)."""
    if not (_u8_c_array(dst) and dst.mutable and _u8_c_array(src)):
        return None
    sig = types.void(dst, src, types.intp, types.uint64)
    return sig, lambda c, b, s, a: _affine_codegen(c, b, s, a, False)


_UNROLL = 4
"""32-byte vectors per iteration of the single-output shuffle kernel's loop (its loads
issued together; LLVM does not unroll the loop an intrinsic builds)."""


def _shuffle_region_codegen(context, builder, sig, args, with_xor):  # noqa: ANN001, ANN202
    """dst[:n] (^)= c * src[:n] for n >= 32 in one loop, the tables in registers: 32-byte
    vectors at the 32-byte aligned positions of ``dst`` (aligned loads and stores), the
    unaligned head and tail each one vector at offsets 0 and n - 32 that overlaps its
    neighbours. Every vector is computed from the bytes as they were on entry (the head
    and tail ones before the loop, stored after it), so bytes written twice get the same
    value twice, in place (dst is src) as well."""
    dst = make_array(sig.args[0])(context, builder, args[0])
    src = make_array(sig.args[1])(context, builder, args[1])
    n = args[2]
    tab = make_array(sig.args[3])(context, builder, args[3])
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    v16, v32 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)
    tptr = builder.bitcast(tab.data, v16.as_pointer())
    twice = ir.Constant(ir.VectorType(i32, 32), [i % 16 for i in range(32)])
    lo_t = builder.load(tptr, align=1)
    hi_t = builder.load(builder.gep(tptr, [ir.Constant(i32, 1)]), align=1)
    lo_t = builder.shuffle_vector(lo_t, lo_t, twice)  # the table in both 128-bit lanes
    hi_t = builder.shuffle_vector(hi_t, hi_t, twice)
    mask = ir.Constant(v32, [0x0F] * 32)
    four = ir.Constant(v32, [4] * 32)
    fn = builder.module.declare_intrinsic(
        "llvm.x86.avx2.pshuf.b", fnty=ir.FunctionType(v32, [v32, v32])
    )

    def product(off, align):  # noqa: ANN001, ANN202
        x = builder.load(builder.bitcast(builder.gep(src.data, [off]), v32.as_pointer()), align=1)
        lo = builder.and_(x, mask)
        hi = builder.and_(builder.lshr(x, four), mask)
        r = builder.xor(builder.call(fn, [lo_t, lo]), builder.call(fn, [hi_t, hi]))
        dptr = builder.bitcast(builder.gep(dst.data, [off]), v32.as_pointer())
        if with_xor:
            r = builder.xor(r, builder.load(dptr, align=align))
        return r, dptr

    last = builder.sub(n, ir.Constant(i64, 32))
    head, head_ptr = product(ir.Constant(i64, 0), 1)
    tail, tail_ptr = product(last, 1)
    addr = builder.ptrtoint(dst.data, i64)
    first = builder.and_(builder.sub(ir.Constant(i64, 0), addr), ir.Constant(i64, 31))
    # aligned vectors at j, j + 32, ... while j <= last: UNROLL at a time, then one at a time
    end_wide = builder.sub(last, ir.Constant(i64, 32 * (_UNROLL - 1)))
    entry = builder.block
    wide = builder.append_basic_block("region.wide")
    narrow_check = builder.append_basic_block("region.narrow_check")
    narrow = builder.append_basic_block("region.narrow")
    done = builder.append_basic_block("region.done")
    builder.cbranch(builder.icmp_signed("<=", first, end_wide), wide, narrow_check)
    builder.position_at_end(wide)
    j = builder.phi(i64)
    j.add_incoming(first, entry)
    results = [product(builder.add(j, ir.Constant(i64, 32 * u)), 32) for u in range(_UNROLL)]
    for r, ptr in results:
        builder.store(r, ptr, align=32)
    j_wide = builder.add(j, ir.Constant(i64, 32 * _UNROLL))
    j.add_incoming(j_wide, wide)
    builder.cbranch(builder.icmp_signed("<=", j_wide, end_wide), wide, narrow_check)
    builder.position_at_end(narrow_check)
    j_rest = builder.phi(i64)
    j_rest.add_incoming(first, entry)
    j_rest.add_incoming(j_wide, wide)
    builder.cbranch(builder.icmp_signed("<=", j_rest, last), narrow, done)
    builder.position_at_end(narrow)
    k = builder.phi(i64)
    k.add_incoming(j_rest, narrow_check)
    r, ptr = product(k, 32)
    builder.store(r, ptr, align=32)
    k_next = builder.add(k, ir.Constant(i64, 32))
    k.add_incoming(k_next, narrow)
    builder.cbranch(builder.icmp_signed("<=", k_next, last), narrow, done)
    builder.position_at_end(done)
    builder.store(head, head_ptr, align=1)
    builder.store(tail, tail_ptr, align=1)
    return context.get_dummy_value()


@intrinsic
def _shuffle_region_xor(typingctx, dst, src, n, tab):  # noqa: ANN001, ANN201
    """dst[:n] ^= c * src[:n], ``tab`` = NIBBLE_TABLE[c], n >= 32 (numba code only; the
    caller checks bounds; HAVE_SHUFFLE hosts only)."""
    if not (_u8_c_array(dst) and dst.mutable and _u8_c_array(src) and _u8_c_array(tab)):
        return None
    sig = types.void(dst, src, types.intp, tab)
    return sig, lambda c, b, s, a: _shuffle_region_codegen(c, b, s, a, True)


@intrinsic
def _shuffle_region(typingctx, dst, src, n, tab):  # noqa: ANN001, ANN201
    """dst[:n] = c * src[:n], like _shuffle_region_xor (src may be dst)."""
    if not (_u8_c_array(dst) and dst.mutable and _u8_c_array(src) and _u8_c_array(tab)):
        return None
    sig = types.void(dst, src, types.intp, tab)
    return sig, lambda c, b, s, a: _shuffle_region_codegen(c, b, s, a, False)


_PREFETCH_AHEAD = 256
"""Bytes ahead of the current step that region_muladd_multi_shuffle prefetches per source
(0: none). Cache-cold repairs of 32 x 1280 B blocks: 2.1 GB/s without, 4.9-5.4 with; no
difference outside the noise on a hot block."""


def _shuffle_multi_intrinsic(rows: int, vecs: int, store: bool):  # noqa: ANN202
    """An intrinsic that multiplies ``32 * vecs`` bytes at offset j of m sources into ``rows``
    repairs at once, the accumulators in registers across all sources:

        out[k0 + k, j : j + 32 * vecs] ^= sum over i < m of coefs[k0 + k, i] * src_i

    with src_i = flat[offsets[i] + j :], and tables NIBBLE_TABLE[coefs[...]] (``nib``);
    ``store``: ``=`` instead of ``^=`` (out is not read). Each source vector is loaded and
    split into nibbles once for all the rows. Numba code only; the caller checks every
    bound."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        out = make_array(sig.args[0])(context, builder, args[0])
        flat = make_array(sig.args[1])(context, builder, args[1])
        offs = make_array(sig.args[2])(context, builder, args[2])
        coefs = make_array(sig.args[3])(context, builder, args[3])
        nib = make_array(sig.args[4])(context, builder, args[4])
        k0, j, m = args[5], args[6], args[7]
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        v16, v32 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)
        twice = ir.Constant(ir.VectorType(i32, 32), [i % 16 for i in range(32)])
        mask = ir.Constant(v32, [0x0F] * 32)
        four = ir.Constant(v32, [4] * 32)
        zero = ir.Constant(v32, [0] * 32)
        fn = builder.module.declare_intrinsic(
            "llvm.x86.avx2.pshuf.b", fnty=ir.FunctionType(v32, [v32, v32])
        )
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch",
            [i8.as_pointer()],
            fnty=ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]),
        )
        out_stride = builder.extract_value(out.strides, 0)
        coef_stride = builder.extract_value(coefs.strides, 0)
        n_acc = rows * vecs
        entry = builder.block
        loop = builder.append_basic_block("multi.loop")
        done = builder.append_basic_block("multi.done")
        builder.cbranch(builder.icmp_signed(">", m, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), entry)
        accs = [builder.phi(v32) for _ in range(n_acc)]
        for a in accs:
            a.add_incoming(zero, entry)
        off = builder.load(builder.gep(offs.data, [i]))
        base = builder.gep(flat.data, [builder.add(off, j)])
        # the sources are read in lockstep, more streams than hardware prefetchers follow:
        # ask for this source's bytes a few steps ahead (a prefetch never faults)
        if _PREFETCH_AHEAD:
            ahead = builder.gep(base, [ir.Constant(i64, _PREFETCH_AHEAD)])
            locality = ir.Constant(i32, 3)
            builder.call(prefetch, [ahead, ir.Constant(i32, 0), locality, ir.Constant(i32, 1)])
        los, his = [], []
        for v in range(vecs):
            ptr = builder.bitcast(builder.gep(base, [ir.Constant(i64, 32 * v)]), v32.as_pointer())
            x = builder.load(ptr, align=1)
            los.append(builder.and_(x, mask))
            his.append(builder.and_(builder.lshr(x, four), mask))
        new = []
        for k in range(rows):
            row = builder.add(k0, ir.Constant(i64, k))
            cptr = builder.gep(coefs.data, [builder.add(builder.mul(row, coef_stride), i)])
            c = builder.zext(builder.load(cptr), i64)
            tptr = builder.bitcast(
                builder.gep(nib.data, [builder.mul(c, ir.Constant(i64, 32))]), v16.as_pointer()
            )
            lo_t = builder.load(tptr, align=1)
            hi_t = builder.load(builder.gep(tptr, [ir.Constant(i32, 1)]), align=1)
            lo_t = builder.shuffle_vector(lo_t, lo_t, twice)
            hi_t = builder.shuffle_vector(hi_t, hi_t, twice)
            for v in range(vecs):
                prod = builder.xor(
                    builder.call(fn, [lo_t, los[v]]), builder.call(fn, [hi_t, his[v]])
                )
                new.append(builder.xor(accs[k * vecs + v], prod))
        i_next = builder.add(i, ir.Constant(i64, 1))
        i.add_incoming(i_next, builder.block)
        for a, b in zip(accs, new, strict=True):
            a.add_incoming(b, builder.block)
        builder.cbranch(builder.icmp_signed("<", i_next, m), loop, done)
        builder.position_at_end(done)
        results = []
        for k in range(n_acc):
            ph = builder.phi(v32)
            ph.add_incoming(zero, entry)
            ph.add_incoming(new[k], loop)
            results.append(ph)
        for k in range(rows):
            row = builder.add(k0, ir.Constant(i64, k))
            rbase = builder.gep(out.data, [builder.add(builder.mul(row, out_stride), j)])
            for v in range(vecs):
                ptr = builder.bitcast(
                    builder.gep(rbase, [ir.Constant(i64, 32 * v)]), v32.as_pointer()
                )
                acc = results[k * vecs + v]
                if not store:
                    acc = builder.xor(acc, builder.load(ptr, align=1))
                builder.store(acc, ptr, align=1)
        return context.get_dummy_value()

    @intrinsic
    def multi(typingctx, out, flat, offsets, coefs, nib, k0, j, m):  # noqa: ANN001, ANN202
        ok = (
            isinstance(out, types.Array) and out.ndim == 2 and out.dtype == types.uint8
            and out.layout == "C" and out.mutable and _u8_c_array(flat)
            and isinstance(offsets, types.Array) and offsets.ndim == 1
            and offsets.dtype == types.int64 and offsets.layout == "C"
            and isinstance(coefs, types.Array) and coefs.ndim == 2
            and coefs.dtype == types.uint8 and coefs.layout == "C"
            and isinstance(nib, types.Array) and nib.ndim == 2 and nib.dtype == types.uint8
            and nib.layout == "C"
        )  # fmt: skip
        if not ok:
            return None
        sig = types.void(out, flat, offsets, coefs, nib, types.intp, types.intp, types.intp)
        return sig, codegen

    return multi


_MULTI = {
    (r, v, st): _shuffle_multi_intrinsic(r, v, st)
    for r in (1, 2, 3, 4)
    for v in (1, 2)
    for st in (False, True)
}
_multi_4x64, _multi_3x64, _multi_2x64, _multi_1x64 = (_MULTI[(r, 2, False)] for r in (4, 3, 2, 1))
_multi_4x32, _multi_3x32, _multi_2x32, _multi_1x32 = (_MULTI[(r, 1, False)] for r in (4, 3, 2, 1))
_dot_4x64, _dot_3x64, _dot_2x64, _dot_1x64 = (_MULTI[(r, 2, True)] for r in (4, 3, 2, 1))
_dot_4x32, _dot_3x32, _dot_2x32, _dot_1x32 = (_MULTI[(r, 1, True)] for r in (4, 3, 2, 1))


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
def region_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:n] = src[:n], n = min(len(dst), len(src)), in uint64 words: numba's own slice
    assignment loops byte by byte (about 0.8 us per 1280 bytes, this about 35 ns)."""
    n = min(dst.shape[0], src.shape[0])
    n8 = n & ~7
    d = as_words(dst)
    s = as_words(src)
    for j in range(n8 >> 3):
        d[j] = s[j]
    for j in range(n8, n):
        dst[j] = src[j]


@njit(cache=True, nogil=True)
def region_zero(dst: np.ndarray) -> None:
    """dst[:] = 0 in uint64 words (see region_copy)."""
    n = dst.shape[0]
    n8 = n & ~7
    d = as_words(dst)
    for j in range(n8 >> 3):
        d[j] = 0
    for j in range(n8, n):
        dst[j] = 0


@njit(cache=True, nogil=True)
def region_muladd_bitsliced(dst: np.ndarray, src: np.ndarray, c: int) -> None:
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
def region_scale_bitsliced(dst: np.ndarray, c: int) -> None:
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
def region_muladd_gfni(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c * src over GF(2^8): one vgf2p8affineqb per 64 bytes (HAVE_GFNI hosts only)."""
    cc = np.int64(c) & 0xFF
    if cc == 0:
        return
    n = min(dst.shape[0], src.shape[0])
    m = AFFINE_TABLE[cc]
    j = 0
    while j + 64 <= n:
        _affine_xor64(dst, src, j, m)
        j += 64
    # The last n % 64 bytes by table: calling the bit-sliced kernel here instead makes LLVM
    # compile the whole function about 1.6x slower on 1280-byte symbols.
    row = MUL_TABLE[cc]
    while j < n:
        dst[j] ^= row[src[j]]
        j += 1


@njit(cache=True, nogil=True)
def region_scale_gfni(dst: np.ndarray, c: int) -> None:
    """dst = c * dst in place, like region_muladd_gfni (HAVE_GFNI hosts only)."""
    cc = np.int64(c) & 0xFF
    if cc == 1:
        return
    n = dst.shape[0]
    m = AFFINE_TABLE[cc]
    j = 0
    while j + 64 <= n:
        _affine64(dst, dst, j, m)
        j += 64
    row = MUL_TABLE[cc]  # the last n % 64 bytes (see region_muladd_gfni)
    while j < n:
        dst[j] = row[dst[j]]
        j += 1


@njit(cache=True, nogil=True)
def region_muladd_shuffle(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c * src over GF(2^8): split-nibble vpshufb, 32 bytes a step (HAVE_SHUFFLE)."""
    cc = np.int64(c) & 0xFF
    if cc == 0:
        return
    n = min(dst.shape[0], src.shape[0])
    if n >= 32:
        _shuffle_region_xor(dst, src, n, NIBBLE_TABLE[cc])
        return
    row = MUL_TABLE[cc]  # a region shorter than one vector
    for j in range(n):
        dst[j] ^= row[src[j]]


@njit(cache=True, nogil=True)
def region_scale_shuffle(dst: np.ndarray, c: int) -> None:
    """dst = c * dst in place, like region_muladd_shuffle (HAVE_SHUFFLE hosts only)."""
    cc = np.int64(c) & 0xFF
    if cc == 1:
        return
    n = dst.shape[0]
    if n >= 32:
        _shuffle_region(dst, dst, n, NIBBLE_TABLE[cc])
        return
    row = MUL_TABLE[cc]
    for j in range(n):
        dst[j] = row[dst[j]]


@njit(cache=True, nogil=True)
def _check_multi(out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray,
                 m: int, n: int) -> None:  # fmt: skip
    if not (0 <= n <= out.shape[1] and 0 <= m <= offsets.shape[0] and m <= coefs.shape[1]):
        raise ValueError("region_muladd_multi: n or m out of bounds")
    if coefs.shape[0] > out.shape[0]:
        raise ValueError("region_muladd_multi: more coefficient rows than output rows")
    for i in range(m):
        if offsets[i] < 0 or offsets[i] + n > flat.shape[0]:
            raise ValueError("region_muladd_multi: a source runs past the buffer")


@njit(cache=True, nogil=True, inline="always")
def _multi_step(out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray,
                k0: int, g: int, j: int, m: int, wide: bool, store: bool) -> None:  # fmt: skip
    """Rows k0 .. k0+g-1 (g <= 4) of region_muladd_multi_shuffle / region_dot_multi_shuffle
    at offset j: 64 bytes when ``wide``, else 32."""
    if store:
        if wide:
            if g == 4:
                _dot_4x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
            elif g == 3:
                _dot_3x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
            elif g == 2:
                _dot_2x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
            else:
                _dot_1x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        elif g == 4:
            _dot_4x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        elif g == 3:
            _dot_3x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        elif g == 2:
            _dot_2x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        else:
            _dot_1x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
    elif wide:
        if g == 4:
            _multi_4x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        elif g == 3:
            _multi_3x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        elif g == 2:
            _multi_2x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
        else:
            _multi_1x64(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
    elif g == 4:
        _multi_4x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
    elif g == 3:
        _multi_3x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
    elif g == 2:
        _multi_2x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)
    else:
        _multi_1x32(out, flat, offsets, coefs, NIBBLE_TABLE, k0, j, m)


@njit(cache=True, nogil=True)
def _multi_shuffle(out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray,
                   m: int, n: int, store: bool) -> None:  # fmt: skip
    """The body of region_muladd_multi_shuffle (``store`` False) and
    region_dot_multi_shuffle (True), bounds checked by the caller."""
    r = coefs.shape[0]
    k0 = 0
    while k0 < r:
        g = min(4, r - k0)
        j = 0
        while j + 64 <= n:
            _multi_step(out, flat, offsets, coefs, k0, g, j, m, True, store)
            j += 64
        if j + 32 <= n:
            _multi_step(out, flat, offsets, coefs, k0, g, j, m, False, store)
            j += 32
        if j < n and store and n >= 32:
            # the last n % 32 bytes: one more vector ending at n, over bytes already
            # written; each is the same pure function of the sources, so they stay
            _multi_step(out, flat, offsets, coefs, k0, g, n - 32, m, False, True)
        elif j < n:  # by table
            for k in range(k0, k0 + g):
                if store:
                    out[k, j:n] = 0
                for i in range(m):
                    row = MUL_TABLE[coefs[k, i]]
                    o = offsets[i]
                    for b in range(j, n):
                        out[k, b] ^= row[flat[o + b]]
        k0 += g


@njit(cache=True, nogil=True)
def region_muladd_multi_shuffle(
    out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray, m: int, n: int
) -> None:
    """region_muladd_multi with the split-nibble shuffle, the accumulators of up to four
    outputs in registers over all m sources, 64 bytes a step (HAVE_SHUFFLE hosts only)."""
    _check_multi(out, flat, offsets, coefs, m, n)
    _multi_shuffle(out, flat, offsets, coefs, m, n, False)


@njit(cache=True, nogil=True)
def region_dot_multi_shuffle(
    out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray, m: int, n: int
) -> None:
    """region_dot_multi with the split-nibble shuffle: as region_muladd_multi_shuffle, the
    sums stored instead of added (the outputs are not read), HAVE_SHUFFLE hosts only."""
    _check_multi(out, flat, offsets, coefs, m, n)
    _multi_shuffle(out, flat, offsets, coefs, m, n, True)


KERNELS = {
    "gfni": (region_muladd_gfni, region_scale_gfni),
    "shuffle": (region_muladd_shuffle, region_scale_shuffle),
    "bitsliced": (region_muladd_bitsliced, region_scale_bitsliced),
}
"""Every (muladd, scale) region kernel pair by name, fastest first."""
AVAILABLE = tuple(
    k for k, ok in (("gfni", HAVE_GFNI), ("shuffle", HAVE_SHUFFLE), ("bitsliced", True)) if ok
)
"""The kernels this host runs (all bit-identical), fastest first."""
KERNEL_ENV = "KVTRANSPORT_GF_KERNEL"
"""Environment variable that forces one of AVAILABLE (tests, benchmarks); its value is part
of kvtransport.kernel_cache's digest, so kernels compiled with another choice are not reused."""


def _pick_kernel() -> str:
    forced = os.environ.get(KERNEL_ENV, "").strip()
    if not forced:
        return AVAILABLE[0]
    if forced not in AVAILABLE:
        raise UserError(f"{KERNEL_ENV}={forced!r}: this host runs one of {', '.join(AVAILABLE)}")
    return forced


KERNEL = _pick_kernel()
"""The region kernel the plain names below run, picked at import: the fastest the host has
(GFNI, else the split-nibble shuffle, else bit-sliced), or the one KVTRANSPORT_GF_KERNEL
names."""
region_muladd, region_scale = KERNELS[KERNEL]

_TILE = 2048
"""Bytes of every output a tile of region_muladd_multi_tiled builds per pass over the
sources: the output tiles and a source tile stay in L1 (a multiple of 64: only the last tile
has a scalar tail)."""


@njit(cache=True, nogil=True)
def region_muladd_multi_tiled(
    out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray, m: int, n: int
) -> None:
    """region_muladd_multi through the host's region_muladd, tile by tile: each source tile
    is read from memory once for all outputs (the outputs' tiles stay in L1)."""
    _check_multi(out, flat, offsets, coefs, m, n)
    r = coefs.shape[0]
    for t0 in range(0, n, _TILE):
        t1 = min(t0 + _TILE, n)
        for i in range(m):
            src = flat[offsets[i] + t0 : offsets[i] + t1]
            for k in range(r):
                c = coefs[k, i]
                if c != 0:
                    region_muladd(out[k, t0:t1], src, c)


@njit(cache=True, nogil=True)
def region_dot_multi_tiled(
    out: np.ndarray, flat: np.ndarray, offsets: np.ndarray, coefs: np.ndarray, m: int, n: int
) -> None:
    """region_dot_multi: the outputs zeroed, then region_muladd_multi_tiled."""
    _check_multi(out, flat, offsets, coefs, m, n)
    for k in range(coefs.shape[0]):
        region_zero(out[k, :n])
    region_muladd_multi_tiled(out, flat, offsets, coefs, m, n)


MULTI_KERNEL = "shuffle" if HAVE_SHUFFLE and KERNEL != "bitsliced" else "tiled"
"""The multi-output kernel the plain names below run: the shuffle kernel's register
accumulators wherever the host has AVX2, a GFNI host included (there, side by side, 1.3x
the GFNI tiles' speed cache-cold and 1.8x cache-hot: scripts/bench_codec.py, docs/results.md),
else tiles of the host's region_muladd (and with the bit-sliced kernel forced)."""
region_muladd_multi = (
    region_muladd_multi_shuffle if MULTI_KERNEL == "shuffle" else region_muladd_multi_tiled
)
"""out[k, :n] ^= sum over i < m of coefs[k, i] * flat[offsets[i] : offsets[i] + n], for every
row k of ``coefs`` (uint8, r x >= m; ``out``: uint8, >= r x n, C-contiguous; ``offsets``:
int64): several outputs (the repairs of one span) from one pass over the sources. Raises
ValueError if a source runs past ``flat`` or n, m exceed the arrays. ``MULTI_KERNEL``'s
variant."""
region_dot_multi = region_dot_multi_shuffle if MULTI_KERNEL == "shuffle" else region_dot_multi_tiled
"""out[k, :n] = sum over i < m of coefs[k, i] * flat[offsets[i] : offsets[i] + n]: as
region_muladd_multi, the outputs overwritten instead of added to (never read; the shuffle
kernel then needs no scalar tail)."""


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
