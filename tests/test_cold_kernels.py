"""A transfer never runs with a cold kernel: after the shells' warm-up, real transfers over
loopback UDP compile or load no numba kernel.

A fresh interpreter (so nothing an earlier test ran is loaded already) does what ``send``
and ``recv`` do before they serve, ``warm_up(key)`` (and ``warm_up(None)`` as with
``--insecure``), records the compiled signatures of every numba dispatcher in the loaded
kvtransport modules, then runs real transfers through the commands' own loops
(kvtransport.embed.inprocess.run_send / run_receive, the engines the daemons run) over a
UDP relay that drops every seventh datagram: one per policy of every kind (every repair
scheme, the DDQN), keyless ones, two sharing a sender's link (the allocator), and a
quantized block stream the receiver decodes range by range (the block codec). Any
dispatcher with a signature it did not have before (or a dispatcher first seen during the
transfers) is a kernel compiled or loaded mid-transfer.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
from typing import Any

KEY = bytes(range(32))


def _dispatchers() -> dict[str, Any]:
    """Every numba dispatcher bound at the top level of a loaded kvtransport module (or in
    a dict, list or tuple there): name -> dispatcher."""
    from numba.core.dispatcher import Dispatcher

    out: dict[str, Any] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("kvtransport") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, dict):
                items = list(obj.values())
            else:
                items = list(obj) if isinstance(obj, list | tuple) else [obj]
            for val in items:
                if isinstance(val, Dispatcher):
                    label = f"{val.py_func.__module__}.{val.py_func.__qualname__}"
                    out.setdefault(label, val)
    return out


def _signatures() -> dict[str, list[str]]:
    return {k: sorted(map(str, d.signatures)) for k, d in _dispatchers().items()}


class _LossyRelay:
    """A UDP relay in a thread between a sender and one receiver: every seventh datagram
    from the sender is dropped, feedback passes."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()
        self.target = target
        self.peer: Any = None
        self.n = 0
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.halt.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.01)
            while ready:
                try:
                    d, addr = self.sock.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr == self.target:
                    if self.peer is not None:
                        self.sock.sendto(d, self.peer)
                    continue
                self.peer = addr
                self.n += 1
                if self.n % 7:
                    self.sock.sendto(d, self.target)

    def close(self) -> None:
        self.halt.set()
        self.thread.join(5)
        self.sock.close()


def _transfers(sent: list[tuple[Any, str]], key: bytes | None) -> list[Any]:
    """Send ``sent`` ((transfer, policy) pairs) at once from one sender, each to its own
    receiver through a lossy relay; the receivers' DeliveredResults."""
    from kvtransport.daemons.daemon import StopSignal, serve
    from kvtransport.daemons.daemon_sender import SenderEngine, SenderHost
    from kvtransport.daemons.udp import DatagramSocket, clock
    from kvtransport.embed.inprocess import delivered, run_receive, run_send

    results: list[Any] = [None] * len(sent)
    rx_stops, threads, relays, socks = [], [], [], []

    def receive(i: int, sock: Any, stop: Any) -> None:
        inc, engine = run_receive(sock, stop=stop, key=key, timeout_s=10.0, idle_timeout_s=3.0)
        results[i] = None if inc is None else delivered(inc, engine)

    for i in range(len(sent)):
        sock = DatagramSocket(("127.0.0.1", 0))
        stop = StopSignal()
        relays.append(_LossyRelay(sock.address))
        rx_stops.append(stop)
        socks.append(sock)
        threads.append(threading.Thread(target=receive, args=(i, sock, stop), daemon=True))
        threads[-1].start()
    tx_stop = StopSignal()
    try:
        if len(sent) == 1:  # the `send` command's loop
            tx = DatagramSocket(("127.0.0.1", 0), relays[0].address)
            run_send(tx, sent[0][0], relays[0].address, rate_bps=5e7, deadline_s=0.6,
                     stop=tx_stop, key=key, policy=sent[0][1])  # fmt: skip
        else:  # a sender daemon's: transfers sharing the link
            tx = DatagramSocket(("127.0.0.1", 0))
            host = SenderHost(rate_bps=5e7, key=key)
            engine = SenderEngine(tx, host)
            for (transfer, policy), relay in zip(sent, relays, strict=True):
                engine.submit(transfer, relay.address, now=clock(), deadline_s=0.6, policy=policy)
            try:
                serve(
                    engine,
                    [],
                    tx_stop,
                    on_idle=lambda now: None if host.active else tx_stop.request(),
                )
            finally:
                engine.close(clock())
        tx.close()
        for t in threads:
            t.join(15)
    finally:
        for stop in rx_stops:
            stop.request()
        for relay in relays:
            relay.close()
        for sock in socks:
            sock.close()
        tx_stop.close()
    return results


def _block_stream() -> Any:
    """A small float32 cache's stream at int8 and int4 (quantized on the way)."""
    import numpy as np

    from kvtransport.kvformat import blocks
    from kvtransport.kvformat.kvcache import KVCache

    rng = np.random.default_rng(3)
    kv = rng.standard_normal((2, 2, 2, 64, 64), dtype=np.float32)
    cache = KVCache(kv[0], kv[1], np.arange(64, dtype=np.int64), "probe")
    i8, i4 = blocks.PRECISIONS.index("int8"), blocks.PRECISIONS.index("int4")
    precision = np.array([[i8, i4, i8, i4], [i4, i8, i4, i8]])
    s = blocks.encode_stream(cache, np.ones((2, 4)), np.arange(8), precision)
    return s.to_transfer()


def probe() -> dict[str, Any]:
    """The check, in this (fresh) interpreter: the signatures compiled during the
    transfers, and what the transfers delivered."""
    import numpy as np

    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.daemons.daemon import data_path_policies, warm_up
    from kvtransport.embed.partial import partial_cache
    from kvtransport.kvformat import blocks

    warm_up(KEY)  # as `send` / `recv` / the receiver daemon
    warm_up(None)  # as with --insecure
    before = _signatures()
    tr = synthetic_transfer(300_000, 24, seed=5)
    utilities: dict[str, float] = {}
    for policy in data_path_policies():
        (res,) = _transfers([(tr, policy)], KEY)
        utilities[policy] = res.utility_recovered
    for policy in ("fixed:1/4", data_path_policies()[-1]):
        (res,) = _transfers([(tr, policy)], None)
        utilities[f"keyless {policy}"] = res.utility_recovered
    shared = _transfers([(tr, data_path_policies()[-1]), (tr, "fixed:1/4")], KEY)
    utilities["shared"] = min(r.utility_recovered for r in shared)
    stream = _block_stream()
    (res,) = _transfers([(stream, "fixed:1/4")], KEY)
    utilities["blocks"] = res.utility_recovered
    decoded = partial_cache(res)  # the receiver's decode (dequantized into float32)
    mirror = np.frombuffer(np.asarray(res.payload).tobytes(), np.uint8)  # read-only, as a mirror
    blocks.RangeDecoder(decoded.manifest).take(mirror, 0, 16)
    after = _signatures()
    grown = {k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items()}
    return {
        "grown": {k: v for k, v in grown.items() if v},
        "utilities": utilities,
        "warm": sorted(k for k, v in before.items() if v),
    }


def test_no_kernel_compiles_or_loads_during_real_transfers_after_warm_up():
    out = subprocess.run(
        [sys.executable, __file__, "probe"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["grown"] == {}, f"compiled or loaded during a transfer: {got['grown']}"
    # the transfers did real work: every one but the unprotected one recovered utility
    # through the loss (that one loses a symbol of every block)
    assert all(u > 0 for k, u in got["utilities"].items() if k != "none"), got["utilities"]
    # and the warm-up reached every scheme's decoder, the DDQN and the allocator
    warm = set(got["warm"])
    for kernel in (
        "codecs.rlc._decode_repair",
        "codecs.blockrs._combine",
        "codecs.aesgcm.open_run",
        "codecs.quant.dequantize_mixed_blocks_into",
        "scheduling.allocator._plan_prefix",
        "policies.ddqn.decide_kernel",
    ):
        assert any(k.endswith(kernel) for k in warm), kernel


if __name__ == "__main__" and sys.argv[1:] == ["probe"]:
    print(json.dumps(probe()))
