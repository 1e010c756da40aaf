"""Fuzzed datagrams against a live receiver daemon during a transfer (issue 12).

The receiver daemon runs as a real process (default set-up: a key, the replay record, a
memory budget), a sender engine in this process sends one transfer to it through a UDP
relay that keeps a copy of the first datagrams, and a fuzzer process sends mutants of those
genuine datagrams (and plain garbage) to the receiver's port while the transfer runs. The
transfer is held back while the fuzz lags (the sender pauses when its share of the
transfer runs ahead of the fuzz's share), so every fuzzed datagram reaches a receiver
with the transfer in progress.

Mutants (kind: what): ``bitflip`` 1-8 random bits anywhere; ``header`` one header field
rewritten; ``truncate``; ``extend`` random bytes appended; ``splice`` one datagram's header
on another's body; ``new_id`` a random transfer id (the admission path); ``random`` random
bytes, half with a valid magic and version; ``unsealed`` the SEALED flag cleared and the
tag dropped (a plaintext forgery). Every mutant differs from its base.

Reported (one JSON object, also written to ``--out``): fuzzed datagrams sent (per kind),
how many the receiver's own parser accepts (the fuzzer checks each one with the key),
sessions and results of any other transfer id at the receiver, the receiver's crash
signs (exited, a traceback in its log, its exit status after SIGTERM), the transfer's
result (complete, byte-identical), the receiver's datagram and drop counters, and its RSS
(sampled every 20 ms) against the configured budget.

``python scripts/eval_fuzz.py [--fuzz 1000000] [--size-mb 34] [--rate-mbps 20] [--seed 1]
[--out FILE]``; tests/test_fuzz_datagrams.py runs it with 50k datagrams.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvtransport.core.wire import HEADER_SIZE, Parser, WireError  # the fuzzer needs only these

KEY_HEX = "5e" * 32


def _key_file(folder: Path) -> Path:
    """KEY_HEX in a 0600 file of ``folder`` (a key in argv is refused: ps shows it)."""
    path = folder / "key"
    path.write_text(KEY_HEX)
    path.chmod(0o600)
    return path


KINDS = ("bitflip", "header", "truncate", "extend", "splice", "new_id", "random", "unsealed")
CAPTURE = 256  # genuine datagrams the fuzzer mutates
BUDGET_MB = 256.0
_LEN = struct.Struct("<I")


# ---------------------------------------------------------------------- the fuzzer


def mutants(bases: list[bytes], n: int, rng: np.random.Generator) -> list[tuple[int, bytes]]:
    """``n`` (kind, datagram) pairs made from the genuine ``bases``."""
    out = []
    kinds = rng.integers(0, len(KINDS), n)
    picks = rng.integers(0, len(bases), n)
    for kind, pick in zip(kinds.tolist(), picks.tolist(), strict=True):
        base = bases[pick]
        name = KINDS[kind]
        if name == "bitflip":
            b = bytearray(base)
            for pos in rng.integers(0, len(b) * 8, int(rng.integers(1, 9))).tolist():
                b[pos >> 3] ^= 1 << (pos & 7)
        elif name == "header":
            b = bytearray(base)
            at = int(rng.integers(2, HEADER_SIZE))
            b[at] = (b[at] + int(rng.integers(1, 256))) & 0xFF
        elif name == "truncate":
            b = bytearray(base[: int(rng.integers(0, len(base)))])
        elif name == "extend":
            b = bytearray(base + rng.bytes(int(rng.integers(1, 65))))
        elif name == "splice":
            other = bases[(pick + 1 + int(rng.integers(0, len(bases) - 1))) % len(bases)]
            b = bytearray(base[:HEADER_SIZE] + other[HEADER_SIZE:])
        elif name == "new_id":
            b = bytearray(base)
            b[8:16] = rng.bytes(8)
        elif name == "random":
            b = bytearray(rng.bytes(int(rng.integers(0, 1500))))
            if len(b) >= 3 and rng.integers(0, 2):
                b[0:3] = bytes([0x4B, 0x56, 2])
        else:  # unsealed: a plaintext datagram with the genuine header
            b = bytearray(base[:-16])
            b[4] &= 0xFE
        if b == base:  # a mutation that changed nothing (splice of an identical body)
            b = bytearray(base)
            b[-1] ^= 1
        out.append((kind, bytes(b)))
    return out


def fuzz_worker(capfile: str, port: int, n: int, seed: int, rate: float, out: str) -> None:
    """The fuzzer process: ``n`` mutants of the datagrams in ``capfile`` to ``port`` at
    up to ``rate`` per second, each checked with the receiver's parser; progress lines on
    stdout, counts to ``out``."""
    data = Path(capfile).read_bytes()
    bases, off = [], 0
    while off < len(data):
        (k,) = _LEN.unpack_from(data, off)
        bases.append(data[off + 4 : off + 4 + k])
        off += 4 + k
    parser = Parser(bytes.fromhex(KEY_HEX))
    rng = np.random.default_rng(seed)
    sent = [0] * len(KINDS)
    accepted = 0
    send_errors = 0
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    dst = ("127.0.0.1", port)
    t0 = time.monotonic()
    done = 0
    while done < n:
        batch = mutants(bases, min(4096, n - done), rng)
        for kind, d in batch:
            try:
                parser.parse(d)
                accepted += 1  # a mutant that opens under the key (none is a copy)
            except WireError:
                pass
            try:
                sock.sendto(d, dst)
            except OSError:
                send_errors += 1
            sent[kind] += 1
        done += len(batch)
        print(f"progress {done}", flush=True)
        ahead = done / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    elapsed = time.monotonic() - t0
    Path(out).write_text(
        json.dumps(
            {
                "fuzz_sent": done,
                "fuzz_by_kind": dict(zip(KINDS, sent, strict=True)),
                "accepted_by_parser": accepted,
                "send_errors": send_errors,
                "fuzz_s": round(elapsed, 3),
                "fuzz_rate_per_s": round(done / elapsed),
            }
        )
    )


# ---------------------------------------------------------------------- the harness


class Relay:
    """UDP relay sender <-> receiver that keeps the first ``CAPTURE`` data datagrams."""

    def __init__(self, target_port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.target = ("127.0.0.1", target_port)
        self.capture: list[bytes] = []
        self.peer = None
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.halt.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.005)
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
                if len(self.capture) < CAPTURE:
                    self.capture.append(d)
                self.sock.sendto(d, self.target)

    def close(self) -> None:
        self.halt.set()
        self.thread.join(5)
        self.sock.close()


class GatedSender:
    """A sender engine on its own thread that pauses while its share of the transfer
    (sources sent) runs ahead of ``allowed()``."""

    def __init__(self, transfer: object, port: int, rate_mbps: float, deadline_s: float,
                 allowed: object) -> None:  # fmt: skip
        from kvtransport.daemons.daemon_sender import SenderEngine, SenderHost
        from kvtransport.daemons.udp import DatagramSocket, clock

        self.sock = DatagramSocket(("127.0.0.1", 0), ("127.0.0.1", port))
        host = SenderHost(rate_bps=rate_mbps * 1e6, key=bytes.fromhex(KEY_HEX))
        self.engine = SenderEngine(self.sock, host)
        self.out = self.engine.submit(
            transfer, ("127.0.0.1", port), now=clock(), deadline_s=deadline_s
        )
        self.allowed = allowed
        self.paused_s = 0.0
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        from kvtransport.daemons.udp import clock, wait_readable

        e, s = self.engine, self.out.session
        while e.host.active and not self.halt.is_set():
            if s.next_esi < s.n_source and s.next_esi / s.n_source > self.allowed():
                time.sleep(0.002)
                self.paused_s += 0.002
                continue
            e.run_due(clock())
            wake = e.next_wake()
            timeout = 0.02 if wake is None else min(0.02, wake - clock())
            if wait_readable([e], timeout):
                e.on_readable(clock())

    def close(self) -> None:
        self.halt.set()
        self.thread.join(5)
        self.sock.close()


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run(n_fuzz: int, size_mb: float, rate_mbps: float, seed: int = 1,
        fuzz_rate: float = 200_000.0, timeout_s: float = 900.0) -> dict:  # fmt: skip
    """One transfer of ``size_mb`` with ``n_fuzz`` fuzzed datagrams; the report."""
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.embed.client import ReceiverClient, ResultSubscriber

    tmp = Path(tempfile.mkdtemp(prefix="kvt-fuzz-"))
    err_path = tmp / "rx.err"
    err = open(err_path, "w")  # noqa: SIM115 (closed below)
    rx = subprocess.Popen(
        [sys.executable, "-m", "kvtransport", "receiver-daemon", "--listen", "127.0.0.1:0",
         "--control", f"ipc://{tmp}/rx.ipc", "--publish", f"ipc://{tmp}/res.ipc",
         "--key-file", str(_key_file(tmp)), "--replay-file", str(tmp / "replay"), "--max-mb", "64",
         "--budget-mb", str(BUDGET_MB)],
        stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    client = ReceiverClient(f"ipc://{tmp}/rx.ipc", timeout_s=120)
    port = int(client.ping()["udp"].rsplit(":", 1)[1])
    sub = ResultSubscriber(f"ipc://{tmp}/res.ipc")
    time.sleep(0.3)
    rss = {"start": _rss_mb(rx.pid), "max": 0.0}
    polling = threading.Event()

    def poll_rss() -> None:
        while not polling.is_set():
            rss["max"] = max(rss["max"], _rss_mb(rx.pid))
            time.sleep(0.02)

    threading.Thread(target=poll_rss, daemon=True).start()
    before = client.stats()
    tr = synthetic_transfer(int(size_mb * 1e6), max(1, int(size_mb * 1e6) // 65536), seed=seed)
    progress = {"done": 0, "finished": False, "from": None}

    def allowed() -> float:
        """The share of the sources the sender may have sent: all until the capture is
        taken, then in step with the fuzz up to 95 %, all once the fuzz is done."""
        start = progress["from"]
        if progress["finished"] or start is None:
            return 1.0
        return start + (0.95 - start) * progress["done"] / n_fuzz

    relay = Relay(port)
    deadline_s = min(timeout_s, 3600.0)
    sender = GatedSender(tr, relay.port, rate_mbps, deadline_s=deadline_s, allowed=allowed)
    report: dict = {"fuzz_requested": n_fuzz, "size_mb": size_mb, "rate_mbps": rate_mbps,
                    "seed": seed, "budget_mb": BUDGET_MB}  # fmt: skip
    t0 = time.monotonic()
    try:
        while len(relay.capture) < CAPTURE and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        s = sender.out.session
        progress["from"] = min(s.next_esi / s.n_source, 0.5)
        capfile = tmp / "capture.bin"
        capfile.write_bytes(b"".join(_LEN.pack(len(d)) + d for d in relay.capture))
        fuzz_out = tmp / "fuzz.json"
        fuzzer = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(capfile), str(port), str(n_fuzz),
             str(seed), str(fuzz_rate), str(fuzz_out)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        for line in fuzzer.stdout:
            if line.startswith("progress "):
                progress["done"] = int(line.split()[1])
        fuzzer.wait()
        progress["finished"] = True
        fuzz_end = time.monotonic()
        report.update(json.loads(fuzz_out.read_text()))
        res = sub.wait_for(sender.out.transfer_id, timeout_s=timeout_s)
        result_at = time.monotonic()
        report["transfer_s"] = round(result_at - t0, 3)
        report["fuzz_finished_before_result"] = fuzz_end < result_at
        report["sender_paused_s"] = round(sender.paused_s, 3)
        n = tr.nbytes
        report["result_reason"] = res.reason
        report["byte_identical"] = bool(
            res.is_complete and np.array_equal(np.asarray(res.payload[:n]), tr.payload)
        )
        time.sleep(0.3)
        after = client.stats()
        others = [s for s in client.status()
                  if s["transfer_id"] != f"{sender.out.transfer_id:016x}"]  # fmt: skip
        report["other_transfer_sessions"] = len(others)
        report["other_results"] = sub.recv(timeout_s=0.2) is not None
        reasons = {
            k: after["drop_reasons"].get(k, 0) - before["drop_reasons"].get(k, 0)
            for k in after["drop_reasons"]
        }
        report["receiver"] = {
            "datagrams": after["socket"]["datagrams_received"]
            - before["socket"]["datagrams_received"],
            "dropped": after["dropped"] - before["dropped"],
            "drop_reasons": {k: v for k, v in sorted(reasons.items()) if v},
            "genuine_sent": sender.sock.stats["datagrams_sent"],
            "results": after["results"] - before["results"],
        }
    finally:
        sender.close()
        relay.close()
        polling.set()
        alive = rx.poll() is None
        client.close()
        sub.close()
        rx.send_signal(signal.SIGTERM)
        try:
            rc = rx.wait(60)
        except subprocess.TimeoutExpired:
            rx.kill()
            rc = rx.wait()
        err.close()
    log = err_path.read_text()
    shutil.rmtree(tmp, ignore_errors=True)
    report["receiver_alive_at_end"] = alive
    report["receiver_exit_status"] = rc
    report["tracebacks"] = log.count("Traceback")
    report["crashes"] = int(not alive or rc != 0 or "Traceback" in log)
    report["rss_start_mb"] = round(rss["start"], 1)
    report["rss_max_mb"] = round(rss["max"], 1)
    report["rss_growth_mb"] = round(rss["max"] - rss["start"], 1)
    report["rss_within_budget"] = rss["max"] - rss["start"] <= BUDGET_MB
    fuzz_received = report["receiver"]["datagrams"] - report["receiver"]["genuine_sent"]
    report["receiver"]["fuzz_received_est"] = fuzz_received
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        capfile, port, n, seed, rate, out = argv[1:]
        fuzz_worker(capfile, int(port), int(n), int(seed), float(rate), out)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fuzz", type=int, default=1_000_000, help="fuzzed datagrams (1M)")
    p.add_argument("--size-mb", type=float, default=34.0, help="the transfer (34 MB)")
    p.add_argument("--rate-mbps", type=float, default=20.0, help="the sender's rate (20)")
    p.add_argument("--fuzz-rate", type=float, default=200_000.0, help="most per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="also write the JSON report here")
    a = p.parse_args(argv)
    os.environ.setdefault("KVT_STATE_DIR", tempfile.mkdtemp(prefix="kvt-fuzz-state-"))
    report = run(a.fuzz, a.size_mb, a.rate_mbps, a.seed, a.fuzz_rate)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
