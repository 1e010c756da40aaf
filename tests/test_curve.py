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
from kvtransport.daemons.curve import client_keys, server_keys, server_public_key
from kvtransport.daemons.udp import clock
from kvtransport.embed.client import ReceiverClient, ResultSubscriber
from kvtransport.errors import UserError

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "tcp://127.evil.example:5555",
     "tcp://localhost.evil.example:5555", "tcp://[::]:5555"],
)  # fmt: skip
def test_tcp_needs_curve(endpoint):
    with pytest.raises(UserError, match="needs CURVE with a client allowlist"):
        check_endpoint(endpoint, "control")
    assert check_endpoint(endpoint, "control", curve=True) == endpoint


def test_loopback_tcp_needs_curve_too():
    """Every local user can connect to a loopback port (issue 44, row 3)."""
    for ep in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://localhost:5555"):
        with pytest.raises(UserError, match="needs CURVE"):
            check_endpoint(ep)


def test_the_cli_refuses_a_public_control_endpoint_in_one_line():
    p = subprocess.run(
        [*CLI, "sender-daemon", "--control", "tcp://127.0.0.1:5555", "--insecure"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "needs CURVE" in p.stderr.strip().splitlines()[-1], p.stderr


def test_curve_without_a_client_allowlist_is_refused_at_start(tmp_path):
    p = subprocess.run(
        [*CLI, "sender-daemon", "--control", "tcp://127.0.0.1:5555", "--insecure",
         "--curve-secret", str(tmp_path / "curve.key")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "curve.key.clients" in last and "allowed clients" in last, p.stderr


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


def test_only_listed_clients_holding_the_daemons_public_key_get_in(tmp_path):
    key = tmp_path / "curve.key"
    server_keys(key)  # the daemon's pair, made ahead so the test knows FILE.pub
    me, stranger = tmp_path / "me.key", tmp_path / "stranger.key"
    client_keys(me)
    client_keys(stranger)
    (tmp_path / "curve.key.clients").write_text(
        "# allowed\n" + (tmp_path / "me.key.pub").read_text()
    )
    ctl, pub = _free_tcp_port(), _free_tcp_port()
    err = open(tmp_path / "rx.err", "w")  # noqa: SIM115
    rx = subprocess.Popen(
        [*CLI, "receiver-daemon", "--listen", "127.0.0.1:0", "--control", f"tcp://0.0.0.0:{ctl}",
         "--publish", f"tcp://0.0.0.0:{pub}", "--curve-secret", str(key)],
        stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    pub_key = f"{key}.pub"
    ctl_ep, pub_ep = f"tcp://127.0.0.1:{ctl}", f"tcp://127.0.0.1:{pub}"
    clients = []
    try:
        good = ReceiverClient(ctl_ep, timeout_s=120, curve_server_key=pub_key,
                              curve_client_key=str(me))  # fmt: skip
        clients.append(good)
        info = good.ping()
        port = int(info["udp"].rsplit(":", 1)[1])
        # an unlisted client key, a throwaway key, another daemon's key: no answer
        other, _ = zmq.curve_keypair()
        for k, ck in ((pub_key, str(stranger)), (pub_key, None), (other, str(me))):
            bad = ReceiverClient(ctl_ep, timeout_s=1.0, curve_server_key=k, curve_client_key=ck)
            clients.append(bad)
            with pytest.raises(ApiError, match="no answer"):
                bad.ping()
        # results: published to the listed subscriber only
        sub = ResultSubscriber(pub_ep, curve_server_key=pub_key, curve_client_key=str(me))
        nosub = ResultSubscriber(pub_ep, curve_server_key=pub_key, curve_client_key=str(stranger))
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
    text = (tmp_path / "rx.err").read_text()
    assert rx.returncode == 0, text
    assert "not in the allowlist" in text
    assert server_public_key(pub_key).decode() not in text  # the key is not logged
