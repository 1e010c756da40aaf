"""Issue 44, item 7: a receiver's budget counts what arrived, not what a manifest claims.

A session's reservation covers the symbols that arrived plus a bounded window
(kvtransport.hosts.receiver_host: ``window``); a symbol further ahead is dropped
(``ahead_of_data``); a session silent for ``RECLAIM_IDLE_S`` gives its window back when
the budget is short. So a key holder that announces large transfers with a long deadline
and sends almost nothing holds almost nothing, and a later honest transfer fits.

Forged but authenticated traffic (the key is known here), built with the wire's Framer
and the manifest's ManifestSender, against the sans-I/O host and a real receiver daemon
process that a real `kvtransport send` then sends to.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
from procs import receiver_daemon

from kvtransport.core.manifest_fec import ManifestSender
from kvtransport.core.transfer import BlockTable, TransportManifest
from kvtransport.core.wire import DatagramType, Framer
from kvtransport.hosts.receiver_host import RECLAIM_IDLE_S, ReceiverHost

KEY = bytes(range(32))
SYMBOL = 1200
PEER = ("127.0.0.1", 5000)


def _hostile(
    tid: int, claim: int, esis=(0, 1, 2, 3), deadline_s: float = 3600.0, symbol: int = SYMBOL
) -> list[bytes]:
    """A transfer's manifest claiming ``claim`` bytes at ``symbol``-byte symbols
    (``deadline_s``, sent now), whole, then source symbols ``esis``: the datagrams a key
    holder sends."""
    m = TransportManifest(
        symbol_size=symbol,
        payload_len=claim,
        blocks=BlockTable(np.array([0]), np.array([claim]), np.array([1.0])),
        deadline_s=deadline_s,
        sent_at=time.time(),
    )
    ms = ManifestSender(m.to_bytes(), SYMBOL)
    f = Framer(tid, KEY, max_payload=SYMBOL)
    out = [ms.emit(f, seq, 0) for seq in range(ms.m + 2)]  # its symbols and two repairs
    for esi in esis:
        f.payload_view(SYMBOL)[:] = bytes([esi & 0xFF]) * SYMBOL
        out.append(f.finish(DatagramType.SOURCE, len(out), SYMBOL, esi=esi))
    return out


def _feed(host: ReceiverHost, datagrams: list[bytes], now: float) -> None:
    for d in datagrams:
        host.receive_datagram(d, PEER, now)
    host.datagrams_to_send(now)


def test_a_large_claim_holds_what_arrived_and_a_window():
    claim = 30_000_000
    host = ReceiverHost(key=KEY, budget_bytes=32 << 20)
    _feed(host, _hostile(1, claim), 0.0)
    s = host.active[1].session
    assert s.manifest is not None and not s.finished
    n = -(-claim // SYMBOL)
    # the known-symbol map, the window, the 4 symbols that arrived: not the 30 MB claimed
    assert host.held_bytes <= n + host.window + 8 * SYMBOL, host.held_bytes
    held = host.held_bytes
    f = Framer(1, KEY, max_payload=SYMBOL)
    far = (host.window // SYMBOL) + 100  # beyond the window: dropped, nothing reserved
    f.payload_view(SYMBOL)[:] = bytes(SYMBOL)
    _feed(host, [f.finish(DatagramType.SOURCE, 5_000, SYMBOL, esi=far)], 0.1)
    assert s.drop_reasons.get("ahead_of_data") == 1, s.drop_reasons
    assert host.held_bytes == held
    # in-order data moves the window along: the reservation grows with what arrives
    seq0 = 10_000  # past the forged datagrams' numbers
    k = 3 * host.window // SYMBOL
    for i, esi in enumerate(range(4, 4 + k)):
        f.payload_view(SYMBOL)[:] = bytes(SYMBOL)
        host.receive_datagram(f.finish(DatagramType.SOURCE, seq0 + i, SYMBOL, esi=esi), PEER, 0.2)
    host.datagrams_to_send(0.2)
    assert s.n_known == 4 + k and not s.drop_reasons.get("ahead_of_data", 0) > 1
    assert (4 + k) * SYMBOL <= host.held_bytes <= n + (4 + k) * SYMBOL + host.window


def test_a_large_claim_at_tiny_symbols_is_refused_before_its_symbol_map():
    """256 MB claimed at 16-byte symbols: a 16 MB known-symbol map, held whole from the
    manifest. Refused (``too_large``): the manifests hold nothing, and a claim of the
    same size at ordinary symbols is still taken."""
    host = ReceiverHost(key=KEY)  # the defaults: 1 GB budget, 256 MB per transfer
    for tid in range(1, 5):
        _feed(host, _hostile(tid, 256 << 20, esis=(), symbol=16), 0.0)
    for tid in range(1, 5):
        assert host.lingering[tid].session.refused == "too_large"
    assert host.held_bytes == 0, host.held_bytes
    _feed(host, _hostile(9, 256 << 20, esis=()), 0.0)
    s = host.active[9].session
    assert s.manifest is not None and not s.refused, s.drop_reasons


def test_idle_sessions_give_their_window_back_when_the_budget_is_short():
    budget = 4 << 20
    host = ReceiverHost(key=KEY, budget_bytes=budget, max_transfers=16)
    for tid in range(1, 16):  # 15 hostile transfers: their windows take the budget
        _feed(host, _hostile(tid, 3_000_000), 0.0)
    assert all(host.active[t].session.manifest is not None for t in range(1, 16))
    assert host.held_bytes > budget - host.window
    # a transfer arriving while they are silent: their windows are taken back, it fits
    later = RECLAIM_IDLE_S + 0.5
    _feed(host, _hostile(99, 2_000_000), later)
    s = host.active[99].session
    assert s.manifest is not None and not s.refused, s.drop_reasons
    assert host.reclaimed > 0
    assert host.held_bytes <= budget


def test_hostile_claims_cannot_hold_a_daemons_budget_against_a_later_transfer(tmp_path):
    """6 authenticated manifests claiming 5 MB each (30 of the daemon's 32 MB), deadline
    an hour, 4 symbols each: the daemon holds about what arrived, and an honest 8 MB
    transfer sent after them completes."""
    proc, client, port = receiver_daemon(tmp_path, KEY, 32)
    key = tmp_path / "key"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for tid in range(1, 7):
                for d in _hostile(0x4000 + tid, 5_000_000):
                    tx.sendto(d, ("127.0.0.1", port))
                time.sleep(0.02)
        time.sleep(0.5)
        st = client.stats()
        assert st["active"] == 6, st
        assert st["held_bytes"] < 6 * (5_000_000 // SYMBOL + st["reserve_window"] + 8 * SYMBOL)
        assert st["held_bytes"] < 8 << 20, st["held_bytes"]
        sent = subprocess.run(
            [sys.executable, "-m", "kvtransport", "send", f"127.0.0.1:{port}", "--size-mb", "8",
             "--key-file", str(key), "--rate-mbps", "400", "--deadline-ms", "8000", "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert json.loads(sent.stdout.strip().splitlines()[-1])["delivered"] == "complete"
        assert proc.poll() is None
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
