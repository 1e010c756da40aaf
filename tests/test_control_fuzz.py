"""Hostile and careless control requests against both real daemons (real processes, real
ZeroMQ): every one gets a one-line ``ok: false`` answer, no daemon exits, and a submit
answered ``ok: false`` never runs (the sender's status lists exactly the accepted ones).

The suite sends the cases issue 12 lists plus a few thousand seeded mutations of a valid
submit (one or two fields replaced by hostile values), and the same against the
receiver's ops (``KVT_CONTROL_FUZZ=10000`` for the full-scale run).
"""

import json
import os
import random
import time

import pytest
import zmq
from test_daemon import Daemons

from kvtransport.daemons.api import ApiError
from kvtransport.daemons.daemon_sender import HISTORY

HOSTILE = [
    1e308, -1e308, -1, -0.5, 0, 1.5, 2**64, -(2**63), 10**400, "NaN", "Infinity", "-Infinity",
    "x", "", "0" * 5000, [], {}, [1, 2], {"a": 1}, True, False, "ff" * 20, "1e308",
]  # fmt: skip
"""Values no submit field accepts (a string here stands for itself, except NaN and the
infinities, which are written as JSON's non-standard literals)."""

FIELDS = ["to", "deadline_ms", "rho", "initial_rtt_ms", "weight", "transfer_id", "policy",
          "label", "utility", "model", "context_tokens"]  # fmt: skip


def _json(head):
    text = json.dumps(head)
    for lit in ("NaN", "Infinity", "-Infinity"):
        text = text.replace(f'"{lit}"', lit)
    return text.encode()


class _Daemons(Daemons):
    """test_daemon's daemons, waited for patiently (a loaded machine starts them slowly:
    each warms its numba kernels up before it answers)."""

    def __init__(self, directory):
        import test_daemon

        orig = test_daemon.ReceiverClient.ping, test_daemon.SenderClient.ping

        def patient(ping):
            def wait(client):
                end = time.monotonic() + 180
                while True:
                    try:
                        return ping(client)
                    except ApiError:
                        if time.monotonic() > end:
                            raise

            return wait

        test_daemon.ReceiverClient.ping = patient(orig[0])
        test_daemon.SenderClient.ping = patient(orig[1])
        try:
            super().__init__(
                directory,
                sender_args=["--policy", "fixed:1/4"],
                receiver_args=["--listen", "127.0.0.1:0"],
            )
        finally:
            test_daemon.ReceiverClient.ping, test_daemon.SenderClient.ping = orig


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    d = _Daemons(tmp_path_factory.mktemp("fuzz"))
    yield d
    d.stop()


def _asker(endpoint):
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)

    def ask(head, *frames):
        raw = head if isinstance(head, bytes) else _json(head)
        req.send_multipart([raw, *frames])
        reply = json.loads(req.recv_multipart()[0])
        assert isinstance(reply["ok"], bool)
        if not reply["ok"]:
            err = reply["error"]
            assert err and "\n" not in err and len(err) < 400, err
        return reply

    return req, ask


FRAMES = [b"\1" * 3000, (0).to_bytes(8, "little"), (3000).to_bytes(8, "little"),
          b"\0\0\0\0\0\0\xf0\x3f"]  # fmt: skip


def test_named_cases_are_refused_with_one_line_errors(daemons):
    req, ask = _asker(daemons.sender_ctl)
    base = {"op": "submit", "to": daemons.to(9), "deadline_ms": 50}
    try:
        for field, value in [
            ("deadline_ms", 1e308), ("deadline_ms", 1e306), ("deadline_ms", "NaN"),
            ("initial_rtt_ms", 1e308), ("initial_rtt_ms", -1), ("transfer_id", 1.5),
            ("transfer_id", True), ("weight", "Infinity"), ("utility", {"a": 1e308}),
        ]:  # fmt: skip
            r = ask({**base, field: value}, *FRAMES)
            assert r["ok"] is False, (field, value)
        r = ask({**{k: v for k, v in base.items() if k != "deadline_ms"}, "rho": 1e308}, *FRAMES)
        assert r["ok"] is False and "rho" in r["error"]
        deep = b'{"op": "submit", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert "header" in ask(deep)["error"]
        assert "header" in ask(b'{"op": "ping", "x": "' + b"a" * 100_000 + b'"}')["error"]
        # none of them runs
        assert daemons.sender.status() == []
    finally:
        req.close()
    assert daemons.tx.poll() is None and daemons.rx.poll() is None


def test_thousands_of_mutated_requests_never_kill_a_daemon(daemons):
    rng = random.Random(12)
    req, ask = _asker(daemons.sender_ctl)
    rreq, rask = _asker(daemons.receiver_ctl)
    accepted = 0
    try:
        for _ in range(int(os.environ.get("KVT_CONTROL_FUZZ", "3000"))):
            head = {"op": "submit", "to": daemons.to(9), "deadline_ms": 30.0, "label": "fz"}
            for field in rng.sample(FIELDS, rng.choice((1, 1, 2))):
                head[field] = rng.choice(HOSTILE)
            frames = FRAMES if rng.random() < 0.8 else [rng.randbytes(rng.randrange(20))] * 4
            accepted += ask(head, *frames)["ok"]
            op = rng.choice(["status", "cancel", "abort", "stats", "ping", 7, None])
            rhead = {"op": op, "transfer_id": rng.choice(HOSTILE)}
            rask(rhead)
            if op in ("status", "cancel"):
                ask(rhead)
        # garbage framing too
        for _ in range(200):
            ask(rng.randbytes(rng.randrange(1, 60)))
            rask(rng.randbytes(rng.randrange(1, 60)))
    finally:
        req.close()
        rreq.close()
    assert daemons.tx.poll() is None and daemons.rx.poll() is None
    assert daemons.sender.ping()["role"] == "sender"
    assert daemons.receiver.ping()["role"] == "receiver"
    # a submit answered ok:false never runs: the sender knows exactly the accepted ones
    # (the daemon keeps the last HISTORY finished ones)
    assert len(daemons.sender.status()) == min(accepted, HISTORY)
