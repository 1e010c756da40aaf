"""Operability of the daemons: Prometheus metrics from the stats they keep, JSON logs and
one TOML configuration file for both (real daemons, real UDP, real HTTP scrapes)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import Daemons

from kvtransport.cli import build_parser, main
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.daemons.config import apply_config
from kvtransport.daemons.udp import DatagramSocket
from kvtransport.errors import UserError

CONFIG = """\
log-json = true

[sender-daemon]
metrics-port = "127.0.0.1:0"
policy = "adaptive"

[receiver-daemon]
listen = "127.0.0.1:0"
metrics-port = "127.0.0.1:0"
max-mb = 64
"""


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _json_log(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _metrics_port(records: list[dict]) -> int:
    for r in records:
        m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", r["msg"])
        if m:
            return int(m.group(1))
    raise AssertionError(f"no metrics line in {records}")


def test_daemons_export_metrics_log_json_and_read_one_config(tmp_path):
    cfg = tmp_path / "kvtransport.toml"
    cfg.write_text(CONFIG)
    d = Daemons(tmp_path / "d", sender_args=["--config", str(cfg)],
                receiver_args=["--config", str(cfg)])  # fmt: skip
    try:
        rx_log, tx_log = _json_log(d.log("receiver")), _json_log(d.log("sender"))
        assert all({"ts", "level", "daemon", "msg"} <= r.keys() for r in rx_log + tx_log)
        rx_port, tx_port = _metrics_port(rx_log), _metrics_port(tx_log)
        with DatagramSocket(("127.0.0.1", 0)) as junk:  # one datagram shorter than a header
            junk.send([b"xyz"], ("127.0.0.1", d.rx_port))
        t = synthetic_transfer(300_000, 24, seed=5)
        # a deadline far beyond the ~25 ms the transfer takes: the sender's metrics below
        # assume it hears the receiver's final feedback (at rho 3, 75 ms, a descheduled
        # daemon on a loaded host ended at its deadline knowing of 8 symbols decoded)
        tid = d.sender.submit(t, d.to(), deadline_ms=3000)
        res = d.sub.wait_for(tid, timeout_s=20)
        assert res.reason == "complete"
        assert d.sender.status(tid)["policy"] == "adaptive"  # from the config file
        end = time.monotonic() + 10
        while True:  # the sender's record lands when its session is done
            tx = _scrape(tx_port)
            if _value(tx, "kvtransport_repair_ratio_count", role="sender") or (
                time.monotonic() > end
            ):
                break
            time.sleep(0.1)
        rx = _scrape(rx_port)
    finally:
        d.stop()
    assert _value(rx, "kvtransport_transfers_total", role="receiver", outcome="complete") == 1
    assert _value(rx, "kvtransport_transfer_bytes_total", role="receiver") == t.nbytes
    assert _value(rx, "kvtransport_delivered_bytes_total", role="receiver") == t.nbytes
    assert _value(rx, "kvtransport_utility_at_deadline_count", role="receiver") == 1
    assert _value(rx, "kvtransport_utility_at_deadline_sum", role="receiver") == pytest.approx(
        res.utility_recovered
    )
    assert _value(rx, "kvtransport_repair_ratio_count", role="receiver") == 1
    drops = _value(rx, "kvtransport_dropped_datagrams_total", role="receiver", reason="truncated")
    assert drops == 1
    assert _value(rx, "kvtransport_socket_datagrams_received_total", role="receiver") > 24
    assert _value(rx, "kvtransport_active_transfers", role="receiver") == 0
    assert _value(rx, "kvtransport_control_requests_total", role="receiver") >= 1
    outcomes = {k[1]: v for k, v in tx.items() if k[0] == "kvtransport_transfers_total"}
    assert sum(outcomes.values()) == 1
    assert _value(tx, "kvtransport_transfer_bytes_total", role="sender") == t.nbytes
    assert _value(tx, "kvtransport_delivered_bytes_total", role="sender") == t.nbytes
    assert _value(tx, "kvtransport_repair_ratio_count", role="sender") == 1
    assert _value(tx, "kvtransport_decision_latency_seconds_count", role="sender") == 1
    assert _value(tx, "kvtransport_socket_datagrams_sent_total", role="sender") > 24
    # a clean loopback: the queue guard never cut (the pacing gauge is exported; with no
    # transfer in flight it is the link's rate)
    assert _value(tx, "kvtransport_pacing_mbps", role="sender") == 100.0
    assert _value(tx, "kvtransport_queue_cuts_total", role="sender") == 0


def _sub(name):
    parser = build_parser()
    return parser, parser.commands[name]


def test_config_gives_defaults_and_flags_override_them(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'stats = true\nrealtime = true\n[sender-daemon]\nrate_mbps = 200\nno-gso = true\n'
        '[receiver-daemon]\nlisten = ":9500"\n'
    )  # fmt: skip
    parser, sub = _sub("sender-daemon")
    args = apply_config(parser, sub, ["sender-daemon", "--config", str(cfg)])
    assert (args.rate_mbps, args.no_gso, args.stats, args.realtime) == (200.0, True, "-", 5)
    parser, sub = _sub("sender-daemon")
    args = apply_config(parser, sub, ["sender-daemon", "--config", str(cfg), "--rate-mbps", "50"])
    assert args.rate_mbps == 50.0 and args.no_gso
    parser, sub = _sub("receiver-daemon")
    args = apply_config(parser, sub, ["receiver-daemon", "--config", str(cfg)])
    assert args.listen == ":9500" and args.stats == "-"  # the other daemon's table ignored


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rate-mbps = 100\n", "unknown key 'rate-mbps' for receiver-daemon"),
        ("[receiver-daemon]\nmax-mb = 'big'\n", "max-mb: invalid float value: 'big'"),
        ("[receiver-daemon]\nno-gro = 1\n", "no-gro is a switch"),
        ("[receiver-daemon]\nmax-transfers = 2.5\n", "max-transfers: invalid int value: '2.5'"),
        ("listen = [1, 2]\n", "listen must be a single value"),
        ("this is = not toml\n", "is not TOML"),
        (None, "no such file"),
    ],
)
def test_a_bad_config_is_a_one_line_error(tmp_path, capsys, text, needle):
    cfg = tmp_path / "c.toml"
    if text is not None:
        cfg.write_text(text)
    assert main(["receiver-daemon", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_metrics_address_is_checked():
    from kvtransport.daemons.daemon_metrics import parse_metrics_address

    assert parse_metrics_address("9464") == ("127.0.0.1", 9464)
    assert parse_metrics_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    for bad in ("x", "1:99999"):
        with pytest.raises(UserError):
            parse_metrics_address(bad)
