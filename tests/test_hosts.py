"""The sans-I/O endpoint hosts (kvtransport.hosts.sender_host, kvtransport.hosts.receiver_host) on a
virtual clock: no socket, no sleep, every ``now`` chosen by the test. And one check that
the sender daemon's engine and the multi-user simulator drive the same host the same way.
"""

import struct

import numpy as np
import pytest
from kvtransport.codecs import aesgcm

from kvtransport.core import protocol
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import HEADER_SIZE, LaidOutDatagrams, ReceivedBatch
from kvtransport.errors import UserError
from kvtransport.hosts.receiver_host import ReceiverHost, ResultReady, TransferStarted
from kvtransport.hosts.sender_host import SenderHost, TransferFinished
from kvtransport.policies.heuristics import Adaptive
from kvtransport.scheduling.allocator import EqualShare, UtilityWaterFilling, repair_guard_s
from kvtransport.scheduling.utility_model import SigmoidUtility
from kvtransport.sim.multisim import Handover, MultiSimulation
from kvtransport.sim.virtual_clock import VirtualClockLoop

KEY = bytes(range(32))
U = SigmoidUtility(0.85, 10.0, 0.2)
SYMBOL = 1200
A, B, C = ("10.0.0.1", 9000), ("10.0.0.2", 9000), ("10.0.0.3", 9000)


def _tids(pairs: list[tuple[list[bytes], object]]) -> list[int]:
    """The transfer id of every datagram released, in order."""
    return [struct.unpack_from("!Q", d, 8)[0] for batch, _ in pairs for d in batch]


class _Wire:
    """A loss-free, zero-delay path."""

    def transmit(self, t: float, size: int) -> float:
        return t


def _run_sender(host: SenderHost, until: float, now: float = 0.0) -> tuple[list[int], float]:
    """The host alone on the virtual clock from ``now`` to ``until`` (nobody answers); the
    ids of what it sent, and the last time handled."""
    loop = VirtualClockLoop(now=now)
    loop.add(host, "sender")
    loop.run(until)
    return [struct.unpack_from("!Q", d, 8)[0] for _t, d, _to in loop.take_outbox()], loop.now


def test_weights_decide_the_shares_and_what_each_transfer_sends():
    host = SenderHost(rate_bps=100e6, symbol_size=SYMBOL, burst_s=0.0)
    outs = [
        host.submit(
            synthetic_transfer(2_000_000, 160, seed=i),
            dest,
            now=0.0,
            deadline_s=0.1,
            weight=w,
            utility=U,
            policy="none",
        )  # fmt: skip
        for i, (dest, w) in enumerate(((A, 1.0), (B, 4.0), (C, 1.0)))
    ]
    light, heavy, other = (o.link for o in outs)
    # 6 MB wanted by 100 ms, ~1.2 MB fits: the weight-4 transfer is served first
    assert heavy.share > light.share + 0.2 and heavy.share > other.share + 0.2
    sent, _ = _run_sender(host, 0.03)
    n = {o.transfer_id: sent.count(o.transfer_id) for o in outs}
    assert n[outs[1].transfer_id] > 2 * max(n[outs[0].transfer_id], n[outs[2].transfer_id])


def test_a_link_too_slow_to_split_carries_one_transfer_at_a_time():
    """Every share below a datagram per slot: the first of the largest takes the whole
    link and the other waits (it used to pause both until one left: 20 slots, nothing
    sent); once the first leaves, the other has the link at once."""
    rate = 1.5e6  # a datagram per 10 ms slot is ~1.1 Mbit/s: half of this link is less
    host = SenderHost(rate_bps=rate, symbol_size=SYMBOL, burst_s=0.0, slot_policy=EqualShare())
    a, b = (
        host.submit(
            synthetic_transfer(200_000, 16, seed=i),
            dest,
            now=0.0,
            deadline_s=2.0,
            utility=U,
            policy="none",
        )  # fmt: skip
        for i, dest in enumerate((A, B))
    )
    assert a.link.share == b.link.share == 0.5
    assert not a.link.paused and a.link.rate_bps == rate and b.link.paused
    sent, now = _run_sender(host, 0.2)
    assert len(sent) >= 20 and set(sent) == {a.transfer_id}  # 20 slots of a, none of b
    assert host.cancel(a.transfer_id, 0.2)
    assert _tids(host.datagrams_to_send(0.2)) == [a.transfer_id]  # its ABORT only
    sent, _ = _run_sender(host, 0.3, 0.2)
    assert sent and set(sent) == {b.transfer_id}  # alone: the whole link, at once
    assert not b.link.paused and b.link.rate_bps == rate


def test_submit_refusals_change_nothing():
    host = SenderHost(rate_bps=10e6, max_transfers=2)
    tr = synthetic_transfer(50_000, 4)
    first = host.submit(tr, A, now=0.0, deadline_s=1.0, transfer_id=7)
    bad = [
        ({"deadline_s": 1e-6}, "deadline"),
        ({"deadline_s": 1.0, "weight": -1.0}, "weight"),
        ({"deadline_s": 1.0, "initial_rtt": 0.0}, "initial RTT"),
        ({"deadline_s": 1.0, "transfer_id": 7}, "already in use"),
        ({"deadline_s": 1.0, "policy": "nope"}, "unknown policy"),
        # by a 20 ms initial RTT a datagram needs 10 ms: 9 ms would send nothing at all
        ({"deadline_s": 0.009}, "leaves no time to send"),
    ]
    for kw, what in bad:
        with pytest.raises(UserError, match=what):
            host.submit(tr, B, now=0.0, **kw)
    assert list(host.active) == [7] and list(host.link.members) == [7]
    assert first.link.share == 1.0  # still alone on the link
    host.max_transfers = 1
    with pytest.raises(UserError, match="transfers in flight"):
        host.submit(tr, B, now=0.0, deadline_s=1.0)
    assert list(host.active) == [7] and list(host.link.members) == [7]


def test_sender_demux_drops_and_counts_what_names_no_transfer_in_flight():
    host = SenderHost(rate_bps=10e6, key=KEY)
    out = host.submit(synthetic_transfer(50_000, 4), A, now=0.0, deadline_s=1.0)
    forged = bytearray(64)
    struct.pack_into("!Q", forged, 8, out.transfer_id ^ 1)
    host.receive_datagram(bytes(forged), A, 0.01)
    host.receive_datagram(b"\x00" * (HEADER_SIZE - 1), A, 0.01)
    struct.pack_into("!Q", forged, 8, out.transfer_id)  # its id, but no valid tag
    host.receive_datagram(bytes(forged), A, 0.01)
    assert host.drop_reasons == {"foreign_transfer": 1, "truncated": 1}
    assert out.session.drop_reasons and out.session.stats["feedback_received"] == 0
    host.cancel(out.transfer_id, 0.02)
    host.receive_datagram(bytes(forged), A, 0.03)
    assert host.drop_reasons["finished_transfer"] == 1 and host.dropped == 3


def _exchange(sender: SenderHost, receiver: ReceiverHost, until: float) -> float:
    """Both hosts (at A and B) on one loss-free, zero-delay wire until neither has work
    before ``until``; returns the last time handled."""
    loop = VirtualClockLoop()
    loop.add(sender, A, channel=_Wire())
    loop.add(receiver, B, channel=_Wire())
    loop.run(until)
    return loop.now


def test_finish_and_result_events_and_the_receivers_loss_is_remembered():
    sender = SenderHost(rate_bps=50e6, key=KEY, burst_s=0.0)
    receiver = ReceiverHost(key=KEY, linger_s=0.5)
    tr = synthetic_transfer(120_000, 8, seed=3)
    out = sender.submit(tr, B, now=0.0, deadline_s=0.5, policy="adaptive")
    assert out.link.prior_loss is None
    _exchange(sender, receiver, 0.4)
    ev = sender.next_event()
    assert isinstance(ev, TransferFinished) and ev.transfer is out and sender.next_event() is None
    assert out.state == "done" and out.transfer_id not in sender.link.members
    assert out.status(1.0)["delivered_bytes"] == tr.nbytes
    started, ready = receiver.next_event(), receiver.next_event()
    assert isinstance(started, TransferStarted) and started.transfer.transfer_id == ev.transfer_id
    assert isinstance(ready, ResultReady) and receiver.next_event() is None
    res = ready.transfer.session.result
    assert res is not None and res.complete.all()
    assert np.array_equal(res.payload[: tr.nbytes], np.asarray(tr.payload))
    # its receiver reported: the next transfer to it starts from that path's loss
    nxt = sender.submit(tr, B, now=1.0, deadline_s=0.5)
    assert nxt.link.prior_loss == pytest.approx(out.session.loss_estimate())
    assert sender.submit(tr, A, now=1.0, deadline_s=0.5).link.prior_loss is None


class _Delay:
    """A loss-free path of a fixed delay."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def transmit(self, t: float, size: int) -> float:
        return t + self.delay_s


def test_the_links_guard_follows_the_one_way_delay_the_host_measures():
    """No one-way delay given (the daemon): the host's link takes half the shortest
    smoothed round trip, and its allocator's guard is derived from that estimate."""
    sender = SenderHost(rate_bps=20e6, key=KEY, burst_s=0.0)
    guard = sender.link.scheduler.policy.guard_s
    assert sender.link.one_way_s == 0.0 and guard == repair_guard_s(0.0)
    outs = [
        sender.submit(
            synthetic_transfer(400_000, 32, seed=i), B, now=0.0, deadline_s=0.5, utility=U
        )
        for i in range(2)
    ]
    loop = VirtualClockLoop()
    loop.add(sender, A, channel=_Delay(0.01))
    loop.add(ReceiverHost(key=KEY), B, channel=_Delay(0.01))
    loop.run(0.1)
    srtt = min(o.session.srtt for o in outs if o.session.srtt is not None)
    assert sender.link.one_way_s == srtt / 2.0 and srtt >= 0.02
    assert sender.link.scheduler.policy.guard_s == repair_guard_s(srtt / 2.0)


def test_a_new_transfer_assumes_the_round_trip_its_receivers_last_one_measured():
    """No initial RTT given: the first transfer to a receiver assumes the config's (20 ms),
    the next one the shortest round trip the first measured on its 80 ms path, and so on a
    1 Gbit/s link gets the decoder window two such round trips call for. Another receiver
    still starts from the config's; a given initial RTT wins."""
    sender = SenderHost(rate_bps=1e9, key=KEY, burst_s=0.0)
    first = sender.submit(synthetic_transfer(2_000_000, 32, seed=1), B, now=0.0,
                          deadline_s=1.0)  # fmt: skip
    assert first.session.decoder_window == protocol.DECODER_WINDOW
    assert sender.initial_rtt_for(B) == protocol.DEFAULT_INITIAL_RTT
    assert not sender.has_prior_for(B)  # nor a loss prior (for the default policy)
    loop = VirtualClockLoop()
    loop.add(sender, A, channel=_Delay(0.04))
    loop.add(ReceiverHost(key=KEY), B, channel=_Delay(0.04))
    loop.run(0.5)
    assert first.transfer_id in sender.finished
    rtt = sender.initial_rtt_for(B)
    assert rtt == pytest.approx(0.08, abs=1e-4)
    assert rtt == first.session.min_rtt <= first.session.srtt
    assert sender.has_prior_for(B) and not sender.has_prior_for(C)
    big = synthetic_transfer(40_000_000, 64, seed=2)
    again = sender.submit(big, B, now=0.5, deadline_s=2.0)
    assert again.session.decoder_window == protocol.decoder_window(1e9, rtt) == 16384
    assert sender.initial_rtt_for(C) == protocol.DEFAULT_INITIAL_RTT
    told = sender.submit(big, B, now=0.5, deadline_s=2.0, initial_rtt=0.02)
    assert told.session.decoder_window == protocol.DECODER_WINDOW


def test_a_transfer_joining_a_link_whose_transfers_report_loss_has_a_prior():
    """A first transfer to a receiver still starts from a loss prior while another
    transfer on the link has had feedback (LinkShare._prime): the default policy reads
    it (has_prior_for)."""
    sender = SenderHost(rate_bps=100e6, key=KEY, burst_s=0.0)
    sender.submit(synthetic_transfer(4_000_000, 32, seed=1), B, now=0.0, deadline_s=2.0)
    assert not sender.has_prior_for(C)
    loop = VirtualClockLoop()
    loop.add(sender, A, channel=_Delay(0.01))
    loop.add(ReceiverHost(key=KEY), B, channel=_Delay(0.01))
    loop.run(0.1)  # feedback has come; the transfer (0.33 s of sending) goes on
    assert sender.active and sender.link.link_loss() is not None
    assert sender.has_prior_for(C)


def test_the_last_transfer_to_finish_leaves_no_wake_up_and_a_given_prior_wins():
    host = SenderHost(rate_bps=10e6, key=KEY, burst_s=0.0, slot_policy=EqualShare())
    tr = synthetic_transfer(50_000, 4)
    a = host.submit(tr, A, now=0.0, deadline_s=1.0)
    b = host.submit(tr, B, now=0.0, deadline_s=1.0)
    _run_sender(host, 0.05)
    host.cancel(b.transfer_id, 0.05)
    assert host.get_timer() == 0.05  # the other transfer gets the whole link at once
    host.handle_timer(0.05)
    host.cancel(a.transfer_id, 0.06)
    assert not host.active and host.get_timer() is None  # nothing left: no wake-up
    host.receiver_loss[A] = 0.03
    assert host.submit(tr, A, now=0.1, deadline_s=1.0).link.prior_loss == 0.03
    given = host.submit(tr, A, now=0.1, deadline_s=1.0, prior_loss=0.2, policy=Adaptive())
    assert given.link.prior_loss == 0.2 and given.session.policy.prior_loss == 0.2


def test_a_receiver_told_the_deadline_ends_there_not_at_the_manifests():
    """expect(): the session is open before its first datagram and ends at the deadline
    given on the shared clock (the simulator's receiver), not at the manifest's deadline
    counted from its first datagram (5 ms later here)."""
    sender = SenderHost(rate_bps=20e6, key=KEY, burst_s=0.0)
    receiver = ReceiverHost(key=KEY)
    out = sender.submit(synthetic_transfer(800_000, 64, seed=1), B, now=0.0, deadline_s=0.2)
    inc = receiver.expect(out.transfer_id, A, 0.0, 0.2)
    assert isinstance(receiver.next_event(), TransferStarted)
    with pytest.raises(UserError, match="already in use"):
        receiver.expect(out.transfer_id, A, 0.0, 0.2)
    loop = VirtualClockLoop()
    loop.add(sender, A, channel=_Delay(0.005))
    loop.add(receiver, B, channel=_Delay(0.005))
    loop.run(0.5)
    res = inc.session.result
    assert res is not None and res.reason == "deadline"
    assert inc.session.timings["finished"] == 0.2


def test_receiver_admission_demux_and_abort():
    sender = SenderHost(rate_bps=50e6, key=KEY, burst_s=0.0, slot_policy=EqualShare())
    first = sender.submit(synthetic_transfer(200_000, 8, seed=1), B, now=0.0, deadline_s=1.0)
    second = sender.submit(synthetic_transfer(200_000, 8, seed=2), B, now=0.0, deadline_s=1.0)
    receiver = ReceiverHost(key=KEY, max_transfers=1, linger_s=0.1)
    while (t := sender.get_timer()) is not None and t <= 0.005:
        sender.handle_timer(t)
        for batch, _ in sender.datagrams_to_send(t):
            for d in batch:
                receiver.receive_datagram(d, A, t)
    assert list(receiver.active) == [first.transfer_id] and second.link.rate_bps > 0
    assert receiver.drop_reasons["over_capacity"] >= 1  # the second one: no room
    stranger = SenderHost(rate_bps=50e6, key=bytes(32))  # a forger without the key
    forged = stranger.submit(synthetic_transfer(10_000, 1), B, now=0.0, deadline_s=1.0)
    stranger.handle_timer(0.0)
    for batch, _ in stranger.datagrams_to_send(0.0):
        receiver.receive_datagram(batch[0], A, 0.0)
    assert forged.transfer_id not in receiver.active and receiver.drop_reasons["bad_tag"] == 1
    assert receiver.abort(first.transfer_id, 0.05)
    assert any(receiver.datagrams_to_send(0.05))  # the final feedback, to its peer
    assert receiver.next_event() is not None  # TransferStarted
    ev = receiver.next_event()
    assert isinstance(ev, ResultReady) and ev.transfer.session.result.reason == "abort"
    receiver.handle_timer(0.2)  # lingered out: its late datagrams are dropped by id
    sender.handle_timer(0.2)
    for batch, _ in sender.datagrams_to_send(0.2):
        for d in batch:
            if struct.unpack_from("!Q", d, 8)[0] == first.transfer_id:
                receiver.receive_datagram(d, A, 0.2)
    assert receiver.drop_reasons["finished_transfer"] >= 1


def test_the_daemon_engine_and_the_simulator_drive_the_host_identically():
    """The multi-user simulator's calls into its SenderHost, replayed at the same virtual
    times into the sender daemon's engine over real UDP sockets: the same datagrams, in
    the same order, at the same calls."""
    from kvtransport.daemons.daemon_sender import SenderEngine
    from kvtransport.daemons.udp import DatagramSocket, wait_readable

    hs = [Handover(0, 0.0, 0.12, 400_000, U), Handover(1, 0.03, 0.15, 300_000, U, weight=2.0)]
    trace: list[tuple] = []
    sim = MultiSimulation(hs, UtilityWaterFilling(), channel="bernoulli-5", rate_mbps=40,
                          seed=3, trace=trace)  # fmt: skip
    sim.run()
    trace = [e for e in trace if e[2] == 0]  # the sender host is the loop's endpoint 0
    assert any(e[0] == "recv" for e in trace) and sum(e[0] == "send" for e in trace) > 300
    expected: list[tuple[int, bytes]] = []  # (call number, datagram)
    calls = 0
    for e in trace:
        if e[0] == "send":
            expected.append((calls, e[3]))
        else:
            calls += 1

    sock = DatagramSocket(("127.0.0.1", 0))
    feeder = DatagramSocket(("127.0.0.1", 0))
    sinks = [DatagramSocket(("127.0.0.1", 0)) for _ in hs]
    try:
        host = SenderHost(rate_bps=40e6, burst_s=0.0, max_transfers=2,
                          slot_policy=UtilityWaterFilling(), one_way_s=sim.delay_s)  # fmt: skip
        engine = SenderEngine(sock, host)
        users = {u.tid: (u, sinks[i].address) for i, u in enumerate(sim.users)}
        got: list[tuple[int, bytes]] = []
        calls = 0
        arrivals = iter(sim.users)  # the loop's scheduled calls: the arrivals, in order
        for e in trace:
            if e[0] == "send":
                continue
            calls += 1
            t = e[1]
            if e[0] == "call":
                u, dest = users[next(arrivals).tid]
                engine.submit(u.transfer, dest, now=t, deadline_s=u.h.deadline - t,
                              transfer_id=u.tid, weight=u.h.weight, utility=u.h.utility,
                              initial_rtt=2.0 * sim.delay_s + 1e-3, wall_offset=0.0)  # fmt: skip
            elif e[0] == "timer":
                engine.run_due(t)
            else:
                feeder.send([e[3]], sock.address)
                assert wait_readable([sock], 2.0)
                engine.on_readable(t)
            for sink in sinks:
                got += [(calls, bytes(d)) for d, _ in sink.recv_batch()]

        # within one call, datagrams to different receivers arrive on different sockets
        def order(x: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
            return sorted(x, key=lambda cd: (cd[0], struct.unpack_from("!Q", cd[1], 8)[0]))

        assert len(got) == len(expected)
        assert order(got) == order(expected)
    finally:
        for s in (sock, feeder, *sinks):
            s.close()


def test_the_daemon_engine_and_the_simulator_drive_the_receiver_host_identically():
    """Each user's receiver host in the multi-user simulator, its calls replayed at the
    same virtual times into the receiver daemon's engine over real UDP: the same feedback
    datagrams at the same calls, and the same result."""
    from kvtransport.daemons.daemon_receiver import ReceiverEngine
    from kvtransport.daemons.udp import DatagramSocket, wait_readable

    hs = [Handover(0, 0.0, 0.12, 300_000, U), Handover(1, 0.02, 0.1, 200_000, U)]
    trace: list[tuple] = []
    sim = MultiSimulation(hs, EqualShare(), channel="bernoulli-5", rate_mbps=40, seed=2,
                          trace=trace)  # fmt: skip
    res = sim.run()
    for i, u in enumerate(sim.users):
        mine = [e for e in trace if e[2] == i + 1]  # user i's host is endpoint i + 1
        expected, calls = [], 0
        for e in mine:
            if e[0] == "send":
                expected.append((calls, e[3]))
            else:
                calls += 1
        assert len(expected) > 10
        sock, peer = DatagramSocket(("127.0.0.1", 0)), DatagramSocket(("127.0.0.1", 0))
        try:
            results: list = []
            engine = ReceiverEngine(sock, ReceiverHost(), on_result=results.append)
            got, calls = [], 0
            for e in mine:
                if e[0] == "send":
                    continue
                calls += 1
                if e[0] == "recv":
                    peer.send([e[3]], sock.address)
                    assert wait_readable([sock], 2.0)
                    engine.on_readable(e[1])
                else:
                    engine.run_due(e[1])
                got += [(calls, bytes(d)) for d, _ in peer.recv_batch()]
            assert got == expected
            assert len(results) == 1 and u.received is not None
            mine_res, sim_res = results[0].session.result, u.received.session.result
            assert mine_res.reason == sim_res.reason == res.outcomes[i].receiver_finish
            assert np.array_equal(mine_res.complete, sim_res.complete)
        finally:
            sock.close()
            peer.close()


def test_a_deadline_shorter_than_the_initial_rtt_allows_is_sent_with_a_shorter_one():
    """The refusal names the initial RTT; with the link's real (shorter) round trip the
    same deadline sends."""
    host = SenderHost(rate_bps=100e6)
    tr = synthetic_transfer(50_000, 4)
    with pytest.raises(UserError, match=r"initial RTT \(20 ms\)"):
        host.submit(tr, A, now=0.0, deadline_s=0.005)
    out = host.submit(tr, A, now=0.0, deadline_s=0.005, initial_rtt=0.001)
    sent, _ = _run_sender(host, 0.005)
    assert len(sent) > 10 and set(sent) == {out.transfer_id}


def test_a_socket_reads_runs_reach_their_sessions_laid_out(monkeypatch):
    """Two transfers' datagrams as a receiver daemon reads them (ReceivedBatch: each read's
    datagrams in one buffer, 64 a read, with a truncated and a foreign datagram among
    them): each transfer's runs reach its session laid out at the right places, so most
    sources open in the compiled kernel, and the host ends exactly as one given the same
    pairs as a plain list (results and drops)."""
    sender = SenderHost(rate_bps=200e6, key=KEY, burst_s=0.0)
    for i in range(2):
        sender.submit(synthetic_transfer(300_000, 16, seed=i), B, now=0.0, deadline_s=0.5)
    trace: list[tuple] = []
    loop = VirtualClockLoop(trace)
    loop.add(sender, A, channel=_Wire())
    rx = loop.add(ReceiverHost(key=KEY), B, channel=_Wire())
    loop.run(0.45)
    got = [e[3] for e in trace if e[0] == "recv" and e[2] == rx]
    tids = {struct.unpack_from("!Q", d, 8)[0] for d in got}
    assert len(tids) == 2 and len(got) > 400
    got[100:100] = [got[99][:20], b"\x4b\x56" + bytes(60)]  # truncated; bad magic
    opened: list[int] = []
    real = aesgcm.open_run

    def counted(ctx, buf, starts, ends, i, *rest):
        j = real(ctx, buf, starts, ends, i, *rest)
        opened.append(j - i)
        return j

    monkeypatch.setattr(aesgcm, "open_run", counted)
    hosts = {"list": ReceiverHost(key=KEY), "laid out": ReceiverHost(key=KEY)}
    for a in range(0, len(got), 64):
        read = got[a : a + 64]
        laid = LaidOutDatagrams.join(read)
        pairs = [(d, A) for d in laid]
        hosts["laid out"].receive_datagrams(
            ReceivedBatch(pairs, laid.buf, laid.starts, laid.ends), 0.3
        )
        calls = len(opened)
        hosts["list"].receive_datagrams([(d, A) for d in read], 0.3)
        assert len(opened) == calls  # a plain list never reaches the kernel
    sources = sum(1 for d in got if len(d) > 3 and d[3] == 1)
    assert sum(opened) >= 0.5 * sources
    ends = {}
    for name, host in hosts.items():
        host.close(1.0)
        host.datagrams_to_send(1.0)  # settles them: their results come as events
        results = []
        while (ev := host.next_event()) is not None:
            if isinstance(ev, ResultReady):
                res = ev.transfer.session.result
                results.append((ev.transfer.transfer_id, res.payload.tobytes(), res.reason))
        ends[name] = (sorted(results), dict(host.drop_reasons))
    assert ends["list"] == ends["laid out"]
    assert len(ends["list"][0]) == 2 and sum(ends["list"][1].values()) == 2
