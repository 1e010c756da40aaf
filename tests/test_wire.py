"""Wire format: every datagram type round-trips; every malformed datagram is rejected."""

import struct

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.core import wire
from kvtransport.core.wire import DatagramType as T

KEY = b"0123456789abcdef0123456789abcdef"
TID = 0xDEADBEEF_01234567


def _all_types(framer: wire.Framer) -> list[tuple[bytes, dict]]:
    """One datagram of every type with distinctive field values."""
    sym = bytes(range(256)) * 5
    fb = wire.Feedback(7, 250, 100, 12, 90, 40, 3, 2, 80, 20, 0.12, 2.5, wire.FB_MANIFEST_DONE,
                       ((41, 2), (60, 1)))  # fmt: skip
    fb_buf = bytearray(wire.feedback_size(2))
    n = wire.encode_feedback(fb, memoryview(fb_buf))
    cases = [
        (T.SOURCE, dict(esi=123456, payload=sym)),
        (T.SOURCE, dict(esi=5, payload=sym, flags=wire.FLAG_RETRANSMIT)),
        (T.REPAIR, dict(esi=77, key=0xBEEF, dt_nss=wire.pack_dt_nss(15, 4095), payload=sym)),
        (T.BLOCK_REPAIR, dict(esi=64, key=wire.block_repair_key(4, 3), dt_nss=32, payload=sym)),
        (T.FEEDBACK, dict(payload=bytes(fb_buf[:n]))),
        (T.MANIFEST, dict(esi=2, key=9, payload=sym)),
        (T.MANIFEST_REPAIR, dict(key=17, dt_nss=wire.pack_dt_nss(15, 9), payload=sym)),
        (T.CONTROL, dict(esi=wire.ControlCode.FIN)),
    ]
    out = []
    for i, (dtype, kw) in enumerate(cases):
        out.append((framer.build(dtype, 1000 + i, **kw), dict(type=dtype, seq=1000 + i, **kw)))
    return out


@pytest.mark.parametrize("key", [None, KEY])
def test_every_type_round_trips(key):
    framer = wire.Framer(TID, key)
    parser = wire.Parser(key)
    for data, want in _all_types(framer):
        d = parser.parse(data)
        assert d.type == want["type"] and d.seq == want["seq"] and d.transfer_id == TID
        assert bytes(d.payload) == want.get("payload", b"")
        if d.type == T.FEEDBACK:  # its FEC payload id fields carry the framer's epoch
            assert wire.feedback_epoch(d) == framer.epoch and (framer.epoch != 0) == bool(key)
            continue
        assert d.esi == want.get("esi", 0) and d.key == want.get("key", 0)
        assert d.dt_nss == want.get("dt_nss", 0)
        assert d.flags & wire.FLAG_RETRANSMIT == want.get("flags", 0)
        assert len(data) == wire.HEADER_SIZE + len(d.payload) + (wire.TAG_SIZE if key else 0)


def test_repair_fields_follow_rfc8681_layout():
    framer = wire.Framer(TID)
    data = framer.build(T.REPAIR, 1, b"x" * 8, esi=0x01020304, key=0xA1B2,
                        dt_nss=wire.pack_dt_nss(9, 0x123))  # fmt: skip
    # repair FEC payload id = Repair_Key(16) | DT(4) NSS(12) | first ESI(32), big endian
    assert data[20:28] == bytes.fromhex("a1b2912301020304")
    d = wire.parse(data)
    assert (d.dt, d.nss) == (9, 0x123)
    with pytest.raises(ValueError):
        wire.pack_dt_nss(16, 1)
    with pytest.raises(ValueError):
        wire.pack_dt_nss(15, 4096)


def test_feedback_payload_round_trips():
    fb = wire.Feedback(1, 2, 3, 4, 100, 10, 7, 1, 5, 6, 0.25, 3.0, wire.FB_ALL_DONE,
                       ((10, 3), (20, 4)), ((0, 1), (3, 2)))  # fmt: skip
    buf = bytearray(1024)
    n = wire.encode_feedback(fb, memoryview(buf))
    assert n == wire.feedback_size(2, 2)
    assert wire.decode_feedback(bytes(buf[:n])) == fb


def _header(**kw):
    f = dict(magic=wire.MAGIC, version=wire.VERSION, type=T.SOURCE, flags=0, reserved=0,
             plen=4, tid=TID, seq=0, key=0, dt_nss=0, esi=0)  # fmt: skip
    f.update(kw)
    return wire.HEADER.pack(*f.values())


@pytest.mark.parametrize(
    "data, error",
    [
        (b"", wire.Truncated),
        (_header()[:27], wire.Truncated),
        (_header() + b"abc", wire.Truncated),  # payload shorter than announced
        (_header() + b"abcde", wire.BadLength),  # trailing bytes
        (_header(plen=0) + b"x" * 70000, wire.Oversized),
        (_header(magic=0x4B57) + b"abcd", wire.BadMagic),
        (_header(version=1) + b"abcd", wire.BadVersion),  # the BLAKE2b-tag format
        (_header(type=0) + b"abcd", wire.BadType),
        (_header(type=99) + b"abcd", wire.BadType),
        (_header(flags=0x80) + b"abcd", wire.BadType),
        (_header(reserved=1) + b"abcd", wire.BadType),
        (_header(type=T.REPAIR, flags=wire.FLAG_RETRANSMIT) + b"abcd", wire.BadType),
        (_header(flags=wire.FLAG_SEALED) + b"abcd" + b"t" * 16, wire.BadTag),  # no key here
        (_header(flags=wire.FLAG_SEALED) + b"abcd" + b"t" * 15, wire.Truncated),
    ],
)
def test_malformed_datagrams_raise_their_error(data, error):
    with pytest.raises(error) as info:
        wire.Parser().parse(data)
    assert isinstance(info.value, wire.WireError) and info.value.reason


def test_authentication_rejects_forged_missing_and_foreign_key_tags():
    good = wire.Framer(TID, KEY).build(T.SOURCE, 3, b"payload", esi=1)
    parser = wire.Parser(KEY)
    assert bytes(parser.parse(good).payload) == b"payload"
    forged = bytearray(good)
    forged[-1] ^= 1
    with pytest.raises(wire.BadTag):
        parser.parse(bytes(forged))
    tampered = bytearray(good)
    tampered[wire.HEADER_SIZE] ^= 1  # flip a payload bit, keep the tag
    with pytest.raises(wire.BadTag):
        parser.parse(bytes(tampered))
    tampered = bytearray(good)
    tampered[16] ^= 1  # flip a header bit (seq)
    with pytest.raises(wire.BadTag):
        parser.parse(bytes(tampered))
    with pytest.raises(wire.BadTag):  # no tag at all on a keyed transfer
        parser.parse(wire.Framer(TID).build(T.SOURCE, 3, b"payload", esi=1))
    with pytest.raises(wire.BadTag):  # sealed with another key
        parser.parse(wire.Framer(TID, b"another key, 16+ bytes").build(T.SOURCE, 3, b"payload"))


def test_sealed_datagrams_carry_no_plaintext_byte_run():
    """Every type's payload is ciphertext on the wire: no 8-byte run of any payload appears
    in its datagram (an identity or header-only "seal" fails this)."""
    for data, want in _all_types(wire.Framer(TID, KEY)):
        plain = bytes(want.get("payload", b""))
        for i in range(len(plain) - 7):
            assert plain[i : i + 8] not in data, (want["type"], i)
        if plain:
            assert bytes(wire.Parser(KEY).parse(data).payload) == plain


def test_a_sealed_datagram_moved_to_another_transfer_seq_or_direction_is_rejected():
    good = wire.Framer(TID, KEY).build(T.SOURCE, 41, b"secret symbol", esi=7)
    parser = wire.Parser(KEY)
    assert parser.parse(good).esi == 7
    moves = {
        "transfer": (8, (TID ^ 1).to_bytes(8, "big")),
        "seq": (16, (42).to_bytes(4, "big")),
        "direction": (3, bytes([T.FEEDBACK])),
        "esi": (24, (8).to_bytes(4, "big")),
    }
    for what, (off, new) in moves.items():
        moved = bytearray(good)
        moved[off : off + len(new)] = new
        with pytest.raises(wire.BadTag):
            parser.parse(bytes(moved))
        assert what


def test_bad_feedback_payloads_raise_bad_payload():
    fb = wire.Feedback(1, 2, 3, 4, 100, 10, 7, 1, 5, 6, 0.25, 3.0, 0, ((10, 3),))
    buf = bytearray(1024)
    n = wire.encode_feedback(fb, memoryview(buf))
    good = bytes(buf[:n])
    bad = [
        good[:-1],  # truncated range
        good + b"\0" * 6,  # more ranges than announced
        good[:10],
        wire.FEEDBACK_FIXED.pack(1, 2, 3, 4, 5, 10, 0, 0, 0, 0, 0.1, 1.0, 0, 0, 0),  # through > end
        wire.FEEDBACK_FIXED.pack(1, 2, 3, 4, 50, 10, 41, 0, 0, 0, 0.1, 1.0, 0, 0, 0),  # too many
        wire.FEEDBACK_FIXED.pack(1, 2, 3, 4, 50, 10, 0, 0, 0, 0, float("nan"), 1.0, 0, 0, 0),
        wire.FEEDBACK_FIXED.pack(1, 2, 3, 4, 50, 10, 0, 0, 0, 0, 1.5, 1.0, 0, 0, 0),
        wire.FEEDBACK_FIXED.pack(1, 2, 3, 4, 50, 10, 1, 0, 0, 0, 0.1, 1.0, 0, 1, 0)
        + struct.pack("!IH", 5, 1),  # range below decoded_through
        wire.FEEDBACK_FIXED.pack(1, 2, 3, 4, 50, 10, 1, 0, 0, 0, 0.1, 1.0, 0, 1, 0)
        + struct.pack("!IH", 20, 0),  # empty range
    ]
    for payload in bad:
        with pytest.raises(wire.BadPayload):
            wire.decode_feedback(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_arbitrary_bytes_only_ever_raise_wire_errors(data, keyed):
    parser = wire.Parser(KEY if keyed else None)
    try:
        d = parser.parse(data)
    except wire.WireError:
        return
    assert d.type in set(T)
    try:
        wire.decode_feedback(d.payload)
    except wire.WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=wire.HEADER_SIZE + 4, max_size=120),
    st.integers(0, 8 * 120 - 1),
)
def test_any_single_bit_flip_of_a_tagged_datagram_is_rejected(payload, bit):
    data = bytearray(wire.Framer(TID, KEY).build(T.SOURCE, 9, payload, esi=3))
    bit %= 8 * len(data)
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(wire.WireError):
        wire.Parser(KEY).parse(bytes(data))


def test_framer_checks_its_arguments():
    with pytest.raises(ValueError):
        wire.Framer(1 << 64)
    for short in (b"", b"k", b"15 bytes secret"):
        with pytest.raises(ValueError, match="16..64 bytes"):
            wire.Framer(1, key=short)
        with pytest.raises(ValueError, match="16..64 bytes"):
            wire.Parser(short)
    framer = wire.Framer(1, key=KEY)
    framer.build(T.SOURCE, 5, b"x")
    with pytest.raises(ValueError, match="nonce reuse"):  # a seq twice in one direction
        framer.build(T.REPAIR, 5, b"y")
    framer.build(T.FEEDBACK, 0, b"")  # the other direction numbers its own
    with pytest.raises(ValueError):
        wire.Framer(1, max_payload=16).build(T.SOURCE, 0, b"x" * 17)
    with pytest.raises(ValueError):
        wire.block_repair_key(4, 4)


def _reference_verdict(data: bytes, key: bytes | None):
    """What the module docstring says of ``data``: the first rule it breaks (as an error
    class), or the header fields and payload, written out field by field."""

    n = len(data)
    if n < wire.HEADER_SIZE:
        return wire.Truncated
    if n > wire.MAX_DATAGRAM:
        return wire.Oversized
    magic, version, dtype, flags, reserved, plen, tid, seq, k, dt_nss, esi = wire.HEADER.unpack(
        data[: wire.HEADER_SIZE]
    )
    if magic != wire.MAGIC:
        return wire.BadMagic
    if version != wire.VERSION:
        return wire.BadVersion
    if dtype not in {int(t) for t in T}:
        return wire.BadType
    if flags & ~(wire.FLAG_SEALED | wire.FLAG_RETRANSMIT) or reserved:
        return wire.BadType
    tagged = bool(flags & wire.FLAG_SEALED)
    expect = wire.HEADER_SIZE + plen + (wire.TAG_SIZE if tagged else 0)
    if n < expect:
        return wire.Truncated
    if n > expect:
        return wire.BadLength
    if tagged != (key is not None):
        return wire.BadTag
    if flags & wire.FLAG_RETRANSMIT and dtype != T.SOURCE:
        return wire.BadType
    end = wire.HEADER_SIZE + plen
    payload = data[wire.HEADER_SIZE : end]
    if key is not None:
        if dtype == T.FEEDBACK and not (k or dt_nss or esi):
            return wire.BadTag  # epoch 0 would be the data path's nonces
        try:
            payload = _open(data, key, tid, _nonce(dtype, seq, k, dt_nss, esi))
        except InvalidTag:
            return wire.BadTag
    return (dtype, flags, tid, seq, k, dt_nss, esi, payload)


def _transfer_key(key: bytes, tid: int) -> AESGCM:
    """The documented per-transfer key, written out with the primitives."""
    hkdf = HKDF(hashes.SHA256(), 32, tid.to_bytes(8, "big"), b"kvtransport/2 datagram AES-256-GCM")
    return AESGCM(hkdf.derive(key))


def _nonce(dtype: int, seq: int, k: int, dt_nss: int, esi: int) -> bytes:
    """The documented nonce: epoch (u64) | seq (u32); the data path's epoch is 0, a
    FEEDBACK's is its key, DT/NSS and ESI fields."""
    epoch = (k << 48 | dt_nss << 32 | esi) if dtype == T.FEEDBACK else 0
    return epoch.to_bytes(8, "big") + seq.to_bytes(4, "big")


def _open(data: bytes, key: bytes, tid: int, nonce: bytes) -> bytes:
    h = wire.HEADER_SIZE
    return _transfer_key(key, tid).decrypt(nonce, data[h:], data[:h])


def _seal(header: bytes, body: bytes, key: bytes, tid: int, nonce: bytes) -> bytes:
    return header + _transfer_key(key, tid).encrypt(nonce, body, header)


def _mostly(good, *bad):
    """A field value: usually the good one, sometimes each of the bad ones."""
    return st.sampled_from([good] * (2 * len(bad) + 2) + list(bad))


@settings(max_examples=600, deadline=None)
@given(
    _mostly(wire.MAGIC, wire.MAGIC ^ 1, 0),
    _mostly(wire.VERSION, 0, 2),
    st.sampled_from(list(range(1, 8)) * 2 + [0, 8, 255]),
    st.sampled_from([0, 1, 2, 3] * 3 + [4, 0x80, 0xFF]),
    _mostly(0, 1),
    st.integers(0, 40),
    _mostly(0, -17, -16, -1, 1, 16, 17),
    _mostly("good", "bad", "none"),
    st.booleans(),
    st.integers(0, 2**64 - 1),
)
def test_parser_verdict_matches_the_documented_rules(
    magic, version, dtype, flags, reserved, plen, slack, tag, keyed, tid
):
    """Every header field, length and tag combination: the parser accepts exactly what the
    rules accept (with the same fields) and otherwise raises the first rule broken."""
    key = KEY if keyed else None
    header = wire.HEADER.pack(magic, version, dtype, flags, reserved, plen, tid, 77, 5, 9, 3)
    body = bytes(range(max(0, plen + slack)))
    data = header + body
    if tag != "none":
        data = _seal(header, body, KEY, tid, _nonce(dtype, 77, 5, 9, 3))
        if tag == "bad":
            data = data[:-1] + bytes([data[-1] ^ 1])
    expected = _reference_verdict(data, key)
    if isinstance(expected, tuple):
        d = wire.Parser(key).parse(data)
        assert isinstance(d, wire.Datagram)
        assert (*d[:7], bytes(d.payload)) == expected
    else:
        with pytest.raises(expected):
            wire.Parser(key).parse(data)


@pytest.mark.parametrize("key", [None, KEY])
def test_seal_builds_the_datagram_finish_builds_field_for_field(key):
    """Framer.seal (payload held elsewhere) and Framer.finish (payload copied in) give the
    same bytes, and both are the documented layout: the header, then the payload sealed
    under the transfer's AES-GCM key with the header as associated data."""
    payload = bytes(range(256)) * 5
    by_finish, by_seal = wire.Framer(TID, key), wire.Framer(TID, key)
    for seq, (dtype, esi, rkey, dt_nss, n) in enumerate(
        [(T.SOURCE, 9, 0, 0, 1280), (T.REPAIR, 3, 0xBEEF, 0xF123, 1280), (T.SOURCE, 1, 0, 0, 7)]
    ):
        by_finish.payload_view(n)[:] = payload[:n]
        a = by_finish.finish(dtype, seq, n, esi=esi, key=rkey, dt_nss=dt_nss)
        b = by_seal.seal(dtype, seq, memoryview(payload)[:n], esi=esi, key=rkey, dt_nss=dt_nss)
        header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, dtype,
                                  wire.FLAG_SEALED if key else 0, 0, n, TID, seq, rkey,
                                  dt_nss, esi)  # fmt: skip
        body = payload[:n]
        if key:
            body = wire.transfer_cipher(KEY, TID).encrypt(struct.pack("!IQ", 0, seq), body, header)
        assert a == b == header + body
    with pytest.raises(ValueError, match="nonce reuse"):
        by_seal.seal(T.SOURCE, 1, b"x")
