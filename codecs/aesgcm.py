"""AES-256-GCM over whole runs of datagrams in one compiled call.

kvtransport.core.wire seals and opens each datagram with ``cryptography``'s ``AESGCM``: one
Python call per datagram, about 0.9 us for 1,280 bytes on an idle host of which the cipher
itself is a third (the rest is the call, the nonce, the slices and the result object). The
data path's runs of sources (a sender's run of source slots, a receiver's run of in-order
sources) instead go through the kernels here: they call the system's OpenSSL libcrypto
(the EVP AES-256-GCM that ``cryptography`` runs as well) straight from numba, so one Python
call seals or opens a whole run, headers included.

The contract (tests/test_aesgcm.py checks it against ``AESGCM`` byte for byte):

- :class:`GcmKey` holds one 32-byte key's two EVP contexts (sealing and opening), keyed
  once; a run kernel sets only each datagram's nonce. Not thread-safe: one caller at a
  time (a Framer or a Parser each own theirs).
- :func:`seal_run` writes ``count`` datagrams back to back into ``out``: the 28-byte header
  ``header`` with the sequence number and ESI fields (u32, big-endian, at ``seq_at`` and
  ``esi_at``) set to ``seq + k`` and ``esi + k``, then symbol ``esi + k`` of ``payload``
  sealed under the nonce ``direction (u32) | seq + k (u64)`` with the header as associated
  data, then the 16-byte tag (with no key, ``ctx`` 0: the plain symbol and no tag). The
  symbol ``last_esi`` comes from ``last_symbol`` (the zero-padded last one).
- :func:`open_run` takes datagrams ``i, i + 1, ...`` (before ``stop``) of a buffer
  (datagram j is ``buf[starts[j]:ends[j]]``) while each is exactly the expected one: its
  length, its header equal to ``header`` with ``seq + k`` and ``esi + k`` set (on the bytes
  ``check`` marks), and its tag verified; the plaintext goes to ``out`` at ``(esi + k) *
  size`` only after the tag verified (it is decrypted into ``scratch`` first), so a forged
  datagram writes nothing. Returns the index of the first datagram not taken.

Availability: :data:`AVAILABLE` is False where no libcrypto of OpenSSL 1.1 or later loads
(the callers keep their per-datagram ``AESGCM`` path) or where the environment variable
``KVTRANSPORT_AEAD=python`` asks for that path (tests and benchmarks force each).

Which libcrypto: the system's (``ctypes.util.find_library("crypto")``), or the file the
environment variable ``KVTRANSPORT_LIBCRYPTO`` names, for a newer OpenSSL than the system
ships without replacing it (OpenSSL 3.0 has no AES-GCM path for VAES/AVX-512; later releases
do). A named file that does not load as an OpenSSL libcrypto with AES-256-GCM fails the
import with a one-line :class:`~kvtransport.errors.UserError`: no silent fallback. The
kernels' EVP calls are bound to the loaded library's own functions by address (before any
kernel is compiled or loaded from the cache), so they and :class:`GcmKey`'s contexts always
come from the same library, whatever other libcrypto the process has loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from llvmlite import binding as llvm_binding
from numba import njit, types
from numba.core import cgutils

from kvtransport.errors import UserError

if TYPE_CHECKING:
    # as in kvtransport.codecs.gf256: to mypy an intrinsic is untyped
    def intrinsic(func: Callable[..., Any]) -> Any: ...
else:
    from numba.extending import intrinsic

AEAD_ENV = "KVTRANSPORT_AEAD"
LIBCRYPTO_ENV = "KVTRANSPORT_LIBCRYPTO"
HEADER_BYTES = 28
TAG_BYTES = 16
NONCE_BYTES = 12
_GCM_GET_TAG = 0x10  # EVP_CTRL_GCM_GET_TAG
_GCM_SET_TAG = 0x11  # EVP_CTRL_GCM_SET_TAG
_MIN_OPENSSL = 0x10100000  # 1.1.0: EVP_CIPHER_CTX_new and friends as used here


_KERNEL_CALLS = (
    "EVP_EncryptInit_ex",
    "EVP_EncryptUpdate",
    "EVP_EncryptFinal_ex",
    "EVP_DecryptInit_ex",
    "EVP_DecryptUpdate",
    "EVP_DecryptFinal_ex",
    "EVP_CIPHER_CTX_ctrl",
)
"""The libcrypto functions the run kernels call (bound by address in ``_open``)."""


def _open(name: str) -> ctypes.CDLL:
    """``name`` loaded as a libcrypto with AES-256-GCM, its kernel calls bound for numba's
    linker; OSError, AttributeError or RuntimeError (with the reason) if it is not one."""
    lib = ctypes.CDLL(name)
    lib.OpenSSL_version_num.restype = ctypes.c_ulong
    if lib.OpenSSL_version_num() < _MIN_OPENSSL:
        raise RuntimeError(f"OpenSSL {lib.OpenSSL_version_num():#x} is older than 1.1")
    lib.EVP_aes_256_gcm.restype = ctypes.c_void_p
    if not lib.EVP_aes_256_gcm():
        raise RuntimeError("it has no AES-256-GCM")
    for fn in _KERNEL_CALLS:
        llvm_binding.add_symbol(fn, ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value)
    lib.EVP_CIPHER_CTX_new.restype = ctypes.c_void_p
    lib.EVP_CIPHER_CTX_free.argtypes = [ctypes.c_void_p]
    lib.EVP_CIPHER_CTX_free.restype = None
    for init in (lib.EVP_EncryptInit_ex, lib.EVP_DecryptInit_ex):
        init.argtypes = [ctypes.c_void_p] * 5
        init.restype = ctypes.c_int
    lib.OpenSSL_version.restype = ctypes.c_char_p
    lib.OpenSSL_version.argtypes = [ctypes.c_int]
    return lib


def _load_libcrypto() -> ctypes.CDLL | None:
    """libcrypto with AES-256-GCM (``LIBCRYPTO_ENV``'s file, else the system's), its kernel
    calls bound; None if there is none (or the environment asks for the per-datagram
    path). A file named in ``LIBCRYPTO_ENV`` that fails raises UserError."""
    if os.environ.get(AEAD_ENV, "").strip().lower() == "python":
        return None
    forced = os.environ.get(LIBCRYPTO_ENV, "").strip()
    if forced:
        try:
            return _open(forced)
        except (OSError, AttributeError, RuntimeError) as exc:
            why = "not an OpenSSL libcrypto" if isinstance(exc, AttributeError) else exc
            raise UserError(f"{LIBCRYPTO_ENV}={forced}: {why}") from None
    names = [ctypes.util.find_library("crypto"), "libcrypto.so.3", "libcrypto.so.1.1"]
    for name in dict.fromkeys(n for n in names if n):
        try:
            return _open(name)
        except (OSError, AttributeError, RuntimeError):
            continue
    return None


def libcrypto_version() -> str | None:
    """The OpenSSL version the run kernels call (like ``OpenSSL 3.0.19 27 Jan 2026``), or
    None where they are not available."""
    if _LIB is None:
        return None
    return _LIB.OpenSSL_version(0).decode()  # OPENSSL_VERSION


_LIB = _load_libcrypto()
AVAILABLE = _LIB is not None
"""Whether the run kernels can be used here (module docstring)."""

_vp, _i32 = types.voidptr, types.int32
_encrypt_init: Any = types.ExternalFunction("EVP_EncryptInit_ex", _i32(_vp, _vp, _vp, _vp, _vp))
_encrypt_update: Any = types.ExternalFunction("EVP_EncryptUpdate", _i32(_vp, _vp, _vp, _vp, _i32))
_encrypt_final: Any = types.ExternalFunction("EVP_EncryptFinal_ex", _i32(_vp, _vp, _vp))
_decrypt_init: Any = types.ExternalFunction("EVP_DecryptInit_ex", _i32(_vp, _vp, _vp, _vp, _vp))
_decrypt_update: Any = types.ExternalFunction("EVP_DecryptUpdate", _i32(_vp, _vp, _vp, _vp, _i32))
_decrypt_final: Any = types.ExternalFunction("EVP_DecryptFinal_ex", _i32(_vp, _vp, _vp))
_ctx_ctrl: Any = types.ExternalFunction("EVP_CIPHER_CTX_ctrl", _i32(_vp, _i32, _i32, _vp))
_memcpy: Any = types.ExternalFunction("memcpy", _vp(_vp, _vp, types.intp))
"""libc's memcpy: numba's slice assignment copies through a temporary (the two arrays
might overlap), about 14x slower for a 1,280-byte symbol. Callers check bounds first."""


@intrinsic
def _ptr(typingctx, address):  # noqa: ANN001, ANN202 (numba typing signature)
    """An integer address as a ``void *`` for the EVP calls."""
    sig = types.voidptr(types.intp)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


class GcmKey:
    """One AES-256 key's EVP contexts for the run kernels (module docstring). ``seal_ctx``
    and ``open_ctx`` are the contexts' addresses; they are freed with the object."""

    __slots__ = ("seal_ctx", "open_ctx", "__weakref__")

    def __init__(self, key: bytes) -> None:
        if _LIB is None:
            raise RuntimeError("no libcrypto with AES-256-GCM is available (aesgcm.AVAILABLE)")
        if len(key) != 32:
            raise ValueError(f"an AES-256 key is 32 bytes (got {len(key)})")
        lib = _LIB
        cipher = lib.EVP_aes_256_gcm()
        ctxs: list[int] = []
        for init in (lib.EVP_EncryptInit_ex, lib.EVP_DecryptInit_ex):
            ctx = lib.EVP_CIPHER_CTX_new()
            if not ctx:
                raise MemoryError("EVP_CIPHER_CTX_new failed")
            ctxs.append(ctx)
            if init(ctx, cipher, None, key, None) != 1:
                for c in ctxs:
                    lib.EVP_CIPHER_CTX_free(c)
                raise RuntimeError("libcrypto refused the AES-256-GCM key")
        self.seal_ctx, self.open_ctx = ctxs
        weakref.finalize(self, _free_contexts, lib, tuple(ctxs))


def _free_contexts(lib: ctypes.CDLL, ctxs: tuple[int, ...]) -> None:
    for ctx in ctxs:
        lib.EVP_CIPHER_CTX_free(ctx)


@njit(cache=True, nogil=True)
def _put_u32(a: np.ndarray, at: int, v: int) -> None:
    a[at] = (v >> 24) & 0xFF
    a[at + 1] = (v >> 16) & 0xFF
    a[at + 2] = (v >> 8) & 0xFF
    a[at + 3] = v & 0xFF


@njit(cache=True, nogil=True)
def _put_nonce(nonce: np.ndarray, direction: int, seq: int) -> None:
    _put_u32(nonce, 0, direction)
    _put_u32(nonce, 4, (seq >> 32) & 0xFFFFFFFF)
    _put_u32(nonce, 8, seq & 0xFFFFFFFF)


@njit(cache=True, nogil=True)
def seal_run(
    ctx: int,
    header: np.ndarray,
    seq_at: int,
    esi_at: int,
    direction: int,
    seq: int,
    esi: int,
    count: int,
    payload: np.ndarray,
    size: int,
    last_esi: int,
    last_symbol: np.ndarray,
    out: np.ndarray,
) -> int:
    """Seal ``count`` datagrams into ``out`` (module docstring); returns the bytes written,
    or -1 if libcrypto failed (nothing to send then)."""
    tag = TAG_BYTES if ctx else 0
    whole = HEADER_BYTES + size + tag
    if count <= 0 or out.size < count * whole or header.size != HEADER_BYTES:
        return 0 if count <= 0 else -1
    nonce = np.empty(NONCE_BYTES, np.uint8)
    outl = np.zeros(1, np.int32)
    c = _ptr(ctx)
    null = _ptr(0)
    at = 0
    for k in range(count):
        e = esi + k
        if e == last_esi:
            if last_symbol.size < size:
                return -1
            src = last_symbol.ctypes.data
        else:
            if e < 0 or (e + 1) * size > payload.size:
                return -1
            src = payload.ctypes.data + e * size
        _memcpy(_ptr(out.ctypes.data + at), _ptr(header.ctypes.data), HEADER_BYTES)
        _put_u32(out, at + seq_at, seq + k)
        _put_u32(out, at + esi_at, e)
        body = at + HEADER_BYTES
        if not ctx:
            _memcpy(_ptr(out.ctypes.data + body), _ptr(src), size)
        else:
            _put_nonce(nonce, direction, seq + k)
            o = _ptr(outl.ctypes.data)
            if (
                _encrypt_init(c, null, null, null, _ptr(nonce.ctypes.data)) != 1
                or _encrypt_update(c, null, o, _ptr(out.ctypes.data + at), HEADER_BYTES) != 1
                or _encrypt_update(
                    c, _ptr(out.ctypes.data + body), o, _ptr(src), size
                ) != 1
                or _encrypt_final(c, null, o) != 1
                or _ctx_ctrl(c, _GCM_GET_TAG, TAG_BYTES, _ptr(out.ctypes.data + body + size)) != 1
            ):  # fmt: skip
                return -1
        at += whole
    return at


@njit(cache=True, nogil=True)
def open_run(
    ctx: int,
    buf: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    i: int,
    stop: int,
    header: np.ndarray,
    check: np.ndarray,
    seq_at: int,
    esi_at: int,
    direction: int,
    seq: int,
    esi: int,
    size: int,
    out: np.ndarray,
    scratch: np.ndarray,
) -> int:
    """Open the run of expected datagrams from index ``i`` (module docstring); returns the
    index of the first one not taken."""
    tag = TAG_BYTES if ctx else 0
    whole = HEADER_BYTES + size + tag
    if header.size != HEADER_BYTES or check.size != HEADER_BYTES or scratch.size < size:
        return i
    want = header.copy()
    nonce = np.empty(NONCE_BYTES, np.uint8)
    outl = np.zeros(1, np.int32)
    c = _ptr(ctx)
    null = _ptr(0)
    j = i
    stop = min(stop, starts.size, ends.size)
    while j < stop:
        k = j - i
        a = starts[j]
        if ends[j] - a != whole or a < 0 or ends[j] > buf.size:
            break
        e = esi + k
        if e < 0 or (e + 1) * size > out.size:
            break
        _put_u32(want, seq_at, seq + k)
        _put_u32(want, esi_at, e)
        same = True
        for b in range(HEADER_BYTES):
            if check[b] and buf[a + b] != want[b]:
                same = False
                break
        if not same:
            break
        body = a + HEADER_BYTES
        dst = _ptr(out.ctypes.data + e * size)
        if not ctx:
            _memcpy(dst, _ptr(buf.ctypes.data + body), size)
        else:
            _put_nonce(nonce, direction, seq + k)
            o = _ptr(outl.ctypes.data)
            if (
                _decrypt_init(c, null, null, null, _ptr(nonce.ctypes.data)) != 1
                or _decrypt_update(c, null, o, _ptr(buf.ctypes.data + a), HEADER_BYTES) != 1
                or _decrypt_update(
                    c, _ptr(scratch.ctypes.data), o, _ptr(buf.ctypes.data + body), size
                ) != 1
                or _ctx_ctrl(c, _GCM_SET_TAG, TAG_BYTES, _ptr(buf.ctypes.data + body + size)) != 1
                or _decrypt_final(c, _ptr(scratch.ctypes.data), o) != 1
            ):  # fmt: skip
                break  # a tag that does not verify (or a libcrypto failure): not taken
            _memcpy(dst, _ptr(scratch.ctypes.data), size)
        j += 1
    return j
