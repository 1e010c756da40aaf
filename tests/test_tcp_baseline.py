"""The TCP baseline without namespaces: block-completion accounting (BlockClock), and the
receiver and sender over real loopback TCP sockets, in-process and as the command line
that kvtransport.demo.demo_netns starts in the testbed's namespaces."""

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvtransport.core.transfer import BlockTable, synthetic_transfer
from kvtransport.demo.tcp_baseline import (
    BlockClock,
    Receipt,
    receive,
    send,
    stream_header,
    write_stream,
)

CLI = [sys.executable, "-m", "kvtransport.demo.tcp_baseline"]


def table(offsets, lengths):
    n = len(offsets)
    return BlockTable(np.array(offsets), np.array(lengths), np.full(n, 1.0 / n))


def test_block_clock_records_when_each_block_became_complete():
    # blocks [0,10) [10,30) [35,40) [40,41): a gap before the third
    clock = BlockClock(table([0, 10, 35, 40], [10, 20, 5, 1]))
    assert clock.advance(9, 0.1) == 0  # one byte short of the first block
    assert clock.advance(10, 0.2) == 1  # its last byte exactly
    assert clock.advance(34, 0.3) == 1  # the second ends at 30; the gap is no block
    assert clock.advance(34, 0.35) == 0
    assert clock.advance(41, 0.4) == 2  # one read completes the last two
    np.testing.assert_array_equal(clock.arrival_s, [0.2, 0.3, 0.4, 0.4])
    assert clock.complete.all()


def test_block_clock_leaves_unfinished_blocks_at_inf_and_rejects_going_back():
    clock = BlockClock(table([0, 10, 20], [10, 10, 10]))
    clock.advance(25, 1.5)
    np.testing.assert_array_equal(clock.arrival_s, [1.5, 1.5, np.inf])
    np.testing.assert_array_equal(clock.complete, [True, True, False])
    with pytest.raises(ValueError, match="went back"):
        clock.advance(24, 1.6)


def listener():
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    return ls


def receive_in_thread(ls, deadline_s, accept_timeout_s=10.0):
    out: dict[str, Receipt] = {}
    th = threading.Thread(
        target=lambda: out.update(r=receive(ls, deadline_s, accept_timeout_s)), daemon=True
    )
    th.start()
    return th, out


def test_loopback_transfer_arrives_byte_identical_with_times_in_stream_order():
    tr = synthetic_transfer(3_000_000, 40, "zipf", seed=4, app_metadata=b"blocks manifest")
    with listener() as ls:
        th, out = receive_in_thread(ls, deadline_s=30.0)
        sent = send(ls.getsockname(), [stream_header(tr), tr.payload], timeout_s=30)
        th.join(30)
    rec = out["r"]
    assert rec.reason == "complete" and sent["reason"] == "complete"
    assert rec.manifest.blocks.equals(tr.blocks)
    assert rec.manifest.app_metadata == b"blocks manifest"
    np.testing.assert_array_equal(rec.payload, tr.payload)
    assert rec.complete.all()
    assert np.all(np.diff(rec.arrival_s) >= 0)
    assert 0 <= rec.arrival_s[0] and rec.arrival_s[-1] <= rec.timings["finished_s"]
    assert sent["bytes_written"] == len(stream_header(tr)) + tr.nbytes
    if sent["tcp"]:  # Linux: the kernel acknowledged every byte (plus SYN and FIN)
        assert sent["tcp"]["bytes_acked"] == sent["bytes_written"] + 2


def test_deadline_cuts_the_connection_and_keeps_only_whole_blocks():
    tr = synthetic_transfer(400_000, 16, "linear", seed=2)
    head = stream_header(tr)
    cut = 130_000  # inside block 5 (blocks of 25,000 bytes): blocks 0-4 are whole
    deadline_s = 0.4
    with listener() as ls:
        th, out = receive_in_thread(ls, deadline_s)
        with socket.create_connection(ls.getsockname()) as s:
            s.sendall(head + tr.payload[:cut].tobytes())
            th.join(10)  # the sender stalls; the receiver gives up at its deadline
            with pytest.raises(ConnectionError):  # and reset the connection
                s.settimeout(5)
                s.recv(1)
                s.sendall(b"x" * 100_000)
    rec = out["r"]
    assert rec.reason == "deadline"
    ends = tr.blocks.offsets + tr.blocks.lengths
    np.testing.assert_array_equal(rec.complete, ends <= cut)
    assert rec.complete.sum() == 5
    np.testing.assert_array_equal(rec.payload[:cut], tr.payload[:cut])
    assert np.all(rec.arrival_s[:5] < deadline_s)
    assert deadline_s <= rec.timings["finished_s"] < deadline_s + 1.0


def test_early_close_is_fin_and_garbage_is_abort_and_silence_is_idle():
    tr = synthetic_transfer(50_000, 5, "flat", seed=1)
    with listener() as ls:
        th, out = receive_in_thread(ls, 10.0)
        with socket.create_connection(ls.getsockname()) as s:
            s.sendall(stream_header(tr) + tr.payload[:25_000].tobytes())
        th.join(10)
        assert out["r"].reason == "fin"
        np.testing.assert_array_equal(out["r"].complete, [1, 1, 0, 0, 0])

        th, out = receive_in_thread(ls, 10.0)
        with socket.create_connection(ls.getsockname()) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            th.join(10)
        assert out["r"].reason == "abort" and "magic" in out["r"].error
        assert out["r"].manifest is None and len(out["r"].arrival_s) == 0

        rec = receive(ls, 1.0, accept_timeout_s=0.2)
        assert rec.reason == "idle" and rec.bytes_received == 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_line_pair_over_loopback(tmp_path):
    tr = synthetic_transfer(500_000, 10, "zipf", seed=7, app_metadata=b"meta")
    stream = tmp_path / "stream.bin"
    assert write_stream(stream, tr) == stream.stat().st_size
    addr = f"127.0.0.1:{free_port()}"
    rx = subprocess.Popen(
        [*CLI, "recv", addr, "--deadline-s", "30", "--out", str(tmp_path / "rx")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert rx.stdout.readline().strip() == "ready"
        tx = subprocess.run([*CLI, "send", addr, str(stream)], capture_output=True, text=True)
        rx_out, _ = rx.communicate(timeout=30)
    finally:
        if rx.poll() is None:
            rx.kill()
    assert tx.returncode == 0, tx.stderr
    sent = json.loads(tx.stdout)
    assert sent["reason"] == "complete" and sent["bytes_written"] == stream.stat().st_size
    summary = json.loads((tmp_path / "rx" / "result.json").read_text())
    assert summary == json.loads(rx_out.strip().splitlines()[-1])
    assert summary["reason"] == "complete" and summary["blocks_complete"] == 10
    payload = np.fromfile(tmp_path / "rx" / "payload.bin", dtype=np.uint8)
    np.testing.assert_array_equal(payload, tr.payload)
    assert (tmp_path / "rx" / "manifest.bin").read_bytes() == stream_header(tr)[8:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["send", "nowhere", "x.bin"], "is not HOST:PORT"),
        (["send", "127.0.0.1:9", "/nonexistent/stream.bin"], "cannot read"),
        (["recv", "127.0.0.1:0", "--deadline-s", "0", "--out", "OUT"], "--deadline-s must be"),
        (["recv", "127.0.0.1:0", "--out", "OUT"], "--deadline-s"),
    ],
)
def test_command_line_errors_are_one_line(tmp_path, args, message):
    args = [str(tmp_path / "o") if a == "OUT" else a for a in args]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_command_line_help():
    proc = subprocess.run([*CLI, "recv", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--deadline-s" in proc.stdout


def test_send_reports_a_receiver_that_cuts_it_short():
    # a stream far larger than the socket buffers; the receiver resets after its deadline
    tr = synthetic_transfer(200_000_000, 8, "flat", seed=0)
    with listener() as ls:
        conn_ready = threading.Event()

        def cut_after_first_bytes():
            conn, _ = ls.accept()
            conn_ready.set()
            conn.recv(1)
            time.sleep(0.2)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

        th = threading.Thread(target=cut_after_first_bytes, daemon=True)
        th.start()
        sent = send(ls.getsockname(), [stream_header(tr), tr.payload], timeout_s=30)
        th.join(10)
    assert sent["reason"] == "reset"
    assert 0 < sent["bytes_written"] < tr.nbytes
