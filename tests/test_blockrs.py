"""Block Reed-Solomon baseline: any k of k+p symbols give the block back, fewer never invent
one, and the decoder speaks the RLC decoder's interface."""

import random

import numpy as np
import pytest
import reedsolo
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransport.codecs.blockrs import BlockRSDecoder, BlockRSEncoder
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


def test_parity_is_the_rs_codeword_of_each_byte_position():
    size, k, p = 6, 4, 3
    sources, repairs, _ = make_block_stream(size, k, p, 1, 7)
    for j in range(size):
        column = bytes(s[j] for s in sources)
        parity = reedsolo.rs_encode_msg(column, p)[k:]  # systematic: message then parity
        assert bytes(repairs[(0, i)][j] for i in range(p)) == bytes(parity)


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
