"""ReceiverSession.receive_datagrams (runs of data symbols through one
RLCDecoder.add_packets call) against receive_datagram once per datagram.

A real sender and a real receiver run on the simulator over a lossy, jittered (reordering)
channel; everything the receiver was handed (datagrams and its timer calls) is recorded,
duplicates and forged copies added. Two fresh receivers then get exactly that, one datagram
per call and in runs of random length: their feedback datagrams, after every call, and
their results and counters must be identical.
"""

import numpy as np
import pytest
from kvtransport.codecs.rlc import RLCDecoder
from kvtransport.netem import Profile, make_channel, parse_loss

from kvtransport.core import protocol, wire
from kvtransport.core.manifest_fec import ManifestSender
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.receiver_parts import BlockTracker
from kvtransport.core.transfer import BlockTable, TransportManifest, synthetic_transfer
from kvtransport.policies.registry import make_policy
from kvtransport.sim.simulator import Simulation


@pytest.fixture(autouse=True)
def _one_feedback_epoch(monkeypatch):
    """The sessions compared seal their feedback under one epoch (each draws a random one,
    kvtransport.core.wire "Sealing"), so their datagrams compare byte for byte."""
    monkeypatch.setattr(wire, "new_epoch", lambda: 1)


TID = 0x0BA7_C4ED_0000_0001
KEY = bytes(range(32))
RATE = 200e6
DELAY = 0.004


def _receiver_inputs(
    policy: str,
    key: bytes | None,
    seed: int,
    loss: float,
    jitter_ms: float,
    size: int,
    deadline: float,
    tid: int = TID,
    delay: float = DELAY,
    config: ProtocolConfig = STANDARD,
) -> list[tuple[str, float, bytes]]:
    """What the receiver of one transfer on the simulator (lossy, jittered: reordered; both
    hosts built with ``config``) was handed, in order: ("data", t, datagram) and
    ("timer", t, b"")."""
    tr = synthetic_transfer(size, 40, "zipf", seed=seed)
    data_path = Profile(
        "lossy",
        loss=parse_loss(f"{loss * 100:g}%"),
        rate_mbps=RATE / 1e6,
        delay_ms=delay * 1e3,
        jitter_ms=jitter_ms,
    )
    back = Profile("back", rate_mbps=RATE / 1e6, delay_ms=delay * 1e3)
    a, b = np.random.SeedSequence(seed).spawn(2)
    trace: list[tuple] = []
    Simulation(
        tr,
        make_policy(policy),
        make_channel(data_path, a),
        make_channel(back, b),
        rate_bps=RATE,
        deadline=deadline,
        transfer_id=tid,
        key=key,
        initial_rtt=2 * delay,
        record=False,
        trace=trace,
        config=config,
    ).run()
    out: list[tuple[str, float, bytes]] = []
    for e in trace:
        if e[2] != 1:  # the receiver is the loop's endpoint 1
            continue
        if e[0] == "timer":
            out.append(("timer", e[1], b""))
        elif e[0] == "recv":
            out.append(("data", e[1], e[3]))
    return out  # fmt: skip


def _record(
    seed: int,
    loss: float,
    size: int,
    deadline: float,
    jitter_ms: float = 0.3,
    extra: bool = True,
    policy: str = "adaptive",
) -> list[tuple[str, float, bytes]]:
    """The receiver's inputs of one transfer (``_receiver_inputs``, the sender's
    ``policy``), with some datagrams handed twice and some forged copies (bad tag) added
    after their originals (``extra``)."""
    rng = np.random.default_rng(seed)
    events: list[tuple[str, float, bytes]] = []
    for kind, t, d in _receiver_inputs(policy, KEY, seed, loss, jitter_ms, size, deadline):
        events.append((kind, t, d))
        if kind != "data" or not extra:
            continue
        if rng.random() < 0.03:  # some come twice
            events.append(("data", t, d))
        if rng.random() < 0.01:  # a forged copy: bad tag
            forged = bytearray(d)
            forged[-1] ^= 1
            events.append(("data", t, bytes(forged)))
    return events


def _state(r: ReceiverSession) -> dict:
    res = r.result
    assert res is not None
    return {
        "reason": res.reason,
        "payload": res.payload.tobytes(),
        "complete": res.complete.tolist(),
        "complete_at": res.complete_at.tolist(),
        "missing": res.missing.tolist(),
        "utility": res.utility_recovered,
        "timings": res.timings,
        "counters": (
            r.source_received,
            r.repair_received,
            r.symbols_recovered,
            r.duplicates,
            r.n_known,
            r.through,
            r.esi_end,
            r.blocks_complete,
            r.utility,
            r.feedback_sent,
            r.dropped,
        ),  # fmt: skip
        "drops": dict(r.drop_reasons),
        "monitor": (r.monitor.received, r.monitor.lost, r.monitor.loss_rate),
        "ends": list(r.fb.ends),
        "released": r.dec.released,  # where decoder state was released (the decoder itself
        # is gone with the result: _decoder_state, before it)
    }


def _decoder_state(r: ReceiverSession) -> dict | None:
    """The window decoder's state that outcomes depend on (None without one): its base,
    pending equations, and statistics but for the sources it was handed and their
    duplicates (receive_datagram hands a lazy run over later than the runs may)."""
    dec = r.decoder
    if dec is None:
        return None
    stats = {k: v for k, v in dec.stats.items() if k not in ("sources", "duplicates")}
    return {"base": dec.base, "pending": dec.pending_equations, **stats}


def _one_and_runs(
    events: list[tuple[str, float, bytes]],
    deadline: float,
    seed: int,
    key: bytes | None = KEY,
    longest: int = 300,
    tid: int = TID,
    config: ProtocolConfig = STANDARD,
    laid_out: bool = False,
) -> tuple[ReceiverSession, ReceiverSession]:
    """Two fresh receivers of transfer ``tid`` (built with ``config``) given ``events``: one
    datagram per call, and in runs of random length (1..longest - 1) through
    receive_datagrams (``laid_out``: each run in one buffer, as a socket read hands it
    over: ``wire.LaidOutDatagrams``); their feedback after every call, their results and
    counters must be identical. Returns both."""
    one = ReceiverSession(tid, key=key, deadline=deadline, config=config)
    run = ReceiverSession(tid, key=key, deadline=deadline, config=config)
    rng = np.random.default_rng(seed)
    i = 0
    while i < len(events):
        kind, t, _ = events[i]
        if kind == "timer":
            one.handle_timer(t)
            run.handle_timer(t)
            i += 1
        else:
            j, n = i, rng.integers(1, longest)
            while j < len(events) and events[j][0] == "data" and j - i < n:
                j += 1
            batch = [d for _, _, d in events[i:j]]
            t = events[j - 1][1]  # the run is read when its last datagram is in
            for d in batch:
                one.receive_datagram(d, t)
            if laid_out:
                run.receive_datagrams(wire.LaidOutDatagrams.join(batch), t)
            else:
                run.receive_datagrams([memoryview(d) for d in batch], t)
            i = j
        assert one.datagrams_to_send(t) == run.datagrams_to_send(t), f"event {i}"
    assert _decoder_state(one) == _decoder_state(run)
    one.close(events[-1][1] + 1.0)
    run.close(events[-1][1] + 1.0)
    assert one.datagrams_to_send(0.0) == run.datagrams_to_send(0.0)
    assert _state(one) == _state(run)
    return one, run


@pytest.mark.parametrize(
    "seed, loss, size, deadline",
    [(1, 0.10, 2_000_000, 0.5), (2, 0.03, 1_500_000, 0.3), (3, 0.20, 1_200_000, 0.25)],
)
def test_runs_decode_exactly_as_one_datagram_per_call(monkeypatch, seed, loss, size, deadline):
    events = _record(seed, loss, size, deadline)
    rows = {"packets": 0, "repairs": 0, "calls": 0}
    real = RLCDecoder.add_packets

    def counting(self, meta, payloads, ends=None, sources=None):
        m = np.asarray(meta)
        rows["packets"] += m.shape[0]
        rows["repairs"] += int((m[:, 1] > 0).sum())
        rows["calls"] += 1
        return real(self, meta, payloads, ends, sources)

    monkeypatch.setattr(RLCDecoder, "add_packets", counting)
    one, _ = _one_and_runs(events, deadline, seed + 100)
    # the runs did go through add_packets, repairs among them, many per call
    assert rows["repairs"] > 20 and rows["packets"] > 10 * rows["calls"]
    # and the transfer was a real one: losses repaired, blocks delivered
    assert one.symbols_recovered > 20 and one.blocks_complete > 0
    assert one.drop_reasons.get("bad_tag", 0) > 0


@pytest.mark.parametrize("jitter_ms, extra, in_order", [(0.0, False, True), (0.3, True, False)])
def test_held_in_order_sources_are_marked_exactly_as_one_by_one(
    monkeypatch, jitter_ms, extra, in_order
):
    """Sources in order at decoded-through with nothing pending have their marking held
    and done per stretch (_mark_held): the same feedback, results, counters, decoder
    releases and block completions as one datagram per call, on a lossless transfer (in
    order, and reordered with duplicates and forged copies)."""
    events = _record(7, 0.0, 2_000_000, 0.5, jitter_ms=jitter_ms, extra=extra)
    seen = {"held": 0, "releases": 0, "blocks": 0, "inside": False}
    real_mark, real_release = ReceiverSession._mark_held, ReceiverSession._release
    real_sweep = BlockTracker.sweep

    def mark_held(self, now):
        if self._held_from >= 0:
            seen["held"] += self._lazy_to - self._held_from
        seen["inside"] = True
        real_mark(self, now)
        seen["inside"] = False

    def release(self, t):
        seen["releases"] += seen["inside"]
        real_release(self, t)

    def sweep(self, t):
        before = self.n_complete
        real_sweep(self, t)
        seen["blocks"] += (self.n_complete - before) * seen["inside"]

    monkeypatch.setattr(ReceiverSession, "_mark_held", mark_held)
    monkeypatch.setattr(ReceiverSession, "_release", release)
    monkeypatch.setattr(BlockTracker, "sweep", sweep)
    one, run = _one_and_runs(events, 0.5, 8)
    assert one.result is not None and one.result.reason == "complete"
    n = sum(1 for kind, _, _ in events if kind == "data")
    if in_order:  # most sources were held; decoder releases and blocks came from held runs
        assert seen["held"] > 0.5 * n and seen["releases"] >= 3 and seen["blocks"] >= 10
    else:  # reordered: the stretches between the holes
        assert seen["held"] > 0.01 * n


def test_held_sources_reach_a_side_decoder_as_one_by_one():
    """Block Reed-Solomon parities (a side decoder, which sees every source once made) on
    a lossy in-order path: the runs give the same results as one datagram per call, and
    the side decoder recovered symbols in both."""
    events = _record(5, 0.03, 1_000_000, 0.5, jitter_ms=0.0, extra=False, policy="block-rs:4/16")
    one, _ = _one_and_runs(events, 0.5, 6)
    assert one.dec.side and one.symbols_recovered > 5


def _block1_parities(src: list, framer: wire.Framer) -> list[bytes]:
    """Block Reed-Solomon (k 8, p 2) over ``src``: block 1's two parities (ESIs 8..15),
    framed as packets 100 and 101."""
    from kvtransport.codecs.blockrs import BlockRSEncoder

    enc = BlockRSEncoder(64, 8, 2)
    for x in src:
        enc.add_source(x.tobytes())
    parities = []
    for i, parity in enumerate(enc.repairs(1)):
        framer.payload_view(64)[:] = parity
        parities.append(framer.finish(wire.DatagramType.BLOCK_REPAIR, 100 + i, 64, esi=8,
                                      key=wire.block_repair_key(2, i), dt_nss=8))  # fmt: skip
    return parities


def test_held_sources_wait_while_a_side_decoder_needs_them():
    """Both block Reed-Solomon parities of block 1 (ESIs 8..15, k 8, p 2) arrive ahead of
    its sources, then sources 8..13 in order after 0..7: one datagram at a time the side
    decoder gets each and recovers 14 and 15 with the sixth. In runs too: sources are not
    held while a side decoder exists (it would not see them)."""
    src, data = _stream(16, [(e,) for e in range(14)])
    order = data[:8] + _block1_parities(src, wire.Framer(TID, KEY, max_payload=2048)) + data[8:]
    one = ReceiverSession(TID, key=KEY)
    run = ReceiverSession(TID, key=KEY)
    for d in order:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(order, 1.0)
    assert one.symbols_recovered == 2 and one._known[14] and one._known[15]
    for r in (one, run):
        r.close(2.0)
    assert _state(one) == _state(run)
    assert run._out[: 16 * 64].tobytes() == src.tobytes()


def test_a_held_run_starts_only_with_no_equation_pending():
    """A repair over ESIs 601..640 arrived ahead of them; source 600 (not involved) starts
    a lazy run that 601.. continue. One datagram at a time, the decoder release at
    decoded-through 640 hands it 600..639, which recovers 640 before its own datagram comes
    (then a duplicate). The runs must not hold those sources' marking (an equation is
    pending), or 640 would count as received instead."""
    order = [(e,) for e in range(600)] + [(601, 40, 1)]
    src, data = _stream(701, order + [(600,)] + [(e,) for e in range(601, 701)])
    one = ReceiverSession(TID, key=KEY)
    run = ReceiverSession(TID, key=KEY)
    for d in data:
        one.receive_datagram(d, 1.0)
    for part in (data[: len(order)], data[len(order) : len(order) + 1], data[len(order) + 1 :]):
        run.receive_datagrams(part, 1.0)
    assert one.symbols_recovered == 1 and one.duplicates == 1  # the intended scenario
    assert one.datagrams_to_send(1.0) == run.datagrams_to_send(1.0)
    for r in (one, run):
        r.close(2.0)
    assert _state(one) == _state(run)
    assert run._out[: 701 * 64].tobytes() == src.tobytes()


def test_a_run_never_completes_a_transfer_late():
    """The transfer completes on the datagram that completes it: datagrams after it in the
    same run are answered as after the result, not counted (as one call per datagram)."""
    events = _record(4, 0.05, 400_000, 0.5)
    data = [d for kind, _, d in events if kind == "data"]
    one = ReceiverSession(TID, key=KEY, deadline=10.0)
    run = ReceiverSession(TID, key=KEY, deadline=10.0)
    extra = data[-50:]  # repeats after the end
    for d in data + extra:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(data + extra, 1.0)
    assert one.result is not None and one.result.reason == "complete"
    assert one.datagrams_to_send(1.0) == run.datagrams_to_send(1.0)
    assert _state(one) == _state(run)


def test_ends_split_add_packets_results_per_packet():
    """add_packets' ``ends``: packet i's ESIs are result[ends[i-1]:ends[i]], the ESIs its
    own add_source / add_repair call returns."""
    from kvtransport.codecs.rlc import RLCEncoder

    size, n = 64, 40
    rng = np.random.default_rng(5)
    src = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    enc = RLCEncoder(size, window=n)
    for x in src:
        enc.add_source(x)
    packets = [(e, 0, 0, 0) for e in range(n) if e % 5 != 2]
    packets += [(0, 20, k, 15) for k in range(4)] + [(20, 20, k, 15) for k in range(4)]
    order = rng.permutation(len(packets))
    packets = [packets[k] for k in order]
    pays = [src[p[0]] if p[1] == 0 else enc.repair(*p) for p in packets]
    one = RLCDecoder(size, max_window=64)
    per = [one.add_source(p[0], x) if p[1] == 0 else one.add_repair(*p, x)
           for p, x in zip(packets, pays, strict=True)]  # fmt: skip
    batch = RLCDecoder(size, max_window=64)
    ends = np.zeros(len(packets), dtype=np.int64)
    got = batch.add_packets(packets, b"".join(pays), ends)
    bounds = [0, *ends.tolist()]
    assert [got[bounds[i] : bounds[i + 1]] for i in range(len(packets))] == per
    assert sum(len(x) for x in per) == n
    # the same with the sources' bytes read from a buffer indexed by ESI (their rows unread)
    again = RLCDecoder(size, max_window=64)
    rows = b"".join(bytes(size) if p[1] == 0 else x for p, x in zip(packets, pays, strict=True))
    buf = np.frombuffer(b"".join(src), dtype=np.uint8)
    assert again.add_packets(packets, rows, None, buf) == got
    assert [again.get(e) for e in range(n)] == src
    with pytest.raises(ValueError, match="packet"):  # a source beyond the buffer
        again.add_packets([(n, 0, 0, 0)], bytes(size), None, buf)


def _stream(n: int, order: list[tuple], size: int = 64, tid: int = TID):
    """Source symbols 0..n-1 and datagrams of a transfer, in ``order``: (esi,) for a
    source, (esi, bytes) for a source with other bytes, (first_esi, nss, repair_key) for an
    RFC 8681 repair, ("manifest",) for the manifest's datagrams (payload: the n symbols,
    four blocks; without one, the transfer has no manifest). Packet numbers count from 0."""
    from kvtransport.codecs.rlc import RLCEncoder

    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, (n, size), dtype=np.uint8)
    enc = RLCEncoder(size, window=n)
    enc.add_sources(src.tobytes())
    framer = wire.Framer(tid, KEY, max_payload=max(2048, size))
    out: list[bytes] = []
    for item in order:
        seq = len(out)
        if item == ("manifest",):
            cut = np.linspace(0, n * size, 5).astype(np.int64)
            blocks = BlockTable(cut[:-1], np.diff(cut), np.full(4, 0.25))
            man = ManifestSender(TransportManifest(size, n * size, blocks).to_bytes(), size)
            out += [man.emit(framer, seq + i, 0) for i in range(man.m)]
        elif len(item) <= 2:  # (esi,) or (esi, other bytes): a forged copy, the key's holder's
            body = src[item[0]].tobytes() if len(item) == 1 else item[1]
            framer.payload_view(size)[:] = body
            out.append(framer.finish(wire.DatagramType.SOURCE, seq, size, esi=item[0]))
        else:
            first, nss, key = item
            framer.payload_view(size)[:] = enc.repair(first, nss, key)
            dt_nss = wire.pack_dt_nss(15, nss)
            out.append(framer.finish(wire.DatagramType.REPAIR, seq, size, esi=first, key=key,
                                     dt_nss=dt_nss))  # fmt: skip
    return src, out


def _both(data: list[bytes], split: int = 0) -> tuple[ReceiverSession, ReceiverSession]:
    """The datagrams one per call, and in runs (two calls, the second from ``split``)."""
    one = ReceiverSession(TID, key=KEY)
    run = ReceiverSession(TID, key=KEY)
    for d in data:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(data[:split], 1.0)
    run.receive_datagrams(data[split:], 1.0)
    assert one.datagrams_to_send(1.0) == run.datagrams_to_send(1.0)
    for r in (one, run):
        r.close(2.0)
    assert _state(one) == _state(run)
    return one, run


def test_a_run_ends_before_a_repair_reaching_below_a_release_it_may_cause():
    """Repair 1 recovers ESI 10, so decoded-through jumps to 850 and the receiver releases
    the decoder below 338; repair 2 (ESIs 250..899) then reaches below that: one datagram
    at a time it is stale and 850 stays lost. In one run it must be the same (the run ends
    before repair 2), not decoded before the release."""
    order = [(e,) for e in range(900) if e not in (10, 850)] + [(0, 64, 1), (250, 650, 2)]
    src, data = _stream(900, order)
    one, run = _both(data)
    assert one._known[10] and not one._known[850]  # the scenario is the intended one
    assert run._out[10 * 64 : 11 * 64].tobytes() == src[10].tobytes()


def test_the_release_bound_counts_the_equations_already_pending():
    """The run's first datagram (source 11) completes an equation that waited since the
    previous call (ESIs 10 and 11 lost): two holes fill at once, decoded-through jumps to
    850 and the receiver releases below 338, so repair 2 (250..899) must see the release."""
    order = [(e,) for e in range(900) if e not in (10, 11, 850)] + [(0, 64, 1)]
    src, data = _stream(900, order + [(11,), (250, 650, 2)])
    one, run = _both(data, split=len(order))
    assert one._known[10] and not one._known[850]
    assert run._out[10 * 64 : 11 * 64].tobytes() == src[10].tobytes()


def test_a_run_ends_before_a_datagram_that_slides_the_decoder_window():
    """Repair 1 recovers ESI 5; source DECODER_WINDOW + 5 then slides the decoder window
    past it, and its bytes take ESI 5's slot. One datagram at a time ESI 5 was read out before;
    in one run too (the run ends before that source)."""
    window = protocol.DECODER_WINDOW
    order = [(e,) for e in range(100) if e != 5] + [(0, 64, 1), (window + 5,)]
    src, data = _stream(window + 6, order)
    one, run = _both(data)
    assert one._known[5] and one._known[window + 5]
    assert run._out[5 * 64 : 6 * 64].tobytes() == src[5].tobytes()


def test_the_first_copy_of_a_source_in_a_run_is_the_one_kept():
    """Two copies of source 3 with different bytes (a key holder's forgery) in one run,
    while a repair equation waits on it: one datagram at a time the first is kept (and
    recovers ESI 2 right); in one run too."""
    order = [(0,), (1,), (0, 8, 1), (3,), (3, bytes(64)), (4,), (5,), (6,), (7,)]
    src, data = _stream(8, order)
    one, run = _both(data)
    assert one._known[2] and one.duplicates == 1
    assert run._out[: 8 * 64].tobytes() == src.tobytes()


def test_a_run_of_large_symbols_holds_at_most_batch_bytes():
    """60,000-byte symbols: a run holds BATCH_BYTES // 60000 = 17 of them (each repair's
    bytes are staged), and splitting there changes nothing."""
    from kvtransport.core import receiver

    size = 60_000
    order = [(0,), (1,)] + [(0, 40, k) for k in range(3)] + [(e,) for e in range(3, 40)]
    src, data = _stream(40, order, size=size)
    one = ReceiverSession(TID, key=KEY)
    run = ReceiverSession(TID, key=KEY)
    for d in data:
        one.receive_datagram(d, 1.0)
    run.receive_datagrams(data, 1.0)
    assert run._batch.rows == receiver.BATCH_BYTES // size == 17
    assert run._batch.pay.nbytes <= receiver.BATCH_BYTES
    assert one.datagrams_to_send(1.0) == run.datagrams_to_send(1.0)
    for r in (one, run):
        r.close(2.0)
    assert _state(one) == _state(run)
    # three equations solve ESI 2 and the last two (recovered before their sources come)
    assert one.symbols_recovered == 3 and one.duplicates == 2
    assert run._out[: 40 * size].tobytes() == src.tobytes()


def test_the_host_hands_each_transfers_runs_of_a_batch_to_its_session():
    """ReceiverHost.receive_datagrams (what the receiver daemon calls per socket read) on
    two transfers interleaved in runs of any length, garbage between them: the same
    feedback after every batch and the same results as receive_datagram per datagram."""
    from kvtransport.hosts.receiver_host import ReceiverHost

    rng = np.random.default_rng(21)
    streams = []
    for k, tid in enumerate((TID, TID + 1)):
        lost = {int(e) for e in rng.choice(400, 30, replace=False)}
        order = [(e,) for e in range(400) if e not in lost]
        for first in range(0, 384, 32):  # two repairs per 32 sources, after them
            at = min(len(order), first + 32 + 4 * k)
            order[at:at] = [(first, 32, 2 * first + 1), (first, 32, 2 * first + 2)]
        streams.append(_stream(400, order, tid=tid)[1])
    stream = []
    while streams[0] or streams[1]:
        pick = streams[int(rng.integers(0, 2))] or streams[0] or streams[1]
        take = int(rng.integers(1, 12))
        stream += pick[:take]
        del pick[:take]
        if rng.random() < 0.2:
            stream.append(b"\x00" * int(rng.integers(0, 40)))  # truncated or garbage
    addr = ("127.0.0.1", 9)
    one, run = ReceiverHost(key=KEY), ReceiverHost(key=KEY)
    for h in (one, run):  # the streams carry no manifest: their sessions opened ahead
        for tid in (TID, TID + 1):
            h.expect(tid, addr, 0.0, 100.0)
    t, i = 0.0, 0
    while i < len(stream):
        batch = stream[i : i + int(rng.integers(1, 80))]
        i += len(batch)
        t += 0.0005
        for d in batch:
            one.receive_datagram(d, addr, t)
        run.receive_datagrams([(memoryview(d), addr) for d in batch], t)
        assert one.datagrams_to_send(t) == run.datagrams_to_send(t)
    for h in (one, run):
        h.close(t + 1.0)
    assert one.datagrams_to_send(t + 1.0) == run.datagrams_to_send(t + 1.0)
    assert one.stats() == run.stats()
    for tid in (TID, TID + 1):
        a, b = one.get(tid), run.get(tid)
        assert a is not None and b is not None and a.datagrams == b.datagrams
        assert _state(a.session) == _state(b.session)
        assert a.session.symbols_recovered > 5
