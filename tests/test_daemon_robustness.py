"""Robustness over real loopback sockets: garbage, truncated, forged and foreign datagrams
(injected with a raw socket that forges the peer's source address), bounded receiver state,
a sender that dies mid-transfer, total loss of feedback, reordering and duplication.

Real daemons (keyed), real UDP; the impairments come from a small UDP proxy in this
process that sits between the sender daemon and the receiver daemon."""

import os
import random
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest
from test_daemon import Daemons, SenderThread, assert_blocks_exact

from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import HEADER, DatagramType, Framer
from kvtransport.daemons.api import ApiError
from kvtransport.daemons.daemon_receiver import ReceiverEngine
from kvtransport.daemons.daemon_sender import SenderEngine
from kvtransport.daemons.udp import DatagramSocket, clock
from kvtransport.hosts.receiver_host import ReceiverHost
from kvtransport.hosts.sender_host import SenderHost
from kvtransport.policies.registry import make_policy

KEY_HEX = "a5" * 32
KEY = bytes.fromhex(KEY_HEX)
WRONG = b"not the key" * 3
_SEQ = struct.Struct("!I")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    d = Daemons(
        tmp_path_factory.mktemp("robust"),
        key=KEY_HEX,
        receiver_args=[
            "--listen", "127.0.0.1:0", "--max-transfers", "2", "--max-mb", "4",
            "--idle-timeout", "0.5",
        ],
    )  # fmt: skip
    yield d
    d.stop()


def kernel_udp_drops(*ports: int) -> int:
    """Datagrams the kernel dropped on the IPv4 UDP sockets bound to these local ports
    (receive buffer full), from the ``drops`` column of /proc/net/udp."""
    total = 0
    with open("/proc/net/udp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) in ports:
                total += int(fields[-1])
    return total


def _wait(cond, timeout=10.0, step=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError("condition not met in time")


# ---------------------------------------------------------------------- injection


def raw_send(src, dst, payloads):
    """UDP datagrams with a forged source address (IPv4 header built here; root only),
    else from an ordinary socket of our own."""
    if os.geteuid() != 0:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for p in payloads:
                s.sendto(p, dst)
        return
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
        for p in payloads:
            udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(p), 0) + p
            ip = struct.pack(
                "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                socket.inet_aton(src[0]), socket.inet_aton(dst[0]),
            )  # fmt: skip
            s.sendto(ip + udp, (dst[0], 0))


def forged(tid, n, key, dtype=DatagramType.SOURCE, size=1280, esi0=0):
    f = Framer(tid, key, max_payload=size)
    return [f.build(dtype, 10_000 + i, bytes([i % 256]) * size, esi=esi0 + i) for i in range(n)]


def test_garbage_truncated_forged_and_foreign_are_counted_and_dropped(daemons):
    rng = np.random.default_rng(5)
    tr = synthetic_transfer(4_000_000, 325, seed=31)
    name = int(rng.integers(1, 2**62))
    before = daemons.receiver.stats()
    # a client's id names the transfer; the wire id is the daemon's random one
    tid = int(daemons.sender.submit(tr, daemons.to(), deadline_ms=2000, transfer_id=name), 16)
    assert tid != name and daemons.sender.status(name)["transfer_id"] == f"{tid:016x}"
    st = _wait(lambda: [s for s in daemons.receiver.status() if s["transfer_id"] == f"{tid:016x}"])
    host, port = st[0]["from"].rsplit(":", 1)
    sender_addr, rx_addr = (host, int(port)), ("127.0.0.1", daemons.rx_port)
    garbage = [
        rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(28, 1400, 50)
    ]
    truncated = [forged(tid, 1, KEY)[0][:k] for k in range(5, 25)]
    raw_send(sender_addr, rx_addr, garbage + truncated)
    raw_send(sender_addr, rx_addr, forged(tid, 20, WRONG))  # the transfer's id, wrong key
    raw_send(sender_addr, rx_addr, forged(tid ^ 1, 20, WRONG))  # foreign id, wrong key
    raw_send(sender_addr, rx_addr, forged(tid ^ 2, 10, KEY, DatagramType.FEEDBACK, size=80))
    # and the other way: forged and foreign feedback to the sender
    raw_send(
        rx_addr, ("127.0.0.1", daemons.tx_port), forged(tid, 15, WRONG, DatagramType.FEEDBACK, 80)
    )
    raw_send(
        rx_addr, ("127.0.0.1", daemons.tx_port), forged(tid ^ 3, 5, KEY, DatagramType.FEEDBACK, 80)
    )
    res = daemons.sub.wait_for(tid, timeout_s=20)
    assert res.reason == "complete" and res.utility_recovered == pytest.approx(1.0)
    assert_blocks_exact(res, tr)
    time.sleep(0.1)
    after = daemons.receiver.stats()
    grew = {k: after["drop_reasons"].get(k, 0) - before["drop_reasons"].get(k, 0)
            for k in after["drop_reasons"]}  # fmt: skip
    assert grew.get("bad_magic", 0) + grew.get("bad_version", 0) == 50, grew
    assert grew.get("truncated", 0) == 20 and grew.get("bad_tag", 0) == 40, grew
    assert grew.get("unexpected_type", 0) == 10, grew
    # forged datagrams opened no session: only the real transfer was ever received
    assert [s["transfer_id"] for s in daemons.receiver.status() if s["transfer_id"] in
            {f"{tid ^ k:016x}" for k in (1, 2)}] == []  # fmt: skip
    sst = daemons.sender.status(f"{tid:016x}")
    assert sst["drop_reasons"].get("bad_tag", 0) == 15, sst
    assert daemons.sender.stats()["drop_reasons"].get("foreign_transfer", 0) >= 5


def test_receiver_state_is_bounded_and_expires(daemons):
    """max 2 transfers at once, 4 MB each, idle expiry 0.5 s (the fixture's limits)."""

    def first_datagrams(size, n, deadline=0.3):
        tr = synthetic_transfer(size, max(1, size // 12_288), seed=size)
        s = SenderSession(
            tr,
            make_policy("none"),
            rate_bps=1e9,
            deadline=deadline,
            key=KEY,
            wall_offset=time.time(),
        )  # its clock starts now: a fresh manifest
        out = []
        while len(out) < n:
            out += s.datagrams_to_send(s.next_timer())
        return s.transfer_id, out[:n]

    (a, da), (b, db), (c, dc) = (first_datagrams(1_000_000, 12) for _ in range(3))
    big, dbig = first_datagrams(6_000_000, 12)
    before = daemons.receiver.stats()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in da + db + dc:
            s.sendto(d, ("127.0.0.1", daemons.rx_port))
        live = _wait(
            lambda: len([x for x in daemons.receiver.status() if x["state"] == "receiving"]) == 2
        )
        assert live
        ids = {x["transfer_id"] for x in daemons.receiver.status()}
        assert f"{a:016x}" in ids and f"{b:016x}" in ids and f"{c:016x}" not in ids
        # a and b got their manifests, hence deadlines: they end there, partial
        for tid in (a, b):
            res = daemons.sub.wait_for(tid, timeout_s=5)
            assert res.reason == "deadline" and res.blocks is not None
        # capacity is free again. A transfer larger than --max-mb is refused as soon as its
        # manifest says so; one whose manifest never comes (only sources here) opens
        # nothing: its datagrams wait in the pool and expire, and no result is published
        for d in dbig:
            s.sendto(d, ("127.0.0.1", daemons.rx_port))
        res = daemons.sub.wait_for(big, timeout_s=5)
        assert res.reason == "refused" and res.utility_recovered == 0
        e, de = first_datagrams(1_000_000, 12)
        sources = [d for d in de if HEADER.unpack_from(d)[2] == DatagramType.SOURCE]
        for d in sources:
            s.sendto(d, ("127.0.0.1", daemons.rx_port))
        with pytest.raises(ApiError, match="no result"):
            daemons.sub.wait_for(e, timeout_s=2.0)
    after = daemons.receiver.stats()
    grew = {k: v - before["drop_reasons"].get(k, 0) for k, v in after["drop_reasons"].items()}
    assert grew["over_capacity"] == 12  # c's: its manifest came while a and b held the slots
    assert grew["pool_expired"] == len(sources) and after["results"] - before["results"] == 3
    assert after["drop_reasons"].get("too_large", 0) >= 1
    assert after["active"] == 0


def test_engine_drops_foreign_and_finished_transfers():
    """The `recv` command's single mode and late datagrams of a finished transfer."""
    with (
        DatagramSocket(("127.0.0.1", 0)) as rs,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        results = []
        host = ReceiverHost(key=KEY, single=True, linger_s=0.0)
        eng = ReceiverEngine(rs, host, on_result=results.append)
        tx.bind(("127.0.0.1", 0))
        # forged sources carry no manifest (nothing opens before one): 1 is opened ahead
        host.expect(1, tx.getsockname(), clock(), clock() + 60.0)
        one, two = forged(1, 3, KEY), forged(2, 3, KEY)
        for d in one + two:
            tx.sendto(d, rs.address)
        _wait(lambda: eng.on_readable(clock()) or host.dropped >= 3, timeout=2)
        assert host.drop_reasons == {"foreign_transfer": 3} and list(host.active) == [1]
        eng.abort(1, clock())
        eng.run_due(clock() + 1)  # past the linger time: the id is remembered as finished
        tx.sendto(one[0], rs.address)
        _wait(lambda: eng.on_readable(clock()) or host.dropped >= 4, timeout=2)
        assert (
            host.drop_reasons["finished_transfer"] == 1
            and results[0].session.result.reason == "abort"
        )
    # the sender side: feedback for a transfer it does not have
    with (
        DatagramSocket(("127.0.0.1", 0)) as ss,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        sender = SenderHost(rate_bps=1e8, key=KEY)
        eng = SenderEngine(ss, sender)
        for d in forged(77, 4, KEY, DatagramType.FEEDBACK, size=80) + [b"short"]:
            tx.sendto(d, ss.address)
        _wait(lambda: eng.on_readable(clock()) or sender.dropped >= 5, timeout=2)
        assert sender.drop_reasons == {"foreign_transfer": 4, "truncated": 1}


def test_sender_dying_mid_transfer_leaves_a_partial_result_at_the_deadline(daemons):
    tr = synthetic_transfer(3_500_000, 284, seed=32)  # 1.5 s at 20 Mbit/s (< --max-mb)
    sender = SenderThread(tr, daemons.rx_port, deadline_s=1.2, rate_mbps=20, key=KEY)
    try:
        _wait(lambda: sender.out.session.fb_through > 300)
    finally:
        sender.kill()  # no FIN, no ABORT: the receiver hears nothing more
    res = daemons.sub.wait_for(sender.out.transfer_id, timeout_s=5)
    assert res.reason == "deadline"
    # the deadline counts from the transfer's first datagram (manifest: 1.2 s)
    assert 1.19 <= res.stats["timings_s"]["finished"] < 1.5, res.stats
    assert 0 < res.utility_recovered < 1
    assert_blocks_exact(res, tr)


# ---------------------------------------------------------------------- the proxy


class Proxy:
    """A UDP relay between the sender daemon and the receiver: ``data(batch)`` and
    ``feedback(batch)`` map each direction's datagrams to what is forwarded."""

    def __init__(self, target_port, data=None, feedback=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.target = ("127.0.0.1", target_port)
        self.data = data or (lambda batch, flush: batch)
        self.feedback = feedback or (lambda batch, flush: batch)
        self.peer = None
        self.counts = {"data": 0, "feedback": 0}
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.halt.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.003)
            fwd, back = [], []
            while ready:
                try:
                    d, addr = self.sock.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr == self.target:
                    back.append(d)
                else:
                    self.peer = addr
                    fwd.append(d)
            self.counts["data"] += len(fwd)
            self.counts["feedback"] += len(back)
            for d in self.data(fwd, not ready):
                self.sock.sendto(d, self.target)
            if self.peer is not None:
                for d in self.feedback(back, not ready):
                    self.sock.sendto(d, self.peer)

    def close(self):
        self.halt.set()
        self.thread.join(5)
        self.sock.close()


def test_total_loss_of_feedback_the_sender_finishes_open_loop(daemons):
    proxy = Proxy(daemons.rx_port, feedback=lambda batch, flush: [])
    try:
        tr = synthetic_transfer(2_000_000, 162, seed=33)
        tid = daemons.sender.submit(tr, f"127.0.0.1:{proxy.port}", deadline_ms=600)
        res = daemons.sub.wait_for(tid, timeout_s=10)
        st = daemons.sender.wait(tid, timeout_s=5)
    finally:
        proxy.close()
    assert proxy.counts["feedback"] > 0  # the receiver did report; none got through
    assert st["feedback_received"] == 0 and st["finish_reason"] == "deadline"
    # it stopped on its own clock, with room for a stalled host firing the timer late
    assert st["elapsed_s"] <= 0.6 + 0.15
    assert st["source_sent"] == st["n_source"]
    assert res.reason == "complete" and res.utility_recovered == pytest.approx(1.0)
    assert_blocks_exact(res, tr)


def test_reordering_and_duplication_change_nothing(daemons):
    dropped = []
    held = []
    rnd = random.Random(7)

    def impair(batch, flush):
        """Drop every datagram whose seq is 4 mod 9, duplicate the rest, shuffle them in
        windows of six."""
        for d in batch:
            seq = _SEQ.unpack_from(d, 16)[0]
            if seq % 9 == 4 and HEADER.unpack_from(d)[2] != DatagramType.CONTROL:
                dropped.append(seq)
            else:
                held.extend((d, d))
        out = []
        while len(held) >= 6 or (flush and held):
            window, held[:6] = held[:6], []
            rnd.shuffle(window)
            out += window
        return out

    proxy = Proxy(daemons.rx_port, data=impair)
    drops_before = kernel_udp_drops(daemons.rx_port, proxy.port)
    try:
        tr = synthetic_transfer(2_000_000, 162, seed=34)
        tid = daemons.sender.submit(tr, f"127.0.0.1:{proxy.port}", deadline_ms=1500)
        res = daemons.sub.wait_for(tid, timeout_s=10)
        # the proxy doubles the stream in bursts: on a slow host the receiver's (or the
        # proxy's) socket buffer overflows, and the kernel's drops are loss too
        kernel_drops = kernel_udp_drops(daemons.rx_port, proxy.port) - drops_before
    finally:
        proxy.close()
    assert res.reason == "complete" and res.utility_recovered == pytest.approx(1.0)
    assert_blocks_exact(res, tr)
    st = res.stats
    # duplicates are dropped by the packet-number window, and nothing else is
    dups = st["drop_reasons"].get("duplicate_packet", 0)
    assert dups > 100 and st["dropped"] == dups, st
    # reordering is not loss and duplicates do not hide loss: the receiver counted exactly
    # the datagrams the proxy dropped (up to a last shuffled window it stopped counting in),
    # plus at most what the kernel dropped (a dropped duplicate is no loss)
    below = sum(1 for s in dropped if s < st["highest_seq"])
    assert below <= st["datagrams_lost"] <= below + kernel_drops + 6, (below, kernel_drops, st)
    assert below > 50


def test_a_new_transfer_starts_from_its_receivers_last_loss(daemons):
    """The sender daemon remembers the loss each receiver's last transfer ended with and
    primes the next transfer's repair with it (before: a blind 10 % prior every time)."""
    rnd = random.Random(9)
    proxy = Proxy(
        daemons.rx_port, data=lambda batch, flush: [d for d in batch if rnd.random() > 0.05]
    )
    try:
        tids = []
        for seed in (41, 42):
            tr = synthetic_transfer(1_000_000, 81, seed=seed)
            tids.append(daemons.sender.submit(tr, f"127.0.0.1:{proxy.port}", deadline_ms=1000))
            daemons.sub.wait_for(tids[-1], timeout_s=10)
            daemons.sender.wait(tids[-1], timeout_s=5)
    finally:
        proxy.close()
    first, second = (daemons.sender.status(t) for t in tids)
    assert first["prior_loss"] is None  # a receiver (the proxy's port) never seen before
    assert 0.02 < first["loss_estimate"] < 0.1, first
    assert second["prior_loss"] == first["loss_estimate"]
