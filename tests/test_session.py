"""Sender and receiver sessions over scripted networks with a fake clock.

The driver below is the whole "network": it moves datagrams between the two real sessions
with fixed delays and lets each test decide, per datagram, whether it is lost, duplicated
or delayed (reordered). Time only moves when a session's timer or a delivery says so.
"""

import dataclasses
import math
from collections import deque

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvtransport.codecs.rlc import RLCEncoder

from kvtransport.core import protocol, wire
from kvtransport.core.manifest_fec import ManifestSender
from kvtransport.core.observation import Obs
from kvtransport.core.policy_base import ACTIONS
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.schemes.rlc import LAST_ROUND_Z, _gilbert_failures, last_round_repairs
from kvtransport.core.sender import OPEN_LOOP_LOSS, STOP_RTTVAR, SenderSession
from kvtransport.core.transfer import BlockTable, Transfer, TransportManifest, synthetic_transfer
from kvtransport.core.wire import DatagramType as T
from kvtransport.policies.heuristics import REPAIR_ONLY, ExternalPolicy
from kvtransport.policies.registry import make_policy
from kvtransport.sim.virtual_clock import (
    ReceiverSessionEndpoint,
    SenderSessionEndpoint,
    VirtualClockLoop,
)

TID = 0x1234_5678_9ABC_DEF0
RATE = 100e6
DELAY = 0.005


def _keep(i, d):
    return [0.0]


class _Scripted:
    """One session as an endpoint whose datagrams meet the test's rule on their way out:
    ``rule(i, parsed)`` gives the extra delays of the i-th datagram's copies ([] drops it),
    which its path then adds to the fixed delay. ``alive`` False: the session is dead (no
    timers, deaf)."""

    def __init__(self, endpoint, rule, log, path, key):
        self.endpoint, self.rule, self.log, self.path, self.key = endpoint, rule, log, path, key
        self.alive = True

    def get_timer(self):
        return self.endpoint.get_timer() if self.alive else None

    def handle_timer(self, now):
        self.endpoint.handle_timer(now)

    def receive_datagram(self, data, addr, now):
        if self.alive:
            self.endpoint.receive_datagram(data, addr, now)

    def datagrams_to_send(self, now):
        out = []
        for batch, addr in self.endpoint.datagrams_to_send(now):
            copies = []
            for d in batch:
                parsed = wire.parse(d, self.key)
                self.log.append((now, parsed))
                for extra in self.rule(len(self.log) - 1, parsed):
                    self.path.extras.append(extra)
                    copies.append(d)
            out.append((copies, addr))
        return out


class _Path:
    """A fixed delay plus each copy's extra delay, in the order the copies are sent."""

    def __init__(self, delay):
        self.delay = delay
        self.extras = deque()

    def transmit(self, t, size):
        return t + self.delay + self.extras.popleft()


class Net:
    """Moves datagrams between a sender and a receiver on a virtual clock (the
    simulators' loop, kvtransport.sim.virtual_clock).

    ``data(i, parsed)`` and ``back(i, parsed)`` return, per datagram (i-th on that path),
    the list of extra delays of its copies: [] drops it, [0.0] delivers it once, two
    entries duplicate it, a positive extra delay reorders it.
    """

    def __init__(self, sender, receiver, data=_keep, back=_keep, delay=DELAY, key=None):
        self.s, self.r = sender, receiver
        self.sent = []  # (time, parsed datagram) on the data path, as sent
        self.feedback = []  # (time, parsed datagram) on the feedback path, as sent
        self.loop = VirtualClockLoop()
        self.tx = _Scripted(SenderSessionEndpoint(sender, "r"), data, self.sent, _Path(delay), key)
        back_path = _Path(delay)
        rx = _Scripted(ReceiverSessionEndpoint(receiver, "s"), back, self.feedback, back_path, key)
        self.loop.add(self.tx, "s", rank=1, channel=self.tx.path)
        self.loop.add(rx, "r", rank=2, channel=back_path)

    @property
    def t(self):
        return self.loop.now

    @property
    def sender_alive(self):
        return self.tx.alive

    def run(self, until=10.0, stop_sender_after=None):
        s, r, loop = self.s, self.r, self.loop

        def over():
            if stop_sender_after is not None and len(self.sent) >= stop_sender_after:
                if self.tx.alive:
                    self.tx.alive = False
                    loop.touch(0)
            return r.finished and (s.done or not self.tx.alive) and not loop.in_flight

        loop.touch(0)  # the test may have called the sessions between runs
        loop.touch(1)
        loop.run(until, over)

    def of_type(self, dtype):
        return [(t, d) for t, d in self.sent if d.type == dtype]


def make_pair(size=200_000, blocks=20, policy="adaptive", rho=None, deadline=1.0, key=None,
              receiver_deadline="same", delay=DELAY, **kw):  # fmt: skip
    tr = synthetic_transfer(size, blocks, "zipf", seed=7)
    n_source = -(-size // 1280)
    if rho is not None:
        deadline = rho * n_source * (28 + 1280 + 42) * 8 / RATE
    pol = make_policy(policy) if isinstance(policy, str) else policy
    s = SenderSession(tr, pol, rate_bps=RATE, deadline=deadline, transfer_id=TID, key=key,
                      initial_rtt=2 * delay, **kw)  # fmt: skip
    rd = deadline if receiver_deadline == "same" else receiver_deadline
    r = ReceiverSession(TID, key=key, deadline=rd)
    return tr, s, r


def _block_ok(tr, res, b):
    o, n = int(tr.blocks.offsets[b]), int(tr.blocks.lengths[b])
    return np.array_equal(res.payload[o : o + n], tr.payload[o : o + n])


def _drop_sources(esis):
    """Lose the first transmission of these source ESIs."""
    seen = set()

    def rule(i, d):
        if d.type == T.SOURCE and d.esi in esis and d.esi not in seen:
            seen.add(d.esi)
            return []
        return [0.0]

    return rule


def test_clean_transfer_delivers_every_block_byte_for_byte():
    tr, s, r = make_pair(size=300_000, blocks=25)
    net = Net(s, r)
    net.run()
    res = r.result
    assert res.reason == "complete" and res.missing.size == 0 and res.complete.all()
    assert np.array_equal(res.payload, tr.payload)
    assert res.utility_recovered == pytest.approx(1.0)
    assert res.app_metadata == b"" and res.manifest.blocks.equals(tr.blocks)
    # the receiver's ALL_DONE stops the sender long before its deadline
    assert s.done and s.finish_reason == "receiver done" and s.finished_at < 0.1
    assert res.timings["complete"] < 0.1


def test_lost_sources_are_repaired_inside_their_segment():
    lost = {10, 11, 12, 70}
    tr, s, r = make_pair(size=200_000, blocks=20)
    net = Net(s, r, data=_drop_sources(lost))
    net.run()
    res = r.result
    assert res.reason == "complete" and np.array_equal(res.payload, tr.payload)
    assert r.symbols_recovered == len(lost)  # decoded from repairs, never resent as sources
    assert [d.esi for _, d in net.of_type(T.SOURCE)].count(10) == 1
    # after feedback reported the holes, reactive repairs cover exactly a segment's holes
    first_fb = min(t for t, d in net.feedback if wire.decode_feedback(d.payload).ranges)
    later = [d for t, d in net.of_type(T.REPAIR) if t >= first_fb]
    assert later
    windows = {(d.esi, d.esi + d.nss) for d in later}
    seg = protocol.REPAIR_SEGMENT
    assert any(lo <= 10 and hi >= 13 and hi <= seg for lo, hi in windows)
    assert any(lo >= seg and lo <= 70 < hi <= 2 * seg for lo, hi in windows)


def test_repairs_built_ahead_in_one_pass_are_the_rfc_repairs_of_their_header():
    """Reactive repairs owed over one span, and tail repairs, are built several at a time
    (RLCEncoder.repairs_into); each one sent must still be the repair its header names."""
    lost = set(range(10, 22)) | {70, 71, 72, 300}
    tr, s, r = make_pair(size=600_000, blocks=20)
    batches = []
    build = s.encoder.repairs_into

    def spy(out, first, nss, keys, dt=15):
        batches.append(len(keys))
        build(out, first, nss, keys, dt)

    s.encoder.repairs_into = spy
    net = Net(s, r, data=_drop_sources(lost))
    net.run()
    assert r.result.reason == "complete" and np.array_equal(r.result.payload, tr.payload)
    assert batches and max(batches) > 1  # the one-pass path ran
    ref = RLCEncoder(1280, window=4096, stream=tr.payload)
    ref.add_stream_sources(ref.stream_symbols)
    repairs = net.of_type(T.REPAIR)
    assert len(repairs) >= sum(batches)
    for _, d in repairs:
        assert bytes(d.payload) == ref.repair(d.esi, d.nss, d.key, 15)


def test_decoder_limits_are_sized_for_a_gigabit_link_with_40ms_rtt():
    bdp = 1e9 * 0.040 / 8 / (1280 + 28 + 16 + 42)  # datagrams in flight
    assert protocol.DECODER_WINDOW == protocol.decoder_window(1e9, 0.040) >= 2 * bdp
    assert protocol.decoder_window(100e6, 0.020) == protocol.MIN_DECODER_WINDOW
    assert protocol.decoder_window(10e9, 0.040) >= 20 * bdp
    assert protocol.MAX_REPAIR_SPAN <= protocol.DECODER_WINDOW
    # bounded state: the coefficient rows stay within what the 4096-ESI window allowed
    assert protocol.MAX_PENDING_EQUATIONS * protocol.DECODER_WINDOW <= 4096 * 4096
    _, s, r = make_pair(size=20_000)
    Net(s, r).run(until=DELAY + 0.0005)  # the decoder exists from the first symbol on
    assert r.decoder.max_window == protocol.DECODER_WINDOW
    assert r.decoder.max_pending == protocol.MAX_PENDING_EQUATIONS


def test_the_decoder_window_is_sized_from_the_link_and_named_in_the_manifest():
    """Two bandwidth-delay products of the link the sender is given, within the config's
    bounds and no wider than the transfer (the next test: the manifest carries it)."""
    tr = synthetic_transfer(40_000_000, 100, "zipf", seed=7)  # 31,250 symbols

    def window(rate, rtt, transfer=tr):
        s = SenderSession(transfer, make_policy("adaptive"), rate_bps=rate, deadline=1.0,
                          transfer_id=TID, initial_rtt=rtt)  # fmt: skip
        return s.decoder_window

    assert window(100e6, 0.040) == window(1e9, 0.040) == protocol.DECODER_WINDOW
    assert window(1e9, 0.080) == protocol.decoder_window(1e9, 0.080) == 16384
    assert window(1e9, 0.200) == tr.nbytes // 1280  # the whole transfer
    assert window(1e9, 0.200, synthetic_transfer(400_000, 10, "zipf")) == protocol.DECODER_WINDOW
    big = synthetic_transfer(45_000_000, 100, "zipf", seed=7)  # 35,157 symbols
    assert window(1e9, 0.200, big) == protocol.MAX_DECODER_WINDOW


def test_the_receiver_widens_its_decoder_to_the_manifests_window_or_refuses_it():
    """A path whose round trip (40 ms, about 370 datagrams) outlasts the window a receiver
    starts with (256 ESIs here): the sender asks for a wider one. The manifest's first run
    is lost, so the receiver's decoder starts narrow with the first symbols and widens
    when the manifest arrives; the repairs of a burst a round trip old decode there (a
    decoder left narrow has let the burst slide out: the transfer runs to its deadline). A
    receiver whose limit is lower refuses the transfer (counted as decoder_window)."""
    small = protocol.ProtocolConfig(
        decoder_window=256, max_decoder_window=1024, max_pending_equations=64,
        max_repair_span=256, release_lag=64,
    )  # fmt: skip
    tr = synthetic_transfer(2_000_000, 40, "zipf", seed=7)
    drop = _drop_sources(set(range(300, 330)) | set(range(100, 2000, 37)))

    def rule(i, d):
        if d.type in (T.MANIFEST, T.MANIFEST_REPAIR) and i < 20:
            return []
        return drop(i, d)

    def run(receiver_config):
        s = SenderSession(tr, make_policy("adaptive"), rate_bps=RATE, deadline=1.0,
                          transfer_id=TID, initial_rtt=0.040, config=small)  # fmt: skip
        r = ReceiverSession(TID, deadline=1.0, config=receiver_config)
        net = Net(s, r, data=rule, delay=0.020)
        net.run()
        return s, r

    s, r = run(small)
    assert s.decoder_window == r.decoder_window == 1024
    assert r.result.reason == "complete" and np.array_equal(r.result.payload, tr.payload)
    _, r = run(dataclasses.replace(small, max_decoder_window=512))
    assert r.result.reason == "refused" and r.drop_reasons["decoder_window"] >= 1
    assert r.result.utility_recovered == 0.0


def test_feedback_comes_periodically_and_at_once_on_a_loss():
    tr, s, r = make_pair(size=400_000, blocks=10, policy="none")
    net = Net(s, r, data=_drop_sources({150}))
    net.run()
    times = [t for t, _ in net.feedback]
    last_arrival = net.sent[-1][0] + DELAY
    gaps = np.diff([t for t in times if t <= last_arrival])
    assert len(gaps) > 5 and gaps.max() <= r.feedback_interval + 1e-9
    # the datagram right after the lost one arrives -> a report leaves at that instant
    lost_at = next(t for t, d in net.sent if d.type == T.SOURCE and d.esi == 151) + DELAY
    assert any(abs(t - lost_at) < 1e-9 for t in times)
    fb = next(wire.decode_feedback(d.payload) for t, d in net.feedback if abs(t - lost_at) < 1e-9)
    assert (150, 1) in fb.ranges and fb.lost == 1 and fb.unrecovered == 1


def test_feedback_lists_only_the_holes_no_pending_equation_is_pivoted_on():
    """Two holes in one segment and one repair over both: the repair's equation pivots on
    the lower hole, so the receiver reports only the upper one, the one that still needs an
    equation (the wire's NACK list), while still counting both as unrecovered. A second
    repair decodes both and the list is empty."""
    sym, n = 64, 40
    payload = np.random.default_rng(5).integers(0, 256, n * sym, dtype=np.uint8)
    enc = RLCEncoder(sym, window=n, stream=payload)
    enc.add_stream_sources(n)
    framer = wire.Framer(TID)
    r = ReceiverSession(TID, deadline=10.0)
    seq = 0

    def send(d, now):
        nonlocal seq
        r.receive_datagram(d, now)
        seq += 1

    def last_feedback(now):
        r.handle_timer(now)  # the periodic report is due
        fbs = [wire.parse(d) for d in r.datagrams_to_send(now)]
        fbs = [wire.decode_feedback(d.payload) for d in fbs if d.type == T.FEEDBACK]
        return fbs[-1]

    def repair(key):
        return framer.build(T.REPAIR, seq, enc.repair(0, n, key), esi=0, key=key,
                            dt_nss=wire.pack_dt_nss(15, n))  # fmt: skip

    for e in range(n):
        if e not in (10, 20):
            send(framer.build(T.SOURCE, seq, payload[e * sym : (e + 1) * sym], esi=e), 0.001)
    fb = last_feedback(1.0)
    assert fb.ranges == ((10, 1), (20, 1)) and fb.unrecovered == 2
    send(repair(1), 1.1)
    fb = last_feedback(2.0)
    assert fb.ranges == ((20, 1),) and fb.unrecovered == 2 and fb.pending == 1
    send(repair(2), 2.1)
    assert r.n_known == n
    for e in (10, 20):
        assert bytes(r.known_symbol(e)) == payload[e * sym : (e + 1) * sym].tobytes()


def test_a_hole_list_cut_at_its_cap_sends_proactive_repairs_where_it_stopped():
    """300 holes (every third source of 300..1199) on a 100 ms one-way path: the receiver's
    reports list 96 ranges and stop short of the rest. Once every source is out and the
    listed holes have their repairs in flight, the sender's spare slots go to repairs over
    the symbols from where the list stopped (which it knows hold unlisted holes), not over
    the newest symbols (which hold none): most wide repairs start there."""
    tr = synthetic_transfer(3_000_000, 40, "zipf", seed=7)
    s = SenderSession(tr, make_policy("adaptive"), rate_bps=RATE, deadline=1.0,
                      transfer_id=TID, initial_rtt=0.2)  # fmt: skip
    r = ReceiverSession(TID, deadline=1.0)
    net = Net(s, r, data=_drop_sources(set(range(300, 1200, 3))), delay=0.1)
    net.run()
    assert r.result.reason == "complete" and np.array_equal(r.result.payload, tr.payload)
    cut_ends = set()
    for _, d in net.feedback:
        fb = wire.decode_feedback(d.payload)
        if len(fb.ranges) == wire.MAX_FEEDBACK_RANGES:
            cut_ends.add(fb.ranges[-1][0] + fb.ranges[-1][1])
    assert cut_ends
    proactive = [d for _, d in net.of_type(T.REPAIR) if d.nss > protocol.REPAIR_SEGMENT]
    at_cut = [d for d in proactive if d.esi in cut_ends]
    assert len(at_cut) > len(proactive) // 2


def test_deadline_cuts_the_stream_and_the_missing_list_is_exact():
    tr, s, r = make_pair(size=400_000, blocks=40, policy="none", rho=0.5)
    net = Net(s, r)
    net.run()
    res = r.result
    assert res.reason == "deadline" and s.finish_reason == "deadline"
    last_data = max(t for t, d in net.sent if d.type != T.CONTROL)
    assert last_data <= s.stop_time < s.deadline
    assert last_data + DELAY <= s.deadline  # everything sent could arrive in time
    sent = {d.esi for _, d in net.of_type(T.SOURCE)}
    first, last = tr.blocks.symbol_ranges(1280)
    want_missing = [b for b in range(len(tr.blocks)) if not set(range(first[b], last[b])) <= sent]
    assert res.missing.tolist() == want_missing and 0 < len(want_missing) < len(tr.blocks)
    assert res.utility_recovered == pytest.approx(float(tr.blocks.utilities[res.complete].sum()))
    assert all(_block_ok(tr, res, b) for b in np.flatnonzero(res.complete))
    # no source was useless: the block holding each one's first byte was completed
    ends = tr.blocks.offsets + tr.blocks.lengths
    owner = np.searchsorted(ends, np.array(sorted(sent)) * 1280, side="right")
    assert res.complete[owner].all()


def _cut_run(extra):
    """A deadline-cut transfer (no repair, rho 0.5, 3000 small blocks) whose i-th datagram
    on each path takes ``DELAY`` plus ``extra(i)``; the sender and the data datagrams'
    arrival times."""
    extras = []

    def data(i, d):
        extras.append(extra(i))
        return [extras[-1]]

    tr, s, r = make_pair(size=4_000_000, blocks=3000, policy="none", rho=0.5)
    net = Net(s, r, data=data, back=lambda i, d: [extra(i)])
    net.run()
    arrivals = [t + DELAY + extras[i] for i, (t, d) in enumerate(net.sent) if d.type != T.CONTROL]
    return s, np.array(arrivals)


def _jittered_cut_run(jitter_s, seed):
    """``_cut_run`` with a uniform extra in [0, jitter_s] each way (datagrams reorder)."""
    rng = np.random.default_rng(seed)
    return _cut_run(lambda i: float(rng.uniform(0.0, jitter_s)))


def test_the_stop_time_keeps_a_jittered_paths_last_datagrams_before_the_deadline(monkeypatch):
    """Up to 2 ms of jitter each way on a 5 ms path, three runs: the path reorders, and the
    stop time's margin of ``STOP_RTTVAR`` RTT mean deviations keeps all but at most one of
    their ~4500 data datagrams' arrivals before the deadline, where half the smoothed RTT
    alone (the mean one-way delay, even a little less: the receiver echoes the highest
    number that arrived, which favours the datagrams that were fast) lets several arrive
    late. Without jitter the mean deviation, and the margin, stay near 0."""
    runs = [_jittered_cut_run(0.002, seed) for seed in range(3)]
    for s, _ in runs:
        assert s.finish_reason == "deadline" and s.path_reorders
        assert 0.0002 < s.rttvar < 0.0012  # the RTT's spread: a triangle over 0..4 ms
        want = s.deadline - s.srtt / 2 - STOP_RTTVAR * s.rttvar - s.slot_s
        assert s.stop_time == pytest.approx(want)
    late = sum(int((arrivals > s.deadline).sum()) for s, arrivals in runs)
    assert late <= 1
    fixed, _ = _cut_run(lambda i: 0.0)
    assert fixed.rttvar < 1e-5 and not fixed.path_reorders
    assert fixed.stop_time > max(s.stop_time for s, _ in runs) + 0.001
    monkeypatch.setattr("kvtransport.core.sender.STOP_RTTVAR", 0.0)
    bare = [_jittered_cut_run(0.002, seed) for seed in range(3)]
    assert sum(int((arrivals > s.deadline).sum()) for s, arrivals in bare) >= 5


def test_a_reordering_paths_gaps_are_not_taken_for_loss_bursts():
    """Jitter alone (nothing lost): gaps open all the time, but late datagrams fill them
    within the reordering window, so only the first ones, before the receiver has a window,
    settle as bursts; the receiver reports about 1 (what RLC's last-round margin and the
    DDQN read; when gaps counted as they opened it was above 2). With 20 back-to-back
    datagrams of every 200 lost on the same jittered path, it reports bursts as long as on
    a path that does not reorder."""
    for seed in range(2):
        s, _ = _jittered_cut_run(0.002, seed)
        assert s.path_reorders and s.fb_burst < 1.3
    bursts = []
    for jitter_s in (0.0, 0.002):
        rng = np.random.default_rng(3)
        tr, s, r = make_pair(size=2_000_000, blocks=100, rho=0.9)

        def data(i, d, rng=rng, jitter_s=jitter_s):
            return [] if 100 <= i % 200 < 120 else [float(rng.uniform(0.0, jitter_s))]

        Net(s, r, data=data).run()
        assert s.path_reorders == (jitter_s > 0)
        bursts.append(s.fb_burst)
    assert bursts[0] > 5.0 and bursts[1] == pytest.approx(bursts[0], rel=0.2)


def test_delay_that_varies_in_order_keeps_no_stop_margin():
    """A queue that fills and drains (the delay climbs 4 ms and falls back, in order): the
    RTT samples spread as much as under jitter, but nothing reorders, so the stop time
    keeps no margin (half the smoothed RTT, which lags a draining queue, errs late
    already)."""
    s, arrivals = _cut_run(lambda i: 0.004 * (1.0 - abs(i / 700.0 - 1.0)) if i < 1400 else 0.0)
    assert s.rttvar > 0.0003 and not s.path_reorders and s.jitter_margin == 0.0
    assert s.stop_time == pytest.approx(s.deadline - s.srtt / 2 - s.slot_s)
    assert np.all(np.diff(arrivals) > 0)  # in order


def test_manifest_arrives_even_when_its_whole_first_run_is_lost():
    def rule(i, d):
        if d.type in (T.MANIFEST, T.MANIFEST_REPAIR) and i < 20:
            return []
        return [0.0]

    tr, s, r = make_pair(size=300_000, blocks=25)
    net = Net(s, r, data=rule)
    net.run()
    res = r.result
    manifest = [t for t, d in net.sent if d.type in (T.MANIFEST, T.MANIFEST_REPAIR)]
    assert len([t for t in manifest if t < manifest[0] + 20 * s.slot_s]) >= 5
    assert res.reason == "complete" and np.array_equal(res.payload, tr.payload)
    assert res.timings["manifest"] > res.timings["first_packet"]


def test_manifest_survives_heavy_random_loss():
    rng = np.random.default_rng(3)
    ok = 0
    for _ in range(10):
        tr, s, r = make_pair(size=100_000, blocks=10, policy="adaptive")
        net = Net(s, r, data=lambda i, d: [] if rng.random() < 0.4 else [0.0])
        net.run()
        ok += r.manifest is not None
    assert ok == 10


def test_duplicates_and_reordering_change_nothing():
    tr, s, r = make_pair(size=300_000, blocks=30, policy="adaptive")
    lost = _drop_sources({5, 6, 7, 90})
    Net(s, r, data=lost).run()
    clean = r.result

    tr, s, r = make_pair(size=300_000, blocks=30, policy="adaptive")
    lost = _drop_sources({5, 6, 7, 90})

    def messy(i, d):
        out = lost(i, d)
        if not out:
            return out
        jitter = 0.0004 * (i % 3)  # neighbours swap places
        return [jitter, jitter + 0.0002]  # and every datagram comes twice

    net = Net(s, r, data=messy, back=lambda i, d: [0.0, 0.0001 * (i % 2)])
    net.run()
    res = r.result
    assert r.monitor.duplicates > 100
    assert res.reason == clean.reason == "complete"
    assert np.array_equal(res.payload, clean.payload) and np.array_equal(res.payload, tr.payload)
    assert s.stats["feedback_stale"] > 0  # reordered old reports were ignored


def test_total_feedback_loss_leaves_the_sender_finishing_open_loop():
    rng = np.random.default_rng(5)
    tr, s, r = make_pair(size=400_000, blocks=40, policy="adaptive", rho=0.9)
    net = Net(s, r, data=lambda i, d: [] if rng.random() < 0.05 else [0.0], back=lambda i, d: [])
    net.run()
    assert s.stats["feedback_received"] == 0
    assert s.done and s.finish_reason == "deadline"
    assert s.stats["rlc_repair_sent"] > 0.04 * s.stats["source_sent"]  # protected blind
    res = r.result
    assert res.reason == "deadline" and res.utility_recovered > 0.5
    assert all(_block_ok(tr, res, b) for b in np.flatnonzero(res.complete))


@pytest.mark.parametrize(("rho", "prior"), [(0.8, None), (1.0, None), (1.0, 0.02)])
def test_a_receiver_that_never_answers_still_gets_its_first_sources_repaired(rho, prior):
    """Every report lost, 10 % loss, 40 ms one way, rho 1 and below (no slack), a policy
    that sends no proactive repair of its own: two round trips into the silence the sender assumes
    ``OPEN_LOOP_LOSS`` (the tail rule then leaves room), repairs at that share between the
    sources, and walks them from the oldest symbols, so the first (most useful) sources,
    sent before the silence counted, are repaired too. Before, the sender assumed no loss,
    admitted every source, had no slack to repair with and aimed any repair at the newest
    symbols: 0.18-0.25 of the utility (docs/results.md, "A return path that never
    answers"). The same with a prior below the loss (a daemon's later transfer: 2 %), which
    the sender kept before: 0.16-0.48 (docs/results.md, "A return path that dies
    midway")."""
    rng = np.random.default_rng(11)
    tr, s, r = make_pair(size=4_000_000, blocks=200, policy="tail-rule", rho=rho, delay=0.04)
    s.set_prior_loss(prior)
    net = Net(s, r, data=lambda i, d: [] if rng.random() < 0.1 else [0.0], back=lambda i, d: [],
              delay=0.04)  # fmt: skip
    net.run()
    assert s.stats["feedback_received"] == 0 and s.open_loop
    assert s.loss_estimate() == OPEN_LOOP_LOSS
    repairs = net.of_type(T.REPAIR)
    assert min(d.esi for _, d in repairs) == 0  # the oldest symbols got repairs
    # at the assumed loss's share between the sources, not all after the last one
    last_source = net.of_type(T.SOURCE)[-1][0]
    assert sum(t < last_source for t, _ in repairs) > 0.1 * len(repairs)
    res = r.result
    assert res.utility_recovered > 0.85
    assert res.complete[:10].all()  # the ten most useful blocks
    assert all(_block_ok(tr, res, b) for b in np.flatnonzero(res.complete))


@pytest.mark.parametrize("rho", [0.8, 1.0])
def test_a_return_path_that_dies_midway_leaves_the_unreported_sources_repaired(rho):
    """Every report lost after the first 30 % of the deadline, 10 % loss, 5 ms one way, a
    policy with no proactive repair of its own: four round trips into the silence the
    sender assumes at least ``OPEN_LOOP_LOSS`` (the last report's smoothed rate lagged the
    loss), repairs at that share and walks them from the first symbol that report did not
    describe, so the sources sent between it and the silence counting are repaired too.
    Before, open loop spent only the slack over the newest symbols: 0.80-0.83 of the
    utility (docs/results.md, "A return path that dies midway"); with the walk but the
    reported rate, 0.76-0.80 on these draws."""
    rng = np.random.default_rng(4)  # the last report says 9.4-9.7 %
    tr, s, r = make_pair(size=4_000_000, blocks=200, policy="tail-rule", rho=rho)
    cut = 0.3 * s.deadline
    net = Net(s, r, data=lambda i, d: [] if rng.random() < 0.1 else [0.0],
              back=lambda i, d: [] if net.t > cut else [0.0])  # fmt: skip
    net.run()
    assert s.stats["feedback_received"] > 0 and s.open_loop
    assert s.loss_estimate() == OPEN_LOOP_LOSS > s.fb_loss
    described = s.fb_esi_end  # the last report's reach
    late = [d for t, d in net.of_type(T.REPAIR) if t > cut + 4 * s.srtt]
    # the walk: windows from a span before the undescribed symbols, a stride apart
    assert min(d.esi for d in late) < described < max(d.esi for d in late)
    assert len(late) > 0.1 * (s.next_esi - described)
    res = r.result
    assert res.utility_recovered > 0.9
    assert res.complete[:100].all()
    assert all(_block_ok(tr, res, b) for b in np.flatnonzero(res.complete))


def test_sender_death_leaves_the_receiver_delivering_at_the_deadline():
    tr, s, r = make_pair(size=400_000, blocks=40, policy="adaptive", deadline=0.2,
                         receiver_deadline=None)  # fmt: skip
    net = Net(s, r)
    net.run(stop_sender_after=120)
    res = r.result
    assert res is not None and res.reason == "deadline"
    # no deadline was given to the receiver: it is the manifest's, counted from arrival
    assert res.timings["finished"] == pytest.approx(res.timings["first_packet"] + 0.2)
    got = {d.esi for _, d in net.sent if d.type == T.SOURCE}
    first, last = tr.blocks.symbol_ranges(1280)
    want = [b for b in range(len(tr.blocks)) if not set(range(first[b], last[b])) <= got]
    assert res.missing.tolist() == want and len(want) < len(tr.blocks)
    assert all(_block_ok(tr, res, b) for b in np.flatnonzero(res.complete))


def test_garbage_is_counted_by_reason_and_changes_nothing():
    key = b"k" * 32
    tr, s, r = make_pair(size=100_000, blocks=10, key=key)
    good = s.datagrams_to_send(0.0)
    assert len(good) == 1
    r.receive_datagram(good[0], 0.005)
    before = (r.n_known, r.source_received, r.monitor.received)
    forged = bytearray(good[0])
    forged[40] ^= 0xFF
    garbage = [
        b"\x00" * 10,
        b"XY" + good[0][2:],
        bytes(forged),
        wire.Framer(TID).build(T.SOURCE, 99, b"x" * 1280, esi=3),  # untagged
        wire.Framer(TID + 1, key).build(T.SOURCE, 99, b"x" * 1280, esi=3),  # foreign
        wire.Framer(TID, key).build(T.FEEDBACK, 1, b""),  # wrong direction
        wire.Framer(TID, key).build(T.SOURCE, 98, b"x" * 100, esi=4),  # wrong symbol size
        wire.Framer(TID, key).build(T.SOURCE, 97, b"x" * 1280, esi=1 << 30),  # beyond payload
        wire.Framer(TID, key).build(T.CONTROL, 96, b"", esi=77),  # unknown control
    ]
    for g in garbage:
        r.receive_datagram(g, 0.006)
    assert r.drop_reasons == {
        "truncated": 1,
        "bad_magic": 1,
        "bad_tag": 2,
        "foreign_transfer": 1,
        "unexpected_type": 1,
        "bad_symbol_size": 1,
        "out_of_range": 1,
        "bad_control": 1,
    }
    assert before[:2] == (r.n_known, r.source_received) and not r.finished
    for g in (b"", b"junk" * 20, good[0], wire.Framer(TID + 1, key).build(T.FEEDBACK, 1, b"")):
        s.receive_datagram(g, 0.01)
    assert s.drop_reasons == {"truncated": 1, "bad_magic": 1, "unexpected_type": 1,
                              "foreign_transfer": 1}  # fmt: skip
    assert s.stats["feedback_received"] == 0


def test_wrong_key_receiver_accepts_nothing():
    tr, s, _ = make_pair(size=50_000, blocks=5, key=b"the right key, 32 bytes long....")
    r = ReceiverSession(TID, key=b"the wrong key, 32 bytes long....", deadline=1.0)
    Net(s, r, key=b"the right key, 32 bytes long....").run(until=1.5)
    assert r.n_known == 0 and r.drop_reasons["bad_tag"] > 10 and r.result.manifest is None


def test_arq_retransmits_exactly_what_feedback_nacks():
    tr, s, r = make_pair(size=200_000, blocks=20, policy="arq")
    net = Net(s, r, data=_drop_sources({20, 21, 100}))
    net.run()
    retx = [d for _, d in net.of_type(T.SOURCE) if d.flags & wire.FLAG_RETRANSMIT]
    assert sorted(d.esi for d in retx) == [20, 21, 100]
    assert r.result.reason == "complete" and np.array_equal(r.result.payload, tr.payload)
    assert not net.of_type(T.REPAIR)


def test_block_rs_recovers_a_block_from_its_parities():
    tr, s, r = make_pair(size=40_000, blocks=4, policy="block-rs:4/16")
    net = Net(s, r, data=_drop_sources({1, 2, 3, 17}))
    net.run()
    parities = net.of_type(T.BLOCK_REPAIR)
    n_source = -(-40_000 // 1280)
    assert len(parities) == 4 * -(-n_source // 16)
    assert {(d.esi, d.nss) for _, d in parities} == {(0, 16), (16, 16)}
    res = r.result
    assert res.reason == "complete" and np.array_equal(res.payload, tr.payload)
    assert r.symbols_recovered == 4


def test_external_policy_pauses_at_each_decision():
    tr, s, r = make_pair(size=200_000, blocks=20, policy=ExternalPolicy())
    assert s.datagrams_to_send(0.0) == [] and s.awaiting_action
    assert s.next_timer() is None
    assert s.obs[Obs.TIME_LEFT] == pytest.approx(1.0) and s.obs[Obs.SOURCE_LEFT] == 1.0
    assert s.obs[Obs.FEEDBACK_AGE] == 16.0  # no feedback yet
    s.apply_action(0)  # admit, no proactive repair
    sent = []
    t = 0.0
    while not s.awaiting_action:
        sent += [wire.parse(d) for d in s.datagrams_to_send(t)]
        t = s.next_timer() or t
    assert len(sent) == s.decision_packets
    assert {d.type for d in sent} == {T.MANIFEST, T.MANIFEST_REPAIR, T.SOURCE}
    assert s.obs[Obs.SOURCE_LEFT] < 1.0 and s.obs[Obs.LAST_SHARE] == 0.0
    s.apply_action(REPAIR_ONLY)  # stop admitting: what is left is repair
    more = []
    while not s.awaiting_action:
        more += [wire.parse(d) for d in s.datagrams_to_send(t)]
        t = s.next_timer() or t
    assert T.SOURCE not in {d.type for d in more}
    assert sum(d.type == T.REPAIR for d in more) >= s.decision_packets - 4
    assert s.obs[Obs.LAST_ADMIT] == 0.0 and s.obs[Obs.LAST_SHARE] == 1.0
    with pytest.raises(ValueError):
        s.apply_action(len(ACTIONS))
    s.apply_action(0)
    with pytest.raises(RuntimeError):
        s.apply_action(0)


def test_pacing_follows_the_link_rate_and_catches_up_when_late():
    tr, s, r = make_pair(size=400_000, blocks=10, policy="none")
    slot = (28 + 1280 + 42) * 8 / RATE
    assert s.slot_s == pytest.approx(slot)
    assert len(s.datagrams_to_send(0.0)) == 1
    assert s.next_timer() == pytest.approx(slot)
    assert s.datagrams_to_send(slot / 2) == []
    assert len(s.datagrams_to_send(slot * 5.5)) == 5  # late shell: the backlog goes at once
    assert s.next_timer() == pytest.approx(slot * 6)


@pytest.mark.parametrize("rate", [100e6, 1e9, 3e9, 20e9])
def test_a_late_shell_gets_16_datagrams_or_100_us_of_the_link_at_most(rate):
    """A shell far behind its pace gets MAX_CATCH_UP (+1) datagrams, or on a link where
    they are over in less than CATCH_UP_S as many as that time holds, never more than one
    UDP GSO batch; the rest of the backlog is given up and pacing goes on from there."""
    from kvtransport.core.sender import CATCH_UP_S, MAX_CATCH_UP
    from kvtransport.daemons.udp import MAX_GSO_BYTES

    tr = synthetic_transfer(20_000_000, 100, "zipf", seed=7)
    s = SenderSession(tr, make_policy("none"), rate_bps=rate, deadline=10.0,
                      transfer_id=TID, key=bytes(32), initial_rtt=2 * DELAY)  # fmt: skip
    assert len(s.datagrams_to_send(0.0)) == 1
    late = 0.01
    burst = s.datagrams_to_send(late)
    assert s.next_timer() == pytest.approx(late + s.slot_s)  # the backlog is given up
    n = len(burst)
    assert n * s.datagram_bytes <= MAX_GSO_BYTES
    if MAX_CATCH_UP * s.slot_s >= CATCH_UP_S:
        assert n == MAX_CATCH_UP + 1
    else:
        # as much as CATCH_UP_S holds, or what fits one GSO batch where that is less
        assert (n - 1) * s.slot_s <= CATCH_UP_S < n * s.slot_s or (
            n + 1
        ) * s.datagram_bytes > MAX_GSO_BYTES
        assert n > MAX_CATCH_UP + 1
    if rate >= 20e9:
        assert (n + 1) * s.datagram_bytes > MAX_GSO_BYTES  # the batch is full
    s.set_rate(rate / 100, late + s.slot_s)  # slower: back to MAX_CATCH_UP
    s.datagrams_to_send(late + s.slot_s)
    assert len(s.datagrams_to_send(late + 1.0)) == MAX_CATCH_UP + 1


def test_a_rate_raised_beyond_the_factor_makes_the_policy_decide_at_the_next_slot():
    """The last decision counted the slots left at the old rate; a share raised by more than
    RATE_REDECIDE in one step is decided on again at once; a smaller rise, or a cut (the
    tail rule counts each source's slots at the new rate), waits for the interval's end."""
    from kvtransport.core.sender import RATE_REDECIDE

    assert 1.3 < RATE_REDECIDE < 1.3 * 1.3
    tr, s, r = make_pair(size=400_000, blocks=10, policy="adaptive", deadline=0.5)

    def send_next(k=1):  # the next k datagrams, each at its pacing time
        for _ in range(k):
            assert len(s.datagrams_to_send(s.next_timer())) == 1

    send_next(10)  # slots 0..9: one decision, at slot 0
    assert s.stats["decisions"] == 1 and s.slot == 10
    s.set_rate(RATE * 1.3, s.next_timer())  # within the factor: the interval stands
    send_next()
    assert s.stats["decisions"] == 1
    s.set_rate(RATE * 1.3 * 1.3, s.next_timer())  # a second small step: it stands too
    send_next()
    assert s.stats["decisions"] == 1
    s.set_rate(RATE * 4.0, s.next_timer())  # past it in one step: decided at the next slot,
    t = s.next_timer()
    assert len(s.datagrams_to_send(t + 3.5 * s.slot_s)) == 4  # also inside a run of sources
    assert s.stats["decisions"] == 2 and s.driver.decision_slot == 12 and s.slot == 16
    s.set_rate(RATE / 2.0, s.next_timer())  # cut: the interval stands
    send_next()
    assert s.stats["decisions"] == 2
    send_next(60)  # the interval grid goes on: slots 32 and 64
    assert s.slot == 77 and s.stats["decisions"] == 4


def test_receiver_state_is_bounded_by_max_bytes():
    tr, s, _ = make_pair(size=200_000, blocks=10, policy="none")
    r = ReceiverSession(TID, deadline=1.0, max_bytes=64 * 1280)
    Net(s, r).run()
    assert r.drop_reasons.get("out_of_range", 0) + r.drop_reasons.get("too_large", 0) > 0
    assert len(r._known) <= 64  # never grew past what max_bytes allows
    assert r.result.manifest is None  # a transfer larger than allowed is refused


def test_cancel_makes_the_receiver_deliver_at_once():
    tr, s, r = make_pair(size=400_000, blocks=40, policy="adaptive")
    net = Net(s, r)
    net.run(until=0.012)
    s.cancel(net.t)
    net.run()
    res = r.result
    assert s.finish_reason == "cancelled" and res.reason == "abort"
    assert res.timings["finished"] < 0.02 and 0 < res.complete.sum() < len(tr.blocks)
    assert all(_block_ok(tr, res, b) for b in np.flatnonzero(res.complete))


def test_without_manifest_or_deadline_the_receiver_closes_after_fin():
    def no_manifest(i, d):
        return [] if d.type in (T.MANIFEST, T.MANIFEST_REPAIR) else [0.0]

    tr, s, _ = make_pair(size=100_000, blocks=10, policy="none", deadline=0.05)
    r = ReceiverSession(None)  # adopts the first datagram's transfer id
    Net(s, r, data=no_manifest).run()
    res = r.result
    assert r.transfer_id == TID and res.reason == "fin" and res.manifest is None
    assert res.missing.size == 0 and res.utility_recovered == 0.0
    assert r.n_known > 0  # the symbols came, but without a manifest they mean nothing


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_block_completion_follows_the_known_symbols_in_any_arrival_order(data):
    """Whatever the arrival order (sources in or out of order, duplicated, lost, recovered
    by RLC repairs, the manifest early or late), a block counts as complete, with its
    utility, exactly when all of its symbols are known, and its bytes are right."""
    sym = 32
    lens = data.draw(st.lists(st.integers(1, 3 * sym), min_size=1, max_size=10), label="lens")
    gaps = data.draw(st.lists(st.integers(0, sym), min_size=len(lens), max_size=len(lens)))
    offs, pos = [], 0
    for gap, n in zip(gaps, lens, strict=True):
        offs.append(pos + gap)
        pos += gap + n
    nbytes = pos + data.draw(st.integers(0, sym))
    util = np.arange(1, len(lens) + 1, dtype=np.float64)
    blocks = BlockTable(np.array(offs), np.array(lens), util / util.sum())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tr = Transfer(rng.integers(0, 256, nbytes, dtype=np.uint8), blocks)
    n = -(-nbytes // sym)
    padded = np.zeros(n * sym, dtype=np.uint8)
    padded[:nbytes] = tr.payload
    framer = wire.Framer(TID)
    enc = RLCEncoder(sym, window=n, stream=padded)
    enc.add_stream_sources(n)

    # the arrival schedule: every source 0..2 times, some repairs, the manifest somewhere
    events = [("src", e) for e in range(n) for _ in range(data.draw(st.integers(0, 2)))]
    for key in range(data.draw(st.integers(0, n))):
        first = data.draw(st.integers(0, n - 1))
        events.append(("rep", first, data.draw(st.integers(1, n - first)), key))
    events = data.draw(st.permutations(events), label="order")
    events.insert(data.draw(st.integers(0, len(events))), ("manifest",))

    r = ReceiverSession(TID, deadline=10.0)
    first_sym, last_sym = blocks.symbol_ranges(sym)
    seq = 0
    for ev in events:
        if ev[0] == "src":
            e = ev[1]
            dgrams = [framer.build(T.SOURCE, seq, padded[e * sym : (e + 1) * sym], esi=e)]
        elif ev[0] == "rep":
            _, first, nss, key = ev
            dgrams = [framer.build(T.REPAIR, seq, enc.repair(first, nss, key), esi=first, key=key,
                                   dt_nss=wire.pack_dt_nss(15, nss))]  # fmt: skip
        else:
            man = ManifestSender(TransportManifest(sym, nbytes, blocks).to_bytes(), sym)
            dgrams = [man.emit(framer, seq + i, 0) for i in range(man.m)]
        for d in dgrams:
            r.receive_datagram(d, 0.001 * seq)
            seq += 1
        if r.finished:
            break
        if r.manifest is not None:
            known = np.frombuffer(bytes(r._known), dtype=np.uint8).astype(bool)
            truth = np.array([known[a:b].all() for a, b in zip(first_sym, last_sym, strict=True)])
            assert np.array_equal(r.complete, truth)
            assert r.blocks_complete == truth.sum()
            assert r.utility == pytest.approx(blocks.utilities[truth].sum(), abs=1e-12)
    r.close(1.0)
    res = r.result
    assert res.manifest is not None
    for b in np.flatnonzero(res.complete):
        assert _block_ok(tr, res, b)
    assert np.array_equal(res.missing, np.flatnonzero(~res.complete))


@settings(max_examples=150, deadline=None)
@example([(T.REPAIR, 0, 0, 0, 0)])  # NSS 0 before the symbol size is known
@example([(T.SOURCE, 0, 0, 0, 16), (T.REPAIR, 0, 0xF000, 1, 16), (T.REPAIR, 0, 0xF001, 1, 16)])
@given(
    st.lists(
        st.tuples(
            st.sampled_from([T.SOURCE, T.REPAIR, T.BLOCK_REPAIR]),
            st.integers(0, 40),  # esi / first
            st.one_of(st.sampled_from([0, 1, 0xF000, 0xF001, 0xF008]), st.integers(0, 0xFFFF)),
            st.integers(0, 0xFFFF),  # key
            st.sampled_from([0, 1, 15, 16, 64, 65]),  # payload size
        ),
        max_size=25,
    )
)
def test_any_data_datagram_is_used_or_counted_never_raised(items):
    """Arbitrary field values in well-framed data datagrams, before and after the symbol
    size is known: each is used or dropped by reason; nothing escapes, counts stay true."""
    r = ReceiverSession(TID, deadline=10.0, max_bytes=64 * 64)
    framer = wire.Framer(TID)
    for seq, (dtype, esi, dt_nss, key, size) in enumerate(items):
        payload = bytes((seq + i) & 0xFF for i in range(size))
        r.receive_datagram(framer.build(dtype, seq, payload, esi=esi, key=key, dt_nss=dt_nss), 0)
        assert r.n_known == sum(r._known)
    assert r.dropped == sum(r.drop_reasons.values())
    assert r.dropped + r.source_received + r.repair_received >= len(items)  # each one or both


def test_a_refused_block_is_not_skipped_for_a_later_smaller_one():
    """Sources go in stream order only (SenderSession's contract): when the tail rule
    refuses a large block near the deadline, the later small blocks that would still fit
    are not sent instead; the slots left protect what was sent (RLC fill). The sources
    that went out are exactly the stream's prefix before the refused block."""
    s = protocol.DEFAULT_SYMBOL_SIZE
    lengths = np.array([2 * s] * 10 + [40 * s] + [2 * s] * 10, dtype=np.uint64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    u = np.linspace(1.0, 2.0, len(lengths))  # prefix-like: the recent end weighs more
    table = BlockTable(offsets, lengths, u / u.sum())
    payload = np.random.default_rng(3).integers(0, 256, int(lengths.sum()), dtype=np.uint8)
    slot = (wire.HEADER_SIZE + s + protocol.LINK_OVERHEAD_BYTES) * 8 / RATE
    deadline = DELAY + 2 * slot + 40 * slot  # room for the first 10 blocks and a few more
    snd = SenderSession(Transfer(payload, table), make_policy("adaptive"), rate_bps=RATE,
                        deadline=deadline, transfer_id=TID, initial_rtt=2 * DELAY)  # fmt: skip
    rcv = ReceiverSession(TID, deadline=deadline)
    net = Net(snd, rcv)
    net.run()
    first, _ = table.symbol_ranges(s)
    big = 10
    sources = [(t, d.esi) for t, d in net.of_type(T.SOURCE)]
    assert sorted({e for _, e in sources}) == list(range(first[big]))
    last_source = max(t for t, _ in sources)
    spare = [d for t, d in net.sent if t > last_source and d.type == T.REPAIR]
    assert len(spare) >= 2  # a later 2-symbol block would have fitted in these slots
    res = rcv.result
    assert res.complete.tolist() == [True] * big + [False] * (len(lengths) - big)


def _hole_then_lost_repair(before_stop, outages=False):
    """A transfer that keeps the link busy to its end (rho 0.9); the first source sent
    ``before_stop`` seconds before the sender's stop time is lost, and so is the first
    reactive repair over its segment. With ``outages``, until 0.1 s before the stop time
    the link also loses 20 back-to-back sources in every 200 (with the repairs between
    them, the receiver reports bursts of about five). Returns the receiver's result, the
    lost ESI's block and the repairs sent over its segment after the report of its loss."""
    tr, s, r = make_pair(size=2_000_000, blocks=100, rho=0.9)
    lost = {}
    in_outage = set()  # ESIs whose first transmission an outage took
    net = None

    def rule(i, d):
        t = net.sent[-1][0]
        if (outages and d.type == T.SOURCE and 100 <= d.esi % 200 < 120
                and t < s.stop_time - 0.1 and d.esi not in in_outage):  # fmt: skip
            in_outage.add(d.esi)
            return []
        if d.type == T.SOURCE and "esi" not in lost and t >= s.stop_time - before_stop:
            lost["esi"] = d.esi
            return []
        esi = lost.get("esi")
        if (d.type == T.REPAIR and esi is not None and "repair" not in lost
                and d.esi <= esi < d.esi + d.nss and d.nss <= protocol.REPAIR_SEGMENT):  # fmt: skip
            lost["repair"] = t
            return []
        return [0.0]

    net = Net(s, r, data=rule)
    net.run()
    esi = lost["esi"]
    seg_len = protocol.REPAIR_SEGMENT
    reported = min(
        t for t, d in net.feedback
        if any(f <= esi < f + c for f, c in wire.decode_feedback(d.payload).ranges)
    )  # fmt: skip
    over = [
        (t, d) for t, d in net.of_type(T.REPAIR)
        if t >= reported and d.esi // seg_len == esi // seg_len and d.nss <= seg_len
    ]  # fmt: skip
    block = int(np.searchsorted(tr.blocks.offsets, esi * 1280, "right")) - 1
    return r.result, block, over


def test_a_hole_reported_in_the_last_round_gets_a_repair_to_spare():
    """A hole reported when a lost repair could no longer be replaced before the stop time
    (a round trip plus a feedback interval) gets more repairs than it lacks equations
    (kvtransport.core.schemes.rlc.last_round_repairs), so losing one of them still
    recovers it; reported earlier it gets exactly one, and a lost one is replaced."""
    for before_stop, first_answer in ((0.060, 1), (0.017, 2)):
        res, block, over = _hole_then_lost_repair(before_stop)
        first = [d for t, d in over if t < over[0][0] + 1e-3]  # the answer to the report
        assert len(first) == first_answer, before_stop
        assert res.complete[block], before_stop  # recovered despite the lost repair


def test_a_hole_reported_in_the_last_round_of_an_outage_path_gets_no_margin():
    """Where the receiver reports long loss bursts, back-to-back margin repairs would be
    lost together (kvtransport.core.schemes.rlc.last_round_repairs): the last-round hole
    gets the one repair it lacks (its loss then leaves the block incomplete, as the rule
    accepts), and earlier holes are still replaced."""
    res, block, over = _hole_then_lost_repair(0.017, outages=True)
    first = [d for t, d in over if t < over[0][0] + 1e-3]
    assert len(first) == 1
    assert not res.complete[block]
    res, block, over = _hole_then_lost_repair(0.060, outages=True)
    assert res.complete[block]  # reported earlier: the lost repair is replaced


def test_gilbert_failures_match_a_simulated_gilbert_channel():
    """P(fewer than m of j back-to-back datagrams arrive) on the two-state channel of that
    loss and mean burst, against 200,000 rounds of netem's own Gilbert-Elliott sampler
    (``gemodel g r``; each round starts 40 datagrams after the last one ended, so from
    about the stationary state); with bursts of 1 / (1 - p) it is the binomial tail."""
    from kvtransport.netem import GilbertElliott

    rng = np.random.default_rng(5)
    rounds, gap = 200_000, 40
    for loss, burst, m, k in ((0.09, 20.0, 3, 12), (0.2, 2.5, 2, 8)):
        fail = _gilbert_failures(m, k, loss, burst)
        r = 1 / burst
        sampler = GilbertElliott(p=loss * r / (1 - loss), r=r).sampler(rng)
        sampler.draw(10_000)  # away from the chain's start in the good state
        lost = np.concatenate([sampler.draw(20_000 * (k + gap)).reshape(-1, k + gap)[:, :k]
                               for _ in range(rounds // 20_000)])  # fmt: skip
        arrived = np.concatenate([np.zeros((rounds, 1), int), np.cumsum(~lost, axis=1)], axis=1)
        sim = (arrived < m).mean(axis=0)
        tol = 4 * np.sqrt(np.maximum(sim * (1 - sim), 1e-6) / rounds)
        assert np.all(np.abs(np.array(fail) - sim) <= tol), (loss, burst)
    p, m, k = 0.05, 4, 9
    binomial = [sum(math.comb(j, a) * (1 - p) ** a * p ** (j - a) for a in range(min(m, j + 1)))
                for j in range(k + 1)]  # fmt: skip
    assert np.allclose(_gilbert_failures(m, k, p, 1 / (1 - p)), binomial, atol=1e-12)


def test_last_round_margin_is_left_out_where_bursts_outlast_it():
    """With a burst much longer than the margin (9 % loss in bursts of 20, 24 % in bursts
    of 20) a segment gets exactly what it lacks; with independent or short bursts
    (ge-heavy's 11 % in bursts of 2.3) the independent margin. Never more than it."""
    for m in (1, 2, 4, 9):
        assert last_round_repairs(m, 0.09, 20.0) == m
        assert last_round_repairs(m, 0.24, 20.0) == m
        for p in (0.02, 0.05, 0.114):
            assert last_round_repairs(m, p, 1 / (1 - p)) == last_round_repairs(m, p)
        assert last_round_repairs(m, 0.114, 2.3) == last_round_repairs(m, 0.114) > m
        for burst in (1.0, 1.5, 3.0, 8.0, 40.0):
            assert m <= last_round_repairs(m, 0.1, burst) <= last_round_repairs(m, 0.1)


def test_last_round_repairs_cover_the_missing_equations_with_a_margin():
    """The fewest repairs whose expected arrivals, less LAST_ROUND_Z standard deviations,
    cover what is missing; without loss, exactly what is missing."""
    for missing in (1, 4, 20):
        for p in (0.01, 0.05, 0.2):
            k = last_round_repairs(missing, p)
            sure = [j * (1 - p) - LAST_ROUND_Z * math.sqrt(j * p * (1 - p)) for j in (k, k - 1)]
            assert sure[0] >= missing > sure[1]
        assert last_round_repairs(missing, 0.0) == missing
    assert (last_round_repairs(1, 0.05), last_round_repairs(4, 0.05)) == (2, 6)
    assert last_round_repairs(0, 0.3) == 0 and last_round_repairs(-2, 0.3) == 0
