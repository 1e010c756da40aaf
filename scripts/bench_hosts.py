#!/usr/bin/env python3
"""What the endpoint hosts cost per datagram over their sessions, side by side.

The daemons hand every datagram to a sans-I/O host (kvtransport.hosts.sender_host,
kvtransport.hosts.receiver_host) that demultiplexes it by transfer id and settles feedback and
events; before, the engines did the same inline. This measures the host layer's share:
one recorded loss-free transfer (a SenderHost and a ReceiverHost on a virtual clock), then

    receiver  the recorded data datagrams into a fresh ReceiverSession directly, vs into a
              fresh ReceiverHost (``receive_datagram`` each, ``datagrams_to_send`` every
              256 as the daemon's batch does);
    sender    a fresh SenderSession's ``datagrams_to_send`` at the recorded timer times,
              vs a fresh SenderHost's ``handle_timer`` + ``datagrams_to_send`` there,
              the recorded feedback fed back at the same points in both.

CPU time, best of --rounds interleaved rounds; the figures are microseconds per data
datagram and the ratio host / session. Writes results/bench_hosts.json.

    .venv/bin/python scripts/bench_hosts.py
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

KEY = bytes(range(32))
PEER = ("127.0.0.1", 9000)
BATCH = 256


def record(size: int) -> tuple[Any, list[tuple[str, float, bytes]]]:
    """One loss-free transfer between the hosts; the sender's inputs and outputs."""
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.hosts.receiver_host import ReceiverHost
    from kvtransport.hosts.sender_host import SenderHost

    tr = synthetic_transfer(size, max(1, size // 12_288), seed=2)
    sender = SenderHost(rate_bps=1e9, key=KEY, burst_s=0.0)
    receiver = ReceiverHost(key=KEY, max_bytes=2 * size)
    out = sender.submit(tr, PEER, now=0.0, deadline_s=5.0, transfer_id=7, initial_rtt=1e-3)
    log: list[tuple[str, float, bytes]] = []
    now = 0.0
    n = 0
    while (t := sender.get_timer()) is not None and not out.session.done:
        now = max(now, t)
        log.append(("timer", now, b""))
        sender.handle_timer(now)
        for batch, _ in sender.datagrams_to_send(now):
            for d in batch:
                log.append(("data", now, d))
                receiver.receive_datagram(d, PEER, now)
                n += 1
                if n % BATCH == 0:
                    for fb, _ in receiver.datagrams_to_send(now):
                        for f in fb:
                            log.append(("feedback", now, f))
                            sender.receive_datagram(f, PEER, now)
    return tr, log


def time_receiver(log: list[tuple[str, float, bytes]], size: int, host: bool) -> float:
    from kvtransport.core.receiver import ReceiverSession
    from kvtransport.hosts.receiver_host import ReceiverHost

    data = [(t, d) for kind, t, d in log if kind == "data"]
    if host:
        rx = ReceiverHost(key=KEY, max_bytes=2 * size)
        receive, flush = rx.receive_datagram, rx.datagrams_to_send
        t0 = time.process_time()
        for i, (t, d) in enumerate(data, 1):
            receive(d, PEER, t)
            if i % BATCH == 0:
                flush(t)
        return time.process_time() - t0
    s = ReceiverSession(7, key=KEY, max_bytes=2 * size)
    receive_s, flush_s = s.receive_datagram, s.datagrams_to_send
    t0 = time.process_time()
    for i, (t, d) in enumerate(data, 1):
        receive_s(d, t)
        if i % BATCH == 0:
            flush_s(t)
    return time.process_time() - t0


def time_sender(tr: Any, log: list[tuple[str, float, bytes]], host: bool) -> float:
    from kvtransport.core.sender import SenderSession
    from kvtransport.hosts.sender_host import SenderHost
    from kvtransport.policies.registry import make_policy

    inputs = [(kind, t, d) for kind, t, d in log if kind != "data"]
    if host:
        sh = SenderHost(rate_bps=1e9, key=KEY, burst_s=0.0)
        sh.submit(tr, PEER, now=0.0, deadline_s=5.0, transfer_id=7, initial_rtt=1e-3)
        t0 = time.process_time()
        for kind, t, d in inputs:
            if kind == "timer":
                sh.handle_timer(t)
                sh.datagrams_to_send(t)
            else:
                sh.receive_datagram(d, PEER, t)
        return time.process_time() - t0
    s = SenderSession(tr, make_policy("adaptive"), rate_bps=1e9, deadline=5.0, now=0.0,
                      transfer_id=7, key=KEY, initial_rtt=1e-3)  # fmt: skip
    t0 = time.process_time()
    for kind, t, d in inputs:
        if kind == "timer":
            s.datagrams_to_send(t)
        else:
            s.receive_datagram(d, t)
    return time.process_time() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=20.0, help="transfer size (MB)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="results/bench_hosts.json")
    args = p.parse_args()
    from kvtransport.daemons.daemon import warm_up

    warm_up(KEY, ("adaptive",))
    size = int(args.mb * 1e6)
    tr, log = record(size)
    n = sum(kind == "data" for kind, _, _ in log)
    best: dict[str, float] = {}
    runs = [
        ("receiver_session", lambda: time_receiver(log, size, False)),
        ("receiver_host", lambda: time_receiver(log, size, True)),
        ("sender_session", lambda: time_sender(tr, log, False)),
        ("sender_host", lambda: time_sender(tr, log, True)),
    ]
    for r in range(args.rounds):
        for name, fn in runs if r % 2 == 0 else runs[::-1]:  # no side always first
            best[name] = min(best.get(name, float("inf")), fn())
    us = {k: round(v / n * 1e6, 3) for k, v in best.items()}
    res = {
        "datagrams": n,
        "us_per_datagram": us,
        "ratio_host_over_session": {
            side: round(best[f"{side}_host"] / best[f"{side}_session"], 3)
            for side in ("receiver", "sender")
        },
        "rounds": args.rounds,
        "machine": platform.processor() or platform.machine(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
