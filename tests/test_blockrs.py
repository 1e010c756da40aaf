"""Block Reed-Solomon baseline: any k of k+p symbols give the block back, fewer never invent
one, and the decoder speaks the RLC decoder's interface."""

import itertools
import random

import numpy as np
import pytest
import reedsolo
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransport.codecs.blockrs import (
    BlockRSDecoder,
    BlockRSEncoder,
    _gf_invert,
    parity_matrix,
    reedsolo_decode_block,
    reedsolo_encode_block,
)
from kvtransport.codecs.gf256 import MUL_TABLE
from kvtransport.codecs.rlc import RLCDecoder


def make_block_stream(size, k, p, blocks, seed):
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(k * blocks)]
    enc = BlockRSEncoder(size, k, p, max_blocks=blocks)
    for s in sources:
        enc.add_source(s)
    packets = []
    for b in range(blocks):
        packets += [("source", b * k + i) for i in range(k)]
        packets += [("repair", (b * k, k, j, 15)) for j in range(p)]
    repairs = {(b * k, j): r for b in range(blocks) for j, r in enumerate(enc.repairs(b))}
    return sources, repairs, packets


def deliver(dec, sources, repairs, packet):
    kind, args = packet
    if kind == "source":
        return dec.add_source(args, sources[args])
    first, nss, key, dt = args
    return dec.add_repair(first, nss, key, dt, repairs[(first, key)])


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 12),
    p=st.integers(1, 6),
    size=st.integers(1, 24),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_k_of_k_plus_p_recover_the_block(k, p, size, extra, seed):
    sources, repairs, packets = make_block_stream(size, k, p, 1, seed)
    rng = random.Random(seed)
    received = rng.sample(packets, min(k + p, k + extra))
    dec = BlockRSDecoder(size, k, p)
    got, decoded = [], set()
    for n, packet in enumerate(received, start=1):
        new = deliver(dec, sources, repairs, packet)
        got += new
        own = [packet[1]] if packet[0] == "source" else []
        if n < k:  # fewer than k symbols: only the sources themselves are known
            assert new == own
        decoded |= set(new) - set(own)
    assert sorted(got) == list(range(k))
    assert [dec.get(e) for e in range(k)] == sources
    assert set(dec.recovered) == decoded
    assert {e for e in range(k) if ("source", e) not in received} <= decoded
    assert dec.decoded_through == k - 1 and dec.missing(0, k) == []


CODES = [(1, 1), (4, 3), (8, 32), (32, 8), (200, 55), (254, 1)]


@pytest.mark.parametrize(("k", "p"), CODES)
def test_repairs_are_reedsolos_encoding_byte_for_byte(k, p):
    """The matrix path computes exactly reedsolo's systematic RS code, byte position by byte
    position (37 bytes: not a multiple of the kernels' 8-byte lanes)."""
    size = 37
    sources, repairs, _ = make_block_stream(size, k, p, 2, seed=k * 1000 + p)
    rs = reedsolo.RSCodec(nsym=p)  # reedsolo's defaults: prim 0x11D, generator 2, fcr 0
    for b in range(2):
        block = np.frombuffer(b"".join(sources[b * k : (b + 1) * k]), np.uint8).reshape(k, size)
        want = np.array([list(rs.encode(bytes(block[:, j]))[k:]) for j in range(size)]).T
        got = np.frombuffer(b"".join(repairs[(b * k, i)] for i in range(p)), np.uint8)
        assert np.array_equal(got.reshape(p, size), want)


def receive_subset(k, p, size, keep, seed):
    """Deliver only the block's symbols whose codeword positions are in ``keep``."""
    sources, repairs, packets = make_block_stream(size, k, p, 1, seed)
    dec = BlockRSDecoder(size, k, p)
    got = []
    for pos in keep:
        got += deliver(dec, sources, repairs, packets[pos])
    return sources, repairs, dec, got


def test_every_k_of_k_plus_p_positions_decode_exactly():
    k, p, size = 4, 3, 21
    for keep in itertools.combinations(range(k + p), k):
        sources, _, dec, got = receive_subset(k, p, size, keep, seed=sum(keep))
        assert sorted(got) == list(range(k)), keep
        assert [dec.get(e) for e in range(k)] == sources, keep
        assert set(dec.recovered) == {e for e in range(k) if e not in keep}


@pytest.mark.parametrize(("k", "p"), [(32, 8), (8, 32), (200, 55)])
def test_large_codes_decode_like_reedsolo(k, p):
    """Random k-subsets of big codes (up to 55 lost sources) give back the sources, and the
    direct reedsolo path decodes the same erasure pattern to the same bytes."""
    size = 13
    rng = random.Random(k + p)
    for trial in range(3):
        lost = rng.sample(range(k), min(p, k))
        keep = [pos for pos in range(k + p) if pos not in lost]
        keep = [pos for pos in keep if pos < k] + rng.sample(
            [pos for pos in keep if pos >= k], len(lost)
        )
        sources, repairs, dec, got = receive_subset(k, p, size, keep, seed=trial)
        assert [dec.get(e) for e in range(k)] == sources
        assert sorted(set(got) - set(keep)) == sorted(lost)
        word = np.zeros((k + p, size), np.uint8)
        for pos in keep:
            word[pos] = np.frombuffer(sources[pos] if pos < k else repairs[(0, pos - k)], np.uint8)
        erased = [pos for pos in range(k + p) if pos not in keep]
        ref = reedsolo_decode_block(word, erased, k)
        assert [row.tobytes() for row in ref] == sources


def test_reference_path_and_parity_matrix_agree():
    k, p = 6, 4
    data = np.random.default_rng(5).integers(0, 256, (k, 11), dtype=np.uint8)
    pm = parity_matrix(k, p)
    assert pm.shape == (p, k) and not pm.flags.writeable
    assert parity_matrix(k, p) is pm  # derived once per code
    want = np.zeros((p, 11), np.uint8)
    for i in range(p):
        for c in range(k):
            want[i] ^= MUL_TABLE[pm[i, c]][data[c]]
    assert np.array_equal(reedsolo_encode_block(data, p), want)


def test_gf_inverse_and_singular_matrices():
    rng = np.random.default_rng(11)
    for n in (1, 2, 7, 40):
        a = rng.integers(0, 256, (n, n), dtype=np.uint8)
        inv = _gf_invert(a)  # these seeded random matrices are all invertible
        prod = np.zeros((n, n), np.uint8)
        for i in range(n):
            for j in range(n):
                prod[i] ^= MUL_TABLE[a[i, j]][inv[j]]
        assert np.array_equal(prod, np.eye(n, dtype=np.uint8)), n
    singular = np.array([[1, 2], [2, 4]], dtype=np.uint8)  # row 2 = 2 * row 1
    with pytest.raises(ValueError, match="singular"):
        _gf_invert(singular)


def test_blocks_decode_independently_and_the_window_slides():
    size, k, p, blocks = 8, 4, 2, 30
    sources, repairs, packets = make_block_stream(size, k, p, blocks, 3)
    dec = BlockRSDecoder(size, k, p, max_blocks=3)
    rng = random.Random(3)
    lost_sources = set()
    for packet in packets:
        if rng.random() < 0.2:
            if packet[0] == "source":
                lost_sources.add(packet[1])
            continue
        for e in deliver(dec, sources, repairs, packet):
            assert dec.get(e) == sources[e]
    assert dec.base == (blocks - 3) * k
    assert len(dec._repairs) <= 3 and len(dec._have) <= 3  # bounded on a long stream
    assert dec.stats["recovered"] > 0
    # A block is complete iff at least k of its k+p symbols arrived.
    for b in range(blocks - 3, blocks):
        esis = range(b * k, b * k + k)
        assert all(dec.known(e) for e in esis) or any(e in lost_sources for e in esis)


def test_encoder_checks_repair_names_and_block_completeness():
    enc = BlockRSEncoder(4, 3, 2, max_blocks=2)
    for i in range(4):
        enc.add_source(bytes([i]))
    with pytest.raises(ValueError, match="not complete"):
        enc.repair(3, 3, 0)
    for args in [(1, 3, 0), (0, 2, 0), (0, 3, 2)]:
        with pytest.raises(ValueError, match="multiple of k"):
            enc.repair(*args)
    out = bytearray(6)
    enc.repair_into(out, 0, 3, 1)
    assert bytes(out[:4]) == enc.repair(0, 3, 1)
    for i in range(4, 9):
        enc.add_source(bytes([i]))
    with pytest.raises(ValueError, match="left the encoder"):
        enc.repair(0, 3, 0)
    with pytest.raises(ValueError):
        BlockRSEncoder(4, 200, 56)


def test_same_interface_as_the_rlc_decoder():
    rlc, rs = RLCDecoder(8, max_window=16), BlockRSDecoder(8, 4, 2, max_blocks=4)
    for name in [
        "add_source",
        "add_repair",
        "get",
        "read_into",
        "known",
        "missing",
        "release_before",
        "decoded_through",
        "recovered",
        "base",
        "stats",
    ]:
        assert hasattr(rlc, name) and hasattr(rs, name), name
    for dec in (rlc, rs):
        assert dec.add_source(1, b"x") == [1]
        assert dec.add_source(1, b"x") == []
        assert dec.missing(0, 3) == [0, 2] and dec.decoded_through == -1
        buf = bytearray(8)
        assert dec.read_into(1, buf) and bytes(buf) == b"x" + bytes(7)
        dec.release_before(2)
        assert dec.get(1) is None and dec.missing(0, 3) == [2]
