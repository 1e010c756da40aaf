"""Issue 44, item 6: what arrived is never taken for delivered when the receiver could not
write it. A receiver that saves results (``hold_reports``: `recv --out`, the daemon's
``--out-dir``) holds a finished transfer's final report until the result is written; one
that could not be written where asked is reported as refusal ``result_unsaved``, and the
sender finishes "refused (result_unsaved)" (`kvtransport send` exits 4 naming it; the
real-process check with a full --out is tests/test_full_filesystem.py)."""

from __future__ import annotations

import pytest
from test_full_filesystem import small_fs  # noqa: F401 (the fixture)

from kvtransport.core.feedback import RESULT_UNSAVED, refusal_reason
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import Parser, decode_feedback
from kvtransport.hosts.receiver_host import ReceiverHost
from kvtransport.policies.registry import make_policy

KEY = bytes(range(32))
PEER = ("127.0.0.1", 5000)


def _run_until_received(host: ReceiverHost, sender: SenderSession) -> tuple[float, list[bytes]]:
    """Move datagrams both ways until the receiver's session finished; returns the time
    and the feedback sent after it finished."""
    t, after = 0.0, []
    inc = None
    while t < 2.0:
        for d in sender.datagrams_to_send(t):
            host.receive_datagram(d, PEER, t)
        for datagrams, _ in host.datagrams_to_send(t):
            for fb in datagrams:
                if inc is not None and inc.session.finished:
                    after.append(fb)
                sender.receive_datagram(fb, t)
        inc = host.get(sender.transfer_id)
        if inc is not None and inc.session.finished:
            return t, after
        t += 1e-4
    raise AssertionError("the transfer did not finish")


@pytest.mark.parametrize("saved", [True, False])
def test_the_final_report_waits_for_the_result_and_names_it_unsaved(saved):
    t = synthetic_transfer(200_000, 8, seed=5)
    sender = SenderSession(t, make_policy("adaptive"), rate_bps=1e9, deadline=5.0,
                           transfer_id=0x77, key=KEY)  # fmt: skip
    host = ReceiverHost(key=KEY, hold_reports=True, linger_s=0.01)
    now, after = _run_until_received(host, sender)
    inc = host.get(0x77)
    assert inc is not None and inc.session.result.reason == "complete"
    assert not sender.done and not after  # no final report yet: the result is being kept
    for late in sender.datagrams_to_send(now + 0.05):  # late datagrams are not answered
        host.receive_datagram(late, PEER, now + 0.05)
    host.handle_timer(now + 1.0)  # and the session lingers while its report is held
    assert not host.datagrams_to_send(now + 1.0) and host.get(0x77) is inc

    host.result_kept(0x77, now + 1.0, saved=saved)
    out = host.datagrams_to_send(now + 1.0)
    assert len(out) == 1 and len(out[0][0]) == 1
    fb = decode_feedback(Parser(KEY).parse(out[0][0][0]).payload)
    assert refusal_reason(fb.flags) == ("" if saved else RESULT_UNSAVED)
    sender.receive_datagram(out[0][0][0], now + 1.0)
    assert sender.done
    if saved:
        assert sender.finish_reason == "receiver done" and not sender.refused
    else:
        assert sender.refused == RESULT_UNSAVED
        assert sender.finish_reason == f"refused ({RESULT_UNSAVED})"
    host.handle_timer(now + 2.0)  # reported: now it is forgotten
    assert host.get(0x77) is None


def test_without_hold_reports_the_final_report_goes_at_once():
    t = synthetic_transfer(200_000, 8, seed=5)
    sender = SenderSession(t, make_policy("adaptive"), rate_bps=1e9, deadline=5.0,
                           transfer_id=0x78, key=KEY)  # fmt: skip
    host = ReceiverHost(key=KEY)
    _run_until_received(host, sender)
    assert sender.done and sender.finish_reason == "receiver done"


def test_a_daemon_whose_out_dir_is_full_tells_the_sender(small_fs, tmp_path):  # noqa: F811
    """A receiver daemon with --out-dir on a 2 MiB tmpfs (it passes the start probe) and
    a 3 MB transfer: the result is kept in the state directory, the daemon lives on, and
    `kvtransport send` exits 4 naming result_unsaved. Real processes; needs root."""
    import json
    import os
    import subprocess
    import time

    from test_full_filesystem import KVT, _free_port, _send

    from kvtransport.embed.client import ReceiverClient

    state = tmp_path / "state"
    env = {**os.environ, "KVT_STATE_DIR": str(state)}
    ctl, pub = f"ipc://{tmp_path}/rx.ipc", f"ipc://{tmp_path}/res.ipc"
    port = _free_port()
    proc = subprocess.Popen([*KVT, "receiver-daemon", "--listen", f"127.0.0.1:{port}",
                             "--control", ctl, "--publish", pub, "--insecure",
                             "--out-dir", str(small_fs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)  # fmt: skip
    client = ReceiverClient(ctl, timeout_s=300)
    try:
        client.ping()
        time.sleep(0.2)
        sent = _send(port, 3.0)
        assert client.ping()["role"] == "receiver"
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
    assert sent.returncode == 4, sent.stderr
    assert RESULT_UNSAVED in sent.stderr.strip().splitlines()[-1], sent.stderr
    assert json.loads(sent.stdout.strip().splitlines()[-1])["refused"] == RESULT_UNSAVED
    kept = list((state / "results").glob("*.result.safetensors"))
    assert len(kept) == 1 and kept[0].stat().st_size > 3_000_000
