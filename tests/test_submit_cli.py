"""`kvtransport submit`, `status` and `cancel` against real daemons (real processes, real
UDP on loopback, real ZeroMQ over ipc://): what they print, their exit statuses, and that
what they ask for is what the daemons do (the receiver daemon's published results are
the witness). The commands run in this process through kvtransport.cli.main, as the
console command would; the one-line errors also as a subprocess, as a user sees them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from test_daemon import Daemons

from kvtransport.cli import main
from kvtransport.commands.recv import EXIT_COMPLETE, EXIT_NOTHING, EXIT_PARTIAL


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    d = Daemons(tmp_path_factory.mktemp("daemons"), receiver_args=["--listen", "127.0.0.1:0"])
    yield d
    d.stop()


def _cli(capsys, daemons, *argv):
    """Exit status and stdout of `kvtransport ARGV --control <the test's sender daemon>`
    (its stderr stays readable with ``capsys.readouterr().err``)."""
    capsys.readouterr()
    rc = main([*argv, "--control", daemons.sender_ctl, "--timeout", "20"])
    out = capsys.readouterr()
    sys.stderr.write(out.err)
    return rc, out.out


def _free_udp_port():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submit_wait_exits_as_recv_does(daemons, capsys):
    """--wait prints the final status; the exit status says what the receiver reported:
    all (0), a part (3: 4 MB need 320 ms at the daemon's 100 Mbit/s, the deadline is
    150 ms) or nothing (4: nobody listens at the address)."""
    rc, out = _cli(capsys, daemons, "submit", "--size-mb", "1", "--to", daemons.to(),
                   "--deadline-ms", "3000", "--label", "whole", "--wait", "--json")  # fmt: skip
    st = json.loads(out)
    assert rc == EXIT_COMPLETE, st
    assert st["state"] == "done" and st["label"] == "whole"
    assert st["decoded_through"] == st["n_source"] > 0
    res = daemons.sub.wait_for(st["transfer_id"], timeout_s=20)
    assert res.is_complete

    rc, out = _cli(capsys, daemons, "submit", "--size-mb", "4", "--to", daemons.to(),
                   "--deadline-ms", "150", "--wait")  # fmt: skip
    assert rc == EXIT_PARTIAL, out
    m = re.search(r"transfer ([0-9a-f]{16}) to .*: deadline after", out)
    assert m, out
    m2 = re.search(r"receiver decoded\s+(\d+) of (\d+) source symbols", out)
    assert m2 and 0 < int(m2.group(1)) < int(m2.group(2)), out
    res = daemons.sub.wait_for(m.group(1), timeout_s=20)
    assert not res.is_complete and res.complete.any()

    rc, out = _cli(capsys, daemons, "submit", "--size-mb", "1", "--to",
                   f"127.0.0.1:{_free_udp_port()}", "--deadline-ms", "300", "--wait")  # fmt: skip
    assert rc == EXIT_NOTHING, out
    assert "receiver decoded     0 of" in out and "feedback received    0" in out


def test_submit_prints_the_id_then_status_and_cancel_act_on_it(daemons, capsys):
    """Without --wait the id alone is printed; status shows the transfer (label, policy)
    at the daemon; cancel aborts it, and the receiver delivers its partial result."""
    rc, out = _cli(capsys, daemons, "submit", "--size-mb", "20", "--to", daemons.to(),
                   "--deadline-ms", "30000", "--label", "big", "--policy", "fixed:4/32",
                   "--weight", "2")  # fmt: skip
    assert rc == 0 and re.fullmatch(r"[0-9a-f]{16}\n", out), out
    tid = out.strip()

    rc, out = _cli(capsys, daemons, "status", "--json")
    listed = {t["transfer_id"]: t for t in json.loads(out)["transfers"]}
    assert rc == 0 and tid in listed
    assert listed[tid]["label"] == "big" and listed[tid]["policy"] == "fixed:4/32"
    assert listed[tid]["weight"] == 2.0 and listed[tid]["state"] != "done"
    rc, out = _cli(capsys, daemons, "status")
    assert rc == 0 and re.search(rf"{tid} \[big\] to {daemons.to()}: ", out), out

    rc, out = _cli(capsys, daemons, "cancel", tid)
    assert rc == 0 and out == f"transfer {tid} cancelled\n"
    res = daemons.sub.wait_for(tid, timeout_s=20)
    assert not res.is_complete  # 20 MB take 1.6 s at 100 Mbit/s: cut short
    rc, out = _cli(capsys, daemons, "status", tid, "--json")
    assert rc == 0 and json.loads(out)["finish_reason"] == "cancelled"
    rc, out = _cli(capsys, daemons, "cancel", tid)
    assert rc == 1 and "already finished: cancelled" in out
    rc, _ = _cli(capsys, daemons, "cancel", "123456789abcdef0")
    assert rc == 2 and "has no transfer 123456789abcdef0" in capsys.readouterr().err


def test_a_card_is_planned_for_its_deadline_or_sent_as_it_is(daemons, capsys, tmp_path):
    """CARD with --deadline-ms goes as the handoff plan encodes it (fp16/int8 blocks);
    --precision keep sends it as it is (fp32), as kvtransport send does."""
    from kvtransport.kvformat import blocks, card
    from kvtransport.kvformat.kvcache import KVCache
    from kvtransport.model import encoding

    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((30, 3, 256, 64), dtype=np.float32) for _ in range(2))
    path = card.write_card(
        tmp_path / "c.card", encoding.encode_cache(KVCache(k, v, np.arange(256), "m"))
    )
    sent = {}
    for precision in ("auto", "keep"):
        rc, out = _cli(capsys, daemons, "submit", str(path), "--to", daemons.to(),
                       "--deadline-ms", "400", "--precision", precision)  # fmt: skip
        assert rc == 0, out
        res = daemons.sub.wait_for(out.strip(), timeout_s=20)
        sent[precision] = blocks.Manifest.from_bytes(res.app_metadata)
    planned = {blocks.PRECISIONS[int(p)] for p in np.unique(sent["auto"].precision)}
    assert planned <= {"fp16", "int8", "int4"} and "int8" in planned
    kept = {blocks.PRECISIONS[int(p)] for p in np.unique(sent["keep"].precision)}
    assert kept == {"fp32"}


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "kvtransport", *argv],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_no_daemon_is_one_line_that_says_how_to_start_one(tmp_path, daemons):
    missing = f"ipc://{tmp_path}/none.ipc"
    out = _run("submit", "--size-mb", "1", "--to", "127.0.0.1:9", "--control", missing,
               "--timeout", "0.3")  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"kvtransport submit: error: no sender daemon answers at {missing} (no socket "
        f"file after 0.3 s): start one with `kvtransport sender-daemon --control {missing}`"
    )
    # a socket file nobody serves (a daemon killed without cleaning up)
    stale = tmp_path / "stale.ipc"
    stale.touch()
    out = _run("status", "--control", f"ipc://{stale}", "--timeout", "0.5")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "no sender daemon answers at" in out.stderr and "no answer within 0.5 s" in out.stderr
    # the receiver daemon's endpoint is not a sender daemon's
    out = _run("cancel", "0123456789abcdef", "--control", daemons.receiver_ctl)
    assert out.returncode == 2
    assert "is a receiver daemon, not a sender daemon" in out.stderr
    out = _run("status", "--receiver", "--control", daemons.receiver_ctl, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["role"] == "receiver"
