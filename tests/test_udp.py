"""The socket layer (GSO/GRO, errors) and one transfer over real loopback UDP with the
`kvtransport send` / `kvtransport recv` commands."""

import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvtransport.cli import main
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.daemons.api import read_result_file
from kvtransport.daemons.udp import DatagramSocket, parse_address
from kvtransport.errors import UserError
from kvtransport.kvformat import card
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import encoding

CLI = [sys.executable, "-m", "kvtransport"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recv_all(sock, n, timeout=2.0):
    """Up to n datagrams as (bytes, address); each read's layout (where each datagram lies
    in the socket's buffer, ReceivedBatch) must name exactly its datagram's bytes."""
    got = []
    end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        batch = sock.recv_batch()
        assert len(batch.starts) == len(batch.ends) == len(batch)
        for (d, _), a, b in zip(batch, batch.starts, batch.ends, strict=True):
            assert batch.buf[a:b].tobytes() == bytes(d)
        got += [(bytes(d), a) for d, a in batch]
        time.sleep(0.001)
    return got


# ---------------------------------------------------------------------------- sockets


@pytest.mark.parametrize("gro", [True, False])
def test_gso_batches_arrive_as_the_same_datagrams_in_order(gro):
    with DatagramSocket(("127.0.0.1", 0), gro=gro) as rx:
        with DatagramSocket(("127.0.0.1", 0), rx.address) as tx:
            rng = np.random.default_rng(0)
            # 150 full-size datagrams (more than one GSO batch), a shorter last one, then
            # sizes that must not be glued into a batch
            sizes = [1324] * 150 + [700, 60, 1324, 1324, 1]
            sent = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
            assert tx.send(sent) == len(sent)
            got = _recv_all(rx, len(sent))
            src = tx.address
    assert [d for d, _ in got] == sent
    assert {a for _, a in got} == {src}
    assert tx.stats["gso_batches"] >= 3  # 150 datagrams need at least three batches
    assert tx.stats["send_calls"] < len(sent) / 10
    assert tx.stats["datagrams_sent"] == len(sent)
    if gro:
        assert rx.stats["gro_batches"] >= 1
        assert rx.stats["recv_calls"] < len(sent)
    else:
        assert rx.stats["recv_calls"] == len(sent)


def test_unconnected_socket_sends_to_each_destination():
    with (
        DatagramSocket(("127.0.0.1", 0)) as a,
        DatagramSocket(("127.0.0.1", 0)) as b,
        DatagramSocket(("127.0.0.1", 0)) as tx,
    ):
        tx.send([b"to-a"] * 5, a.address)
        tx.send([b"to-b"] * 3, b.address)
        assert [d for d, _ in _recv_all(a, 5)] == [b"to-a"] * 5
        assert [d for d, _ in _recv_all(b, 3)] == [b"to-b"] * 3


def _to_a_dead_port() -> DatagramSocket:
    """A socket connected to a port nobody listens on (not its own: the port it was
    bound to may be the one just freed)."""
    while True:
        port = _free_port()
        tx = DatagramSocket(("127.0.0.1", 0), ("127.0.0.1", port))
        if tx.address[1] != port:
            return tx
        tx.close()


def test_refused_and_unreachable_are_counted_not_raised():
    with _to_a_dead_port() as tx:
        for _ in range(20):
            tx.send([b"x" * 100] * 3)
            tx.recv_batch()
            time.sleep(0.002)
        assert tx.stats["refused"] >= 1  # the ICMP port unreachable came back
        assert tx.stats["datagrams_sent"] >= 1
    with DatagramSocket(("127.0.0.1", 0)) as tx, DatagramSocket(("127.0.0.1", 0)) as rx:
        # a loopback-bound socket cannot reach another network (EINVAL): counted, and the
        # failure is not blamed on GSO, which keeps working towards a reachable peer
        assert tx.send([b"y" * 100] * 4, ("192.0.2.1", 9)) == 0
        assert tx.stats["send_errors"] >= 1 and tx.stats["gso_refused"] == 0
        assert tx.send([b"z" * 100] * 4, rx.address) == 4
        assert tx.stats["gso_batches"] == 1 and len(_recv_all(rx, 4)) == 4


def test_a_tiny_batch_buffer_still_reads_whole_datagrams():
    with DatagramSocket(("127.0.0.1", 0), gro=False, batch_bytes=1) as rx:
        # a tiny batch buffer still reads whole datagrams (it is at least 2 x 64 KiB)
        with DatagramSocket(("127.0.0.1", 0), rx.address, gso=False) as tx:
            tx.send([b"z" * 60000])
            got = _recv_all(rx, 1)
    assert len(got) == 1 and len(got[0][0]) == 60000 and rx.stats["truncated"] == 0


def test_address_parsing():
    assert parse_address(":9400") == ("0.0.0.0", 9400)
    assert parse_address("127.0.0.1:5") == ("127.0.0.1", 5)
    for bad in ("host:port", "1.2.3.4:70000", "no-such-host.invalid:1"):
        with pytest.raises(UserError):
            parse_address(bad)


# ---------------------------------------------------------------------------- send / recv


def _start_recv(*args):
    """`kvtransport recv` in its own process; returns once it listens."""
    rx = subprocess.Popen(
        [*CLI, "recv", "--listen", "127.0.0.1:0", "--json", "--timeout", "30", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = [rx.stderr.readline()]
    while "pre-shared key" in lines[-1]:  # a key file made on first use is logged first
        lines.append(rx.stderr.readline())
    line = lines[-1]
    assert "listening on" in line, "".join(lines) + rx.stderr.read()
    return rx, int(line.rsplit(":", 1)[1])


def _run_pair(recv_args, send_args, capsys, timeout=60):
    """recv in a subprocess, send in this process (the real CLI entry point)."""
    rx, port = _start_recv(*recv_args)
    try:
        assert main(["send", f"127.0.0.1:{port}", "--json", *send_args]) == 0
        out, err = rx.communicate(timeout=timeout)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert rx.returncode == 0, err
    return json.loads(capsys.readouterr().out), json.loads(out)


def test_send_recv_synthetic_transfer_is_byte_exact(tmp_path, capsys):
    key = tmp_path / "key"
    key.write_text("5e" * 16)
    key.chmod(0o600)
    sent_st, recv_st = _run_pair(
        ["--key-file", str(key), "--out", str(tmp_path)],
        [
            "--key-file",
            str(key),
            "--size-mb",
            "1.5",
            "--rate-mbps",
            "100",
            "--rho",
            "3",
            "--seed",
            "7",
        ],
        capsys,
    )
    assert recv_st["reason"] == "complete" and recv_st["utility"] == pytest.approx(1.0)
    assert sent_st["finish_reason"] in ("receiver done", "receiver finished")
    assert sent_st["feedback_received"] >= 1 and recv_st["dropped"] == 0
    res = read_result_file(recv_st["file"])
    expect = synthetic_transfer(1_500_000, 1_500_000 // 12_288, "zipf", seed=7)
    assert res.blocks.equals(expect.blocks)
    assert res.complete.all() and res.missing.size == 0
    assert np.array_equal(res.payload, expect.payload)


def test_send_card_arrives_as_a_readable_card(tmp_path, capsys):
    rng = np.random.default_rng(4)
    k = rng.standard_normal((4, 2, 96, 64)).astype(np.float16)
    v = rng.standard_normal((4, 2, 96, 64)).astype(np.float16)
    cache = KVCache(k, v, rng.integers(0, 1000, 96), "toy", rng.random((4, 96)).astype("f4"))
    path = tmp_path / "ctx.card"
    card.write_card(path, encoding.encode_cache(cache, created={"by": "test"}))
    out = tmp_path / "out"
    out.mkdir()
    _, recv_st = _run_pair(
        ["--out", str(out)],
        ["--card", str(path), "--rate-mbps", "50", "--deadline-ms", "400", "--precision", "keep"],
        capsys,
    )
    assert recv_st["reason"] == "complete"
    got = card.read_card(recv_st["file"])  # the result file is a cache card
    back = got.reassemble()
    assert np.array_equal(back.cache.keys, k) and np.array_equal(back.cache.values, v)
    assert np.array_equal(got.payload, card.read_card(path).payload)


def test_send_plans_a_card_for_its_deadline(tmp_path, capsys):
    """With a deadline the card crosses as the plan encodes it: prefix order, fp16 for the
    most useful blocks and int8 for the rest, within the bytes the deadline allows."""
    from kvtransport.kvformat import blocks

    rng = np.random.default_rng(5)
    k = rng.standard_normal((4, 2, 256, 64)).astype(np.float32)
    v = rng.standard_normal((4, 2, 256, 64)).astype(np.float32)
    cache = KVCache(k, v, rng.integers(0, 1000, 256), "toy", rng.random((4, 256)).astype("f4"))
    path = tmp_path / "ctx.card"
    card.write_card(path, encoding.encode_cache(cache, created={"by": "test"}))
    out = tmp_path / "out"
    out.mkdir()
    # 1 MiB fp32, 0.5 MiB fp16, 0.27 MiB int8: 1 s at 5 Mbit/s fits a mix. The plan
    # fills its budget, so the loss it is told of (none happens on loopback) leaves the
    # sender room for an RTT inflated by a busy host (it stops half an RTT early) and for
    # a stall (150 ms; 30 ms when the same bytes had 200 ms at 25 Mbit/s)
    _, recv_st = _run_pair(
        ["--out", str(out)],
        ["--card", str(path), "--rate-mbps", "5", "--deadline-ms", "1000",
         "--loss-estimate", "0.15"],
        capsys,
    )  # fmt: skip
    assert recv_st["reason"] == "complete"
    got = card.read_card(recv_st["file"])
    m = got.manifest
    names = {blocks.PRECISIONS[p] for p in m.precision.tolist()}
    assert names == {"fp16", "int8"}
    assert np.all(np.diff(m.token_block.astype(int)) >= 0)  # token ranges front first
    fp16 = m.precision == blocks.PRECISIONS.index("fp16")
    assert m.utility[fp16].min() >= m.utility[~fp16].max()  # fp16 for the most useful
    back = got.reassemble().cache
    assert np.abs(back.keys - k).max() < 0.05 and np.abs(back.values - v).max() < 0.05


def test_send_picks_the_policy_for_a_planned_card_over_a_long_link(tmp_path, capsys):
    """Told no --policy, a planned card (whole token ranges) over a long --initial-rtt-ms
    goes with the heuristic, the same card kept as it is (utility order) with the default
    (kvtransport.hosts.policy_choice.default_policy_for)."""
    from kvtransport.hosts.policy_choice import LONG_LINK_HANDOFF_POLICY, LONG_LINK_ONE_WAY_S
    from kvtransport.policies.registry import default_policy

    rng = np.random.default_rng(6)
    k = rng.standard_normal((4, 2, 128, 64)).astype(np.float16)
    cache = KVCache(
        k, k.copy(), rng.integers(0, 1000, 128), "toy", rng.random((4, 128)).astype("f4")
    )
    path = tmp_path / "ctx.card"
    card.write_card(path, encoding.encode_cache(cache))
    rtt = ["--initial-rtt-ms", f"{2e3 * LONG_LINK_ONE_WAY_S:g}"]
    send = ["--card", str(path), "--rate-mbps", "50", "--deadline-ms", "400", *rtt]
    planned, _ = _run_pair(["--out", str(tmp_path)], send, capsys)
    kept, _ = _run_pair(["--out", str(tmp_path)], [*send, "--precision", "keep"], capsys)
    assert planned["policy"] == LONG_LINK_HANDOFF_POLICY
    assert kept["policy"] == default_policy()


def test_recv_exit_status_tells_partial_from_complete(capsys):
    """0 for a complete transfer (the tests above), 3 when blocks missed the deadline, on
    both ends (send's as its receiver reported)."""
    rx, port = _start_recv()
    try:
        # a fifth of the bytes fits the deadline, with room for a stall of the sender
        send = ["--size-mb", "2", "--rate-mbps", "4", "--deadline-ms", "750", "--json"]
        assert main(["send", f"127.0.0.1:{port}", *send]) == 3
        out, err = rx.communicate(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    st = json.loads(out)
    assert st["manifest"] and 0 < st["blocks_complete"] < st["blocks"], st
    assert rx.returncode == 3, err


def test_recv_exit_status_without_a_manifest_is_nothing_usable():
    from kvtransport.commands.recv import EXIT_NOTHING, exit_status
    from kvtransport.daemons.api import DeliveredResult

    nothing = DeliveredResult(1, 0.0, "idle", None, np.zeros(0, bool), np.zeros(0, np.int64),
                              np.zeros(0, np.uint8), None)  # fmt: skip
    assert exit_status(nothing) == EXIT_NOTHING != 0


def test_send_and_recv_refuse_bad_arguments_in_one_line(tmp_path, capsys):
    port = f"127.0.0.1:{_free_port()}"
    for args, msg in (
        (["send", port, "--rate-mbps", "0"], "--rate-mbps"),
        (["send", port, "--policy", "nope"], "unknown policy"),
        (["send", port, "--key", "zz"], "--key"),
        (["send", "not-an-address", "--size-mb", "1"], "not HOST:PORT"),
        (["send", port, "--card", str(tmp_path / "missing.card")], "no such file"),
        (["recv", "--listen", port, "--out", str(tmp_path / "nodir")], "not a directory"),
        (["recv", "--listen", port, "--timeout", "0.2"], "no transfer arrived"),
    ):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert msg in err[-1] and "Traceback" not in "".join(err), (args, err)


class _TamperingProxy:
    """A man in the middle on loopback: every datagram, either way, is preceded by a copy
    with one random bit flipped; everything that crosses is recorded."""

    def __init__(self, rx_port, seed=3):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.rx = ("127.0.0.1", rx_port)
        self.sender = None
        self.rng = np.random.default_rng(seed)
        self.wire = []
        self.tampered = {"to_receiver": 0, "to_sender": 0}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            if addr == self.rx:
                dest, way = self.sender, "to_sender"
            else:
                self.sender, dest, way = addr, self.rx, "to_receiver"
            if dest is None:
                continue
            bad = bytearray(data)
            bit = int(self.rng.integers(0, 8 * len(bad)))
            bad[bit // 8] ^= 1 << (bit % 8)
            self.sock.sendto(bytes(bad), dest)
            self.sock.sendto(data, dest)
            self.tampered[way] += 1
            self.wire.append(data)

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_default_setup_survives_a_tampering_man_in_the_middle_and_hides_the_payload(
    tmp_path, capsys
):
    """No key options at all (the default key file on both ends): a tampered copy ahead of
    every datagram both ways; the transfer is byte-exact, every tampered copy is dropped,
    and no 24-byte run of the payload is readable on the wire."""
    rx, port = _start_recv("--idle-timeout", "2", "--out", str(tmp_path))
    proxy = _TamperingProxy(port)
    try:
        args = ["send", f"127.0.0.1:{proxy.port}", "--json", "--size-mb", "0.5"]
        assert main([*args, "--rate-mbps", "50", "--rho", "4", "--seed", "11"]) == 0
        out, err = rx.communicate(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
        proxy.close()
    assert rx.returncode == 0, err
    sent_st, recv_st = json.loads(capsys.readouterr().out), json.loads(out)
    assert recv_st["reason"] == "complete" and recv_st["utility"] == pytest.approx(1.0)
    expect = synthetic_transfer(500_000, 500_000 // 12_288, "zipf", seed=11)
    assert recv_st["source_received"] == -(-500_000 // 1280)
    # every tampered copy that reached a session was dropped (none was accepted)
    assert recv_st["source_received"] - 1 <= recv_st["dropped"] <= proxy.tampered["to_receiver"]
    res = read_result_file(recv_st["file"])
    assert res.complete.all() and np.array_equal(res.payload, expect.payload)
    # the sender: tampered feedback dropped, only genuine feedback counted
    assert 0 < sum(sent_st["drop_reasons"].values()) <= proxy.tampered["to_sender"]
    assert sent_st["feedback_received"] <= proxy.tampered["to_sender"]
    blob = b"".join(proxy.wire)
    rng = np.random.default_rng(0)
    payload = expect.payload.tobytes()
    for esi in rng.integers(0, len(payload) // 1280, 300):
        off = int(esi) * 1280 + int(rng.integers(0, 1280 - 24))
        assert payload[off : off + 24] not in blob
