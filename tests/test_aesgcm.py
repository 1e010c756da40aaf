"""The compiled AES-256-GCM run kernels (kvtransport.codecs.aesgcm) against ``cryptography``'s
AESGCM, byte for byte, and the wire layer's use of them (Framer.seal_sources,
Parser.source_run on laid-out datagrams) against the per-datagram path."""

import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvtransport.codecs import aesgcm

from kvtransport.core import wire

KEY = bytes(range(32, 64))
TID = 0x1234_5678_9ABC_DEF0
SOURCE = int(wire.DatagramType.SOURCE)
WHOLE = {True: wire.HEADER_SIZE + wire.TAG_SIZE, False: wire.HEADER_SIZE}  # overhead


def test_the_kernels_are_available_on_linux_with_openssl():
    assert aesgcm.AVAILABLE  # CI and users' hosts: Linux with OpenSSL 1.1 or 3
    env = {**os.environ, aesgcm.AEAD_ENV: "python"}
    code = "from kvtransport.codecs import aesgcm; print(aesgcm.AVAILABLE)"
    forced = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert forced.stdout.strip() == "False", forced.stderr


_BOUND_TO = """
import ctypes, json
import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from llvmlite import binding
from kvtransport.codecs import aesgcm
lib = aesgcm._LIB
bound = {f: binding.address_of_symbol(f) for f in aesgcm._KERNEL_CALLS}
own = {f: ctypes.cast(getattr(lib, f), ctypes.c_void_p).value for f in aesgcm._KERNEL_CALLS}
key = bytes(range(32))
header = np.zeros(28, np.uint8)
payload = np.arange(1280, dtype=np.uint8)
out = np.zeros(1280 + 44, np.uint8)
gcm = aesgcm.GcmKey(key)  # kept: its contexts are freed with it
aesgcm.seal_run(gcm.seal_ctx, header, 16, 20, 0, 7, 0, 1, payload, 1280, 0, payload, out)
aad = bytes(16) + (7).to_bytes(4, "big") + bytes(8)  # seq 7 at byte 16, ESI 0 at 20
want = aad + AESGCM(key).encrypt(bytes(4) + (7).to_bytes(8, "big"), payload.tobytes(), aad)
maps = open("/proc/self/maps").read()
print(json.dumps({"bound": bound, "own": own, "same": out.tobytes() == want,
                  "version": aesgcm.libcrypto_version(), "maps": maps}))
"""


def test_kvtransport_libcrypto_binds_the_kernels_to_the_named_file(tmp_path):
    """With KVTRANSPORT_LIBCRYPTO naming a copy of the system's libcrypto (another file,
    so another load at other addresses), the kernels' EVP calls are that copy's functions,
    also where the system's is loaded too, and they still seal as AESGCM does."""
    system = ctypes.util.find_library("crypto")
    assert system is not None
    found = ctypes.CDLL(system)
    path = tmp_path / "libcrypto-copy.so.3"
    shutil.copy(os.path.realpath(_loaded_path(found)), path)
    env = {**os.environ, aesgcm.LIBCRYPTO_ENV: str(path)}
    env.pop(aesgcm.AEAD_ENV, None)
    preload = f"import ctypes; ctypes.CDLL({system!r}, mode=ctypes.RTLD_GLOBAL)\n"
    got = subprocess.run([sys.executable, "-c", preload + _BOUND_TO], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert got.returncode == 0, got.stderr
    res = json.loads(got.stdout)
    assert str(path) in res["maps"]
    assert res["bound"] == res["own"]  # the copy's functions, not the system's
    assert res["same"] and res["version"].startswith("OpenSSL ")


def _loaded_path(lib: ctypes.CDLL) -> str:
    """The file a loaded library came from (from this process's mappings)."""
    name = os.path.basename(lib._name)
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(name) or f"/{name}" in line:
            return line.split()[-1]
    raise AssertionError(f"{name} is not mapped")


@pytest.mark.parametrize(
    ("value", "message"),
    [("/no/such/libcrypto.so.3", "cannot open shared object"), ("libc.so.6", "not an OpenSSL")],
)
def test_a_bad_kvtransport_libcrypto_is_a_one_line_error(value, message):
    env = {**os.environ, aesgcm.LIBCRYPTO_ENV: value}
    env.pop(aesgcm.AEAD_ENV, None)
    cli = [sys.executable, "-m", "kvtransport", "simulate", "--size-mb", "1"]
    got = subprocess.run(cli, env=env, capture_output=True, text=True)
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and aesgcm.LIBCRYPTO_ENV in lines[0] and message in lines[0]


def _header(size: int, sealed: bool, tid: int = TID, dtype: int = SOURCE) -> np.ndarray:
    flags = wire.FLAG_SEALED if sealed else 0
    h = wire.HEADER.pack(wire.MAGIC, wire.VERSION, dtype, flags, 0, size, tid, 0, 0, 0, 0)
    return np.frombuffer(h, np.uint8)


def _symbols(rng: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A payload of n symbols whose last is short, and that last one zero-padded."""
    payload = rng.integers(0, 256, n * size - size // 3, dtype=np.uint8)
    last = np.zeros(size, np.uint8)
    tail = payload[(n - 1) * size :]
    last[: tail.size] = tail
    return payload, last


@pytest.mark.parametrize("size", [1, 16, 17, 1280, 1400])
@pytest.mark.parametrize("direction", [0, 1])
def test_seal_run_is_aesgcm_byte_for_byte(size, direction):
    """Every datagram of a run: the header with its seq and ESI, the symbol sealed under
    the nonce direction | seq with the header as associated data, the tag; the last ESI's
    symbol from the padded copy. Sequence numbers above 2^24 and ESIs across a byte
    boundary exercise the big-endian fields."""
    rng = np.random.default_rng(size + direction)
    n, seq, esi0 = 40, (1 << 24) + 250, 0
    payload, last = _symbols(rng, n, size)
    cipher = AESGCM(KEY)
    key = aesgcm.GcmKey(KEY)
    header = _header(size, True)
    out = np.zeros(n * (size + WHOLE[True]), np.uint8)
    count = n - esi0
    wrote = aesgcm.seal_run(
        key.seal_ctx, header, 16, 24, direction, seq, esi0, count, payload, size, n - 1, last, out
    )
    assert wrote == out.size
    whole = size + WHOLE[True]
    for k in range(count):
        e = esi0 + k
        h = wire.HEADER.pack(wire.MAGIC, wire.VERSION, SOURCE, 1, 0, size, TID, seq + k, 0, 0, e)
        sym = last if e == n - 1 else payload[e * size : (e + 1) * size]
        nonce = wire._NONCE.pack(direction, seq + k)
        want = h + cipher.encrypt(nonce, sym.tobytes(), h)
        assert out[k * whole : (k + 1) * whole].tobytes() == want, k


def test_seal_run_refuses_what_does_not_fit():
    """An output too short, a symbol beyond the payload: -1 and nothing claimed written."""
    key = aesgcm.GcmKey(KEY)
    payload = np.zeros(100, np.uint8)
    last = np.zeros(64, np.uint8)
    h = _header(64, True)
    short = np.zeros(2 * (64 + WHOLE[True]) - 1, np.uint8)
    assert aesgcm.seal_run(key.seal_ctx, h, 16, 24, 0, 0, 0, 2, payload, 64, 9, last, short) == -1
    room = np.zeros(3 * (64 + WHOLE[True]), np.uint8)  # ESI 1 ends past the 100 bytes
    assert aesgcm.seal_run(key.seal_ctx, h, 16, 24, 0, 0, 0, 3, payload, 64, 9, last, room) == -1


def _laid(datagrams: list[bytes]) -> wire.LaidOutDatagrams:
    return wire.LaidOutDatagrams.join(datagrams)


def _open(key, laid, i, stop, seq, esi, size, out, sealed=True):
    return aesgcm.open_run(
        key.open_ctx if sealed else 0, laid.buf, laid.starts, laid.ends, i, stop,
        _header(size, sealed), wire._SOURCE_CHECKED, 16, 24, 0, seq, esi, size, out,
        np.zeros(size, np.uint8),
    )  # fmt: skip


@pytest.mark.parametrize("sealed", [True, False])
def test_open_run_takes_exactly_the_expected_datagrams(sealed):
    """A run of 30 sources opens whole; each kind of stranger ends it where it lies, and
    a forged one writes nothing into its slot: a flipped tag, payload or header byte
    (checked field or the key field the check skips: then the tag fails), a datagram one
    byte longer or shorter, the wrong packet number or ESI, another transfer's."""
    size, n = 48, 30
    rng = np.random.default_rng(5)
    payload, last = _symbols(rng, n, size)
    framer = wire.Framer(TID, KEY if sealed else None)
    data = framer.seal_sources(0, 0, n, payload, size, n - 1, last)
    key = aesgcm.GcmKey(wire.transfer_key(KEY, TID))  # the framer's transfer key
    out = np.zeros(n * size, np.uint8)
    laid = _laid(data)
    assert _open(key, laid, 0, n, 0, 0, size, out, sealed) == n
    assert out[: (n - 1) * size].tobytes() == payload[: (n - 1) * size].tobytes()
    assert _open(key, laid, 4, 9, 4, 4, size, out, sealed) == 9  # stop is respected
    bad: list[tuple[str, bytes]] = []
    d = bytearray(data[10])
    if sealed:
        bad.append(("tag", bytes(d[:-1] + bytes([d[-1] ^ 1]))))
        bad.append(("key field", bytes(d[:20] + bytes([d[20] ^ 1]) + d[21:])))
    bad.append(("payload", bytes(d[:40] + bytes([d[40] ^ 0x80]) + d[41:])))
    bad.append(("flags", bytes(d[:4] + bytes([d[4] ^ wire.FLAG_RETRANSMIT]) + d[5:])))
    bad.append(("longer", bytes(d) + b"\0"))
    bad.append(("shorter", bytes(d[:-1])))
    bad.append(("transfer", bytes(d[:15] + bytes([d[15] ^ 1]) + d[16:])))
    bad.append(("seq", data[11]))  # the next one: wrong packet number and ESI here
    for what, x in bad:
        fresh = np.zeros(n * size, np.uint8)
        took = _open(key, _laid(data[:10] + [x] + data[10:]), 0, n + 1, 0, 0, size, fresh, sealed)
        if what == "payload" and not sealed:
            assert took == 11, what  # no tag: taken; the genuine one after it is not next
            continue
        assert took == 10, what
        assert not fresh[10 * size : 11 * size].any(), what
    assert _open(key, laid, 0, n, 0, 1, size, np.zeros(n * size, np.uint8), sealed) == 0  # ESI
    small = np.zeros(5 * size, np.uint8)  # the output ends at ESI 5: the run stops there
    assert _open(key, laid, 0, n, 0, 0, size, small, sealed) == 5


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_framer_seal_sources_equals_seal_one_by_one(monkeypatch, sealed, compiled):
    """Framer.seal_sources gives Framer.seal's datagrams (compiled, or one seal each where
    the kernels are unavailable), moves the framer's packet numbers on as they do, and
    refuses a packet number already used."""
    monkeypatch.setattr(aesgcm, "AVAILABLE", compiled and aesgcm.AVAILABLE)
    size, n = 1280, 20
    payload, last = _symbols(np.random.default_rng(1), n, size)
    ref = wire.Framer(TID, KEY if sealed else None)
    want = [
        ref.seal(
            SOURCE, 7 + e, (last if e == n - 1 else payload[e * size : (e + 1) * size]).tobytes(), e
        )
        for e in range(n)
    ]
    framer = wire.Framer(TID, KEY if sealed else None)
    got = framer.seal_sources(7, 0, 12, payload, size, n - 1, last)
    got += framer.seal_sources(19, 12, 8, payload, size, n - 1, last)
    assert got == want
    with pytest.raises(ValueError, match="nonce reuse"):
        framer.seal_sources(26, 0, 1, payload, size, n - 1, last)
    with pytest.raises(ValueError, match="do not fit"):
        framer.seal_sources(40, 15, 6, payload, size, n - 1, last)


@pytest.mark.parametrize("sealed", [True, False])
def test_parser_source_run_laid_out_equals_the_per_datagram_loop(sealed):
    """The same run through Parser.source_run as a list and laid out: the same datagrams
    taken (up to a forged one) and the same bytes; with a key nothing is taken before the
    parser has derived the transfer's cipher (parse has seen it)."""
    size, n = 64, 50
    payload, last = _symbols(np.random.default_rng(2), n, size)
    data = wire.Framer(TID, KEY if sealed else None).seal_sources(
        0, 0, n, payload, size, n - 1, last
    )
    forged = bytearray(data[30])
    forged[-1] ^= 1
    batch = data[:30] + [bytes(forged)] + data[30:]
    results = []
    for laid in (False, True):
        p = wire.Parser(KEY if sealed else None)
        out = np.zeros(n * size, np.uint8)
        run = _laid(batch) if laid else batch
        if sealed:
            assert p.source_run(run, 1, len(run), TID, 1, 1, size, memoryview(out)) == 1
        p.parse(batch[0])
        took = p.source_run(run, 1, len(run), TID, 1, 1, size, memoryview(out))
        results.append((took, out.tobytes()))
    assert results[0] == results[1]
    assert results[0][0] == (30 if sealed else 31)


def test_gcm_key_checks_its_length():
    with pytest.raises(ValueError, match="32 bytes"):
        aesgcm.GcmKey(bytes(16))
