"""TinyMT32 pseudorandom number generator exactly as RFC 8682.

RFC 8681 derives the coding coefficients of every repair symbol from TinyMT32 seeded with the
repair key, so sender and receiver must agree bit for bit with the RFC's reference C code
(section 2.1 of RFC 8682, parameter set mat1=0x8f7011ee, mat2=0xfc78ff1f, tmat=0x3793fdff).

The generator state is four 32-bit words. The numba kernels keep them in a ``uint64[4]``
array and mask every result to 32 bits, which reproduces the C ``uint32_t`` wrap-around
without relying on numba's small-integer promotion rules. ``tinymt32_init`` and
``tinymt32_generate_uint32`` are callable from other numba kernels (the RLC coefficient
generator draws from them inside its loop); ``TinyMT32`` is the Python-facing wrapper.
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
_MIN_LOOP = 8
_PRE_LOOP = 8


@njit(cache=True, nogil=True)
def tinymt32_next_state(status: np.ndarray) -> None:
    """Advance the 127-bit state by one step (RFC 8682 tinymt32_next_state)."""
    y = status[3]
    x = (status[0] & _MASK31) ^ status[1] ^ status[2]
    x ^= (x << _ONE) & _M32
    y ^= (y >> _ONE) ^ x
    status[0] = status[1]
    status[1] = status[2]
    status[2] = x ^ ((y << _SH1) & _M32)
    status[3] = y
    if y & _ONE:
        status[1] ^= _MAT1
        status[2] ^= _MAT2


@njit(cache=True, nogil=True)
def tinymt32_temper(status: np.ndarray) -> np.uint64:
    """Output function (RFC 8682 tinymt32_temper)."""
    t0 = status[3]
    t1 = (status[0] + (status[2] >> _SH8)) & _M32
    t0 ^= t1
    if t1 & _ONE:
        t0 ^= _TMAT
    return t0


@njit(cache=True, nogil=True)
def tinymt32_init(status: np.ndarray, seed: int) -> None:
    """Seed ``status`` (uint64[4]) like RFC 8682 tinymt32_init with the RFC parameter set."""
    status[0] = np.uint64(seed) & _M32
    status[1] = _MAT1
    status[2] = _MAT2
    status[3] = _TMAT
    for i in range(1, _MIN_LOOP):
        prev = status[(i - 1) & 3]
        status[i & 3] ^= (np.uint64(i) + _INIT_MULT * (prev ^ (prev >> _SH30))) & _M32
    # Period certification: the all-zero state (top bit of word 0 ignored) is a fixed point.
    if (status[0] & _MASK31) == 0 and status[1] == 0 and status[2] == 0 and status[3] == 0:
        status[0] = np.uint64(ord("T"))
        status[1] = np.uint64(ord("I"))
        status[2] = np.uint64(ord("N"))
        status[3] = np.uint64(ord("Y"))
    for _ in range(_PRE_LOOP):
        tinymt32_next_state(status)


@njit(cache=True, nogil=True)
def tinymt32_generate_uint32(status: np.ndarray) -> np.uint64:
    """Next 32-bit output (returned in a uint64 holding a value below 2^32)."""
    tinymt32_next_state(status)
    return tinymt32_temper(status)


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
