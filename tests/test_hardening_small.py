"""Issue 44, row 9's smaller items: bounded manifest and submit lengths, one-line errors
for bad host names and tcp:// ports, forged transfer ids that cannot evict a genuine
transfer's key, result files private to their owner, and a control socket drained
without the loop's idle sleep while requests wait."""

import logging
import struct
import zlib

import numpy as np
import pytest
import zmq

from kvtransport.cli import main
from kvtransport.core.transfer import (
    _CRC,
    _MANIFEST_FIXED,
    MANIFEST_MAGIC,
    MANIFEST_VERSION,
    BlockTable,
    TransferResult,
    TransportManifest,
)
from kvtransport.core.wire import (
    MAX_CACHED_KEYS,
    BadPayload,
    BadTag,
    DatagramType,
    Framer,
    LaidOutDatagrams,
    Parser,
)
from kvtransport.daemons import daemon
from kvtransport.daemons.api import ApiError, check_endpoint, transfer_from_frames
from kvtransport.daemons.udp import parse_address
from kvtransport.errors import UserError

KEY = bytes(range(32))
HUGE = (1 << 64) - 1


def _raw_manifest(offsets, lengths, payload_len):
    """A manifest's bytes as a forger writes them (no BlockTable checks on the way)."""
    n = len(offsets)
    table = zlib.compress(
        np.asarray(offsets, "<u8").tobytes()
        + np.asarray(lengths, "<u8").tobytes()
        + np.full(n, 1.0 / n, "<f8").tobytes()
    )
    head = _MANIFEST_FIXED.pack(
        MANIFEST_MAGIC, MANIFEST_VERSION, 0, 1024, payload_len, n, 1.0, 0.0, 0, len(table), 0
    )
    body = head + table
    return body + _CRC.pack(zlib.crc32(body))


def test_a_manifest_whose_lengths_wrap_a_u64_is_refused():
    """lengths [500, 2^64-1]: the end wraps to 499 and the table looked complete."""
    assert TransportManifest.from_bytes(_raw_manifest([0, 500], [500, 500], 1000)).payload_len
    with pytest.raises(BadPayload, match="at most"):
        TransportManifest.from_bytes(_raw_manifest([0, 500], [500, HUGE], 1000))
    with pytest.raises(BadPayload, match="at most"):
        TransportManifest.from_bytes(_raw_manifest([0, HUGE - 10], [500, 20], 1000))
    with pytest.raises(BadPayload, match="payload of"):
        TransportManifest.from_bytes(_raw_manifest([0], [500], HUGE))


def test_a_submit_whose_lengths_wrap_a_u64_is_a_one_line_error():
    payload = np.zeros(1000, np.uint8)
    frames = [
        payload.tobytes(),
        np.array([0, 500], "<u8").tobytes(),
        np.array([500, HUGE], "<u8").tobytes(),
        np.array([0.5, 0.5], "<f8").tobytes(),
    ]
    with pytest.raises(ApiError, match="bad block table: .*at most"):
        transfer_from_frames(frames)
    with pytest.raises(ValueError):
        BlockTable(np.array([0, 500]), np.array([500, HUGE], np.uint64), np.array([0.5, 0.5]))


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "a..b", ".", "x." * 130 + "y"])
def test_bad_host_names_are_one_line_errors(host):
    with pytest.raises(UserError, match="not a host name|cannot resolve"):
        parse_address(f"{host}:9400", what="receiver")


def test_bad_host_names_on_the_command_line_exit_2_without_a_traceback(capsys):
    for argv in (["send", "a" * 70 + ".example:9"], ["send", "a..b:9"],
                 ["recv", "--listen", ".:9400"]):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and "not a host name" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1", "x", "*", ""])
def test_tcp_ports_outside_1_to_65535_are_refused(port):
    """ZeroMQ binds 99999 as 34463 without a word."""
    with pytest.raises(UserError, match="1..65535"):
        check_endpoint(f"tcp://127.0.0.1:{port}", "control", curve=True)
    assert check_endpoint("tcp://127.0.0.1:65535", "control", curve=True)


def test_the_cli_refuses_a_tcp_port_beyond_65535_in_one_line(capsys):
    pkg = logging.getLogger("kvtransport")
    saved = (pkg.handlers[:], pkg.level, pkg.propagate)
    try:  # the daemon command sets up its log (on capsys's stderr) before it checks
        assert main(["sender-daemon", "--control", "tcp://127.0.0.1:99999"]) == 2
    finally:  # later tests in this process must not log into a closed capture
        pkg.handlers[:], pkg.level, pkg.propagate = saved
    assert "1..65535" in capsys.readouterr().err.strip().splitlines()[-1]


def _sources(framer, count, size=64):
    payload = np.arange(count * size, dtype=np.uint8)
    last = payload[(count - 1) * size :].copy()
    return framer.seal_sources(0, 0, count, payload, size, count - 1, last), payload


def test_forged_transfer_ids_do_not_evict_a_genuine_transfers_key():
    """A flood of datagrams under random transfer ids (each one a key derivation) leaves
    the genuine transfer's context cached: its run of sources still opens in one go
    (Parser.source_run takes nothing of a transfer whose context is not cached)."""
    rng = np.random.default_rng(0)
    framer = Framer(7, KEY)
    datagrams, payload = _sources(framer, 8)
    parser = Parser(KEY)
    parser.parse(datagrams[0])  # the transfer is seen: its context is cached
    for tid in rng.integers(8, 1 << 62, 2 * MAX_CACHED_KEYS):
        forged = bytearray(datagrams[1])
        forged[8:16] = int(tid).to_bytes(8, "big")
        with pytest.raises(BadTag):
            parser.parse(bytes(forged))
    out = memoryview(bytearray(8 * 64))
    run = LaidOutDatagrams.join(datagrams)
    assert parser.source_run(run, 1, 8, 7, 1, 1, 64, out) == 8
    assert bytes(out[64:]) == payload[64:].tobytes()
    plain = Parser(KEY)  # and a feedback of a transfer it never saw opens as before
    fb = Framer(9, KEY).build(DatagramType.FEEDBACK, 0, b"x")
    assert plain.parse(fb).transfer_id == 9


def test_result_files_are_private_to_their_owner(tmp_path):
    from kvtransport.daemons.api import write_result_file

    table = BlockTable(np.array([0]), np.array([8]), np.array([1.0]))
    m = TransportManifest(8, 8, table)
    res = TransferResult(5, m, np.arange(8, dtype=np.uint8), np.ones(1, bool),
                         np.zeros(0, np.int64), 1.0, "complete")  # fmt: skip
    path = write_result_file(tmp_path, res, {})
    assert path.stat().st_mode & 0o777 == 0o600


class _Idle:
    """An engine with nothing scheduled (the loop would sleep its longest)."""

    def next_wake(self):
        return None


def test_the_loop_does_not_sleep_while_control_requests_wait(tmp_path):
    """A drain answers at most 64 requests; the rest wait, and the control socket's
    edge-triggered descriptor will not wake the loop for them: it must not sleep."""
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/c.ipc"
    server = daemon.ControlServer(ctx, endpoint, {"ping": lambda head, frames: {}})
    client = ctx.socket(zmq.DEALER)
    client.connect(endpoint)
    try:
        for _ in range(200):
            client.send_multipart([b"", b'{"op": "ping"}'])
        answered = 0
        while answered < 200:
            if not server.pending():
                zmq.select([server.sock], [], [], 5.0)  # the first requests' arrival
                assert server.pending(), "the requests never arrived"
            assert daemon._sleep_s(_Idle(), [server]) == 0.0
            answered += server.drain()
        assert not server.pending()
        assert daemon._sleep_s(_Idle(), [server]) == daemon.MAX_IDLE_SLEEP_S
        replies = 0
        while client.poll(1000):
            client.recv_multipart()
            replies += 1
        assert replies == 200
    finally:
        client.close(0)
        server.close()
        ctx.term()


def test_struct_layout_the_forger_uses_is_the_manifests():
    assert _MANIFEST_FIXED.size == struct.calcsize("<4sHHIQIddIII")
