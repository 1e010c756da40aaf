"""ReceiverSession's source runs (the in-order sources after a held one, ``_held_run``, or
after one beyond a hole, ``_lazy_run``: opened by ``Parser.source_run`` and accounted in
one go) against one datagram per call.

A real sender and receiver run on the simulator (lossy, some with jitter: reordered); what
the receiver was handed (datagrams and timer calls) is recorded and salted with bad input:
forged, truncated, over-long, foreign, re-flagged and mis-numbered copies, most of them
placed just before the datagram they imitate (inside the runs the fast path takes), and
duplicates. Two fresh receivers get exactly that: one datagram per ``receive_datagram``
call, and in runs of random length through ``receive_datagrams`` with source runs on.
Feedback after every call, the decoded bytes, results, counters (drops by reason
included), loss accounting and decoder state must be identical, with and without a key,
for every repair scheme (RLC, block RS, ARQ, none).
"""

import numpy as np
import pytest
from test_receiver_batch import (
    _block1_parities,
    _one_and_runs,
    _receiver_inputs,
    _state,
    _stream,
)

from kvtransport.core import wire
from kvtransport.core.feedback import SEQ_RING, LossMonitor
from kvtransport.core.receiver import ReceiverSession

TID = 0x5EED_0000_0000_0015
KEY = bytes(range(32))
RATE = 200e6
DELAY = 0.002


def _salted(d: bytes, rng: np.random.Generator) -> list[bytes]:
    """Bad copies to put before datagram ``d`` (usually none): each is dropped (with a key)
    or, without one, taken as what it claims to be, on both paths alike."""
    out = []
    if rng.random() < 0.04:
        kind = int(rng.integers(0, 8))
        x = bytearray(d)
        if kind == 0:
            x[-1] ^= 1  # forged: bad tag (a different payload byte without a key)
        elif kind == 7:
            x[wire.HEADER_SIZE + 1] ^= 1  # forged: another payload (with a key, a bad tag)
        elif kind == 1:
            x = x[: int(rng.integers(0, len(x)))]  # truncated
        elif kind == 2:
            x += b"\x00"  # longer than announced
        elif kind == 3:
            x[0] ^= 0xFF  # bad magic
        elif kind == 4:
            x[8] ^= 1  # another transfer's id
        elif kind == 5:
            x[4] |= wire.FLAG_RETRANSMIT  # re-flagged (the tag covers the header)
        else:
            x[27] ^= 1  # another ESI, same packet number
        out.append(bytes(x))
    return out


def _record(policy: str, key: bytes | None, seed: int, loss: float, jitter_ms: float) -> list:
    """The receiver's inputs of one simulated transfer (``_receiver_inputs``), salted with
    bad copies and duplicates (on a lossy path, some bad copies instead of their
    datagram)."""
    rng = np.random.default_rng(seed)
    events: list[tuple[str, float, bytes]] = []
    inputs = _receiver_inputs(policy, key, seed, loss, jitter_ms, 1_500_000, 0.5, tid=TID,
                              delay=DELAY)  # fmt: skip
    for kind, t, d in inputs:
        if kind == "timer":
            events.append((kind, t, d))
            continue
        events += [("data", t, x) for x in _salted(d, rng)]
        if loss and rng.random() < 0.01:  # a forged copy comes, the genuine one is lost
            x = bytearray(d)
            x[wire.HEADER_SIZE + 2] ^= 4
            events.append(("data", t, bytes(x)))
            continue
        events.append(("data", t, d))
        if rng.random() < 0.02:
            events.append(("data", t, d))  # a duplicate
    return events


def _replay(events: list, key: bytes | None, seed: int) -> tuple[ReceiverSession, ...]:
    """One receiver per datagram, one in runs (1..199) with source runs; both must give
    the same feedback after every call and end in the same state, every byte and the
    loss monitor's record included."""
    assert ReceiverSession.source_runs
    one, run = _one_and_runs(events, 0.5, seed, key=key, longest=200, tid=TID)
    assert one._out.tobytes() == run._out.tobytes()  # every byte, missing symbols' too
    mon = (one.monitor, run.monitor)
    assert [(m.highest, m.settled, m.settled_received, m._ring, m._at, list(m._tops))
            for m in mon][0] == [(m.highest, m.settled, m.settled_received, m._ring, m._at,
                                  list(m._tops)) for m in mon][1]  # fmt: skip
    return one, run


@pytest.mark.parametrize(
    "policy, key, loss, jitter_ms, share, lazy_share",
    [
        ("fixed:1/16", KEY, 0.0, 0.0, 0.5, 0.0),
        ("fixed:1/16", None, 0.0, 0.0, 0.5, 0.0),
        ("fixed:1/16", KEY, 0.01, 0.05, 0.1, 0.005),
        ("fixed:1/16", KEY, 0.05, 0.3, 0.0, 0.0),  # holes and reordering: hardly any run
        ("adaptive", KEY, 0.02, 0.0, 0.2, 0.2),
        ("block-rs:4/32", KEY, 0.02, 0.0, 0.01, 0.0),  # runs only until the first parity
        ("block-rs:4/32", None, 0.02, 0.3, 0.0, 0.0),
        ("arq", KEY, 0.03, 0.0, 0.5, 0.5),
        ("arq", None, 0.0, 0.05, 0.3, 0.0),
        ("none", KEY, 0.0, 0.0, 0.5, 0.0),
        ("none", None, 0.0, 0.1, 0.05, 0.0),
        ("none", None, 0.01, 0.0, 0.5, 0.5),  # beyond the first loss: lazy runs
    ],
    ids=["rlc-key", "rlc-nokey", "rlc-lossy", "rlc-lossy-jitter", "adaptive", "block-rs-key",
         "block-rs-nokey-jitter", "arq-key", "arq-nokey-jitter", "none-key", "none-nokey-jitter",
         "none-nokey-lossy"],
)  # fmt: skip
def test_held_source_runs_receive_what_one_datagram_per_call_does(
    monkeypatch, policy, key, loss, jitter_ms, share, lazy_share
):
    """``share``: at least that share of the datagrams came in source runs (held or lazy),
    ``lazy_share`` in lazy runs (beyond a hole)."""
    events = _record(policy, key, 3, loss, jitter_ms)
    taken = {"_held_run": [], "_lazy_run": []}
    for name in taken:
        real = getattr(ReceiverSession, name)

        def counted(self, batch, i, now, real=real, name=name):
            j = real(self, batch, i, now)
            taken[name].append(j - i)
            return j

        monkeypatch.setattr(ReceiverSession, name, counted)
    one, _ = _replay(events, key, 11)
    drops = one.drop_reasons
    assert sum(drops.values()) > 10 and len(drops) >= 3  # the bad input was met, and dropped
    if key is not None:
        assert drops.get("bad_tag", 0) > 0
    n = sum(1 for kind, _, _ in events if kind == "data")
    held, lazy = sum(taken["_held_run"]), sum(taken["_lazy_run"])
    assert held + lazy >= share * n
    if share >= 0.5:
        assert max(taken["_held_run"]) >= 8
    if lazy_share:
        assert lazy >= lazy_share * n
    if loss > 0 and policy not in ("none", "arq"):
        assert one.symbols_recovered > 0


def test_a_forged_source_inside_a_run_is_dropped_and_the_run_goes_on():
    """Sources 0..99 in order with a forged copy of source 50 (bad tag, the right header,
    another payload) just before it, and a forged copy of source 70 instead of it (lost):
    the run stops at each, the copies are dropped as bad_tag, the rest come in runs again;
    the bytes are the genuine ones, and ESI 70's slot stays as it was (zero)."""
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, (100, 64), dtype=np.uint8)
    framer = wire.Framer(TID, KEY)
    data = [framer.seal(wire.DatagramType.SOURCE, e, src[e].tobytes(), esi=e) for e in range(100)]
    forged = [bytearray(data[e]) for e in (50, 70)]
    for x in forged:
        x[40] ^= 0x55
    batch = data[:50] + [bytes(forged[0])] + data[50:70] + [bytes(forged[1])] + data[71:]
    one = ReceiverSession(TID, key=KEY)
    run = ReceiverSession(TID, key=KEY)
    for d in batch:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(batch, 1.0)
    assert run.drop_reasons == {"bad_tag": 2} and run.n_known == 99 and run.through == 70
    src[70] = 0
    assert run._out[: 100 * 64].tobytes() == src.tobytes()
    for r in (one, run):
        r.close(2.0)
    assert _state(one) == _state(run)


def _one_and_run(batch: list[bytes]) -> tuple[ReceiverSession, ReceiverSession]:
    """``batch`` one datagram per call, and in one receive_datagrams call: the same
    feedback and state."""
    one = ReceiverSession(TID, key=KEY)
    run = ReceiverSession(TID, key=KEY)
    for d in batch:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(batch, 1.0)
    assert one.datagrams_to_send(1.0) == run.datagrams_to_send(1.0)
    for r in (one, run):
        r.close(2.0)
    assert _state(one) == _state(run)
    assert one._out.tobytes() == run._out.tobytes()
    assert not one.drop_reasons
    return one, run


def test_a_lazy_run_stops_before_a_source_known_already():
    """ESI 2 never comes (decoded-through stays there); ESI 7 comes early, then 4, 5, 6 and
    7 again (a new packet number: a late copy sent again) in order, then 8: the lazy run
    after 5 takes 6 and stops before 7, which is a duplicate, as one at a time."""
    order = [(0,), (1,), (3,), (7,), (4,), (5,), (6,), (7,), (8,)]
    src, data = _stream(9, order, tid=TID)
    one, run = _one_and_run(data)
    assert one.duplicates == 1 and one.n_known == 8 and one.through == 2


def test_a_lazy_run_waits_while_a_side_decoder_needs_the_sources():
    """ESI 2 lost (decoded-through stays there); both block Reed-Solomon parities of block 1
    (ESIs 8..15, k 8, p 2) come ahead of its sources, then sources 8..13 in order: one at a
    time the side decoder gets each and recovers 14 and 15 with the sixth; in one call too
    (no lazy run takes them from it: the side decoder's every source ends the lazy run,
    and ``_lazy_run`` also refuses while one exists)."""
    src, data = _stream(16, [(e,) for e in range(14)], tid=TID)
    framer = wire.Framer(TID, KEY, max_payload=2048)
    parities = _block1_parities(src, framer)
    # the sources' packet numbers follow the parities' (101), so 8..13 are in order after them
    late = []
    for seq, e in enumerate(range(8, 14), start=102):
        framer.payload_view(64)[:] = src[e]
        late.append(framer.finish(wire.DatagramType.SOURCE, seq, 64, esi=e))
    one, run = _one_and_run(data[:2] + data[3:8] + parities + late)
    assert one.symbols_recovered == 2 and one._known[14] and one._known[15]
    assert not one._known[2] and one.through == 2


def test_no_lazy_run_at_decoded_through():
    """A repair over ESIs 601..640 is pending when source 600 comes at decoded-through (so
    it is not held), then 601..700 in order: one at a time each moves decoded-through, and
    the decoder release at 640 recovers 640 before its datagram comes. A lazy run (marking
    out of order) must not take them: only sources beyond a hole."""
    order = [(e,) for e in range(600)] + [(601, 40, 1)]
    src, data = _stream(701, order + [(e,) for e in range(600, 701)], tid=TID)
    one, run = _one_and_run(data)
    assert one.symbols_recovered == 1 and one.duplicates == 1 and one.through == 701


@pytest.mark.parametrize("start, n", [(0, 1), (5, 300), (SEQ_RING - 7, 20), (3, SEQ_RING + 9)])
def test_loss_monitor_on_run_is_on_packet_n_times(start, n):
    """``on_run`` (the held runs' packet accounting) against ``on_packet`` per datagram,
    across the ring's end and beyond its size."""
    a, b = LossMonitor(), LossMonitor()
    for seq in range(start):
        a.on_packet(seq, 0.5)
        b.on_packet(seq, 0.5)
    assert [a.on_packet(seq, 1.0) for seq in range(start, start + n)] == [0] * n
    b.on_run(n, 1.0)
    assert (a.highest, a.received, a._ring, a._at, list(a._tops)) == (
        b.highest, b.received, b._ring, b._at, list(b._tops)
    )  # fmt: skip
