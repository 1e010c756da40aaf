"""What the daemons hold, bounded: the sender frees a finished transfer's payload, the
receiver keeps its transfers' buffers inside a byte budget, sessions that finish within
one receive batch do not count against admission, and a lagging result subscriber loses
nothing unseen (the daemon holds results for it; past its backlog the loss is counted on
both ends). Real UDP sockets and real ZeroMQ, engines driven in this process."""

import gc
import socket
import time
import weakref

import zmq

from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.daemons.daemon_receiver import Incoming, ReceiverDaemon, ReceiverEngine
from kvtransport.daemons.daemon_sender import SenderEngine
from kvtransport.daemons.udp import DatagramSocket, clock
from kvtransport.hosts.receiver_host import ReceiverHost
from kvtransport.hosts.sender_host import SenderHost
from kvtransport.policies.registry import make_policy


def test_sender_engine_frees_a_finished_transfers_payload():
    with DatagramSocket(("127.0.0.1", 0)) as sink, DatagramSocket(("127.0.0.1", 0)) as sock:
        host = SenderHost(rate_bps=1e9)
        engine = SenderEngine(sock, host)
        t = synthetic_transfer(2_000_000, 8, seed=1)
        alive = weakref.ref(t.payload)
        out = engine.submit(t, sink.address, now=clock(), deadline_s=0.02, policy="none")
        del t
        for _ in range(20):
            engine.run_due(clock())
            time.sleep(1e-4)
        engine.cancel(out.transfer_id, clock())  # (or its deadline: the same _finish)
        del out
        assert not host.active and len(host.finished) == 1
        gc.collect()
        assert alive() is None  # nothing of the finished transfer holds the payload
        st = host.status(clock())[0]  # and its status is still there
        assert st["state"] == "done" and st["source_sent"] > 0


def _datagrams(transfer, tid, n):
    """The first ``n`` datagrams a sender sends of ``transfer`` (manifest and sources)."""
    s = SenderSession(transfer, make_policy("none"), rate_bps=1e9, deadline=1.0,
                      transfer_id=tid)  # fmt: skip
    out, t = [], 0.0
    while len(out) < n:
        out += s.datagrams_to_send(t)
        t += 1e-5
    return out[:n]


def test_transfers_finishing_inside_one_batch_do_not_count_against_admission():
    small = synthetic_transfer(1000, 1, seed=4)
    with (
        DatagramSocket(("127.0.0.1", 0)) as rx,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        done = []
        host = ReceiverHost(max_transfers=16)
        engine = ReceiverEngine(rx, host, on_result=done.append)
        for tid in range(1, 41):  # 40 tiny transfers, all queued before the engine reads
            for d in _datagrams(small, tid, 3):
                tx.sendto(d, rx.address)
        time.sleep(0.05)
        engine.on_readable(clock())
        assert host.dropped == 0, host.drop_reasons
        assert len(done) == 40
        assert all(inc.session.result.reason == "complete" for inc in done)


def test_receiver_budget_refuses_what_does_not_fit_and_frees_it_later():
    t = synthetic_transfer(300_000, 4, seed=2)
    with (
        DatagramSocket(("127.0.0.1", 0)) as rx,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        done = []
        host = ReceiverHost(budget_bytes=500_000, linger_s=0.0)
        engine = ReceiverEngine(rx, host, on_result=done.append)
        for tid in (1, 2):
            for d in _datagrams(t, tid, 12):  # the manifest decodes: each asks for its map
                # and a window beyond what arrived (256 KB: the least), more than half
                tx.sendto(d, rx.address)
        time.sleep(0.05)
        engine.on_readable(clock())
        refused = [i for i in done if i.session.result.reason == "refused"]
        assert [i.transfer_id for i in refused] == [2]
        assert refused[0].session.drop_reasons.get("over_budget") == 1
        assert 0 < host.held_bytes < 300_000  # a window beyond what arrived, not all of it
        engine.abort(1, clock())  # the first one ends, its buffers are released ...
        engine.run_due(clock() + 1)
        engine.run_due(clock() + 1)
        assert host.held_bytes == 0
        for d in _datagrams(t, 3, 12):  # ... and a third transfer fits again
            tx.sendto(d, rx.address)
        time.sleep(0.05)
        engine.on_readable(clock())
        assert host.active[3].session.manifest is not None


def test_receiver_session_asks_the_budget_before_growing():
    asked = []
    s = ReceiverSession(7, reserve=lambda n: asked.append(n) or sum(asked) <= 10_000)
    t = synthetic_transfer(1_000_000, 4, seed=3)
    for d in _datagrams(t, 7, 40)[1::2]:  # sources only (the manifest never comes)
        s.receive_datagram(d, 0.0)
    assert s.reserved <= 10_000
    assert s.drop_reasons.get("over_budget", 0) > 0


def test_lagging_subscriber_loses_nothing_unseen(tmp_path):
    d = ReceiverDaemon(
        bind=("127.0.0.1", 0), key=None, control=f"ipc://{tmp_path}/c.ipc",
        publish=f"ipc://{tmp_path}/p.ipc",
    )  # fmt: skip
    from kvtransport.embed.client import ResultSubscriber

    sub = ResultSubscriber(f"ipc://{tmp_path}/p.ipc")
    sub.sock.setsockopt(zmq.RCVHWM, 4)
    try:
        time.sleep(0.3)  # the subscription reaches the PUB socket
        n = 600  # far beyond the socket queues (64 + 4): the rest waits in the backlog
        for tid in range(1, n + 1):
            s = ReceiverSession(tid)
            s.close(0.0)
            d._result(Incoming(tid, s, ("127.0.0.1", 1), 0.0))
        assert d._backlog  # the subscriber has not read: results wait in the daemon
        got = []
        while len(got) < n:
            d._on_idle(clock())
            r = sub._recv(0.05)
            if r is not None:
                got.append(r.transfer_id)
        assert got == list(range(1, n + 1)) and sub.lost == 0
        assert d.published == n and d.publish_lost == 0
        # beyond the backlog: the oldest are given up, counted by the daemon and seen as
        # a gap by the subscriber
        d.pub_backlog = 50
        for tid in range(n + 1, n + 1 + 1000):
            s = ReceiverSession(tid)
            s.close(0.0)
            d._result(Incoming(tid, s, ("127.0.0.1", 1), 0.0))
        assert d.publish_lost > 0
        end = time.monotonic() + 20
        while (d._backlog or sub.sock.poll(50)) and time.monotonic() < end:
            d._on_idle(clock())
            while sub._recv(0.01) is not None:
                pass
        assert sub.lost == d.publish_lost
    finally:
        sub.close()
        d.close()


def test_a_forged_card_manifest_cannot_size_memory():
    """The application metadata a receiver gets may claim anything: geometry fields are
    bounded, and its zlib body is inflated no further than its header announces (a
    decompression bomb is refused after a few bytes, not after gigabytes)."""
    import resource

    import pytest
    from test_blocks import _cache, _encode, _reframe

    from kvtransport.kvformat import blocks

    header = _encode(_cache(layers=2, tokens=40)).manifest.header()
    with pytest.raises(blocks.ManifestError, match="non-negative"):
        blocks.Manifest.from_bytes(_reframe({**header, "tokens": 10**30}, b""))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(blocks.ManifestError, match="body holds"):
        blocks.Manifest.from_bytes(_reframe(header, bytes(256 << 20)))  # 256 MiB of zeros
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 100_000  # KiB
