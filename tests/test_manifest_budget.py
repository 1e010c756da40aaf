"""Issue 44, item 7: a key holder cannot grow a receiver daemon's memory through the
manifests it is decoding. A manifest's symbols are bounded (MAX_MANIFEST_BYTES), and the
decoders of manifests not yet decoded share the pre-manifest pool's bound (POOL_BYTES)
with its datagrams, charged as their datagrams arrive. Forged but authenticated traffic
(the key is known here) against a real receiver daemon process."""

import socket
import time

import numpy as np
import pytest
from procs import receiver_daemon

from kvtransport.core.manifest_fec import MAX_MANIFEST_BYTES, ManifestReceiver, ManifestSender
from kvtransport.core.wire import BadPayload, DatagramType, Framer, Parser
from kvtransport.hosts.receiver_host import POOL_BYTES

KEY = bytes(range(32))
SYMBOL = 60_000  # a forger's symbol size: 4095 of them would claim 246 MB


def _manifest_datagram(tid, esi, m, seq, framer):
    payload = np.full(SYMBOL, esi & 0xFF, np.uint8).tobytes()
    return framer.build(DatagramType.MANIFEST, seq, payload, esi=esi, key=m)


def test_a_manifest_claiming_more_than_the_bound_is_refused_at_its_first_datagram():
    framer = Framer(3, KEY, max_payload=SYMBOL)
    d = Parser(KEY).parse(_manifest_datagram(3, 0, 4095, 0, framer))
    with pytest.raises(BadPayload, match="symbols of 60000 bytes >"):
        ManifestReceiver().add(d)
    rx = ManifestReceiver()
    small = Parser(KEY).parse(_manifest_datagram(3, 1, 100, 1, framer))
    assert rx.add(small) is None and rx.nbytes == SYMBOL  # charged as it arrives
    with pytest.raises(ValueError, match="a receiver refuses it"):
        ManifestSender(bytes(MAX_MANIFEST_BYTES), 9000)


def _vm(pid, field):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_manifests_being_decoded_stay_within_the_pool(tmp_path):
    """12 forged transfers, each a manifest of 130 symbols of 60 kB (7.8 MB, within the
    bound): 600 of their datagrams (36 MB) would all sit in decoders. The daemon's peak
    RSS grows by about the pool's bound, not by what was sent."""
    proc, client, port = receiver_daemon(tmp_path, KEY, 32)
    try:
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        framers = [Framer(1000 + i, KEY, max_payload=SYMBOL) for i in range(12)]
        sent = 0
        for round_ in range(50):
            for f in framers:
                tx.sendto(_manifest_datagram(f.transfer_id, round_, 130, round_, f),
                          ("127.0.0.1", port))  # fmt: skip
                sent += SYMBOL
            time.sleep(0.01)  # the daemon keeps up: nothing lost in the socket buffer
            if round_ == 0:  # the first round loads the code paths (imports, kernels,
                time.sleep(0.3)  # allocator arenas): growth is measured from there
                base = _vm(proc.pid, "VmHWM:")
        time.sleep(0.3)
        st = client.stats()
        grown = _vm(proc.pid, "VmHWM:") - base
        tx.close()
        assert sent > 2 * POOL_BYTES
        assert st["pool_bytes"] <= POOL_BYTES
        assert st["drop_reasons"].get("pool_full", 0) > 0, st["drop_reasons"]
        assert grown < POOL_BYTES + (8 << 20), (grown, st)
        assert proc.poll() is None
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
