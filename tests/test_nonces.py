"""Nonces are unique by construction (issue 44, kvtransport.core.wire "Sealing"): every
(key, nonce) pair sealed on both directions is recorded across normal transfers, a
receiver restarted mid-transfer (a new ReceiverHost fed the rest of the transfer) and a
sender restarted with the same client-chosen transfer id; none repeats.

Sealing is observed where it happens: the wire module's AES-GCM context is wrapped to
record each encrypt call (the compiled run sealer is turned off, so runs of sources go
through the same per-datagram call with the same bytes)."""

import heapq

import kvtransport.codecs.aesgcm as run_kernels
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtransport.core import wire
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.hosts.receiver_host import ReceiverHost
from kvtransport.hosts.sender_host import SenderHost

KEY = bytes(range(32))
RX, TX = ("10.0.0.2", 9400), ("10.0.0.1", 9000)
CLIENT_ID = 0x1234


@pytest.fixture
def sealed(monkeypatch):
    """Every (transfer key, nonce) an AES-GCM context of the wire module seals with."""
    pairs: list[tuple[bytes, bytes]] = []

    class Recording:
        def __init__(self, key: bytes) -> None:
            self._key, self._c = bytes(key), AESGCM(key)

        def encrypt(self, nonce, data, aad):
            pairs.append((self._key, bytes(nonce)))
            return self._c.encrypt(nonce, data, aad)

        def decrypt(self, nonce, data, aad):
            return self._c.decrypt(nonce, data, aad)

    monkeypatch.setattr(wire, "AESGCM", Recording)
    monkeypatch.setattr(run_kernels, "AVAILABLE", False)
    return pairs


def _run(tx: SenderHost, rx: ReceiverHost, until: float, restart_at: float | None = None):
    """Both hosts over a loss-free 1 ms path until ``until``; at ``restart_at`` the receiver
    host is replaced by a new one (a restarted receiver). Returns the last receiver."""
    q: list[tuple[float, int, bool, bytes]] = []  # (arrival, order, to receiver, datagram)
    n, t = 0, 0.0
    while t < until:
        due = [x for x in (tx.get_timer(), rx.get_timer(), q[0][0] if q else None) if x is not None]
        if not due:
            break
        t = min(due)
        if restart_at is not None and t >= restart_at:
            rx, restart_at = ReceiverHost(key=KEY), None
        while q and q[0][0] <= t:
            _, _, forward, d = heapq.heappop(q)
            (rx if forward else tx).receive_datagram(d, TX if forward else RX, t)
        if (x := tx.get_timer()) is not None and x <= t:
            tx.handle_timer(t)
        if (x := rx.get_timer()) is not None and x <= t:
            rx.handle_timer(t)
        for forward, host in ((True, tx), (False, rx)):
            for batch, _ in host.datagrams_to_send(t):
                for d in batch:
                    n += 1
                    heapq.heappush(q, (t + 0.001, n, forward, d))
    return rx


def _repeats(pairs):
    seen, repeated = set(), 0
    for p in pairs:
        repeated += p in seen
        seen.add(p)
    return repeated


def test_no_key_and_nonce_pair_repeats_across_restarts_reused_ids_and_directions(sealed):
    # normal transfers, two at once on one link
    tx = SenderHost(rate_bps=20e6, key=KEY, burst_s=0.0)
    for seed in (1, 2):
        tx.submit(synthetic_transfer(150_000, 8, seed=seed), RX, now=0.0, deadline_s=0.5)
    _run(tx, ReceiverHost(key=KEY), 1.0)
    normal = len(sealed)

    # a receiver restarted mid-transfer: its sender starts over with the new receiver
    tx = SenderHost(rate_bps=8e6, key=KEY, burst_s=0.0)
    out = tx.submit(synthetic_transfer(600_000, 32, seed=3), RX, now=0.0, deadline_s=2.0)
    rx = _run(tx, ReceiverHost(key=KEY), 2.5, restart_at=0.3)
    assert out.session.stats["receiver_restarts"] == 1
    assert rx.stats()["results"] == 1  # the new receiver delivered
    restarted = len(sealed) - normal

    # a sender restarted, given the same client-chosen id for another payload
    outs = []
    for seed in (4, 5):
        tx = SenderHost(rate_bps=20e6, key=KEY, burst_s=0.0)
        outs.append(tx.submit(synthetic_transfer(150_000, 8, seed=seed), RX, now=0.0,
                              deadline_s=0.5, name=CLIENT_ID))  # fmt: skip
        _run(tx, ReceiverHost(key=KEY), 1.0)
        assert tx.get(CLIENT_ID) is outs[-1]  # the name finds it

    assert _repeats(sealed) == 0
    assert normal > 200 and restarted > 200 and len(sealed) > normal + restarted + 200
    feedback = sum(n[:8] != bytes(8) for _, n in sealed)  # the receivers' direction
    assert feedback > 20
    assert outs[0].transfer_id != outs[1].transfer_id
