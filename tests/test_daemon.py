"""The daemons over real loopback UDP and real ZeroMQ: submit, status, cancel, results
published and written, several transfers sharing the link, bad requests, SIGTERM.

The daemons run as real processes (`python -m kvtransport sender-daemon|receiver-daemon`)
on ipc:// endpoints in a temporary directory; the test talks to them with
kvtransport.embed.client exactly as a user program would."""

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from kvtransport.codecs import aesgcm

from kvtransport.core.keys import resolve_key
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.daemons.api import ApiError, read_result_file
from kvtransport.daemons.daemon import StopSignal, serve
from kvtransport.daemons.daemon_sender import SenderEngine
from kvtransport.daemons.udp import DatagramSocket, clock
from kvtransport.embed.client import ReceiverClient, ResultSubscriber, SenderClient
from kvtransport.embed.inprocess import warm_kernels
from kvtransport.hosts.sender_host import SenderHost

CLI = [sys.executable, "-m", "kvtransport"]
LINK_MBPS = 100.0
START_TIMEOUT_S = 180.0


class Daemons:
    """A sender daemon and a receiver daemon on loopback, talking over ipc:// endpoints."""

    def __init__(self, directory, *, key=None, sender_args=(), receiver_args=(), netns=None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sender_ctl = f"ipc://{self.dir}/sender.ipc"
        self.receiver_ctl = f"ipc://{self.dir}/receiver.ipc"
        self.results = f"ipc://{self.dir}/results.ipc"
        keyed = []
        if key:  # a key file, as between hosts (a key in argv is refused: ps shows it)
            key_file = self.dir / "key"
            key_file.write_text(key)
            key_file.chmod(0o600)
            keyed = ["--key-file", str(key_file)]
        wrap = netns or (lambda side, argv: argv)
        self.rx = self._spawn(
            "receiver",
            wrap(
                "rcv",
                [*CLI, "receiver-daemon", "--control", self.receiver_ctl, "--publish",
                 self.results, "--stats", *keyed, *receiver_args],
            ),
        )  # fmt: skip
        self.tx = self._spawn(
            "sender",
            wrap(
                "snd",
                [*CLI, "sender-daemon", "--control", self.sender_ctl, "--rate-mbps",
                 str(LINK_MBPS), "--stats", *keyed, *sender_args],
            ),
        )  # fmt: skip
        try:
            # on a cold numba cache a daemon compiles its kernels before it answers (about
            # 20 s, more on a busy host): wait for each as long as it is alive
            self.rx_info = self._ready(ReceiverClient, self.receiver_ctl, self.rx, "receiver")
            self.tx_info = self._ready(SenderClient, self.sender_ctl, self.tx, "sender")
        except BaseException:
            self.kill()  # a failed start leaves no daemon behind
            raise
        self.sender = SenderClient(self.sender_ctl, timeout_s=20)
        self.receiver = ReceiverClient(self.receiver_ctl, timeout_s=20)
        self.sub = ResultSubscriber(self.results)
        self.rx_port = int(self.rx_info["udp"].rsplit(":", 1)[1])
        self.tx_port = int(self.tx_info["udp"].rsplit(":", 1)[1])
        time.sleep(0.2)  # the subscription reaches the PUB socket

    def _ready(self, client_type, endpoint, proc, name, timeout_s=START_TIMEOUT_S):
        """The daemon's ping reply, polled until it answers, exits, or ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            client = client_type(endpoint, timeout_s=2)
            try:
                return client.ping()
            except ApiError:
                if proc.poll() is not None:
                    tail = self.log(name)[-2000:]
                    raise RuntimeError(f"the {name} daemon exited: {tail}") from None
                if time.monotonic() > end:
                    raise
            finally:
                client.close()

    def kill(self):
        for proc in (self.tx, self.rx):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for f in proc.files:
                f.close()

    def _spawn(self, name, argv):
        out = open(self.dir / f"{name}.out", "w")  # noqa: SIM115 (closed in stop)
        err = open(self.dir / f"{name}.err", "w")  # noqa: SIM115
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        proc.files = (out, err)
        return proc

    def to(self, port=None):
        return f"127.0.0.1:{port or self.rx_port}"

    def log(self, name):
        return (self.dir / f"{name}.err").read_text()

    def stats_lines(self, name):
        text = (self.dir / f"{name}.out").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def terminate(self, proc, timeout=20):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in proc.files:
            f.close()
        return proc.returncode

    def stop(self):
        for c in (self.sender, self.receiver, self.sub):
            c.close()
        return self.terminate(self.tx), self.terminate(self.rx)


def block_bytes(transfer, i):
    o, n = int(transfer.blocks.offsets[i]), int(transfer.blocks.lengths[i])
    return transfer.payload[o : o + n]


def assert_blocks_exact(result, transfer):
    """Every block the receiver calls complete is byte-identical to what was sent, and
    ``missing`` is exactly the rest."""
    assert result.blocks.equals(transfer.blocks)
    done = np.flatnonzero(result.complete)
    for i in done:
        assert np.array_equal(result.block_bytes(i), block_bytes(transfer, i)), f"block {i}"
    assert np.array_equal(result.missing, np.flatnonzero(~result.complete))
    got = float(transfer.blocks.utilities[done].sum())
    assert result.utility_recovered == pytest.approx(got, abs=1e-9)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    d = Daemons(
        tmp_path_factory.mktemp("daemons"),
        receiver_args=["--listen", "127.0.0.1:0", "--out-dir", str(tmp_path_factory.mktemp("out")),
                       "--prefault-mb", "8"],
    )  # fmt: skip
    yield d
    d.stop()


def test_submit_status_and_published_result(daemons):
    tr = synthetic_transfer(1_500_000, 122, seed=11)
    tid = daemons.sender.submit(tr, daemons.to(), rho=3.0, label="first")
    res = daemons.sub.wait_for(tid, timeout_s=20)
    assert res.reason == "complete" and res.utility_recovered == pytest.approx(1.0)
    assert_blocks_exact(res, tr)
    st = daemons.sender.wait(tid, timeout_s=10)
    assert st["label"] == "first" and st["share"] == 1.0
    assert st["finish_reason"] in ("receiver done", "receiver finished")
    assert st["source_sent"] == st["n_source"] == -(-1_500_000 // 1280)
    assert st["feedback_received"] >= 1 and st["srtt_ms"] is not None
    # the sender timed each policy decision (one per 32 data-path slots) in the daemon
    dec, slots = st["decisions"], st["datagrams_sent"]
    assert slots // 32 <= dec["n"] <= slots // 32 + 2, (dec, slots)
    assert 0.0 < dec["p50_us"] <= dec["p99_us"] and dec["mean_us"] > 0.0
    rst = daemons.receiver.status(tid)
    assert rst["reason"] == "complete" and rst["blocks_complete"] == 122
    # the result file (--out-dir) holds the same bytes
    stored = read_result_file(res.stats["file"])
    assert stored.transfer_id == int(tid, 16) and stored.complete.all()
    assert np.array_equal(stored.payload, tr.payload)
    # both start-up lines say which AES-GCM seals their datagrams (keyed by default)
    version = aesgcm.libcrypto_version()
    cipher = f"AES-256-GCM on {version}" if version else "AES-256-GCM per datagram"
    for name in ("sender", "receiver"):
        (up,) = [line for line in daemons.log(name).splitlines() if "daemon up" in line]
        assert cipher in up, up
    # the receiver faulted memory in at start-up (--prefault-mb; kvtransport.daemons.heap)
    assert "8 MB faulted in and kept" in daemons.log("receiver")
    assert "faulted in" not in daemons.log("sender")


def test_a_daemon_started_without_a_policy_picks_per_transfer(daemons):
    """``kvtransport sender-daemon`` without ``--policy``: a request naming none gets its
    transfer's default (daemon_sender.transfer_policy): the heuristic for a stream of
    whole token ranges over a long initial RTT, the DDQN for a synthetic stream, unless
    its deadline is under two of those round trips."""
    from kvtransport.hosts.policy_choice import (
        LONG_LINK_HANDOFF_POLICY,
        LONG_LINK_ONE_WAY_S,
        SHORT_DEADLINE_POLICY,
    )
    from kvtransport.kvformat import blocks
    from kvtransport.kvformat.kvcache import KVCache
    from kvtransport.model import utility
    from kvtransport.policies.registry import default_policy

    rng = np.random.default_rng(7)
    k = rng.standard_normal((4, 2, 96, 64)).astype(np.float16)
    cache = KVCache(k, k.copy(), rng.integers(0, 1000, 96), "toy", rng.random((4, 96)).astype("f4"))
    u = utility.cache_utility(cache, 16)
    order = utility.stream_order(u, 16, "position")
    prefix = blocks.encode_stream(cache, u, order, block_tokens=16).to_transfer()
    rtt_ms = 2e3 * LONG_LINK_ONE_WAY_S
    used = {}
    synthetic = synthetic_transfer(200_000, 16, seed=3)
    for name, tr, deadline_ms in (
        ("prefix", prefix, 1000.0),
        ("synthetic", synthetic, 1000.0),
        ("synthetic, 1.5 round trips", synthetic, 1.5 * rtt_ms),
    ):
        tid = daemons.sender.submit(
            tr, daemons.to(), deadline_ms=deadline_ms, initial_rtt_ms=rtt_ms
        )
        daemons.sub.wait_for(tid, timeout_s=20)
        used[name] = daemons.sender.wait(tid, timeout_s=10)["policy"]
    assert used == {
        "prefix": LONG_LINK_HANDOFF_POLICY,
        "synthetic": default_policy(),
        "synthetic, 1.5 round trips": SHORT_DEADLINE_POLICY,
    }


def test_cancel_delivers_the_partial_result_at_once(daemons):
    tr = synthetic_transfer(30_000_000, 2400, seed=12)  # 2.5 s at the link rate
    tid = daemons.sender.submit(tr, daemons.to(), deadline_ms=10_000)
    for _ in range(400):
        if daemons.sender.status(tid)["source_sent"] > 500:
            break
        time.sleep(0.01)
    t0 = time.monotonic()
    assert daemons.sender.cancel(tid) is True
    res = daemons.sub.wait_for(tid, timeout_s=5)
    assert time.monotonic() - t0 < 2.0  # not at the 10 s deadline
    assert res.reason == "abort"
    assert 0.0 < res.utility_recovered < 1.0 and res.missing.size > 0
    assert_blocks_exact(res, tr)
    st = daemons.sender.status(tid)
    assert st["state"] == "done" and st["finish_reason"] == "cancelled"
    assert daemons.sender.cancel(tid) is False  # no longer in flight


def test_several_transfers_share_the_link(daemons):
    sizes = (3_000_000, 2_000_000, 1_000_000)
    trs = [synthetic_transfer(n, n // 12_288, seed=20 + i) for i, n in enumerate(sizes)]
    tids = [
        daemons.sender.submit(t, daemons.to(), deadline_ms=1500, weight=w, label=f"u{i}")
        for i, (t, w) in enumerate(zip(trs, (1.0, 2.0, 1.0), strict=True))
    ]
    snapshots = []
    for _ in range(300):
        live = [s for s in daemons.sender.status() if s["state"] != "done"]
        live = [s for s in live if s["transfer_id"] in tids]
        if len(live) >= 2:
            snapshots.append(live)
        if not live:
            break
        time.sleep(0.005)
    assert snapshots, "the transfers never overlapped"
    # the weights reached the allocator (test_hosts checks that they decide the shares)
    weight_of = {s["transfer_id"]: s["weight"] for live in snapshots for s in live}
    assert [weight_of.get(t, w) for t, w in zip(tids, (1.0, 2.0, 1.0), strict=True)] == [
        1.0, 2.0, 1.0]  # fmt: skip
    assert 2.0 in weight_of.values()
    for live in snapshots:
        # never more than the link: shares sum to at most one, rates follow the shares
        assert sum(s["share"] for s in live) <= 1.0 + 1e-6
        top = max(live, key=lambda s: s["share"])
        for s in live:  # (a share under one datagram per 10 ms slot pauses its sender,
            # unless every share is: then the largest takes the whole link)
            tiny = s["share"] * LINK_MBPS < 1.1
            paused = tiny and s["rate_mbps"] == 0.0
            whole = tiny and s is top and s["rate_mbps"] == pytest.approx(LINK_MBPS)
            follows = s["rate_mbps"] == pytest.approx(s["share"] * LINK_MBPS, rel=1e-3)
            assert paused or whole or follows
    assert any(s["share"] < 1.0 for live in snapshots for s in live)  # the allocator decided
    for tid, tr in zip(tids, trs, strict=True):
        res = daemons.sub.wait_for(tid, timeout_s=20)
        assert res.utility_recovered > 0.5, res.stats
        assert_blocks_exact(res, tr)
    rstats = daemons.receiver.stats()
    assert rstats["dropped"] == 0 and rstats["active"] == 0


def test_bad_requests_get_one_line_errors_and_the_daemon_lives_on(daemons):
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(daemons.sender_ctl)

    def ask(*frames):
        req.send_multipart(list(frames))
        reply = json.loads(req.recv_multipart()[0])
        assert set(reply) >= {"ok"}
        return reply

    try:
        assert "JSON" in ask(b"not json")["error"]
        assert "unknown op" in ask(b'{"op": "fly"}')["error"]
        assert "'to'" in ask(b'{"op": "submit"}', b"x")["error"]
        bad_table = [b"\0" * 100, b"\0" * 7, b"\0" * 8, b"\0" * 8]
        r = ask(b'{"op": "submit", "to": "127.0.0.1:9", "rho": 1}', *bad_table)
        assert r["ok"] is False and "multiple of 8" in r["error"]
        r = ask(b'{"op": "submit", "to": "127.0.0.1:9"}', b"\0" * 100, *([b""] * 3))
        assert r["ok"] is False and "deadline_ms or rho" in r["error"]
        assert "no transfer" in ask(b'{"op": "status", "transfer_id": "00ff"}')["error"]
        assert "hex" in ask(b'{"op": "cancel", "transfer_id": "xyz"}')["error"]
        for r in (ask(b"{}"), ask(b"[1, 2]")):
            assert r["ok"] is False and "\n" not in r["error"]
    finally:
        req.close()
    assert daemons.sender.ping()["role"] == "sender"


class SenderThread:
    """A SenderEngine served by the daemons' loop (kvtransport.daemons.daemon.serve) on its own
    thread in this process (a sender the test controls: it can stop dead, without FIN or
    ABORT, as a crashed process would)."""

    def __init__(self, transfer, port, *, deadline_s, rate_mbps=LINK_MBPS, key=None, **kw):
        self.sock = DatagramSocket(("127.0.0.1", 0), ("127.0.0.1", port))
        key = resolve_key() if key is None else key  # the daemons' default key file
        # kernels compiled before the transfer's clock starts, as the daemon does at start-up
        # (on a cold numba cache the first transfer would otherwise spend its deadline there)
        warm_kernels(key, kw.get("policy", "adaptive"))
        self.engine = SenderEngine(self.sock, SenderHost(rate_bps=rate_mbps * 1e6, key=key))
        self.out = self.engine.submit(
            transfer, ("127.0.0.1", port), now=clock(), deadline_s=deadline_s, **kw
        )
        host = self.engine.host
        self.stop = StopSignal()  # never installed: the test keeps its signal handlers
        self.thread = threading.Thread(
            target=serve,
            args=(self.engine, [], self.stop),
            kwargs={"on_idle": lambda now: None if host.active else self.stop.request("done")},
            daemon=True,
        )
        self.thread.start()

    def kill(self):
        """Stop sending at once (no FIN, no ABORT)."""
        self.stop.request("killed")
        self.thread.join(5)
        self.sock.close()
        self.stop.close()


def test_sigterm_shuts_both_daemons_down_cleanly(tmp_path):
    d = Daemons(tmp_path, receiver_args=["--listen", "127.0.0.1:0"])
    helper = None
    try:
        # a transfer in flight when the sender daemon is told to stop: it is aborted and
        # its receiver delivers at once
        tr = synthetic_transfer(30_000_000, 2400, seed=13)
        tid = d.sender.submit(tr, d.to(), deadline_ms=10_000)
        while d.sender.status(tid)["decoded_through"] < 300:
            time.sleep(0.01)
        tx_rc = d.terminate(d.tx)
        res = d.sub.wait_for(tid, timeout_s=5)
        assert res.reason == "abort" and 0 < res.utility_recovered < 1
        assert_blocks_exact(res, tr)
        # a transfer in flight when the receiver daemon is told to stop: it delivers what
        # it holds before it leaves
        tr2 = synthetic_transfer(30_000_000, 2400, seed=14)
        helper = SenderThread(tr2, d.rx_port, deadline_s=10.0)
        while helper.out.session.fb_through < 300:
            time.sleep(0.01)
        rx_rc = d.terminate(d.rx)
        res2 = d.sub.wait_for(helper.out.transfer_id, timeout_s=5)
        assert res2.reason == "shutdown" and 0 < res2.utility_recovered < 1
        assert_blocks_exact(res2, tr2)
    finally:
        if helper is not None:
            helper.kill()
        with contextlib.suppress(Exception):
            d.stop()
    assert (tx_rc, rx_rc) == (0, 0)
    assert "sender daemon stopping (SIGTERM): 1 transfer(s) aborted" in d.log("sender")
    assert "receiver daemon stopping (SIGTERM): 1 partial result(s) delivered" in d.log("receiver")
    assert "Traceback" not in d.log("sender") + d.log("receiver")
    (line,) = d.stats_lines("sender")
    assert line["transfer_id"] == tid and line["finish_reason"] == "cancelled"
    lines = {x["transfer_id"]: x["reason"] for x in d.stats_lines("receiver")}
    assert lines == {tid: "abort", f"{helper.out.transfer_id:016x}": "shutdown"}


def test_a_card_submitted_with_a_deadline_goes_as_the_handoff_plan(daemons, tmp_path):
    """A sender daemon's submit plans a cache card as kvtransport.send does: for a racing
    receiver (its speed given) the context's front is not sent and blocks go at the plan's
    precisions; with precision "keep" the card goes as it is (every range, fp32)."""
    from kvtransport.kvformat import blocks, card
    from kvtransport.kvformat.kvcache import KVCache
    from kvtransport.model import encoding
    from kvtransport.model.cache_builder import ComputeSpeed

    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((30, 3, 256, 64), dtype=np.float32) for _ in range(2))
    path = card.write_card(
        tmp_path / "c.card", encoding.encode_cache(KVCache(k, v, np.arange(256), "m"))
    )
    speed = ComputeSpeed(per_call_s=0.02, per_token_s=0.003)
    sent = {}
    for precision in ("auto", "keep"):
        tid = daemons.sender.submit(str(path), daemons.to(), deadline_ms=400, precision=precision,
                                    receiver_speed=speed)  # fmt: skip
        res = daemons.sub.wait_for(tid, timeout_s=20)
        sent[precision] = blocks.Manifest.from_bytes(res.app_metadata)
    planned, kept = sent["auto"], sent["keep"]
    assert planned.token_block.min() > 0 and kept.token_block.min() == 0
    names = {blocks.PRECISIONS[int(p)] for p in np.unique(planned.precision)}
    assert names <= {"fp16", "int8", "int4"} and "int8" in names
    assert {blocks.PRECISIONS[int(p)] for p in np.unique(kept.precision)} == {"fp32"}
