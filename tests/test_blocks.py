"""Blocks, manifest and stream: determinism, bit-exact reassembly, loss and corruption."""

import json
import zlib

import numpy as np
import pytest

from kvtransport.core.transfer import BlockTable
from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import utility

BT = 16


def _cache(layers=4, heads=2, tokens=70, dim=64, dtype=np.float32, seed=0, attention=True):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((layers, heads, tokens, dim)) * 3).astype(dtype)
    v = rng.standard_normal((layers, heads, tokens, dim)).astype(dtype)
    att = rng.random((layers, tokens)).astype(np.float32) if attention else None
    ids = rng.integers(0, 49152, tokens)
    return KVCache(k, v, ids, "test-model", att)


def _encode(cache, precision=None, order="utility", **kw):
    u = utility.cache_utility(cache, BT)
    o = utility.stream_order(u, BT, order, seed=1)
    return blocks.encode_stream(cache, u, o, precision, block_tokens=BT, **kw)


def _token_slice(m, i):
    s = int(m.token_start[i])
    return slice(s, s + int(m.token_count[i]))


def test_encoding_is_deterministic():
    c = _cache()
    a, b = _encode(c, created={"by": "test"}), _encode(c, created={"by": "test"})
    assert a.manifest_bytes == b.manifest_bytes
    assert np.array_equal(a.payload, b.payload)
    # and it depends on the content: one changed value changes a checksum
    c.values[2, 1, 33, 5] += 1
    assert _encode(c, created={"by": "test"}).manifest_bytes != a.manifest_bytes


@pytest.mark.parametrize(
    "dtype,precision",
    [(np.float32, None), (np.float16, None), (np.float32, "fp32"), (np.float16, "fp16")],
)
def test_round_trip_is_bit_exact(dtype, precision):
    c = _cache(dtype=dtype)
    s = _encode(c, precision)
    r = blocks.decode_stream(s.manifest_bytes, s.payload.copy())
    assert r.cache.keys.dtype == dtype
    assert np.array_equal(r.cache.keys, c.keys) and np.array_equal(r.cache.values, c.values)
    assert np.array_equal(r.cache.token_ids, c.token_ids)
    assert r.cache.model_id == "test-model"
    assert r.present.all() and r.missing.size == 0 and r.corrupted.size == 0
    assert r.utility_recovered == pytest.approx(1.0, abs=1e-6)


def test_block_table_is_contiguous_and_matches_layout():
    c = _cache(tokens=70)  # 5 token blocks per layer, the last one of 6 tokens
    s = _encode(c)
    m = s.manifest
    assert m.num_blocks == 4 * 5
    assert np.array_equal(s.offsets[1:], s.offsets[:-1] + s.lengths[:-1])
    assert s.offsets[0] == 0 and s.lengths.sum() == s.payload.size
    assert set(m.token_count.tolist()) == {16, 6}
    assert np.all(s.lengths == 2 * 2 * m.token_count * 64 * 4)
    # each block's bytes are exactly that layer's K then V for its token range
    for i in range(m.num_blocks):
        raw = s.payload[s.offsets[i] : s.offsets[i] + s.lengths[i]].view("<f4")
        k, v = np.split(raw, 2)
        sl = _token_slice(m, i)
        assert np.array_equal(k.reshape(2, -1, 64), c.keys[m.layer[i], :, sl])
        assert np.array_equal(v.reshape(2, -1, 64), c.values[m.layer[i], :, sl])
    # the transport accepts it as is
    t = s.to_transfer()
    assert isinstance(t.blocks, BlockTable) and t.blocks.utilities.sum() <= 1.0


def test_missing_blocks_are_reported_exactly_and_masked_per_layer():
    c = _cache()
    s = _encode(c)
    m = s.manifest
    rng = np.random.default_rng(5)
    complete = rng.random(m.num_blocks) > 0.3
    payload = s.payload.copy()
    for i in np.flatnonzero(~complete):  # bytes of lost blocks are garbage, never read
        payload[s.offsets[i] : s.offsets[i] + s.lengths[i]] = rng.integers(0, 256, s.lengths[i])
    r = blocks.decode_stream(s.manifest_bytes, payload, complete)
    assert r.missing.tolist() == np.flatnonzero(~complete).tolist()
    assert r.corrupted.size == 0
    expect_present = np.ones((4, 70), bool)
    for i in range(m.num_blocks):
        sl, layer = _token_slice(m, i), m.layer[i]
        if complete[i]:
            assert np.array_equal(r.cache.keys[layer, :, sl], c.keys[layer, :, sl])
            assert np.array_equal(r.cache.values[layer, :, sl], c.values[layer, :, sl])
        else:
            expect_present[layer, sl] = False
            assert not r.cache.keys[layer, :, sl].any() and not r.cache.values[layer, :, sl].any()
    assert np.array_equal(r.present, expect_present)
    assert r.utility_recovered == pytest.approx(float(m.utility[complete].sum()), rel=1e-6)


def test_corrupted_blocks_count_as_missing_and_are_reported():
    c = _cache()
    s = _encode(c)
    payload = s.payload.copy()
    bad = [0, 7, 19]
    for i in bad:
        payload[s.offsets[i] + 11] ^= 0x40
    complete = np.ones(s.manifest.num_blocks, bool)
    complete[3] = False
    r = blocks.decode_stream(s.manifest_bytes, payload, complete)
    assert r.corrupted.tolist() == bad
    assert r.missing.tolist() == sorted([*bad, 3])
    assert blocks.corrupted_blocks(s.manifest, payload, complete).tolist() == bad
    as_bytes = blocks.decode_stream(s.manifest_bytes, payload.tobytes(), complete)
    assert as_bytes.missing.tolist() == r.missing.tolist()
    assert blocks.corrupted_blocks(s.manifest, bytearray(payload.tobytes())).tolist() == bad


def test_short_payload_for_a_complete_block_is_an_error():
    s = _encode(_cache())
    with pytest.raises(ValueError, match="shorter"):
        blocks.decode_stream(s.manifest_bytes, s.payload[:-1])
    complete = np.ones(s.manifest.num_blocks, bool)
    last = int(np.argmax(s.offsets))
    complete[last] = False  # the truncated block is not claimed: fine
    r = blocks.decode_stream(s.manifest_bytes, s.payload[: s.offsets[last]], complete)
    assert r.missing.tolist() == [last]


def test_every_single_byte_corruption_of_the_manifest_is_detected():
    s = _encode(_cache(layers=2, tokens=40))
    data = bytearray(s.manifest_bytes)
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(blocks.ManifestError):
            blocks.Manifest.from_bytes(bytes(bad))
    for cut in (0, 3, 15, 16, len(data) // 2, len(data) - 1):
        with pytest.raises(blocks.ManifestError):
            blocks.Manifest.from_bytes(bytes(data[:cut]))
    with pytest.raises(blocks.ManifestError):
        blocks.Manifest.from_bytes(bytes(data) + b"\0")


def _reframe(header: dict, body: bytes) -> bytes:
    """A well-framed manifest (valid CRC) around arbitrary content."""
    import struct

    head = json.dumps(header).encode()
    z = zlib.compress(body)
    out = struct.pack("<4sHHII", b"KVMF", 1, 0, len(head), len(z)) + head + z
    return out + struct.pack("<I", zlib.crc32(out))


def test_well_framed_but_inconsistent_manifests_are_rejected():
    s = _encode(_cache(layers=2, tokens=40))
    good = s.manifest
    header = good.header()
    n = good.num_blocks
    cols = lambda layer, tb, prec, util: (  # noqa: E731
        layer.astype("<u2").tobytes() + tb.astype("<u4").tobytes() + prec.astype("u1").tobytes()
        + good.checksum.astype("<u4").tobytes() + util.astype("<f4").tobytes()
    )  # fmt: skip
    ok = cols(good.layer, good.token_block, good.precision, good.utility)
    assert blocks.Manifest.from_bytes(_reframe(header, ok)).num_blocks == n
    bad_layer = good.layer.copy()
    bad_layer[0] = 9
    dup_tb = good.token_block.copy()
    dup_tb[1], dup_tb[0] = good.token_block[0], good.token_block[0]
    dup_layer = good.layer.copy()
    dup_layer[1] = good.layer[0]
    cases = {
        "outside": cols(bad_layer, good.token_block, good.precision, good.utility),
        "twice": cols(dup_layer, dup_tb, good.precision, good.utility),
        "precision": cols(good.layer, good.token_block, good.precision + 7, good.utility),
        "utilities": cols(good.layer, good.token_block, good.precision, good.utility * 3),
        "body holds": ok[:-1],
    }
    for msg, body in cases.items():
        with pytest.raises(blocks.ManifestError, match=msg):
            blocks.Manifest.from_bytes(_reframe(header, body))
    for key, value, msg in [
        ("layers", -1, "non-negative"),
        ("group_size", 24, "group_size"),
        ("dtype", "int7", "dtype"),
        ("num_blocks", 10**6, "geometry has fewer"),
    ]:
        with pytest.raises(blocks.ManifestError, match=msg):
            blocks.Manifest.from_bytes(_reframe({**header, key: value}, ok))
    del header["model_id"]
    with pytest.raises(blocks.ManifestError, match="lacks"):
        blocks.Manifest.from_bytes(_reframe(header, ok))


def test_manifest_json_round_trip_and_tamper_checks():
    s = _encode(_cache(), "int8")
    obj = json.loads(json.dumps(s.manifest.to_json()))
    back = blocks.Manifest.from_json(obj)
    assert back.to_bytes() == s.manifest_bytes
    obj["blocks"]["offset"][3] += 1
    with pytest.raises(blocks.ManifestError, match="offset"):
        blocks.Manifest.from_json(obj)


def test_manifest_is_compact():
    # SmolLM2 geometry at 1024 tokens: 30 layers x 64 token blocks = 1920 blocks
    c = _cache(layers=30, heads=3, tokens=1024, attention=True)
    s = _encode(c)
    per_block = (len(s.manifest_bytes) - 4 * 1024) / s.manifest.num_blocks
    assert per_block < 15, per_block  # raw columns are 15 bytes per block before zlib
    assert len(s.manifest_bytes) < 0.001 * s.payload.size
    hashed = _encode(c, include_token_ids=False)
    assert len(hashed.manifest_bytes) < len(s.manifest_bytes) - 1024


def test_token_ids_by_hash_only():
    c = _cache()
    s = _encode(c, include_token_ids=False)
    assert blocks.Manifest.from_bytes(s.manifest_bytes).token_ids is None
    r = blocks.decode_stream(s.manifest_bytes, s.payload, token_ids=c.token_ids)
    assert np.array_equal(r.cache.token_ids, c.token_ids)
    assert (blocks.decode_stream(s.manifest_bytes, s.payload).cache.token_ids == -1).all()
    wrong = c.token_ids.copy()
    wrong[0] += 1
    with pytest.raises(ValueError, match="hash"):
        blocks.decode_stream(s.manifest_bytes, s.payload, token_ids=wrong)


def test_mixed_precisions_and_dropped_blocks():
    c = _cache(tokens=64)
    g = blocks.Geometry.of(c, BT)
    u = utility.cache_utility(c, BT)
    order = utility.stream_order(u, BT)
    codes = np.random.default_rng(2).integers(-1, 4, u.shape)
    codes[:, 0] = 0  # keep the sinks lossless
    s = blocks.encode_stream(c, u, order, codes, block_tokens=BT)
    m = s.manifest
    assert m.num_blocks == int((codes >= 0).sum())
    flat = m.flat_index()
    assert np.array_equal(m.precision, codes.reshape(-1)[flat])
    assert np.array_equal(flat, order[codes.reshape(-1)[order] >= 0])  # order kept
    assert s.payload.size == sum(
        g.block_nbytes(blocks.PRECISIONS[p]) for p in codes.reshape(-1) if p >= 0
    )
    r = blocks.decode_stream(s.manifest_bytes, s.payload)
    assert r.missing.size == 0
    for layer in range(4):
        for tb in range(4):
            sl = slice(tb * BT, (tb + 1) * BT)
            got, want = r.cache.keys[layer, :, sl], c.keys[layer, :, sl]
            p = codes[layer, tb]
            assert r.present[layer, sl].all() == (p >= 0)
            if p < 0:
                assert not got.any()
            elif p == 0:
                assert np.array_equal(got, want)
            elif p == 1:
                assert np.allclose(got, want, rtol=2**-10, atol=1e-7)
            else:
                span = want.max() - want.min()
                assert np.abs(got - want).max() <= span / (255 if p == 2 else 15)


def test_plan_precision_uniform_and_mixed_budget():
    c = _cache(layers=6, tokens=160)
    g = blocks.Geometry.of(c, BT)
    u = utility.cache_utility(c, BT)
    assert (blocks.plan_precision(g, u, "int4") == 3).all()
    full16 = g.num_blocks * g.block_nbytes("fp16")
    for frac in (0.1, 0.3, 0.6):
        budget = int(frac * full16)
        codes = blocks.plan_precision(g, u, f"mixed:{budget}")
        s = blocks.encode_stream(c, u, utility.stream_order(u, BT), codes, block_tokens=BT)
        assert 0.9 * budget < s.payload.size <= budget
    assert blocks.parse_precision("mixed:1.5M") == ("mixed", int(1.5 * 2**20))
    for bad in ("fp8", "mixed:", "mixed:-3", "mixed:abc"):
        with pytest.raises(ValueError):
            blocks.parse_precision(bad)


def test_encode_rejects_bad_arguments():
    c = _cache()
    u = utility.cache_utility(c, BT)
    o = utility.stream_order(u, BT)
    with pytest.raises(ValueError, match="permutation"):
        blocks.encode_stream(c, u, o[:-1], block_tokens=BT)
    with pytest.raises(ValueError, match="utilities"):
        blocks.encode_stream(c, u[:, :-1], o, block_tokens=BT)
    with pytest.raises(ValueError, match="precision codes"):
        blocks.encode_stream(c, u, o, np.full(u.shape, 9), block_tokens=BT)
    huge = _cache()
    huge.keys[0, 0, 0, 0] = 1e6
    with pytest.raises(ValueError, match="float16"):
        blocks.encode_stream(huge, u, o, "fp16", block_tokens=BT)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # numba in place / numpy rows
@pytest.mark.parametrize(
    "precision,int4_keys",
    [("int8", "channel"), ("int4", "channel"), ("int4", "token"), ("k8v4", "channel"),
     ("k8v4", "token")],
)  # fmt: skip
def test_quantized_blocks_decode_to_exactly_the_reference_dequantization(
    precision, int4_keys, dtype
):
    from kvtransport.codecs import quant

    c = _cache(tokens=70, dtype=dtype)  # includes short tail blocks
    s = _encode(c, precision, int4_keys=int4_keys)
    r = blocks.decode_stream(s.manifest_bytes, s.payload)
    m = s.manifest
    k_bits = 4 if precision == "int4" else 8  # k8v4: keys as int8's, values as int4's
    v_bits = 8 if precision == "int8" else 4
    int4_group = 64 if int4_keys == "channel" else 32
    k_group = 64 if k_bits == 8 else int4_group
    v_group = 64 if v_bits == 8 else int4_group
    for i in range(m.num_blocks):
        layer, sl = m.layer[i], _token_slice(m, i)
        k, v = c.keys[layer, :, sl], c.values[layer, :, sl]
        channel = precision == "int4" and int4_keys == "channel"
        qk = quant.quantize_channels(k, 4) if channel else quant.quantize(k, k_bits, k_group)
        assert np.array_equal(r.cache.keys[layer, :, sl], quant.dequantize(qk, dtype))
        ref_v = quant.dequantize(quant.quantize(v, v_bits, v_group), dtype)
        assert np.array_equal(r.cache.values[layer, :, sl], ref_v)
    assert m.payload_nbytes == sum(
        quant.kv_nbytes_mixed(2, int(t), 64, k_bits, k_group, channel, v_bits, v_group)
        for t in m.token_count
    )


def test_k8v4_sits_between_int8_and_int4_and_is_version_4():
    c = _cache(tokens=70)
    g = blocks.Geometry.of(c)
    sizes = [g.block_nbytes(p) for p in ("int8", "k8v4", "int4")]
    assert sizes[0] > sizes[1] > sizes[2]
    # keys: int8 codes and one scale and zero per head vector; values: int4's layout
    assert sizes[1] == 2 * BT * 64 + 4 * 2 * BT + 2 * BT * 32 + 4 * 2 * BT
    errs = {}
    for p in ("int8", "k8v4", "int4"):
        r = blocks.decode_stream(*_encode_pair(c, p))
        errs[p] = (np.abs(r.cache.keys - c.keys).max(), np.abs(r.cache.values - c.values).max())
    assert errs["k8v4"][0] == errs["int8"][0]  # keys exactly as int8's
    assert errs["k8v4"][1] > 4 * errs["int8"][1]  # values as int4's
    s = _encode(c, "k8v4")
    assert s.manifest.version == 4  # an older reader refuses it by version, not mis-sized
    mixed = np.full((4, 5), blocks.PRECISIONS.index("int8"))
    mixed[1, 2] = blocks.PRECISIONS.index("k8v4")
    u = utility.cache_utility(c, BT)
    m = blocks.encode_stream(c, u, np.arange(20), mixed, block_tokens=BT).manifest
    assert m.version == 4
    assert blocks.Manifest.from_bytes(m.to_bytes()).precision.tolist() == m.precision.tolist()


def _encode_pair(cache, precision):
    s = _encode(cache, precision)
    return s.manifest_bytes, s.payload


def test_int4_keys_per_channel_are_version_3_and_older_int4_manifests_decode_per_token():
    c = _cache(tokens=40, dim=64)
    s = _encode(c, "int4")
    g = s.manifest.geometry
    assert (g.int4_keys, g.group_of("int4")) == ("channel", 64)
    # codes, K's scale and zero per channel and head, V's per head vector
    assert g.block_nbytes("int4") == 2 * 2 * BT * 32 + 4 * (2 * 64 + 2 * BT)
    # version 3, which older readers refuse instead of decoding keys per token
    assert s.manifest.version == 3 and s.manifest_bytes[4:6] == b"\x03\x00"
    assert _encode(c, "int8").manifest.version == 1  # no int4 block: older readers take it
    # a per-token stream whose manifest lacks the key (written before it): per token
    old = _encode(c, "int4", int4_keys="token", group_size=32)
    assert old.manifest.version == 1 and old.manifest.geometry.group_of("int4") == 32
    legacy = _edited_header(old.manifest_bytes, lambda h: h.pop("int4_keys"))
    assert blocks.Manifest.from_bytes(legacy).geometry.int4_keys == "token"
    ref = blocks.decode_stream(old.manifest_bytes, old.payload)
    got = blocks.decode_stream(legacy, old.payload)
    assert np.array_equal(got.cache.keys, ref.cache.keys) and got.missing.size == 0
    # the same bytes read per channel size the blocks otherwise: refused, not misread
    forged = _edited_header(old.manifest_bytes, lambda h: h.update(int4_keys="channel"))
    with pytest.raises(ValueError, match="shorter"):
        blocks.decode_stream(forged, old.payload)
    bad = _edited_header(s.manifest_bytes, lambda h: h.update(int4_keys="diagonal"))
    with pytest.raises(blocks.ManifestError, match="int4_keys"):
        blocks.Manifest.from_bytes(bad)
    with pytest.raises(ValueError, match="int4_keys"):
        _encode(c, "int4", int4_keys="diagonal")


def _edited_header(manifest_bytes: bytes, edit) -> bytes:
    """The manifest re-serialized after ``edit(header)`` changed its JSON header in place
    (a key left out: as a manifest written before that key existed)."""
    fixed = blocks._FIXED
    magic, version, flags, jlen, blen = fixed.unpack_from(manifest_bytes)
    head = json.loads(manifest_bytes[fixed.size : fixed.size + jlen])
    edit(head)
    body = manifest_bytes[fixed.size + jlen : fixed.size + jlen + blen]
    new_head = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    out = fixed.pack(magic, version, flags, len(new_head), blen) + new_head + body
    return out + zlib.crc32(out).to_bytes(4, "little")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_int8_groups_span_the_head_vector_and_older_manifests_keep_the_common_group(dtype):
    c = _cache(tokens=48, dim=64, dtype=dtype)
    s = _encode(c, "int8", int4_keys="token")
    g = s.manifest.geometry
    assert (g.group_size, g.group_of("int8"), g.group_of("int4")) == (32, 64, 32)
    # codes plus one float16 scale and zero per head vector of K and of V
    assert g.block_nbytes("int8") == 2 * 2 * BT * 64 + 2 * 2 * BT * 4
    assert s.payload.size == s.manifest.num_blocks * g.block_nbytes("int8")
    # version 2, which a version-1 reader refuses instead of mis-sizing the blocks; a
    # stream without int8 blocks in other groups stays version 1
    assert s.manifest.version == 2 and s.manifest_bytes[4:6] == b"\x02\x00"
    assert _encode(c, "int4", int4_keys="token").manifest.version == 1
    assert _encode(c, "fp16").manifest.version == 1
    # a stream encoded with 32-value int8 groups, its manifest without the new key (as
    # written before it existed): decodes exactly as with the key, not as 64-value groups
    old = _encode(c, "int8", int8_group_size=32, int4_keys="token")
    assert old.manifest.version == 1 and old.payload.size > s.payload.size
    legacy = _edited_header(old.manifest_bytes, lambda h: h.pop("int8_group_size"))
    assert blocks.Manifest.from_bytes(legacy).geometry.group_of("int8") == 32
    ref = blocks.decode_stream(old.manifest_bytes, old.payload)
    got = blocks.decode_stream(legacy, old.payload)
    assert np.array_equal(got.cache.keys, ref.cache.keys)
    assert np.array_equal(got.cache.values, ref.cache.values)
    assert got.missing.size == 0
    # a group that does not divide head_dim is refused in the header and when encoding
    bad = _edited_header(s.manifest_bytes, lambda h: h.update(int8_group_size=24))
    with pytest.raises(blocks.ManifestError, match="int8_group_size 24"):
        blocks.Manifest.from_bytes(bad)
    with pytest.raises(ValueError, match="int8_group_size 24"):
        _encode(c, "int8", int8_group_size=24)
    # a version this module does not know is refused
    future = bytearray(s.manifest_bytes[:-4])
    future[4:6] = (6).to_bytes(2, "little")
    future += zlib.crc32(bytes(future)).to_bytes(4, "little")
    with pytest.raises(blocks.ManifestError, match="version 6"):
        blocks.Manifest.from_bytes(bytes(future))
