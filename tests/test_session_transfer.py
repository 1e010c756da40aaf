"""Transfer description, transport manifest and manifest protection."""

import numpy as np
import pytest

from kvtransport.core import wire
from kvtransport.core.manifest_fec import ManifestReceiver, ManifestSender, manifest_symbols
from kvtransport.core.transfer import (
    BlockTable,
    Transfer,
    TransportManifest,
    synthetic_transfer,
    utility_profile,
)


@pytest.mark.parametrize("profile", ["zipf", "flat", "linear"])
def test_synthetic_transfer_is_seeded_ordered_and_normalized(profile):
    a = synthetic_transfer(100_003, 17, profile, seed=4)
    b = synthetic_transfer(100_003, 17, profile, seed=4)
    c = synthetic_transfer(100_003, 17, profile, seed=5)
    assert np.array_equal(a.payload, b.payload) and not np.array_equal(a.payload, c.payload)
    u = a.blocks.utilities
    assert u.sum() == pytest.approx(1.0) and (np.diff(u) <= 1e-15).all()  # utility order
    assert a.blocks.offsets[0] == 0 and a.blocks.end == 100_003
    assert (a.blocks.offsets[1:] == a.blocks.offsets[:-1] + a.blocks.lengths[:-1]).all()
    assert a.blocks.lengths.max() - a.blocks.lengths.min() <= 1


def test_utility_profiles_have_their_shapes():
    z, f, lin = (utility_profile(p, 4) for p in ("zipf", "flat", "linear"))
    assert z == pytest.approx(np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    assert f == pytest.approx([0.25] * 4) and lin == pytest.approx([0.4, 0.3, 0.2, 0.1])
    with pytest.raises(ValueError):
        utility_profile("nope", 3)


def test_block_table_rejects_inconsistent_tables():
    with pytest.raises(ValueError):
        BlockTable([0, 5], [10, 10], [0.5, 0.5])  # overlap
    with pytest.raises(ValueError):
        BlockTable([0], [0], [1.0])  # empty block
    with pytest.raises(ValueError):
        BlockTable([0, 10], [10, 10], [0.7, 0.7])  # utilities sum past 1
    with pytest.raises(ValueError):
        BlockTable([0], [10], [float("nan")])
    with pytest.raises(ValueError):
        Transfer(np.zeros(5, np.uint8), BlockTable([0], [10], [1.0]))  # past the payload


def test_block_symbol_ranges_cover_unaligned_blocks():
    t = BlockTable([0, 1000, 3000], [1000, 2000, 10], [0.5, 0.3, 0.2])
    first, last = t.symbol_ranges(1280)
    assert first.tolist() == [0, 0, 2] and last.tolist() == [1, 3, 3]


def test_transport_manifest_round_trips_and_rejects_corruption():
    tr = synthetic_transfer(50_000, 12, "zipf", seed=1, app_metadata=b"app says hi")
    m = TransportManifest(1280, tr.nbytes, tr.blocks, tr.app_metadata, 0.25, 1.5e9, 16384)
    data = m.to_bytes()
    back = TransportManifest.from_bytes(data)
    assert back.blocks.equals(tr.blocks) and back.app_metadata == b"app says hi"
    assert (back.symbol_size, back.payload_len, back.deadline_s) == (1280, 50_000, 0.25)
    assert (back.sent_at, back.decoder_window) == (1.5e9, 16384)
    assert back.n_source == 40
    for bad in (data[:-1], data[:20], b"XXXX" + data[4:], data[:-4] + b"\0\0\0\0"):
        with pytest.raises(wire.BadPayload):
            TransportManifest.from_bytes(bad)


def _manifest(n_blocks):
    tr = synthetic_transfer(10 * n_blocks * 100, n_blocks, "zipf", seed=2, app_metadata=b"m" * 900)
    return TransportManifest(256, tr.nbytes, tr.blocks, tr.app_metadata, 0.1).to_bytes()


def test_manifest_decodes_from_any_m_of_its_datagrams():
    data = _manifest(200)
    sender = ManifestSender(data, 256)
    m = sender.m
    assert m == manifest_symbols(data, 256) and m > 5
    framer = wire.Framer(7)
    dgrams = [wire.parse(sender.emit(framer, i, 2 * i)) for i in range(3 * m)]
    assert [d.type for d in dgrams[:m]] == [wire.DatagramType.MANIFEST] * m
    rng = np.random.default_rng(0)
    for _ in range(5):
        rx = ManifestReceiver()
        used = 0
        got = None
        for i in rng.permutation(3 * m):
            used += 1
            got = rx.add(dgrams[i])
            if got is not None:
                break
        assert got is not None and got.to_bytes() == data
        assert used <= m + 2  # any M suffice, up to a rare dependent combination


def test_manifest_schedule_interleaves_then_backs_off_until_acknowledged():
    sender = ManifestSender(_manifest(30), 256)
    framer = wire.Framer(7)
    slots = []
    for slot in range(3000):
        if not sender.acked and slot >= sender.next_slot:  # as SenderSession schedules it
            sender.emit(framer, slot, slot)
            slots.append(slot)
    initial = sender.m + max(4, sender.m)
    assert slots[:initial] == list(range(0, 2 * initial, 2))
    gaps = np.diff(slots[initial - 1 :])
    assert gaps.tolist()[:4] == [16, 32, 64, 128]


def test_manifest_receiver_rejects_inconsistent_datagrams():
    sender = ManifestSender(_manifest(30), 256)
    framer = wire.Framer(7)
    rx = ManifestReceiver()
    rx.add(wire.parse(sender.emit(framer, 0, 0)))
    bad = wire.parse(framer.build(wire.DatagramType.MANIFEST, 1, b"x" * 256, esi=0, key=99))
    with pytest.raises(wire.BadPayload):
        rx.add(bad)  # disagrees on the manifest's size
    with pytest.raises(wire.BadPayload):
        ManifestReceiver(max_symbols=2).add(wire.parse(sender.emit(framer, 2, 2)))
