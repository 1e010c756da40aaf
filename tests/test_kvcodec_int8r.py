"""int8r: int8 blocks entropy-coded without loss (kvtransport.codecs.kvcodec's int8 layout)
as a sendable precision (kvtransport.kvformat.blocks): the same values as int8 bit for bit,
blocks that decode alone, forged blocks refused and counted, manifest version 5 beside the
older ones, and the plan's size for it."""

import dataclasses
import json
import struct
import zlib

import numpy as np
import pytest
from kvtransport.codecs import kvcodec, quant

from kvtransport.kvformat import blocks, card
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import plan, utility

BT = 16
H, D = 3, 64  # SmolLM2's kv heads and head_dim


def _kv_like(layers=4, tokens=70, dtype=np.float32, seed=0):
    """A cache shaped like a real model's: keys on per-channel offsets with two large
    outlier channels and a slow drift along the tokens, values plain."""
    rng = np.random.default_rng(seed)
    offsets = rng.standard_normal((layers, H, 1, D)) * 2
    offsets[..., [5, 40]] += 12.0
    drift = np.sin(np.arange(tokens) / 9.0)[None, None, :, None] * rng.standard_normal(D)
    k = offsets + drift + rng.standard_normal((layers, H, tokens, D)) * 0.4
    v = rng.standard_normal((layers, H, tokens, D)) * 0.3
    ids = rng.integers(0, 49152, tokens)
    return KVCache(k.astype(dtype), v.astype(dtype), ids, "test-model")


def _encode(cache, precision, order=None):
    u = utility.cache_utility(cache, BT)
    o = np.arange(u.size) if order is None else order
    return blocks.encode_stream(cache, u, o, precision, block_tokens=BT)


def _rows(n=5, tokens=BT, seed=0):
    kv = np.random.default_rng(seed).standard_normal((n, 2, H, tokens, D)).astype(np.float32)
    return quant.quantize_kv(kv, 8, D, False)


def _coded(rows, tokens=BT):
    buf, lengths = kvcodec.encode_int8_rows(rows, H, tokens, D)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return buf, offsets, lengths


# ---------------------------------------------------------------------------------------
# The codec


@pytest.mark.parametrize("tokens", [16, 5, 1])
def test_int8_rows_come_back_bit_for_bit(tokens):
    rows = _rows(tokens=tokens)
    rows[1, : 2 * H * tokens * D] = 0  # one symbol only
    rows[2, : 2 * H * tokens * D : 2] = 255  # 0/255 alternating: escapes everywhere
    rows[2, 1 : 2 * H * tokens * D : 2] = 0
    rows[3, : 2 * H * tokens * D] = 255
    buf, offsets, lengths = _coded(rows, tokens)
    out = np.zeros_like(rows)
    status = kvcodec.decode_int8_rows(buf, offsets, lengths, H, tokens, D, out)
    assert status.tolist() == [0] * rows.shape[0]
    assert np.array_equal(out, rows)
    for j in range(rows.shape[0]):  # each block alone, from its own bytes only
        one = np.zeros_like(rows[:1])
        blk = buf[offsets[j] : offsets[j] + lengths[j]].copy()
        assert kvcodec.decode_int8_rows(blk, [0], [blk.size], H, tokens, D, one).tolist() == [0]
        assert np.array_equal(one[0], rows[j])
    if tokens == BT:
        assert lengths[1] < lengths[0] / 3  # one code everywhere: its anchors and scales


def _int8_forgeries(coded, rng):
    """Every truncation, one flipped bit at every byte, a few random multi-byte edits."""
    out = [coded[:n] for n in range(coded.size)]
    for i in range(coded.size):
        f = coded.copy()
        f[i] ^= 1 << int(rng.integers(8))
        out.append(f)
    for _ in range(100):
        f = coded.copy()
        at = rng.integers(0, f.size, int(rng.integers(2, 8)))
        f[at] = rng.integers(0, 256, at.size)
        out.append(f)
    return out


def test_forged_or_truncated_int8_blocks_get_a_status_never_an_exception():
    rows = _rows(n=1, seed=3)
    buf, _, _ = _coded(rows)
    coded_part = buf.size - (rows.shape[1] - kvcodec.int8_codes_nbytes(H, BT, D))
    refused = 0
    forgeries = _int8_forgeries(buf[:coded_part], np.random.default_rng(4))
    for f in forgeries:
        f = np.concatenate([f, buf[coded_part:]])  # the scales, sent as they are
        out = np.zeros_like(rows)
        st = int(kvcodec.decode_int8_rows(f, [0], [f.size], H, BT, D, out)[0])
        refused += st != 0
        if st:
            assert kvcodec.error_name(st) in kvcodec._ERRORS.values()
    # every truncation and nearly every edit of the coded part is refused: the rANS lanes
    # must end where the encoder began, the streams exactly at their lengths, every code
    # within 0..255 (the scales are the CRC-32's to guard)
    assert refused >= coded_part + 0.95 * (len(forgeries) - coded_part)


# ---------------------------------------------------------------------------------------
# The precision


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_int8r_decodes_to_exactly_int8s_values_in_fewer_bytes(dtype):
    c = _kv_like(dtype=dtype)
    a, b = _encode(c, "int8"), _encode(c, "int8r")
    ra = blocks.decode_stream(a.manifest_bytes, a.payload)
    rb = blocks.decode_stream(b.manifest_bytes, b.payload)
    assert rb.missing.size == 0 and rb.corrupted.size == 0
    assert np.array_equal(ra.cache.keys, rb.cache.keys)
    assert np.array_equal(ra.cache.values, rb.cache.values)
    assert b.payload.size < 0.99 * a.payload.size  # the keys' offsets, anchored
    assert b.manifest.version == 5 and b.manifest_bytes[4:6] == b"\x05\x00"
    # the block table is the coded blocks', back to back; the transport's the same
    assert np.array_equal(b.manifest.offset[1:], np.cumsum(b.manifest.length)[:-1])
    assert b.manifest.payload_nbytes == b.payload.size
    assert np.array_equal(b.to_transfer().blocks.lengths, b.manifest.length)
    # a racing receiver's range decoder gives the same values, range by range
    dec = blocks.RangeDecoder(blocks.Manifest.from_bytes(b.manifest_bytes))
    for r in range(dec.manifest.geometry.token_blocks):
        assert dec.take_range(b.payload, r) is not None
    assert np.array_equal(dec.keys, ra.cache.keys) and not dec.failed.any()


def test_int8r_mixes_with_other_precisions_block_by_block():
    c = _kv_like(layers=3, tokens=40)
    g = blocks.Geometry.of(c, BT)
    codes = np.full((g.num_layers, g.token_blocks), blocks.PRECISIONS.index("int8"))
    codes[::2, 1] = blocks.PRECISIONS.index("int8r")
    codes[1, 0] = blocks.PRECISIONS.index("int4")
    codes[2, 2] = -1  # dropped
    s = blocks.encode_stream(c, utility.cache_utility(c, BT), np.arange(g.num_blocks)[::-1],
                             codes, block_tokens=BT)  # fmt: skip
    r = blocks.decode_stream(s.manifest_bytes, s.payload)
    ref = blocks.decode_stream(*_pair(_encode(c, "int8")))
    int8_or_r = np.isin(codes, [2, 5]).repeat(BT, axis=1)[:, None, : c.num_tokens, None]
    same = np.broadcast_to(int8_or_r, c.keys.shape)
    assert np.array_equal(r.cache.keys[same], ref.cache.keys[same])
    assert np.array_equal(r.cache.values[same], ref.cache.values[same])
    assert not np.array_equal(r.cache.keys[~same], ref.cache.keys[~same])  # int4 and dropped
    assert r.missing.size == 0 and s.manifest.num_blocks == g.num_blocks - 1


def _pair(s):
    return s.manifest_bytes, s.payload


def test_a_lost_int8r_block_is_missing_alone_and_the_rest_exact():
    c = _kv_like()
    s = _encode(c, "int8r")
    ref = blocks.decode_stream(*_pair(_encode(c, "int8")))
    lost = 7
    complete = np.ones(s.manifest.num_blocks, bool)
    complete[lost] = False
    payload = s.payload.copy()
    m = s.manifest
    payload[m.offset[lost] : m.offset[lost] + m.length[lost]] = 0  # never read
    r = blocks.decode_stream(s.manifest_bytes, payload, complete)
    assert r.missing.tolist() == [lost] and r.corrupted.size == 0
    layer, lo = int(m.layer[lost]), int(m.token_start[lost])
    span = slice(lo, lo + int(m.token_count[lost]))
    expect = np.ones_like(r.present)
    expect[layer, span] = False
    assert np.array_equal(r.present, expect)
    there = np.broadcast_to(expect[:, None, :, None], c.keys.shape)
    assert np.array_equal(r.cache.keys[there], ref.cache.keys[there])
    assert np.array_equal(r.cache.values[there], ref.cache.values[there])
    # the receiver recomputes the lost range: here, it puts that block back from int8's
    # values; the cache is then exactly int8's
    r.cache.keys[layer, :, span] = ref.cache.keys[layer, :, span]
    r.cache.values[layer, :, span] = ref.cache.values[layer, :, span]
    assert np.array_equal(r.cache.keys, ref.cache.keys)
    assert np.array_equal(r.cache.values, ref.cache.values)


def _forged_stream(s, i, edit):
    """``s`` with block ``i``'s bytes replaced by ``edit(bytes)`` and the manifest made
    consistent with them (length and CRC-32 recomputed): a forgery the CRC cannot catch."""
    m = s.manifest
    old = s.payload[m.offset[i] : m.offset[i] + m.length[i]]
    new = edit(old.copy())
    payload = np.concatenate([s.payload[: m.offset[i]], new,
                              s.payload[m.offset[i] + m.length[i] :]])  # fmt: skip
    coded = m.length.copy()
    coded[i] = new.size
    checksum = m.checksum.copy()
    checksum[i] = zlib.crc32(new)
    forged = dataclasses.replace(m, coded_length=coded, checksum=checksum)
    return forged.to_bytes(), payload


@pytest.mark.parametrize("how", ["flip", "truncate", "pad"])
def test_a_forged_int8r_block_is_refused_and_counted_never_a_crash(how):
    c = _kv_like()
    s = _encode(c, "int8r")
    ref = blocks.decode_stream(*_pair(_encode(c, "int8")))
    i = 5
    edits = {
        "flip": lambda b: np.where(np.arange(b.size) == b.size // 2, b ^ 0x10, b).astype(np.uint8),
        "truncate": lambda b: b[: b.size - 700],
        "pad": lambda b: np.concatenate([b[:40], np.zeros(3, np.uint8), b[40:]]),
    }
    mb, payload = _forged_stream(s, i, edits[how])
    r = blocks.decode_stream(mb, payload)
    assert r.corrupted.tolist() == [i] and r.missing.tolist() == [i]
    ok = np.broadcast_to(r.present[:, None, :, None], c.keys.shape)
    assert np.array_equal(r.cache.keys[ok], ref.cache.keys[ok])
    dec = blocks.RangeDecoder(blocks.Manifest.from_bytes(mb))
    rng = int(dec.manifest.token_block[i])
    assert dec.take_range(payload, rng) is None
    assert dec.failed.tolist() == [j == i for j in range(dec.manifest.num_blocks)]
    assert dec.take_range(payload, rng) is None  # still refused when asked again
    other = (rng + 1) % dec.manifest.geometry.token_blocks
    assert dec.take_range(payload, other) is not None


def test_manifest_version_5_round_trips_and_older_versions_still_read(tmp_path):
    c = _kv_like(tokens=40)
    s = _encode(c, "int8r")
    m = blocks.Manifest.from_bytes(s.manifest_bytes)
    assert m.version == 5
    assert np.array_equal(m.length, s.manifest.length)
    assert m.to_bytes() == s.manifest_bytes
    assert blocks.Manifest.from_json(json.loads(json.dumps(m.to_json()))).to_bytes() == m.to_bytes()
    # a card holds it: written, read back, decoded to int8's values
    path = card.write_card(tmp_path / "c.safetensors", s)
    back = card.load_cache(path)
    ref = blocks.decode_stream(*_pair(_encode(c, "int8")))
    assert np.array_equal(back.cache.keys, ref.cache.keys)
    # the older versions are read as before: no length column, lengths from the geometry
    for p, v in (("fp16", 1), ("int4", 3), ("k8v4", 4)):
        old = _encode(c, p)
        assert old.manifest.version == v and old.manifest.coded_length is None
        assert blocks.Manifest.from_bytes(old.manifest_bytes).length.tolist() == \
            old.manifest.length.tolist()  # fmt: skip
    # the same body under version 4 lacks the length column a reader needs: refused
    as_v4 = bytearray(s.manifest_bytes)
    as_v4[4:6] = b"\x04\x00"
    as_v4[-4:] = struct.pack("<I", zlib.crc32(bytes(as_v4[:-4])))
    with pytest.raises(blocks.ManifestError, match="body"):
        blocks.Manifest.from_bytes(bytes(as_v4))


@pytest.mark.parametrize("column", ["fixed", "huge", "zero"])
def test_a_length_column_that_cannot_hold_is_refused(column):
    c = _kv_like(tokens=40)
    g = blocks.Geometry.of(c, BT)
    codes = np.full((g.num_layers, g.token_blocks), blocks.PRECISIONS.index("int8r"))
    codes[0, 0] = blocks.PRECISIONS.index("int8")
    s = blocks.encode_stream(c, utility.cache_utility(c, BT), np.arange(g.num_blocks), codes,
                             block_tokens=BT)  # fmt: skip
    n = s.manifest.num_blocks
    i = 0 if column == "fixed" else 1  # block 0 is int8: its length is the geometry's
    value = {"fixed": int(s.manifest.length[0]) - 1, "huge": 10**8, "zero": 0}[column]
    with pytest.raises(blocks.ManifestError, match="length"):
        blocks.Manifest.from_bytes(_with_length(s.manifest_bytes, n, i, value))
    blocks.Manifest.from_bytes(_with_length(s.manifest_bytes, n, i, int(s.manifest.length[i])))


def _with_length(manifest_bytes, n, i, value):
    """A version-5 manifest with block ``i``'s entry of the length column set to
    ``value``, framed and checksummed as a sender would (a forgery only the reader's
    checks can catch)."""
    fixed = blocks._FIXED
    magic, version, flags, jlen, blen = fixed.unpack_from(manifest_bytes)
    body = bytearray(zlib.decompress(manifest_bytes[fixed.size + jlen : -4]))
    at = (2 + 4 + 1 + 4 + 4) * n + 4 * i  # the columns before it, then block i's
    body[at : at + 4] = struct.pack("<I", value)
    z = zlib.compress(bytes(body))
    out = fixed.pack(magic, version, flags, jlen, len(z))
    out += manifest_bytes[fixed.size : fixed.size + jlen] + z
    return out + struct.pack("<I", zlib.crc32(out))


# ---------------------------------------------------------------------------------------
# The plan


def test_plan_sizes_int8r_from_the_cache_and_prefers_it_to_int8_at_int8s_fidelity():
    c = _kv_like(tokens=70)
    g = blocks.Geometry.of(c, BT)
    s = _encode(c, "int8r")
    real = s.payload.size / _encode(c, "int8").payload.size
    from_card = blocks.estimate_coded(g, c, s.manifest)
    assert from_card.int8r_ratio == pytest.approx(real, rel=1e-9)
    sampled = blocks.estimate_coded(g, c, sample=8)  # 8 of the 16 full blocks
    assert sampled.int8r_ratio == pytest.approx(real, abs=0.03)
    assert sampled.block_nbytes("int8r") == round(sampled.int8r_ratio * g.block_nbytes("int8"))
    assert sampled == g  # the ratio is the plan's, not the stream's geometry
    fid = blocks.DEFAULT_FIDELITY
    assert fid["int8r"] == fid["int8"]
    # listed beside int8, int8r (fewer bytes, the same fidelity) wins its place
    assert plan.menu(sampled, ("fp16", "int8", "int8r", "int4")) == ("fp16", "int8r", "int4")
    assert plan.parse_levels("fp16,int8r,int4") == ("fp16", "int8r", "int4")
    assert "int8r" not in plan.DEFAULT_LEVELS  # opt-in


def test_a_planned_handoff_sends_int8r_where_listed_and_the_receiver_gets_int8s_values():
    c = _kv_like(tokens=96)
    c.values[:] = c.keys  # keys and values on per-channel offsets: far below int8's bytes
    g = blocks.Geometry.of(c, BT)
    u = utility.cache_utility(c, BT)
    card_stream = blocks.encode_stream(c, u, np.arange(g.num_blocks), block_tokens=BT)
    link = plan.LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    kw = dict(link=link, budget_s=10.0, levels=("int8r",))
    p, s = plan.planned_stream(card_stream, **kw)
    assert p.split == 0 and np.all(s.manifest.precision == blocks.PRECISIONS.index("int8r"))
    # planned at the cache's own coded size (every full block sampled here), not a default
    assert s.payload.size < 0.9 * g.cost_table(("int8",)).sum()
    assert p.payload_bytes == pytest.approx(s.payload.size, rel=0.01)
    ref = blocks.decode_stream(*_pair(_encode(c, "int8")))
    got = blocks.decode_stream(s.manifest_bytes, s.payload)
    assert np.array_equal(got.cache.keys, ref.cache.keys)
    assert np.array_equal(got.cache.values, ref.cache.values)
