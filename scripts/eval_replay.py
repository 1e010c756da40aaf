"""Replays against a live receiver daemon (issue 44, row 1): the attack shapes at scale.

The receiver daemon runs as a real process on loopback (a key file, a replay record). The
attacker holds a passive capture: the datagrams a genuine sender (a SenderSession in this
process, under the daemon's key) sealed, and replays them from its own UDP socket, which
also counts every byte the daemon sends back. Shapes (all loops bounded, the script stops
by itself):

- ``data_no_manifest``: ``--transfers`` captured transfers, one data datagram each, sent
  ``--rounds`` times (what held every slot of the daemon);
- ``one_datagram``: one data datagram, ``--repeats`` times (what brought back 17.8x);
- ``whole_replay``: a transfer delivered once, then its whole capture again;
- ``after_restart``: the daemon restarted (same record), data of the delivered transfer
  without its manifest; waited past the pool's timeout;
- ``whole_after_restart``: then its whole capture, manifest included (the record refuses).
- ``other_rx_psk_only``: a whole transfer captured on its way to another receiver A that
  holds the same pre-shared key, replayed to this daemon (issue 44, row 4: delivered);
- ``other_rx_identities``: the same with identities (kvtransport.core.wire, "Peers"): the
  transfer sealed from the sender's identity to A's, replayed to a daemon B with its own
  identity that allows the sender and holds the same pre-shared key (target: nothing
  opens, every datagram dropped as ``bad_tag``).

Per shape: datagrams and bytes sent, bytes answered and their ratio (target <= 3), and
the daemon's sessions opened, results and replays refused during the shape (target: no
session, no result for a replay), and the datagrams dropped as ``bad_tag``. ``--out FILE``
writes the rows as JSON.

    .venv/bin/python scripts/eval_replay.py [--transfers 16] [--rounds 5] [--repeats 240]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KEY_HEX = "5e" * 32


class Daemon:
    """The receiver daemon as a process on a fixed port, with a replay record."""

    def __init__(self, folder: Path, port: int, extra: tuple[str, ...] = ()) -> None:
        from kvtransport.embed.client import ReceiverClient

        key = folder / "key"
        if not key.exists():
            key.write_text(KEY_HEX)
            key.chmod(0o600)
        self.err = open(folder / f"rx-{time.monotonic_ns()}.err", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtransport", "receiver-daemon", "--listen",
             f"127.0.0.1:{port}", "--control", f"ipc://{folder}/rx.ipc", "--publish",
             f"ipc://{folder}/res.ipc", "--key-file", str(key), "--replay-file",
             str(folder / "replay"), *extra],
            stdout=subprocess.DEVNULL, stderr=self.err,
        )  # fmt: skip
        self.client = ReceiverClient(f"ipc://{folder}/rx.ipc", timeout_s=300)  # a cold compile
        self.client.ping()

    def stats(self) -> dict:
        return self.client.stats()

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)
        self.err.close()


def capture(seed: int, n: int = 600, size: int = 400_000, key: Any = None) -> list[bytes]:
    """The first ``n`` datagrams a genuine sender seals for one transfer (fresh manifest),
    under ``key`` (default: the pre-shared key)."""
    from kvtransport.core.sender import SenderSession
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.policies.registry import make_policy

    s = SenderSession(synthetic_transfer(size, 16, seed=seed), make_policy("none"),
                      rate_bps=1e9, deadline=2.0, key=key or bytes.fromhex(KEY_HEX),
                      wall_offset=time.time())  # fmt: skip
    out: list[bytes] = []
    while len(out) < n and (t := s.next_timer()) is not None:
        out += s.datagrams_to_send(t)
    return out[:n]


def identities(folder: Path) -> tuple[Any, tuple[str, ...]]:
    """Identities of a sender, receiver A and receiver B in ``folder``: the sender's keys
    to A (the pre-shared key mixed in), and B's daemon options (its own identity, the
    sender allowed, the same pre-shared key)."""
    from kvtransport.core.keys import generate_identity, read_identity
    from kvtransport.core.wire import PeerKeys, pairwise

    publics = {name: generate_identity(folder / name) for name in ("tx", "rx_a", "rx_b")}
    pair = pairwise(read_identity(folder / "tx"), publics["rx_a"], sending=True,
                    psk=bytes.fromhex(KEY_HEX))  # fmt: skip
    opts = ("--identity", str(folder / "rx_b"), "--allow-pub", str(folder / "tx.pub"))
    return PeerKeys([pair]), opts


def data_only(datagrams: list[bytes]) -> list[bytes]:
    from kvtransport.core.wire import DatagramType

    manifests = (DatagramType.MANIFEST, DatagramType.MANIFEST_REPAIR)
    return [d for d in datagrams if d[3] not in manifests]


def shape(name: str, daemon: Daemon, port: int, rounds: list[list[bytes]], gap_s: float,
          settle_s: float = 0.3) -> dict:  # fmt: skip
    """Send each round's datagrams, ``gap_s`` apart; count the bytes answered."""
    before = daemon.stats()
    sent = nbytes = answered = replies = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)

        def drain() -> None:
            nonlocal answered, replies
            while True:
                try:
                    answered += len(s.recv(65536))
                    replies += 1
                except BlockingIOError:
                    return

        for batch in rounds:
            for d in batch:
                s.sendto(d, ("127.0.0.1", port))
                sent += 1
                nbytes += len(d)
                time.sleep(0)
            end = time.monotonic() + gap_s
            while time.monotonic() < end:
                drain()
                time.sleep(0.005)
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            drain()
            time.sleep(0.01)
    after = daemon.stats()
    return {
        "shape": name,
        "datagrams": sent,
        "bytes_sent": nbytes,
        "replies": replies,
        "bytes_answered": answered,
        "ratio": round(answered / nbytes, 4) if nbytes else 0.0,
        "results": after["results"] - before["results"],
        "replays_refused": after["replays_refused"] - before["replays_refused"],
        "active_after": after["active"],
        "bad_tag": _bad_tags(after) - _bad_tags(before),
    }


def _bad_tags(stats: dict) -> int:
    return int(stats.get("drop_reasons", {}).get("bad_tag", 0))


def run(transfers: int, rounds: int, repeats: int) -> list[dict]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = Path(tempfile.mkdtemp(prefix="kvt-replay-"))
    daemon = Daemon(folder, port)
    rows = []
    try:
        caps = [data_only(capture(100 + i, n=40))[5] for i in range(transfers)]
        rows.append(shape("data_no_manifest", daemon, port, [caps] * rounds, 0.5))
        one = data_only(capture(7))[9]
        rows.append(shape("one_datagram", daemon, port, [[one]] * repeats, 0.01))
        genuine = capture(8)
        first = shape("genuine_once", daemon, port, [genuine], 0.5, settle_s=2.5)
        rows.append(first)
        rows.append(shape("whole_replay", daemon, port, [genuine], 0.5))
        daemon.stop()
        daemon = Daemon(folder, port)
        rows.append(shape("after_restart", daemon, port, [data_only(genuine)[:200]], 2.0))
        rows.append(shape("whole_after_restart", daemon, port, [genuine], 0.5))
        to_a = capture(9)  # sealed for A, which holds the same key
        rows.append(shape("other_rx_psk_only", daemon, port, [to_a], 0.5, settle_s=2.5))
        daemon.stop()
        keys, opts = identities(folder)
        daemon = Daemon(folder, port, opts)
        to_a = capture(10, key=keys)  # sealed from the sender's identity to A's
        rows.append(shape("other_rx_identities", daemon, port, [to_a], 0.5, settle_s=2.5))
    finally:
        daemon.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transfers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=240)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = run(max(1, min(a.transfers, 256)), max(1, min(a.rounds, 100)),
               max(1, min(a.repeats, 10_000)))  # fmt: skip
    cols = ("shape", "datagrams", "bytes_sent", "replies", "bytes_answered", "ratio", "results",
            "replays_refused", "active_after", "bad_tag")  # fmt: skip
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]}")
    print("  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>16}" for c in cols))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
