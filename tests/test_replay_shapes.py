"""Replays without their manifest open nothing (issue 44, row 1): the attack shapes
against the sans-I/O ReceiverHost. A transfer has no session, slot, feedback, result or
timer until an authenticated manifest passed the checks; its earlier datagrams wait in a
bounded pool; replies before that stay within 3x of what the peer sent; duplicates
inside a transfer are dropped by the packet-number window."""

from kvtransport.core.replay import ReplayRecord
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import DatagramType, parse
from kvtransport.hosts import receiver_host
from kvtransport.hosts.receiver_host import ReceiverHost, ResultReady
from kvtransport.policies.registry import make_policy

KEY = bytes(range(32))
PEER = ("10.0.0.1", 9000)
WALL = 1_700_000_000.0
_MANIFESTS = (DatagramType.MANIFEST, DatagramType.MANIFEST_REPAIR)


def _capture(seed: int, n: int = 400, size: int = 300_000) -> list[bytes]:
    """The first ``n`` datagrams a sender sends of one transfer (what a relay records)."""
    s = SenderSession(synthetic_transfer(size, 16, seed=seed), make_policy("none"),
                      rate_bps=1e9, deadline=1.0, key=KEY, wall_offset=WALL)  # fmt: skip
    out: list[bytes] = []
    while len(out) < n and (t := s.next_timer()) is not None:
        out += s.datagrams_to_send(t)
    return out[:n]


def _data_only(datagrams: list[bytes]) -> list[bytes]:
    return [d for d in datagrams if parse(d, KEY).type not in _MANIFESTS]


def _host(**kw) -> ReceiverHost:
    record = ReplayRecord(None, now=WALL)
    return ReceiverHost(key=KEY, replay=record, wall_clock=lambda: WALL, **kw)


def _deliver(host: ReceiverHost, datagrams: list[bytes], now: float) -> int:
    """Feed datagrams at ``now``, run the timers due; the bytes the host answered."""
    host.receive_datagrams([(d, PEER) for d in datagrams], now)
    if (t := host.get_timer()) is not None and t <= now:
        host.handle_timer(now)
    return sum(len(d) for batch, _ in host.datagrams_to_send(now) for d in batch)


def _events(host: ReceiverHost) -> list:
    out = []
    while (ev := host.next_event()) is not None:
        out.append(ev)
    return out


def test_a_replayed_datagram_without_its_manifest_does_not_take_the_recv_slot():
    old, real = _data_only(_capture(1))[5], _capture(2)
    host = _host(single=True)
    assert _deliver(host, [old], 0.0) == 0
    assert host.adopted is None and not host.active and not _events(host)
    for i in range(0, len(real), 50):
        _deliver(host, real[i : i + 50], 0.001 * i)
    assert host.adopted == parse(real[0], KEY).transfer_id
    assert host.stats()["drop_reasons"].get("foreign_transfer", 0) == 0


def test_captured_transfers_one_datagram_each_hold_no_slot_and_answer_nothing():
    host = _host(max_transfers=16)
    captures = [_data_only(_capture(10 + i, n=40))[3] for i in range(16)]
    answered = sum(_deliver(host, [d], 3.0 * k) for k in range(3) for d in captures)
    assert answered == 0 and not host.active and host.stats()["active"] == 0
    real = _capture(99)
    _deliver(host, real, 9.0)
    assert host.get(parse(real[0], KEY).transfer_id) is not None and host.results == 1
    assert host.stats()["drop_reasons"].get("over_capacity", 0) == 0


def test_one_datagram_kept_up_at_1_pps_is_answered_within_3x_and_never_finishes():
    d = _data_only(_capture(3))[7]
    host = _host()
    sent = answered = 0
    for k in range(240):  # one replay a second for four minutes
        sent += len(d)
        answered += _deliver(host, [d], float(k))
        host.handle_timer(k + 0.999)
    assert answered <= 3 * sent
    assert not host.active and host.results == 0 and not _events(host)


def test_a_whole_replay_is_refused_before_a_session_and_answered_within_3x():
    captured = _capture(4)
    first = _host()
    _deliver(first, captured, 0.0)
    assert first.results == 1  # genuine the first time
    replayed = _host()
    replayed.replay = first.replay  # the same record: the manifest was accepted before
    answered = _deliver(replayed, captured, 1.0)
    assert not replayed.active and replayed.replays_refused == 1
    assert 0 < answered <= 3 * sum(len(d) for d in captured)
    reasons = replayed.stats()["drop_reasons"]
    assert reasons["replayed_manifest"] == 1 and reasons["replayed"] > 0


def test_a_replay_without_its_manifest_after_a_restart_publishes_no_result():
    captured = _data_only(_capture(5))
    host = _host()  # the restarted receiver
    _deliver(host, captured[:30], 0.0)
    for t in (0.5, 2.0, 15.0, 60.0):
        host.handle_timer(t)
        host.datagrams_to_send(t)
    assert not any(isinstance(ev, ResultReady) for ev in _events(host))
    assert host.results == 0 and not host.pending
    assert host.stats()["drop_reasons"]["pool_expired"] == 30


def test_the_pool_is_bounded_and_a_repeated_packet_number_is_dropped(monkeypatch):
    monkeypatch.setattr(receiver_host, "POOL_DATAGRAMS", 8)
    data = _data_only(_capture(6))
    host = _host()
    _deliver(host, data[:20], 0.0)
    _deliver(host, data[:3], 0.01)  # the same packets again
    reasons = host.stats()["drop_reasons"]
    assert reasons["pool_full"] == 12 and reasons["duplicate_packet"] == 3
    assert host.pool_bytes == sum(len(d) for d in data[:8])


def test_a_duplicate_inside_a_transfer_is_dropped_by_the_window():
    captured = _capture(7)
    host = _host()
    _deliver(host, captured[:100], 0.0)
    (inc,) = host.active.values()
    before = inc.session.source_received
    _deliver(host, captured[40:60], 0.01)
    assert inc.session.drop_reasons["duplicate_packet"] == 20
    assert inc.session.source_received == before


def test_a_restarted_receivers_pool_answers_with_one_small_probe():
    """A receiver restarted mid-transfer has no manifest: after PROBE_EVERY datagrams of
    the transfer it sends one small report (its sender then sends a fresh manifest)."""
    data = _data_only(_capture(8))
    host = _host()
    n = receiver_host.PROBE_EVERY
    answered = _deliver(host, data[:n], 0.0)
    assert 0 < answered <= 200 and host.pending and not host.active
