"""ReceiverSession's source runs (the in-order sources after a held one, ``_held_run``,
after one beyond a hole, ``_lazy_run``, or after one that joined the open decoder run,
``_queue_run``: opened by ``Parser.source_run`` and accounted in one go) against one
datagram per call.

A real sender and receiver run on the simulator (lossy, some with jitter: reordered); what
the receiver was handed (datagrams and timer calls) is recorded and salted with bad input:
forged, truncated, over-long, foreign, re-flagged and mis-numbered copies, most of them
placed just before the datagram they imitate (inside the runs the fast path takes), and
duplicates. Two fresh receivers get exactly that: one datagram per ``receive_datagram``
call, and in runs of random length through ``receive_datagrams`` with source runs on.
Feedback after every call, the decoded bytes, results, counters (drops by reason
included), loss accounting and decoder state must be identical, with and without a key,
for every repair scheme (RLC, block RS, ARQ, none). Directed streams then take the open
decoder run's source runs to each of the run's bounds (``ReceiverSession._joinable``: the
decoder window, completion, known and queued ESIs, the buffer's end, the run's rows, the
run's top for a repair's release bound), with a small decoder window and release lag from
the receiver's config where that is what it takes.
"""

import sys

import numpy as np
import pytest
from kvtransport.codecs import aesgcm
from test_receiver_batch import (
    _block1_parities,
    _decoder_state,
    _one_and_runs,
    _receiver_inputs,
    _state,
    _stream,
)

from kvtransport.core import wire
from kvtransport.core.feedback import SEQ_RING, LossMonitor
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.receiver import ReceiverSession


@pytest.fixture(autouse=True)
def _one_feedback_epoch(monkeypatch):
    """The sessions compared seal their feedback under one epoch (each draws a random one,
    kvtransport.core.wire "Sealing"), so their datagrams compare byte for byte."""
    monkeypatch.setattr(wire, "new_epoch", lambda: 1)


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


def _replay(
    events: list, key: bytes | None, seed: int, laid_out: bool = False
) -> tuple[ReceiverSession, ...]:
    """One receiver per datagram, one in runs (1..199) with source runs (``laid_out``: each
    run in one buffer, so that source runs open in the compiled kernel); both must give
    the same feedback after every call and end in the same state, every byte and the
    loss monitor's record included."""
    assert ReceiverSession.source_runs
    one, run = _one_and_runs(events, 0.5, seed, key=key, longest=200, tid=TID, laid_out=laid_out)
    assert one._out.tobytes() == run._out.tobytes()  # every byte, missing symbols' too
    mon = (one.monitor, run.monitor)
    assert [(m.highest, m.settled, m.settled_received, m._ring, m._at, list(m._tops))
            for m in mon][0] == [(m.highest, m.settled, m.settled_received, m._ring, m._at,
                                  list(m._tops)) for m in mon][1]  # fmt: skip
    return one, run


_RUNS = ("_held_run", "_lazy_run", "_queue_run")
_TAKEN: dict[str, list[int]] | None = None  # _count_runs' record while a test counts
_LAID: set[int] = set()  # the receivers _one_and_run hands its calls laid out


def _count_runs(monkeypatch) -> dict[str, list[int]]:
    """Record how many datagrams each source run (held, lazy, queue) call took (those of
    a receiver ``_one_and_run`` feeds laid out under "laid" + the name), and each call of
    the compiled run kernel (``open_run``)."""
    taken: dict[str, list[int]] = {k: [] for n in _RUNS for k in (n, "laid" + n)}
    taken["open_run"] = []
    monkeypatch.setattr(sys.modules[__name__], "_TAKEN", taken)
    real_open = aesgcm.open_run

    def open_counted(ctx, buf, starts, ends, i, *rest):
        j = real_open(ctx, buf, starts, ends, i, *rest)
        taken["open_run"].append(j - i)
        return j

    monkeypatch.setattr(aesgcm, "open_run", open_counted)
    for name in _RUNS:
        real = getattr(ReceiverSession, name)

        def counted(self, batch, i, *rest, real=real, name=name):
            j = real(self, batch, i, *rest)
            taken[("laid" if id(self) in _LAID else "") + name].append(j - i)
            return j

        monkeypatch.setattr(ReceiverSession, name, counted)
    return taken


@pytest.mark.parametrize(
    "policy, key, loss, jitter_ms, share, lazy_share, queue_share",
    [
        ("fixed:1/16", KEY, 0.0, 0.0, 0.5, 0.0, 0.0),
        ("fixed:1/16", None, 0.0, 0.0, 0.5, 0.0, 0.0),
        ("fixed:1/16", KEY, 0.01, 0.05, 0.3, 0.005, 0.2),
        ("fixed:1/16", KEY, 0.05, 0.3, 0.01, 0.0, 0.01),  # holes and reordering: short runs
        ("adaptive", KEY, 0.02, 0.0, 0.4, 0.2, 0.1),
        ("block-rs:4/32", KEY, 0.02, 0.0, 0.01, 0.0, 0.0),  # runs only until the first parity
        ("block-rs:4/32", None, 0.02, 0.3, 0.0, 0.0, 0.0),
        ("arq", KEY, 0.03, 0.0, 0.5, 0.5, 0.0),
        ("arq", None, 0.0, 0.05, 0.3, 0.0, 0.0),
        ("none", KEY, 0.0, 0.0, 0.5, 0.0, 0.0),
        ("none", None, 0.0, 0.1, 0.05, 0.0, 0.0),
        ("none", None, 0.01, 0.0, 0.5, 0.5, 0.0),  # beyond the first loss: lazy runs
    ],
    ids=["rlc-key", "rlc-nokey", "rlc-lossy", "rlc-lossy-jitter", "adaptive", "block-rs-key",
         "block-rs-nokey-jitter", "arq-key", "arq-nokey-jitter", "none-key", "none-nokey-jitter",
         "none-nokey-lossy"],
)  # fmt: skip
@pytest.mark.parametrize("laid_out", [False, True], ids=["list", "laid-out"])
def test_held_source_runs_receive_what_one_datagram_per_call_does(
    monkeypatch, policy, key, loss, jitter_ms, share, lazy_share, queue_share, laid_out
):
    """``share``: at least that share of the datagrams came in source runs (of any kind),
    ``lazy_share`` in lazy runs (beyond a hole), ``queue_share`` in runs that joined the
    open decoder run. Laid out in one buffer, the runs open in the compiled kernel; in a
    plain list, in the per-datagram loop."""
    events = _record(policy, key, 3, loss, jitter_ms)
    taken = _count_runs(monkeypatch)
    one, _ = _replay(events, key, 11, laid_out)
    runs = taken["_held_run"] + taken["_lazy_run"] + taken["_queue_run"]
    assert sum(taken["open_run"]) == (sum(runs) if laid_out else 0)
    drops = one.drop_reasons
    assert sum(drops.values()) > 10 and len(drops) >= 3  # the bad input was met, and dropped
    if key is not None:
        assert drops.get("bad_tag", 0) > 0
    n = sum(1 for kind, _, _ in events if kind == "data")
    lazy, queue = sum(taken["_lazy_run"]), sum(taken["_queue_run"])
    assert sum(taken["_held_run"]) + lazy + queue >= share * n
    if share >= 0.5:
        assert max(taken["_held_run"]) >= 8
    if lazy_share:
        assert lazy >= lazy_share * n
    if queue_share:
        assert queue >= queue_share * n
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
    laid = ReceiverSession(TID, key=KEY)
    for d in batch:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(batch, 1.0)
    laid.receive_datagrams(wire.LaidOutDatagrams.join(batch), 1.0)
    src[70] = 0
    for r in (run, laid):
        assert r.drop_reasons == {"bad_tag": 2} and r.n_known == 99 and r.through == 70
        assert r._out[: 100 * 64].tobytes() == src.tobytes()
    for r in (one, run, laid):
        r.close(2.0)
    assert _state(one) == _state(run) == _state(laid)


def _one_and_run(
    *calls: list[bytes], config: ProtocolConfig = STANDARD
) -> tuple[ReceiverSession, ReceiverSession, dict | None]:
    """Each of ``calls`` (at times 1, 2, ...) one datagram per call, and in one
    receive_datagrams call, as a list and laid out in one buffer (the compiled source
    runs): the same feedback after each and at the end, the same decoder state before the
    end (``_decoder_state``, returned), the same state and bytes. Returns the receivers
    of one datagram per call and of the list."""
    one = ReceiverSession(TID, key=KEY, config=config)
    run = ReceiverSession(TID, key=KEY, config=config)
    laid = ReceiverSession(TID, key=KEY, config=config)
    _LAID.add(id(laid))
    for t, batch in enumerate(calls, start=1):
        for d in batch:
            one.receive_datagram(d, t)
        run.receive_datagrams(batch, t)
        laid.receive_datagrams(wire.LaidOutDatagrams.join(batch), t)
        fb = one.datagrams_to_send(t)
        assert fb == run.datagrams_to_send(t) == laid.datagrams_to_send(t)
    dec = _decoder_state(one)
    assert dec == _decoder_state(run) == _decoder_state(laid)
    for r in (one, run, laid):
        r.close(len(calls) + 1.0)
    fb = one.datagrams_to_send(0.0)
    assert fb == run.datagrams_to_send(0.0) == laid.datagrams_to_send(0.0)
    assert _state(one) == _state(run) == _state(laid)
    assert one._out.tobytes() == run._out.tobytes() == laid._out.tobytes()
    assert not one.drop_reasons
    _LAID.discard(id(laid))
    if _TAKEN is not None:  # the same runs, the laid-out ones opened by the kernel
        assert all(_TAKEN[n] == _TAKEN["laid" + n] for n in _RUNS)
        assert sum(_TAKEN["open_run"]) == sum(sum(_TAKEN[n]) for n in _RUNS)
    return one, run, dec


def test_a_lazy_run_stops_before_a_source_known_already():
    """ESI 2 never comes (decoded-through stays there); ESI 7 comes early, then 4, 5, 6 and
    7 again (a new packet number: a late copy sent again) in order, then 8: the lazy run
    after 5 takes 6 and stops before 7, which is a duplicate, as one at a time."""
    order = [(0,), (1,), (3,), (7,), (4,), (5,), (6,), (7,), (8,)]
    src, data = _stream(9, order, tid=TID)
    one, run, dec = _one_and_run(data)
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
    one, run, dec = _one_and_run(data[:2] + data[3:8] + parities + late)
    assert one.symbols_recovered == 2 and one._known[14] and one._known[15]
    assert not one._known[2] and one.through == 2


def test_no_lazy_run_at_decoded_through():
    """A repair over ESIs 601..640 is pending when source 600 comes at decoded-through (so
    it is not held), then 601..700 in order: one at a time each moves decoded-through, and
    the decoder release at 640 recovers 640 before its datagram comes. A lazy run (marking
    out of order) must not take them: only sources beyond a hole."""
    order = [(e,) for e in range(600)] + [(601, 40, 1)]
    src, data = _stream(701, order + [(e,) for e in range(600, 701)], tid=TID)
    one, run, dec = _one_and_run(data)
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


def test_a_source_run_after_a_late_source_dates_the_highest_packet_now():
    """Packet 3 (ESI 3) comes late, after packet 4 (a copy of ESI 1) in an earlier call:
    the sources after it (packets 5.., in order) are held in a source run, dated as each
    one is one at a time, so the reports echo the same packet with the same age: at the
    close (t = 3), the reordering window (capped at 0.625 s) has passed, and the echo is
    the highest packet, 40, received at t = 2."""
    order = [(0,), (1,), (2,), (3,), (1,)] + [(e,) for e in range(4, 40)]
    src, data = _stream(40, order, tid=TID)
    calls = (data[:3] + data[4:5], data[3:4] + data[5:])
    one, run, dec = _one_and_run(*calls)
    assert one.through == 40 and one.duplicates == 1
    echoes = []
    for by_run in (False, True):
        r = ReceiverSession(TID, key=KEY)
        for t, batch in enumerate(calls, start=1):
            if by_run:
                r.receive_datagrams(batch, t)
            else:
                for d in batch:
                    r.receive_datagram(d, t)
        r.close(3.0)
        report = r.datagrams_to_send(3.0)[-1]  # the close's (after any due earlier)
        fb = wire.decode_feedback(r.parser.parse(report).payload)
        echoes.append((fb.echo_seq, fb.echo_delay_us))
    assert echoes == [(40, 1_000_000)] * 2


# the open decoder run's source runs (_queue_run) at each of the run's bounds


def test_a_queue_run_stops_before_the_decoder_window_end(monkeypatch):
    """Decoder window 64: ESI 0 lost, a repair over 0..15 pending, then sources 10..70 in
    one call. Source 10 (the equation involves it) opens the decoder run; the queue run
    after it takes 11..63 and stops before 64, which would slide the window past ESI 0
    (source 15 completes the equation: 0 is recovered when the run is decoded, and read out
    then, before 64 comes)."""
    config = ProtocolConfig(decoder_window=64, max_pending_equations=16, max_repair_span=64)
    taken = _count_runs(monkeypatch)
    order = [(e,) for e in range(1, 10)] + [(0, 16, 1)] + [(e,) for e in range(10, 71)]
    src, data = _stream(71, order, tid=TID)
    one, run, dec = _one_and_run(data[:10], data[10:], config=config)
    assert [k for k in taken["_queue_run"] if k] == [53]
    assert one.symbols_recovered == 1 and one.through == 71
    assert run._out[: 71 * 64].tobytes() == src.tobytes()


def test_a_queue_run_stops_before_the_source_that_could_complete(monkeypatch):
    """40 symbols with a manifest; ESI 5 lost, a repair over 0..39 pending, then sources
    30..39 and two more datagrams (a copy of ESI 3, a repair) in one call. The run may hold
    sources only while it cannot complete the transfer (29 known, one equation pending):
    30 opens it, the queue run takes 31..38, and 39 (which completes it, recovering 5)
    comes one at a time: what follows it in the call is answered as after the result."""
    taken = _count_runs(monkeypatch)
    order = [("manifest",)] + [(e,) for e in range(30) if e != 5] + [(0, 40, 1)]
    after = [(e,) for e in range(30, 40)] + [(3,), (0, 40, 2)]
    src, data = _stream(40, order + after, tid=TID)
    split = len(data) - len(after)
    one, run, dec = _one_and_run(data[:split], data[split:])
    assert [k for k in taken["_queue_run"] if k] == [8]
    assert one.result is not None and one.result.reason == "complete"
    assert one.symbols_recovered == 1 and one.duplicates == 0 and one.repair_received == 1
    assert run.result is not None and run.result.payload.tobytes() == src.tobytes()


def test_a_queue_run_stops_before_a_known_or_queued_source(monkeypatch):
    """ESI 3 lost, ESI 20 known early, a repair over 0..31 pending; then in one call 10,
    11, 24, 12..19, 20, 21..40 (24 and 20 again, in order with the rest). The queue runs
    stop before ESI 20 (known) and before the second 24 (queued earlier in the run): one at
    a time those two are duplicates, in the runs too (not a second row of the run)."""
    taken = _count_runs(monkeypatch)
    first = [(e,) for e in range(10) if e != 3] + [(20,), (0, 32, 1)]
    second = [(10,), (11,), (24,)] + [(e,) for e in range(12, 41)]
    src, data = _stream(41, first + second, tid=TID)
    one, run, dec = _one_and_run(data[: len(first)], data[len(first) :])
    assert [k for k in taken["_queue_run"] if k] == [1, 7, 3, 16]
    assert one.duplicates == 2 and one.symbols_recovered == 1 and one.through == 41
    assert run._out[: 41 * 64].tobytes() == src.tobytes()


def test_a_source_a_queue_run_took_is_known_to_the_rest_of_the_run(monkeypatch):
    """ESI 3 lost, a repair over 0..31 pending; in one call sources 10..20 (11..20 in a
    queue run), a copy of ESI 15 with other bytes (the key's holder's), then 21..31. One
    datagram at a time the copy is a duplicate and ESI 15 keeps its bytes (and 3 is
    recovered from them); in the run too: the queue run's sources are queued for it."""
    taken = _count_runs(monkeypatch)
    first = [(e,) for e in range(10) if e != 3] + [(0, 32, 1)]
    second = [(e,) for e in range(10, 21)] + [(15, bytes(64))] + [(e,) for e in range(21, 32)]
    src, data = _stream(32, first + second, tid=TID)
    one, run, dec = _one_and_run(data[: len(first)], data[len(first) :])
    assert [k for k in taken["_queue_run"] if k] == [10, 10]
    assert one.duplicates == 1 and one.symbols_recovered == 1 and one.through == 32
    assert run._out[: 32 * 64].tobytes() == src.tobytes()


def test_a_queue_run_stops_at_the_end_of_the_buffer(monkeypatch):
    """Without a manifest the output buffer grows as symbols come (256 ESIs first): ESIs
    232 and 233 lost, a repair over 230..245 pending, then sources 240..300 in one call.
    The queue run after 240 stops at 255 (the buffer's end); 256 grows the buffer one at a
    time, and the next queue run takes 257..300."""
    taken = _count_runs(monkeypatch)
    first = [(e,) for e in range(240) if e not in (232, 233)] + [(230, 16, 1)]
    src, data = _stream(301, first + [(e,) for e in range(240, 301)], tid=TID)
    one, run, dec = _one_and_run(data[: len(first)], data[len(first) :])
    assert [k for k in taken["_queue_run"] if k] == [15, 44]
    assert dec is not None and dec["pending"] == 1 and one.n_known == 299 and one.through == 232


def test_a_queue_run_stops_when_the_run_is_full(monkeypatch):
    """ESI 0 lost (ESI 600 came early: the buffer holds 601 ESIs), a repair over 0..15
    pending, then sources 10..400 in one call: the run holds BATCH_MAX (256) 64-byte
    symbols, so the queue run after 10 takes 255 and the run is decoded there (recovering
    0), as one at a time; the rest come in a held run."""
    from kvtransport.core.receiver import BATCH_MAX

    taken = _count_runs(monkeypatch)
    first = [(e,) for e in range(1, 10)] + [(600,), (0, 16, 1)]
    src, data = _stream(601, first + [(e,) for e in range(10, 401)], tid=TID)
    one, run, dec = _one_and_run(data[: len(first)], data[len(first) :])
    assert BATCH_MAX == 256 and [k for k in taken["_queue_run"] if k] == [255]
    assert max(taken["_held_run"]) >= 100
    assert one.symbols_recovered == 1 and one.through == 401


def test_a_repair_after_a_queue_run_sees_the_runs_top(monkeypatch):
    """Release lag 8, chunk 4: ESIs 10 and 11 lost, a repair over 0..15 pending; then in
    one call a second repair over 0..15 (solves 10 and 11), sources 16..40 (16 in the run,
    17..40 in a queue run) and a repair over 10..44. One datagram at a time decoded-through
    reaches 41 and the decoder is released below 32 before that repair comes: it is stale.
    The run must end before it (the release bound reads the run's top, 41 after the queue
    run), not decode it before the release (it would leave an equation pending)."""
    config = ProtocolConfig(release_lag=8, release_chunk=4)
    taken = _count_runs(monkeypatch)
    first = [(e,) for e in range(16) if e not in (10, 11)] + [(0, 16, 1)]
    second = [(0, 16, 2)] + [(e,) for e in range(16, 41)] + [(10, 35, 3)]
    src, data = _stream(45, first + second, tid=TID)
    one, run, dec = _one_and_run(data[: len(first)], data[len(first) :], config=config)
    assert [k for k in taken["_queue_run"] if k] == [24]
    assert one.symbols_recovered == 2 and one.through == 41 and one.dec.released == 32
    assert dec is not None and dec["pending"] == 0 and dec["stale"] == 1


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_in_runs_reach_the_run_bounds_as_one_by_one(monkeypatch, seed):
    """Random streams through a small decoder (window 96, release lag 20 in chunks of 4):
    sources with holes, a little reordered, late copies, repairs over the last 16..32 ESIs
    (most of them soon stale) and now and then one from far back, the manifest first on
    even seeds (the transfer completes inside a call), in calls of random length. One
    datagram per call and the runs: the same feedback after every call, state and bytes."""
    config = ProtocolConfig(
        decoder_window=96, max_pending_equations=24, max_repair_span=64, release_lag=20,
        release_chunk=4,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    taken = _count_runs(monkeypatch)
    n = 700
    order: list[tuple] = [("manifest",)] if seed % 2 == 0 else []
    for e in range(n):
        if rng.random() < 0.03:
            continue  # lost
        order.append((e,))
        if rng.random() < 0.02:
            order.append((int(rng.integers(max(0, e - 40), e + 1)),))  # a copy, late
        if e % 8 == 7:
            for _ in range(int(rng.integers(2, 4))):
                span = min(e + 1, int(rng.integers(16, 33)))
                order.append((e + 1 - span, span, int(rng.integers(1, 1 << 16))))
            if e > 100 and rng.random() < 0.15:
                order.append((e - 100, 64, int(rng.integers(1, 1 << 16))))
    order += [(n - 48, 48, k) for k in (1, 2, 3, 4)]
    for i in range(len(order) - 3):
        if rng.random() < 0.03:
            order[i], order[i + 2] = order[i + 2], order[i]
    src, data = _stream(n, order, tid=TID)
    cuts = np.sort(rng.choice(len(data), 40, replace=False)).tolist()
    calls = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    one, run, dec = _one_and_run(*calls, config=config)
    assert sum(taken["_queue_run"]) >= 5 and one.symbols_recovered >= 10
    assert one.result is not None
    assert one.result.reason == ("complete" if seed % 2 == 0 else "shutdown")
