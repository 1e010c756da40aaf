"""Replay protection (kvtransport.core.replay): a captured transfer played again is refused,
after a receiver restart and after 10k newer transfers; a receiver restarted mid-transfer
still accepts the sender's fresh manifest.

The daemon tests run the real receiver daemon (a process, default key file, real UDP) and
an in-process sender engine behind a recording UDP relay; the replay is the relay's
capture sent again, datagram for datagram."""

import signal
import socket
import subprocess
import time

import pytest
from test_daemon import CLI, SenderThread, assert_blocks_exact
from test_daemon_robustness import Proxy

from kvtransport.core.replay import REPLAYED, STALE, ReplayRecord
from kvtransport.core.transfer import TransportManifest, synthetic_transfer
from kvtransport.daemons.api import ApiError
from kvtransport.embed.client import ReceiverClient, ResultSubscriber
from kvtransport.errors import UserError

W = 120.0


# ---------------------------------------------------------------------- the record


def test_record_accepts_a_transfer_once_and_only_while_fresh():
    now = 1.7e9
    r = ReplayRecord(None, now=now, window_s=W)
    assert r.admit(1, now - 5, now) is None
    assert r.admit(1, now - 5, now + 1) == REPLAYED  # the same manifest again
    assert r.admit(1, now - 6, now + 1) == REPLAYED  # an older one of the same id
    assert r.admit(1, now, now + 1) is None  # a newer one (a sender restarting its manifest)
    assert r.admit(2, now - W - 1, now) == STALE  # sent before the window
    assert r.admit(3, now + W + 1, now) == STALE  # from the future
    assert r.admit(4, float("nan"), now) == STALE
    assert r.refused == {REPLAYED: 2, STALE: 3}
    # past the window the entry is forgotten, and the floor keeps the id out even if the
    # wall clock is stepped back afterwards
    assert r.admit(5, now + 200, now + 200) is None
    assert 1 not in r.entries and r.floor == now
    assert r.admit(1, now, now) == STALE


def test_record_is_bounded_and_forgetting_raises_the_floor():
    now = 1.7e9
    r = ReplayRecord(None, now=now, window_s=W, capacity=100)
    for i in range(1000):
        assert r.admit(i, now + i * 0.01, now + 10) is None
        assert len(r.entries) <= 100
    assert len(r._heap) <= 2 * 100 + 64
    assert r.floor == pytest.approx(now + 899 * 0.01)
    assert all(r.admit(i, now + i * 0.01, now + 10) is not None for i in range(1000))


def test_record_survives_a_restart_and_a_damaged_file_fails_safe(tmp_path, caplog):
    path = tmp_path / "state" / "replay"
    now = time.time()
    r = ReplayRecord(path, now=now)
    assert r.admit(7, now, now) is None and r.dirty
    assert r.persist() and not r.dirty and path.stat().st_size == 20 + 16 + 4
    again = ReplayRecord(path, now=now + 1)
    assert again.entries == {7: now} and again.admit(7, now, now + 1) == REPLAYED
    data = path.read_bytes()  # a tampered file (its last byte flipped: writing a 0 there
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # changed nothing 1 time in 256)
    broken = ReplayRecord(path, now=now + 2)
    assert "damaged" in caplog.text and broken.floor == now + 2
    assert broken.admit(8, now + 1, now + 2) == STALE  # anything sent before this start
    path.unlink()
    path.mkdir()
    with pytest.raises(UserError, match="cannot read replay record"):
        ReplayRecord(path, now=now)


def test_the_manifest_carries_its_send_time():
    tr = synthetic_transfer(10_000, 4)
    m = TransportManifest(1280, tr.nbytes, tr.blocks, b"", 0.5, 1.7e9 + 0.25)
    assert TransportManifest.from_bytes(m.to_bytes()).sent_at == 1.7e9 + 0.25


# ---------------------------------------------------------------------- the daemon


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """The receiver daemon as a process on a fixed port with a given replay record."""

    def __init__(self, directory, port, record):
        self.ctl = f"ipc://{directory}/rx.ipc"
        results = f"ipc://{directory}/results.ipc"
        self.err = open(directory / f"rx-{time.monotonic_ns()}.err", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*CLI, "receiver-daemon", "--listen", f"127.0.0.1:{port}", "--control", self.ctl,
             "--publish", results, "--replay-file", str(record)],
            stdout=subprocess.DEVNULL, stderr=self.err,
        )  # fmt: skip
        self.client = ReceiverClient(self.ctl, timeout_s=60)
        self.client.ping()
        self.sub = ResultSubscriber(results)
        time.sleep(0.2)  # the subscription reaches the PUB socket

    def stats(self):
        return self.client.stats()

    def stop(self, sig=signal.SIGTERM):
        self.client.close()
        self.sub.close()
        self.proc.send_signal(sig)
        self.proc.wait(20)
        self.err.close()


def _replay(capture, port):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in capture:
            s.sendto(d, ("127.0.0.1", port))
            time.sleep(0)  # let the receiver keep up (loopback buffers are finite)


def _refused(rx, reason):
    """Wait until the daemon has refused one replay; its counters then."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        st = rx.stats()
        if st["replays_refused"]:
            break
        time.sleep(0.02)
    time.sleep(0.3)  # the rest of the capture arrives
    st = rx.stats()
    assert st["replays_refused"] == 1 and st["results"] == 0, st
    assert st["drop_reasons"].get(reason) == 1, st
    assert st["drop_reasons"].get("replayed", 0) > 0, st  # its later datagrams, unanswered
    return st


def test_a_captured_transfer_is_refused_after_a_restart_and_after_10k_newer(tmp_path):
    port, record = _free_port(), tmp_path / "replay"
    capture = []
    rx = Receiver(tmp_path, port, record)
    proxy = Proxy(port, data=lambda batch, flush: capture.extend(batch) or batch)
    try:
        tr = synthetic_transfer(400_000, 32, seed=41)
        sender = SenderThread(tr, proxy.port, deadline_s=1.0)
        res = rx.sub.wait_for(sender.out.transfer_id, timeout_s=10)
        sender.kill()
    finally:
        proxy.close()
    assert res.reason == "complete" and res.utility_recovered == pytest.approx(1.0)
    assert_blocks_exact(res, tr)
    tid = sender.out.transfer_id
    assert len(capture) > 300
    rx.stop()

    # restart: the record on disk remembers the transfer
    rx = Receiver(tmp_path, port, record)
    try:
        _replay(capture, port)
        _refused(rx, "replayed_manifest")
        with pytest.raises(ApiError, match="no result"):
            rx.sub.wait_for(tid, timeout_s=0.2)
    finally:
        rx.stop(signal.SIGKILL)

    # 10k newer transfers (fed to the record directly: the daemon path is shown above)
    rec = ReplayRecord(record, now=time.time())
    assert tid in rec.entries
    for i in range(10_000):
        now = time.time()
        assert rec.admit(tid + 1 + i, now, now) is None
    assert rec.persist() and tid not in rec.entries and len(rec.entries) <= rec.capacity

    rx = Receiver(tmp_path, port, record)
    try:
        _replay(capture, port)
        _refused(rx, "stale_manifest")
        # a genuine transfer is still accepted
        tr2 = synthetic_transfer(200_000, 16, seed=42)
        sender = SenderThread(tr2, port, deadline_s=1.0)
        res = rx.sub.wait_for(sender.out.transfer_id, timeout_s=10)
        sender.kill()
        assert res.reason == "complete"
        assert_blocks_exact(res, tr2)
    finally:
        rx.stop()


def test_a_receiver_killed_mid_transfer_accepts_the_senders_fresh_manifest(tmp_path):
    """The record of the first receiver holds the transfer; the sender's manifest for the
    restarted one is newer, so it is accepted and the result is exact by the deadline."""
    port, record = _free_port(), tmp_path / "replay"
    rx = Receiver(tmp_path, port, record)
    tr = synthetic_transfer(3_000_000, 240, seed=43)  # 3 s at 8 Mbit/s: sources still go
    sender = SenderThread(tr, port, deadline_s=6.0, rate_mbps=8)  # out after the restart
    try:
        end = time.monotonic() + 10
        while sender.out.session.fb_through < 300 and time.monotonic() < end:
            time.sleep(0.005)
        rx.stop(signal.SIGKILL)
        assert ReplayRecord(record, now=time.time()).entries.keys() == {sender.out.transfer_id}
        rx = Receiver(tmp_path, port, record)
        res = rx.sub.wait_for(sender.out.transfer_id, timeout_s=15)
    finally:
        sender.kill()
        rx.stop()
    assert sender.out.session.stats["receiver_restarts"] == 1
    assert res.reason in ("complete", "deadline") and res.complete.sum() > 100, res.stats
    assert_blocks_exact(res, tr)


def test_recv_mode_refuses_a_replay_and_waits_for_a_genuine_transfer():
    """The `recv` command's engine (single transfer): a replayed transfer does not take
    the one slot; the next genuine transfer is received."""
    from kvtransport.core.sender import SenderSession
    from kvtransport.daemons.daemon_receiver import ReceiverEngine
    from kvtransport.daemons.udp import DatagramSocket, clock
    from kvtransport.hosts.receiver_host import ReceiverHost
    from kvtransport.policies.registry import make_policy

    key = b"k" * 32

    def datagrams(seed):
        tr = synthetic_transfer(20_000, 4, seed=seed)
        s = SenderSession(tr, make_policy("none"), rate_bps=1e9, deadline=0.5, key=key,
                          wall_offset=time.time())  # fmt: skip
        out = []
        while len(out) < 40 and s.next_timer() is not None:
            out += s.datagrams_to_send(s.next_timer())
        return s.transfer_id, out

    (old, captured), (new, fresh) = datagrams(1), datagrams(2)
    record = ReplayRecord(None, now=time.time())
    assert record.admit(old, _sent_at(captured), time.time()) is None  # received before
    results = []
    with DatagramSocket(("127.0.0.1", 0)) as rs, socket.socket(type=socket.SOCK_DGRAM) as tx:
        host = ReceiverHost(key=key, single=True, replay=record, wall_clock=time.time)
        eng = ReceiverEngine(rs, host, on_result=results.append)
        for batch in (captured, fresh):
            for d in batch:
                tx.sendto(d, rs.address)
            end = time.monotonic() + 5
            while host.adopted is None or host.adopted == old:
                eng.on_readable(clock())
                if host.replays_refused and batch is captured or time.monotonic() > end:
                    break
        end = time.monotonic() + 5
        while not results and time.monotonic() < end:
            eng.on_readable(clock())
    assert host.replays_refused == 1 and record.refused == {REPLAYED: 1}
    assert [r.transfer_id for r in results] == [new]
    assert results[0].session.result.reason == "complete"


def _sent_at(datagrams):
    """The send time in the manifest of a transfer's first datagrams (decoded here as a
    receiver would)."""
    from kvtransport.core.manifest_fec import ManifestReceiver
    from kvtransport.core.wire import DatagramType, parse

    rx = ManifestReceiver()
    for d in datagrams:
        g = parse(d, b"k" * 32)
        if g.type in (DatagramType.MANIFEST, DatagramType.MANIFEST_REPAIR):
            m = rx.add(g)
            if m is not None:
                return m.sent_at
    raise AssertionError("no manifest in the datagrams")
