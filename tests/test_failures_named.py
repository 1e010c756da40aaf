"""Failures are named where the user looks (issue 42): another key, a refused or stale
manifest, nothing delivered. Both ends say why in one line and `send` exits non-zero.

The protocol half runs the sans-I/O hosts on a virtual clock; the user's half runs the
real `kvtransport recv` process against the real `send` entry point over loopback UDP.
"""

import json
import subprocess
import sys
import time

import pytest
from procs import finish

from kvtransport.cli import EXIT_BROKEN_PIPE, main
from kvtransport.core.feedback import refusal_datagram, refusal_reason
from kvtransport.core.replay import ReplayRecord
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import HEADER_SIZE, DatagramType, decode_feedback, parse
from kvtransport.hosts.receiver_host import ReceiverHost
from kvtransport.hosts.sender_host import NO_FEEDBACK, SenderHost
from kvtransport.sim.virtual_clock import VirtualClockLoop

CLI = [sys.executable, "-m", "kvtransport"]
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
TX, RX = ("10.0.0.1", 9000), ("10.0.0.2", 9400)
WALL = 1_700_000_000.0


class _Path:
    """Loss-free, 1 ms one way; counts what crosses."""

    def __init__(self) -> None:
        self.datagrams = 0
        self.bytes = 0

    def transmit(self, t: float, size: int) -> float:
        self.datagrams += 1
        self.bytes += size
        return t + 0.001


def _pair(*, skew=0.0, sender_key=KEY, transfers=1, policy="none", size=200_000, **rx_kw):
    """Sender and receiver hosts on the virtual clock (the receiver with a replay record,
    5 s window, at WALL; the sender's wall clock ``skew`` s off it), run for 1 s."""
    record = ReplayRecord(None, now=WALL, window_s=5.0)
    rx = ReceiverHost(key=KEY, replay=record, wall_clock=lambda: WALL, **rx_kw)
    tx = SenderHost(rate_bps=100e6, key=sender_key, symbol_size=1200, burst_s=0.0)
    outs = [
        tx.submit(
            synthetic_transfer(size, 16, seed=i),
            RX,
            now=0.0,
            deadline_s=0.2,
            policy=policy,
            wall_offset=WALL + skew,
        )  # fmt: skip
        for i in range(transfers)
    ]
    back = _Path()
    loop = VirtualClockLoop()
    loop.add(tx, TX, channel=_Path())
    loop.add(rx, RX, channel=back)
    loop.run(1.0)
    return outs, rx, back


def test_a_stale_manifest_is_refused_and_the_sender_is_told_why():
    """The receiver's refusal reaches the sender in its sealed final feedback: the sender
    stops at once, its status names the reason, and the receiver's note names the skew."""
    (out,), rx, _ = _pair(skew=-600.0)
    s = out.session
    assert s.refused == "stale_manifest" and s.finish_reason == "refused (stale_manifest)"
    assert s.finished_at < 0.05  # stopped when told, long before its 200 ms deadline
    delivered, note = out.outcome()
    assert delivered == "nothing" and "clocks in sync" in note
    assert out.status(1.0)["refused"] == "stale_manifest"
    assert "refused (stale_manifest)" in rx.failure_note() and "-600.0 s" in rx.failure_note()
    assert rx.replays_refused == 1


@pytest.mark.parametrize(
    ("rx_kw", "why"),
    [({"max_bytes": 100_000}, "too_large"), ({"budget_bytes": 100_000}, "over_budget")],
)
def test_a_transfer_refused_for_bounded_state_names_its_reason_on_both_ends(rx_kw, why):
    (out,), rx, _ = _pair(**rx_kw)
    assert out.session.refused == why and out.outcome()[0] == "nothing"
    assert f"refused ({why})" in rx.failure_note()


def test_over_capacity_is_refused_with_at_most_one_small_reply_per_manifest_datagram():
    """A receiver at its transfer limit has no session for the new transfer: it answers
    each manifest datagram with the same sealed refusal, smaller than what it answers."""
    (first, second), rx, back = _pair(transfers=2, max_transfers=1, size=1_000_000)
    assert first.outcome()[0] == "complete"
    assert second.session.refused == "over_capacity"
    assert second.session.finish_reason == "refused (over_capacity)"
    refusals = second.session.stats["feedback_received"]
    manifests = second.session.stats["manifest_sent"]
    assert 1 <= refusals <= manifests
    assert "refused" in rx.failure_note() and rx.drop_reasons["over_capacity"] >= manifests
    reply = refusal_datagram(KEY, second.transfer_id, "over_capacity")
    assert len(reply) < HEADER_SIZE + 1200  # less than the manifest datagram it answers
    assert reply == refusal_datagram(KEY, second.transfer_id, "over_capacity")  # same bytes


def test_only_the_key_holder_can_refuse_a_transfer():
    """A refusal sealed with another key (or none) is dropped as garbage: the transfer goes
    on and completes; the genuine one decodes to its reason."""
    host = SenderHost(rate_bps=100e6, key=KEY, symbol_size=1200, burst_s=0.0)
    out = host.submit(synthetic_transfer(50_000, 4), RX, now=0.0, deadline_s=0.5, policy="none")
    tid = out.transfer_id
    for forged in (refusal_datagram(OTHER_KEY, tid, "stale_manifest"),
                   refusal_datagram(None, tid, "stale_manifest")):  # fmt: skip
        host.receive_datagram(forged, RX, 0.001)
    assert not out.session.done and out.session.drop_reasons.get("bad_tag") == 2
    genuine = refusal_datagram(KEY, tid, "stale_manifest")
    d = parse(genuine, KEY)
    assert d.type == DatagramType.FEEDBACK
    assert refusal_reason(decode_feedback(d.payload).flags) == "stale_manifest"
    host.receive_datagram(genuine, RX, 0.002)
    assert out.session.refused == "stale_manifest" and tid not in host.active


def test_another_key_is_named_on_both_ends():
    (out,), rx, back = _pair(sender_key=OTHER_KEY)
    assert back.datagrams == 0  # the receiver answers nothing it cannot authenticate
    assert out.outcome() == ("nothing", NO_FEEDBACK)
    n = rx.stats()["drop_reasons"]["bad_tag"]
    assert n > 100
    assert rx.failure_note() == (
        f"{n} datagrams failed authentication: do both ends have the same key?"
    )


def test_the_receivers_last_report_after_the_sender_stopped_sets_the_outcome():
    """With no repair the sender stops as soon as everything is sent, before the receiver
    reports it complete: that report (after the finish) still makes the outcome."""
    (out,), _, _ = _pair()
    s = out.session
    assert s.finish_reason == "all sent" and s.finished_at < 0.02
    assert out.outcome() == ("complete", "") and out.outcome_final(s.finished_at)


# ---------------------------------------------------------------------- real processes


def _key_file(tmp_path, name, key):
    path = tmp_path / name
    path.write_text(key.hex())
    path.chmod(0o600)
    return str(path)


def _start_recv(tmp_path, *args):
    """`kvtransport recv` in its own process (its own replay record); once it listens."""
    rx = subprocess.Popen(
        [*CLI, "recv", "--listen", "127.0.0.1:0", "--json", "--replay-file",
         str(tmp_path / "replay"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    while True:
        line = rx.stderr.readline()
        seen.append(line)
        if "listening on" in line:
            return rx, int(line.rsplit(":", 1)[1]), seen
        assert line, "".join(seen)


def _send(port, capsys, *args):
    """The real `send` entry point in this process: (exit status, stdout JSON, stderr)."""
    rc = main(["send", f"127.0.0.1:{port}", "--json", "--size-mb", "0.5", "--rate-mbps", "50",
               "--deadline-ms", "400", "--policy", "adaptive", *args])  # fmt: skip
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


def test_send_and_recv_with_different_keys_say_so_and_fail(tmp_path, capsys):
    rx, port, _ = _start_recv(tmp_path, "--key-file", _key_file(tmp_path, "a", KEY),
                              "--timeout", "4")  # fmt: skip
    rc, st, err = _send(port, capsys, "--key-file", _key_file(tmp_path, "b", OTHER_KEY))
    _, _, rx_err = finish(rx)
    assert rc == 4 and st["delivered"] == "nothing" and st["feedback_received"] == 0
    assert err.strip().splitlines()[-1] == f"kvtransport send: {NO_FEEDBACK}"
    assert rx.returncode == 2
    last = rx_err.strip().splitlines()[-1]
    assert last.startswith("kvtransport recv: error: no transfer arrived")
    n = st["datagrams_sent"]
    assert f"; {n} datagrams failed authentication: do both ends have the same key?" in last
    assert "Traceback" not in err + rx_err


def test_a_sender_whose_clock_is_off_is_refused_and_both_ends_name_the_skew(
    tmp_path, capsys, monkeypatch
):
    """The sender's wall clock 10 minutes behind the receiver's 5 s replay window: recv
    exits 4 with the reason soon after the refusal, not at its --timeout (issue 44)."""
    import kvtransport.daemons.daemon_sender as daemon_sender
    from kvtransport.daemons.udp import clock

    key = _key_file(tmp_path, "k", KEY)
    rx, port, _ = _start_recv(tmp_path, "--key-file", key, "--timeout", "600",
                              "--replay-window", "5")  # fmt: skip
    monkeypatch.setattr(daemon_sender, "wall_offset", lambda: time.time() - clock() - 600.0)
    rc, st, err = _send(port, capsys, "--key-file", key)
    _, _, rx_err = finish(rx, timeout=60)  # 60 s: a recv waiting for its --timeout fails here
    assert rc == 4 and st["delivered"] == "nothing"
    assert st["finish_reason"] == "refused (stale_manifest)" and st["refused"] == "stale_manifest"
    assert "kvtransport send: refused by the receiver (stale_manifest)" in err
    assert "clocks in sync" in err.strip().splitlines()[-1]
    assert rx.returncode == 4
    said = rx_err.strip().splitlines()
    assert any(
        line.startswith("kvtransport recv: transfer ") and "refused (stale_manifest)" in line
        for line in said
    ), rx_err  # as it happened
    assert "refused (stale_manifest)" in said[-1] and "-600." in said[-1]  # and at the end


def test_a_refused_transfer_fails_both_ends_with_the_reason(tmp_path, capsys):
    key = _key_file(tmp_path, "k", KEY)
    rx, port, _ = _start_recv(tmp_path, "--key-file", key, "--max-mb", "0.1")
    rc, st, err = _send(port, capsys, "--key-file", key)
    _, rx_out, rx_err = finish(rx)
    assert rc == 4 and st["refused"] == "too_large"
    assert "kvtransport send: refused by the receiver (too_large)" in err
    assert rx.returncode == 4 and json.loads(rx_out)["refused"] == "too_large"
    assert "refused (too_large)" in rx_err


def test_a_partial_transfer_exits_3_and_prints_counts_not_none(tmp_path, capsys):
    """Human output: a partial transfer is 3, as recv's; the RTT line is a number."""
    key = _key_file(tmp_path, "k", KEY)
    rx, port, _ = _start_recv(tmp_path, "--key-file", key)
    rc = main(["send", f"127.0.0.1:{port}", "--key-file", key, "--size-mb", "2",
               "--rate-mbps", "4", "--deadline-ms", "600", "--policy", "adaptive"])  # fmt: skip
    out, _ = capsys.readouterr()
    finish(rx)
    assert rc == 3 and rx.returncode == 3
    assert "delivered                partial" in out
    assert "smoothed RTT             None" not in out and " ms (mean deviation" in out


def test_a_closed_standard_output_ends_quietly():
    """`kvtransport ... | head -1`: the reader is gone before the output is written; the
    command ends as a Unix tool killed by SIGPIPE would, without a word on stderr."""
    p = subprocess.Popen([*CLI, "simulate", "--size-mb", "0.2", "--policy", "none"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    p.stdout.close()  # before the interpreter has even started
    err = p.stderr.read().decode()
    p.wait(120)
    assert p.returncode == EXIT_BROKEN_PIPE and err == ""


def test_send_help_documents_the_exit_status(capsys):
    assert main(["send", "--help"]) == 0
    text = capsys.readouterr().out
    assert "Exit status" in text and "3 when partial" in text and "4 when" in text


def test_simulate_prints_blocks_missing_as_a_count(capsys):
    assert main(["simulate", "--size-mb", "1", "--policy", "none", "--rho", "0.5"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "blocks missing" in x)
    missing = line.split()[2]
    assert missing.isdigit() and int(missing) > 0, line
