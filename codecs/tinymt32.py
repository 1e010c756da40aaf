"""TinyMT32 pseudorandom number generator exactly as RFC 8682.

RFC 8681 derives the coding coefficients of every repair symbol from TinyMT32 seeded with the
repair key, so sender and receiver must agree bit for bit with the RFC's reference C code
(section 2.1 of RFC 8682, parameter set mat1=0x8f7011ee, mat2=0xfc78ff1f, tmat=0x3793fdff).

The generator state is four 32-bit words. The numba kernels hold them in ``uint64`` values and
mask every result to 32 bits, which reproduces the C ``uint32_t`` wrap-around without relying
on numba's small-integer promotion rules. ``tinymt32_seed``, ``tinymt32_step`` and
``tinymt32_output`` work on a 4-tuple so that callers in numba (the RLC coefficient generator)
keep the state in registers; ``TinyMT32`` is the Python-facing wrapper.
"""

from __future__ import annotations

import numpy as np
from numba import njit

MAT1 = 0x8F7011EE
MAT2 = 0xFC78FF1F
TMAT = 0x3793FDFF

_M32 = np.uint64(0xFFFFFFFF)
_MASK31 = np.uint64(0x7FFFFFFF)
_MAT1 = np.uint64(MAT1)
_MAT2 = np.uint64(MAT2)
_TMAT = np.uint64(TMAT)
_INIT_MULT = np.uint64(1812433253)
_ONE = np.uint64(1)
_SH1 = np.uint64(10)
_SH8 = np.uint64(8)
_SH30 = np.uint64(30)
_PRE_LOOP = 8
_T, _I, _N, _Y = (np.uint64(ord(ch)) for ch in "TINY")


# The generator is written on a 4-tuple of state words so that numba keeps the state in
# registers inside the coefficient loop; the array-based wrappers below serve Python callers.


@njit(cache=True, nogil=True, inline="always")
def tinymt32_step(
    s0: np.uint64, s1: np.uint64, s2: np.uint64, s3: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """One state transition (RFC 8682 tinymt32_next_state) on the four state words."""
    y = s3
    x = (s0 & _MASK31) ^ s1 ^ s2
    x ^= (x << _ONE) & _M32
    y ^= (y >> _ONE) ^ x
    n1 = s2
    n2 = x ^ ((y << _SH1) & _M32)
    if y & _ONE:
        n1 ^= _MAT1
        n2 ^= _MAT2
    return s1, n1, n2, y


@njit(cache=True, nogil=True, inline="always")
def tinymt32_output(s0: np.uint64, s1: np.uint64, s2: np.uint64, s3: np.uint64) -> np.uint64:
    """The tempered output of a state (RFC 8682 tinymt32_temper)."""
    t1 = (s0 + (s2 >> _SH8)) & _M32
    t0 = s3 ^ t1
    if t1 & _ONE:
        t0 ^= _TMAT
    return t0


@njit(cache=True, nogil=True, inline="always")
def _init_mix(i: int, prev: np.uint64) -> np.uint64:
    return (np.uint64(i) + _INIT_MULT * (prev ^ (prev >> _SH30))) & _M32


@njit(cache=True, nogil=True, inline="always")
def tinymt32_seed(seed: int) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """The state after RFC 8682 tinymt32_init(seed) with the RFC parameter set."""
    s0, s1, s2, s3 = np.uint64(seed) & _M32, _MAT1, _MAT2, _TMAT
    # The RFC's loop "status[i & 3] ^= i + 1812433253 * (p ^ (p >> 30))" for i = 1..7, with
    # p = status[(i - 1) & 3], unrolled so the state stays in scalars.
    s1 ^= _init_mix(1, s0)
    s2 ^= _init_mix(2, s1)
    s3 ^= _init_mix(3, s2)
    s0 ^= _init_mix(4, s3)
    s1 ^= _init_mix(5, s0)
    s2 ^= _init_mix(6, s1)
    s3 ^= _init_mix(7, s2)
    # Period certification: the all-zero state (top bit of word 0 ignored) is a fixed point.
    if (s0 & _MASK31) == 0 and s1 == 0 and s2 == 0 and s3 == 0:
        s0, s1, s2, s3 = _T, _I, _N, _Y
    for _ in range(_PRE_LOOP):
        s0, s1, s2, s3 = tinymt32_step(s0, s1, s2, s3)
    return s0, s1, s2, s3


@njit(cache=True, nogil=True)
def tinymt32_init(status: np.ndarray, seed: int) -> None:
    """Seed ``status`` (uint64[4]) like RFC 8682 tinymt32_init."""
    status[0], status[1], status[2], status[3] = tinymt32_seed(seed)


@njit(cache=True, nogil=True)
def tinymt32_generate_uint32(status: np.ndarray) -> np.uint64:
    """Advance ``status`` and return the next 32-bit output (in a uint64)."""
    s = tinymt32_step(status[0], status[1], status[2], status[3])
    status[0], status[1], status[2], status[3] = s
    return tinymt32_output(s[0], s[1], s[2], s[3])


@njit(cache=True, nogil=True)
def _fill_uint32(status: np.ndarray, out: np.ndarray) -> None:
    for i in range(out.shape[0]):
        out[i] = tinymt32_generate_uint32(status)


class TinyMT32:
    """RFC 8682 TinyMT32 seeded with a 32-bit ``seed``.

    >>> TinyMT32(1).generate_uint32()
    2545341989
    """

    def __init__(self, seed: int) -> None:
        if not 0 <= int(seed) <= 0xFFFFFFFF:
            raise ValueError(f"TinyMT32 seed must fit in 32 bits, got {seed}")
        self._status = np.zeros(4, dtype=np.uint64)
        tinymt32_init(self._status, int(seed))

    def generate_uint32(self) -> int:
        """Next pseudorandom integer in [0, 2^32)."""
        return int(tinymt32_generate_uint32(self._status))

    def generate_many(self, n: int) -> np.ndarray:
        """The next ``n`` outputs as a uint32 array (one numba call)."""
        out = np.empty(int(n), dtype=np.uint64)
        _fill_uint32(self._status, out)
        return out.astype(np.uint32)

    def rand16(self) -> int:
        """RFC 8681 tinymt32_rand16: the low 4 bits of the next output, in 0..15."""
        return self.generate_uint32() & 0xF

    def rand256(self) -> int:
        """RFC 8681 tinymt32_rand256: the low 8 bits of the next output, in 0..255."""
        return self.generate_uint32() & 0xFF
