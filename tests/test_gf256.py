"""GF(2^8) arithmetic of the RFC 8681 field, checked against hand-worked products and an
independent shift-and-add multiplier written here."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransport.codecs import gf256


def slow_mul(a: int, b: int) -> int:
    """Carry-less multiply then reduce by x^8+x^4+x^3+x^2+1, one bit at a time."""
    r = 0
    while b:
        if b & 1:
            r ^= a
        b >>= 1
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
    return r


REF = np.array([[slow_mul(a, b) for b in range(256)] for a in range(256)], dtype=np.uint8)


@pytest.mark.parametrize(
    ("a", "b", "product"),
    [
        (2, 128, 0x1D),  # x * x^7 = x^8 = x^4 + x^3 + x^2 + 1
        (16, 16, 0x1D),  # x^4 * x^4 = x^8
        (3, 7, 9),  # (x+1)(x^2+x+1) = x^3 + 1, no reduction
        (128, 128, 0x13),  # x^14 = x^4 + x + 1 (worked by hand)
        (2, 142, 1),  # x * (x^7+x^3+x^2+x) = x^8+x^4+x^3+x^2 = 1
        (0, 77, 0),
        (1, 200, 200),
    ],
)
def test_hand_checked_products(a, b, product):
    assert gf256.gf_mul(a, b) == product
    assert gf256.gf_mul(b, a) == product


def test_scalar_ops_match_reference_on_every_pair():
    assert np.array_equal(gf256.MUL_TABLE, REF)
    a = np.arange(256)
    for b in (0, 1, 2, 29, 142, 255):
        assert [gf256.gf_mul(int(x), b) for x in a] == REF[:, b].tolist()


def test_inverse_and_division():
    assert gf256.gf_inv(2) == 142
    for a in range(1, 256):
        inv = gf256.gf_inv(a)
        assert slow_mul(a, inv) == 1
        assert gf256.gf_div(1, a) == inv
        assert gf256.gf_div(slow_mul(a, 57), a) == 57
    with pytest.raises(ZeroDivisionError):
        gf256.gf_inv(0)
    with pytest.raises(ZeroDivisionError):
        gf256.gf_div(5, 0)


def test_two_generates_the_multiplicative_group():
    powers = gf256.EXP_TABLE[:255]
    assert sorted(powers.tolist()) == list(range(1, 256))
    x = 1
    for i in range(255):
        assert gf256.EXP_TABLE[i] == x
        x = slow_mul(x, 2)
    assert x == 1


def _unaligned(arr: np.ndarray, offset: int) -> np.ndarray:
    """A copy of arr starting ``offset`` bytes into a larger buffer (tests unaligned lanes)."""
    buf = np.zeros(arr.size + offset, dtype=np.uint8)
    view = buf[offset:]
    view[:] = arr
    return view


# every variant this host can run (GFNI only where the CPU has it), each checked on its own
MULADD_VARIANTS = [gf256.region_muladd_bitsliced] + (
    [gf256.region_muladd_gfni] if gf256.HAVE_GFNI else []
)
SCALE_VARIANTS = [gf256.region_scale_bitsliced] + (
    [gf256.region_scale_gfni] if gf256.HAVE_GFNI else []
)


def test_affine_matrices_multiply_by_their_constant():
    """The GFNI kernels' matrices, checked on the bit level without the instruction: row i
    (byte 7-i) dotted with x gives bit i of c * x."""
    for c in range(256):
        q = int(gf256.AFFINE_TABLE[c])
        for x in range(256):
            y = sum((bin((q >> (8 * (7 - i))) & x & 0xFF).count("1") & 1) << i for i in range(8))
            assert y == REF[c][x]


@settings(max_examples=100, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=300),
    c=st.integers(0, 255),
    offset=st.integers(0, 7),
)
def test_region_kernels_match_reference(data, c, offset):
    src = _unaligned(np.frombuffer(data, dtype=np.uint8), offset)
    dst0 = np.frombuffer(bytes(reversed(data)), dtype=np.uint8)
    expected = dst0 ^ REF[c][src]

    dst = _unaligned(dst0, (offset + 3) % 8)
    gf256.region_muladd(dst, src, c)
    assert np.array_equal(dst, expected)

    for muladd in MULADD_VARIANTS:
        dst = _unaligned(dst0, (offset + 5) % 8)
        muladd(dst, src, c)
        assert np.array_equal(dst, expected)

    dst = dst0.copy()
    gf256.region_muladd_table(dst, src, c)
    assert np.array_equal(dst, expected)

    scaled = src.copy()
    gf256.region_scale(scaled, c)
    assert np.array_equal(scaled, REF[c][src])
    for scale in SCALE_VARIANTS:
        scaled = _unaligned(src, (offset + 1) % 8)
        scale(scaled, c)
        assert np.array_equal(scaled, REF[c][src])

    x = dst0.copy()
    gf256.region_xor(x, src)
    assert np.array_equal(x, dst0 ^ src)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    size=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
)
def test_region_dot_is_sum_of_products(n, size, seed):
    rng = np.random.default_rng(seed)
    symbols = rng.integers(0, 256, (n, size), dtype=np.uint8)
    coefs = rng.integers(0, 256, n, dtype=np.uint8)
    out = rng.integers(0, 256, size, dtype=np.uint8)  # stale content must be overwritten
    gf256.region_dot(out, symbols, coefs)
    expected = np.zeros(size, dtype=np.uint8)
    for i in range(n):
        expected ^= REF[coefs[i]][symbols[i]]
    assert np.array_equal(out, expected)


def test_region_kernels_read_from_read_only_buffers():
    src = np.frombuffer(bytes(range(200)), dtype=np.uint8)  # read-only view of bytes
    dst = np.zeros(200, dtype=np.uint8)
    gf256.region_muladd(dst, src, 7)
    assert np.array_equal(dst, REF[7][src])
    out = np.empty(200, dtype=np.uint8)
    gf256.region_dot(out, np.stack([src, src[::-1].copy()]), np.array([3, 3], dtype=np.uint8))
    assert np.array_equal(out, REF[3][src] ^ REF[3][src[::-1]])


def test_region_ops_never_write_past_the_shorter_operand():
    dst = np.zeros(24, dtype=np.uint8)
    src = np.full(13, 7, dtype=np.uint8)
    gf256.region_muladd(dst[:13], src, 3)
    assert dst[:13].tolist() == [slow_mul(3, 7)] * 13
    assert not dst[13:].any()
    gf256.region_muladd(dst, src, 3)  # processes min(len) = 13 bytes
    assert dst[:13].tolist() == [0] * 13
    assert not dst[13:].any()


@pytest.mark.parametrize("name", gf256.AVAILABLE)
def test_each_kernel_the_host_runs_matches_the_reference_on_random_data(name):
    """Every region kernel this host can run (GFNI, split-nibble shuffle, bit-sliced),
    forced by name: bit-identical to the shift-and-add reference for all 256 constants,
    on lengths around the vector widths and buffers at any offset from a 64-byte boundary
    (the shuffle kernel aligns its loop to the destination)."""
    muladd, scale = gf256.KERNELS[name]
    rng = np.random.default_rng(len(name))
    for c in range(256):
        n = int(rng.choice([0, 1, 31, 32, 33, 63, 64, 65, 95, 127, 160, 1280, 1283, 4099]))
        src = _unaligned(rng.integers(0, 256, n, dtype=np.uint8), int(rng.integers(0, 64)))
        dst0 = rng.integers(0, 256, n, dtype=np.uint8)
        dst = _unaligned(dst0, int(rng.integers(0, 64)))
        muladd(dst, src, c)
        assert np.array_equal(dst, dst0 ^ REF[c][src]), (name, c, n)
        before = src.copy()
        scale(src, c)
        assert np.array_equal(src, REF[c][before]), (name, c, n)


def test_the_host_kernel_is_picked_at_import_fastest_first():
    assert gf256.AVAILABLE[-1] == "bitsliced" and gf256.KERNEL in gf256.AVAILABLE
    assert ("gfni" in gf256.AVAILABLE) == gf256.HAVE_GFNI
    assert ("shuffle" in gf256.AVAILABLE) == gf256.HAVE_SHUFFLE
    if not os.environ.get(gf256.KERNEL_ENV):
        assert gf256.KERNEL == gf256.AVAILABLE[0]
    assert (gf256.region_muladd, gf256.region_scale) == gf256.KERNELS[gf256.KERNEL]
    # the multi-output kernels: the shuffle accumulators wherever the host has AVX2 (a
    # GFNI host too), unless the bit-sliced kernel is forced
    shuffle = gf256.HAVE_SHUFFLE and gf256.KERNEL != "bitsliced"
    assert gf256.MULTI_KERNEL == ("shuffle" if shuffle else "tiled")
    assert gf256.region_muladd_multi is (
        gf256.region_muladd_multi_shuffle if shuffle else gf256.region_muladd_multi_tiled
    )
    assert gf256.region_dot_multi is (
        gf256.region_dot_multi_shuffle if shuffle else gf256.region_dot_multi_tiled
    )


FORCED = """
import numpy as np
from kvtransport.codecs import gf256
rng = np.random.default_rng(3)
sym = rng.integers(0, 256, (9, 1000), dtype=np.uint8)
coefs = rng.integers(0, 256, 9, dtype=np.uint8)
out = np.empty(1000, dtype=np.uint8)
gf256.region_dot(out, sym, coefs)  # compiled in with the forced kernel
ref = np.zeros(1000, dtype=np.uint8)
for i in range(9):
    ref ^= gf256.MUL_TABLE[coefs[i]][sym[i]]
assert np.array_equal(out, ref)
assert (gf256.region_muladd, gf256.region_scale) == gf256.KERNELS[gf256.KERNEL]
multi = np.zeros((1, 1000), dtype=np.uint8)
gf256.region_muladd_multi(multi, sym.reshape(-1), np.arange(9) * 1000, coefs[None, :], 9, 1000)
assert np.array_equal(multi[0], ref)
print(gf256.KERNEL)
"""


@pytest.mark.parametrize("name", [*gf256.AVAILABLE, "nope"])
def test_the_kernel_can_be_forced_by_environment(name, tmp_path):
    env = {**os.environ, gf256.KERNEL_ENV: name, "NUMBA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", FORCED], env=env, capture_output=True, text=True, timeout=300
    )
    if name == "nope":
        assert run.returncode != 0
        assert f"{gf256.KERNEL_ENV}='nope': this host runs one of" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [name]


MULTI_VARIANTS = [gf256.region_muladd_multi_tiled, gf256.region_dot_multi_tiled] + (
    [gf256.region_muladd_multi_shuffle, gf256.region_dot_multi_shuffle]
    if gf256.HAVE_SHUFFLE
    else []
)


@pytest.mark.parametrize("multi", MULTI_VARIANTS, ids=lambda f: f.__name__)
def test_multi_output_kernels_are_sums_of_reference_products(multi):
    """Several outputs from one pass over the sources (register accumulators in groups of
    four outputs, 64- and 32-byte steps, a table tail or, for the dot variants, a last
    overlapping vector): every output row equals the sum of reference products, added to it
    (muladd) or instead of it (dot), rows past the coefficients and bytes past n untouched."""
    dot = "dot" in multi.__name__
    rng = np.random.default_rng(11)
    for r in (1, 2, 3, 4, 5, 9):
        for n in (0, 5, 32, 33, 64, 100, 127, 1280, 1283):
            m = int(rng.integers(0, 40))
            flat = rng.integers(0, 256, 40 * 1300, dtype=np.uint8)
            offsets = rng.integers(0, flat.size - n + 1, size=m + 1).astype(np.int64)
            coefs = rng.integers(0, 256, (r, m + 2)).astype(np.uint8)
            out = rng.integers(0, 256, (r + 1, n + 3), dtype=np.uint8)
            expected = out.copy()
            if dot:
                expected[:r, :n] = 0
            for k in range(r):
                for i in range(m):
                    expected[k, :n] ^= REF[coefs[k, i]][flat[offsets[i] : offsets[i] + n]]
            multi(out, flat, offsets, coefs, m, n)
            assert np.array_equal(out, expected), (r, n, m)
    out = np.zeros((2, 64), dtype=np.uint8)
    coefs = np.ones((2, 1), dtype=np.uint8)
    with pytest.raises(ValueError, match="past the buffer"):
        multi(out, np.zeros(100, np.uint8), np.array([40], np.int64), coefs, 1, 64)
    with pytest.raises(ValueError, match="out of bounds"):
        multi(out, np.zeros(100, np.uint8), np.array([0], np.int64), coefs, 1, 65)
    with pytest.raises(ValueError, match="output rows"):
        multi(out[:1], np.zeros(100, np.uint8), np.array([0], np.int64), coefs, 1, 64)


def test_region_copy_and_zero_touch_exactly_the_shorter_length():
    rng = np.random.default_rng(4)
    for n_dst, n_src, off in [(0, 5, 0), (13, 13, 3), (1280, 1283, 5), (40, 17, 1)]:
        src = _unaligned(rng.integers(0, 256, n_src, dtype=np.uint8), off)
        buf = rng.integers(0, 256, n_dst + 8, dtype=np.uint8)
        before = buf.copy()
        dst = buf[off : off + n_dst]
        gf256.region_copy(dst, src)
        n = min(n_dst, n_src)
        assert np.array_equal(dst[:n], src[:n])
        assert np.array_equal(buf[off + n :], before[off + n :])
        assert np.array_equal(buf[:off], before[:off])
        gf256.region_zero(dst)
        assert not dst.any() and np.array_equal(buf[off + n_dst :], before[off + n_dst :])
