"""Control and result sockets off loopback: refused without ZeroMQ CURVE; with CURVE
(kvtransport.daemons.curve) a client holding the daemon's public key is served and one without it
is not. The receiver daemon runs as a real process on tcp:// (all interfaces)."""

import socket
import subprocess
import time

import pytest
import zmq
from test_daemon import CLI, SenderThread, assert_blocks_exact

from kvtransport.core.transfer import synthetic_transfer
from kvtransport.daemons.api import ApiError, check_endpoint
from kvtransport.daemons.curve import server_keys, server_public_key
from kvtransport.daemons.udp import clock
from kvtransport.embed.client import ReceiverClient, ResultSubscriber
from kvtransport.errors import UserError

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "tcp://127.evil.example:5555",
     "tcp://localhost.evil.example:5555", "tcp://[::]:5555"],
)  # fmt: skip
def test_tcp_off_loopback_needs_curve(endpoint):
    with pytest.raises(UserError, match="not on loopback and CURVE is not configured"):
        check_endpoint(endpoint, "control")
    assert check_endpoint(endpoint, "control", curve=True) == endpoint


def test_loopback_tcp_needs_no_curve():
    for ep in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://localhost:5555"):
        assert check_endpoint(ep) == ep


def test_the_cli_refuses_a_public_control_endpoint_in_one_line():
    p = subprocess.run(
        [*CLI, "sender-daemon", "--control", "tcp://0.0.0.0:5555", "--key", "a5" * 32],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "CURVE is not configured" in p.stderr


def test_key_files_are_made_private_and_checked(tmp_path):
    path = tmp_path / "d" / "curve.key"
    public, secret = server_keys(path)
    assert path.stat().st_mode & 0o777 == 0o600 and (tmp_path / "d").stat().st_mode & 0o777 == 0o700
    assert server_public_key(str(path) + ".pub") == public and server_keys(path) == (public, secret)
    assert server_public_key(public.decode()) == public
    path.chmod(0o644)
    with pytest.raises(UserError, match="accessible by other users"):
        server_keys(path)
    with pytest.raises(UserError, match="not a CURVE key"):
        server_public_key("not a key")


def _free_tcp_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_client_needs_the_daemons_public_key(tmp_path):
    key = tmp_path / "curve.key"
    ctl, pub = _free_tcp_port(), _free_tcp_port()
    err = open(tmp_path / "rx.err", "w")  # noqa: SIM115
    rx = subprocess.Popen(
        [*CLI, "receiver-daemon", "--listen", "127.0.0.1:0", "--control", f"tcp://0.0.0.0:{ctl}",
         "--publish", f"tcp://0.0.0.0:{pub}", "--curve-secret", str(key)],
        stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    pub_key = f"{key}.pub"
    clients = []
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "curve.key.pub").exists() and time.monotonic() < end:
            time.sleep(0.05)
        good = ReceiverClient(f"tcp://127.0.0.1:{ctl}", timeout_s=60, curve_server_key=pub_key)
        clients.append(good)
        info = good.ping()
        port = int(info["udp"].rsplit(":", 1)[1])
        # no key, or another daemon's key: the handshake never completes, no answer
        other, _ = zmq.curve_keypair()
        for k in (None, other):
            bad = ReceiverClient(f"tcp://127.0.0.1:{ctl}", timeout_s=1.0, curve_server_key=k)
            clients.append(bad)
            with pytest.raises(ApiError, match="no answer"):
                bad.ping()
        # results: published to the keyed subscriber only
        sub = ResultSubscriber(f"tcp://127.0.0.1:{pub}", curve_server_key=pub_key)
        nosub = ResultSubscriber(f"tcp://127.0.0.1:{pub}")
        clients += [sub, nosub]
        time.sleep(0.3)  # subscriptions reach the PUB socket
        tr = synthetic_transfer(200_000, 16, seed=51)
        # the transfer is only the vehicle of a result here: its deadline leaves room for a
        # descheduled test process (it completes in about 20 ms on an idle host)
        sender = SenderThread(tr, port, deadline_s=5.0)
        res = sub.wait_for(sender.out.transfer_id, timeout_s=15)
        sender.kill()
        assert res.reason == "complete", (res.stats, sender.engine.host.status(clock()))
        assert_blocks_exact(res, tr)
        assert nosub.recv(timeout_s=0.5) is None
        assert good.stats()["results"] == 1
    finally:
        for c in clients:
            c.close()
        rx.terminate()
        rx.wait(20)
        err.close()
    assert rx.returncode == 0, (tmp_path / "rx.err").read_text()
