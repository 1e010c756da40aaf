"""Transfers bound to their peers (issue 44, item 3): with static X25519 identities a
transfer's keys mix the sender-receiver Diffie-Hellman (and the pre-shared key) and bind
both public keys, so a capture of a transfer to receiver A opens nothing at receiver B
holding the same pre-shared key, and a sender not on a receiver's allowlist opens no
session. Real `kvtransport send`/`recv` over loopback UDP, a relay that records what the
sender sent, and replays from a socket of the test's own."""

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from procs import finish

from kvtransport.cli import main
from kvtransport.core import keys
from kvtransport.core.manifest_fec import ManifestSender
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import BlockTable, TransportManifest, synthetic_transfer
from kvtransport.core.wire import PeerKeys, pairwise, transfer_key
from kvtransport.daemons.api import read_result_file
from kvtransport.daemons.daemon import warm_up
from kvtransport.policies.registry import make_policy

CLI = [sys.executable, "-m", "kvtransport"]
SIZE = 300_000
BLOCKS = 24
SEED = 5


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Every kernel loaded (or compiled into the on-disk cache) in this process before a
    receiver starts: a receiver's short --timeout then starts with the sender ready."""
    warm_up(bytes(32))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Identities made by `kvtransport keygen` (a sender, an intruder, receivers A and B)
    and one pre-shared key file every host holds (the README's old advice)."""
    d = tmp_path_factory.mktemp("peers")
    for name in ("tx", "intruder", "rx_a", "rx_b"):
        assert main(["keygen", "--identity", str(d / name)]) == 0
        assert os.stat(d / name).st_mode & 0o777 == 0o600
    psk = d / "psk"
    psk.write_text("5e" * 32)
    psk.chmod(0o600)
    return d


def _recv(d, identity, *extra, timeout="30", allow="tx"):
    """`kvtransport recv` as ``identity`` allowing ``allow``'s public key (the sender's);
    returns (process, port) once it listens."""
    rx = subprocess.Popen(
        [*CLI, "recv", "--listen", "127.0.0.1:0", "--json", "--timeout", timeout,
         "--idle-timeout", "1", "--key-file", str(d / "psk"), "--identity", str(d / identity),
         "--allow-pub", str(d / f"{allow}.pub"), "--replay-file", str(d / f"replay-{identity}"),
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = rx.stderr.readline()
    while line and "listening on" not in line:  # a kernel compile is announced first
        line = rx.stderr.readline()
    assert "listening on" in line, line + rx.stderr.read()
    return rx, int(line.rsplit(":", 1)[1])


class Relay:
    """A UDP relay on loopback: forwards what the sender sends to the receiver (recording
    it: the attacker's passive capture) and the receiver's answers back."""

    def __init__(self, to_port: int) -> None:
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.back.connect(("127.0.0.1", to_port))
        self.port = self.front.getsockname()[1]
        self.captured: list[bytes] = []
        self._sender = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.front, self.back], [], [], 0.05)
            for s in ready:
                try:
                    data, addr = s.recvfrom(65536)
                except ConnectionRefusedError:  # the receiver gone: nothing to relay
                    continue
                if s is self.front:
                    self._sender = addr
                    self.captured.append(data)
                    with contextlib.suppress(OSError):  # the receiver gone: ICMP refused
                        self.back.send(data)
                elif self._sender is not None:
                    self.front.sendto(data, self._sender)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.front.close()
        self.back.close()


@pytest.fixture(scope="module")
def delivered(hosts, tmp_path_factory):
    """A transfer from the sender's identity to receiver A's, through the relay: what each
    end reported, A's result file and the relay's capture."""
    d = hosts
    out = tmp_path_factory.mktemp("out")
    rx, port = _recv(d, "rx_a", "--out", str(out))
    relay = Relay(port)
    try:
        send = subprocess.run(
            [*CLI, "send", f"127.0.0.1:{relay.port}", "--json", "--key-file", str(d / "psk"),
             "--identity", str(d / "tx"), "--peer-pub", str(d / "rx_a.pub"), "--size-mb",
             str(SIZE / 1e6), "--blocks", str(BLOCKS), "--seed", str(SEED), "--deadline-ms",
             "5000"],  # a deadline no busy CI host misses: the binding is what is tested
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        code, rx_out, rx_err = finish(rx)
    finally:
        relay.close()
    return send, (code, rx_out, rx_err), relay.captured


def test_a_transfer_between_identities_arrives_byte_exact(delivered):
    send, (code, rx_out, rx_err), captured = delivered
    assert send.returncode == 0, send.stderr
    assert code == 0, rx_err
    st = json.loads(rx_out)
    assert st["reason"] == "complete" and st["dropped"] == 0
    assert 1 <= st["peer_tries"] <= 1 + 2  # one allowed sender: one try per new transfer
    res = read_result_file(st["file"])
    expect = synthetic_transfer(SIZE, BLOCKS, "zipf", seed=SEED)
    assert res.complete.all() and np.array_equal(res.payload, expect.payload)
    assert json.loads(send.stdout)["delivered"] == "complete" and captured


def _replay(port: int, datagrams: list[bytes]) -> int:
    """Send ``datagrams`` to ``port`` from a socket of our own; the bytes answered."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.5)
    try:
        for i, d in enumerate(datagrams):
            s.sendto(d, ("127.0.0.1", port))
            if i % 64 == 63:
                threading.Event().wait(0.002)  # stay under the receiver's socket buffer
        answered = 0
        while True:
            try:
                answered += len(s.recv(65536))
            except TimeoutError:
                return answered
    finally:
        s.close()


def _refused_all(code: int, err: str, n: int) -> None:
    """recv got nothing it could open: no transfer, each datagram counted as failing
    authentication (the note on its last line)."""
    last = err.strip().splitlines()[-1]
    assert code == 2 and "no transfer arrived" in last, err
    assert f"{n} datagrams failed authentication" in last, last
    assert "--allow-pub" in last and "--peer-pub" in last, last  # what identities check


@pytest.mark.parametrize(
    "identity, allow",
    [("rx_b", "tx"), ("tx", "rx_a")],
    ids=["another-receiver", "reflected-to-the-sender"],
)
def test_a_capture_replayed_to_another_receiver_with_the_same_psk_opens_nothing(
    hosts, delivered, identity, allow
):
    """Receiver B holds the same pre-shared key and allows the same sender, but is not the
    receiver the transfer was bound to: every captured datagram fails its tag there. The
    same holds reflected: a receiver run with the sender's own identity that allows A (the
    Diffie-Hellman alone is the same both ways; the binding orders sender and receiver)."""
    captured = delivered[2]
    rx, port = _recv(hosts, identity, timeout="4", allow=allow)
    answered = _replay(port, captured)
    code, _, err = finish(rx)
    assert answered == 0
    _refused_all(code, err, len(captured))


def _forged_capture(sender: X25519PrivateKey, claimed_pub: bytes, rx_pub: bytes, psk: bytes):
    """The first datagrams of a transfer sealed to the receiver as ``sender`` derives its
    pairwise secret, its binding claiming ``claimed_pub`` as the sender's public key."""
    pair = pairwise(sender, rx_pub, sending=True, psk=psk)
    forged = pair._replace(binding=claimed_pub + rx_pub)
    s = SenderSession(synthetic_transfer(100_000, 8, seed=3), make_policy("none"),
                      rate_bps=1e9, deadline=1.0, key=PeerKeys([forged]))  # fmt: skip
    out: list[bytes] = []
    while len(out) < 40 and (t := s.next_timer()) is not None:
        out += s.datagrams_to_send(t)
    return out[:40]


def test_a_sender_not_on_the_allowlist_opens_no_session(hosts, capsys):
    """The intruder holds the pre-shared key and its own identity: its `send` gets no
    answer, and the receiver counts every datagram as failing authentication. Claiming the
    allowed sender's public key does not help: the Diffie-Hellman needs its private key."""
    d = hosts
    rx, port = _recv(d, "rx_a", timeout="6")
    try:
        args = ["send", f"127.0.0.1:{port}", "--json", "--key-file", str(d / "psk"),
                "--identity", str(d / "intruder"), "--peer-pub", str(d / "rx_a.pub"),
                "--size-mb", "0.05", "--rate-mbps", "50", "--deadline-ms", "300"]  # fmt: skip
        assert main(args) == 4  # nothing: no feedback at all
        sent = json.loads(capsys.readouterr().out)
        assert sent["feedback_received"] == 0
        own = keys.read_identity(d / "intruder")
        forged = _forged_capture(
            own, keys.read_public(d / "tx.pub"), keys.read_public(d / "rx_a.pub"),
            keys.read_key_file(d / "psk"),
        )  # fmt: skip
        assert _replay(port, forged) == 0
    finally:
        code, _, err = finish(rx)
    _refused_all(code, err, sent["datagrams_sent"] + len(forged))


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_bad_identity_and_public_key_files_are_one_line_errors(hosts, tmp_path, capsys):
    d = hosts
    psk = ["--key-file", str(d / "psk")]
    send = ["send", "127.0.0.1:9", *psk, "--identity", str(d / "tx")]
    recv = ["recv", "--listen", "127.0.0.1:0", *psk, "--identity", str(d / "rx_a")]
    (tmp_path / "typo.pub").write_text("not a key\n")
    (tmp_path / "short.pub").write_text("ab" * 31)
    (tmp_path / "zero.pub").write_text("00" * 32)  # a low-order point: no shared secret
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "fifo.pub")
    open_id = tmp_path / "open.id"
    open_id.write_text((d / "tx").read_text())
    open_id.chmod(0o644)
    cases = [
        ([*send, "--peer-pub", str(tmp_path / "typo.pub")], "is not 32 bytes in hex"),
        ([*send, "--peer-pub", str(tmp_path / "short.pub")], "is not 32 bytes in hex"),
        ([*send, "--peer-pub", str(tmp_path / "zero.pub")], "not a usable X25519"),
        ([*send, "--peer-pub", str(tmp_path / "fifo.pub")], "not a regular file but a FIFO"),
        ([*send, "--peer-pub", str(tmp_path / "missing.pub")], "cannot read public key file"),
        ([*recv, "--allow-pub", str(tmp_path / "empty")], "without *.pub files"),
        (
            [
                "send",
                "127.0.0.1:9",
                *psk,
                "--identity",
                str(open_id),
                "--peer-pub",
                str(d / "rx_a.pub"),
            ],
            "accessible by other users",
        ),  # fmt: skip
        (
            [
                "send",
                "127.0.0.1:9",
                *psk,
                "--identity",
                str(d / "tx.pub"),
                "--peer-pub",
                str(d / "rx_a.pub"),
            ],
            "accessible by other users",
        ),  # fmt: skip
        ([*send], "--identity needs the peer's public key"),
        ([*send, "--peer-pub", str(d / "rx_a.pub"), "--insecure"], "--insecure runs without"),
        (["keygen", "--identity", str(d / "tx")], "not replaced"),
    ]
    for argv, want in cases:
        assert main(argv) == 2, argv
        line = _err_line(capsys)
        assert want in line, (argv, line)
    # the default identity file, missing: says how to make one
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"))
    out = subprocess.run([*CLI, "send", "127.0.0.1:9", *psk, "--peer-pub", str(d / "rx_a.pub")],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and "kvtransport keygen" in last and "Traceback" not in out.stderr


def test_psk_only_transfer_keys_are_unchanged():
    """Without identities the derivation is the pre-shared key's as before (empty binding):
    a fixed vector, so PSK-only peers of earlier versions interoperate."""
    assert transfer_key(bytes(32), 5).hex()[:16] == "ba448d6a1684d51f"


def test_a_transfer_whose_binding_was_forgotten_is_not_answered_and_nothing_raises(
    monkeypatch,
):
    """More transfers bound than ``MAX_BOUND_TRANSFERS`` (here 2): a pending transfer's
    peer is forgotten while its context stays cached, so its probe cannot be sealed. The
    receiver host sends nothing for it and counts it (``peer_unsealable``), and raises
    nothing into its shell."""
    from kvtransport.core import wire
    from kvtransport.core.wire import DatagramType, Framer, Parser
    from kvtransport.hosts.receiver_host import PROBE_EVERY, ReceiverHost

    monkeypatch.setattr(wire, "MAX_BOUND_TRANSFERS", 2)
    rx, a, b = (X25519PrivateKey.generate() for _ in range(3))
    rx_pub = rx.public_key().public_bytes_raw()
    allowed = [pairwise(rx, s.public_key().public_bytes_raw(), sending=False) for s in (a, b)]
    host = ReceiverHost(key=PeerKeys(allowed))
    tx = PeerKeys([pairwise(a, rx_pub, sending=True)])

    framers: dict[int, Framer] = {}

    def source(tid: int, seq: int) -> bytes:
        f = framers.setdefault(tid, Framer(tid, tx, max_payload=64))
        f.payload_view(64)[:] = bytes(64)
        return f.finish(DatagramType.SOURCE, seq, 64, esi=seq)

    peer = ("127.0.0.1", 5000)
    for seq in range(PROBE_EVERY - 1):  # pending, bound to sender a
        host.receive_datagram(source(7, seq), peer, 0.0)
    for tid in (8, 9):  # two more bound: transfer 7's binding is forgotten
        host.receive_datagram(source(tid, 0), peer, 0.0)
    host.receive_datagram(source(7, PROBE_EVERY - 1), peer, 0.1)  # its probe is due
    assert host.datagrams_to_send(0.1) == []  # no probe went out (nor anything else)
    assert host.pending[7].probes == 0 and host.key.unsealable == 1
    stats = host.stats()
    assert stats["peer_unsealable"] == 1 and stats["peer_tries"] == host.key.tries > 0
    # its manifest: the session opens with the held datagrams, whose opening there binds
    # the peer again, so its feedback is sealed to sender a
    m = TransportManifest(
        symbol_size=64,
        payload_len=64 * 64,
        blocks=BlockTable(np.array([0]), np.array([64 * 64]), np.array([1.0])),
        deadline_s=30.0,
        sent_at=time.time(),
    )
    ms = ManifestSender(m.to_bytes(), 64)
    for seq in range(PROBE_EVERY, PROBE_EVERY + ms.m + 2):
        host.receive_datagram(ms.emit(framers[7], seq, 0), peer, 0.2)
    assert host.active[7].session.manifest is not None
    [(datagrams, to)] = host.datagrams_to_send(0.2)
    assert to == peer and Parser(tx).parse(datagrams[0]).type == DatagramType.FEEDBACK
