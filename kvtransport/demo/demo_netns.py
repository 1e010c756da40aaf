"""The demo's netns link: the real ``kvtransport sender-daemon`` and ``receiver-daemon``
in the two network namespaces of the netem testbed (kvtransport.netem.testbed: kernel
netem, or rate limiting plus the userspace relay where the kernel has no sch_netem), at
real-time priority, driven through the ZeroMQ client API (kvtransport.embed.client).

It runs on real clocks and kernel queues and is not repeatable; its relay draws loss fates
from the seed per packet in arrival order.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtransport.demo.demo_links import (
    INITIAL_RTT_S,
    PROFILE,
    Link,
    LinkOutcome,
    NoTimeToSend,
    TransferRequest,
    refusal_is_no_time,
)
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.netem.profiles import Profile

RECEIVER_PORT = 9400
TCP_PORT = 9401  # the TCP baseline's receiver (kvtransport.demo.tcp_baseline)
DAEMON_PRIORITY = 5  # SCHED_FIFO of the netns daemons (the relay runs above them)
WARM_UP_BYTES = 256 * 1024
WARM_UP_DEADLINE_MS = 500.0  # it ends sooner: a transfer is over once its receiver has it all
RTT_PROBES = 3
RTT_PROBE_BYTES = 32 * 1024


def measured_rtt(rtts: list[float | None]) -> float | None:
    """The link's round trip from probes' shortest round trips (None where a probe
    measured none): their median, within the initial RTTs a sender accepts; None when no
    probe measured one."""
    import statistics

    from kvtransport import bounds

    got = [r for r in rtts if r is not None and r > 0]
    if not got:
        return None
    return min(statistics.median(got), bounds.MAX_INITIAL_RTT_S)


class NetnsLink(Link):
    """The real sender and receiver daemons in the testbed's two namespaces, ``profile``
    between them, real-time priority, driven over ZeroMQ from this process.

    The constructor builds the testbed and starts both daemons without waiting for them
    (they load their code while the caller works); :meth:`ready` waits until they answer
    and sends one small warm-up transfer per policy in ``policies``. The testbed is private
    to this process (prefix from the pid) and removed by :meth:`close`; the daemons'
    control and result sockets are ipc:// files in a private temporary directory, so
    nothing collides with other runs, and a key made for this run (a 0600 file in that
    directory) seals their datagrams. ``shaper``: the testbed's rate limiter (the relay's
    token bucket by default; "tbf" where the rate must change, kvtransport.netem.testbed);
    ``sender_args``: more options for the sender daemon (``--no-queue-guard``).
    """

    name = "netns"

    def __init__(
        self,
        seed: int,
        profile: str | Profile = PROFILE,
        policies: tuple[str, ...] = (),
        *,
        shaper: str = "relay",
        sender_args: tuple[str, ...] = (),
    ) -> None:
        from kvtransport.core.keys import generate_key_file
        from kvtransport.netem.testbed import RCV_ADDR, Testbed

        self.policies = policies
        self.on_submitted: Callable[[], object] | None = None
        """Called once the sender daemon has accepted a transfer (its first datagrams are
        leaving): a testbed's rate steps start there (``tb.play_rate_steps``)."""
        self.dir = Path(tempfile.mkdtemp(prefix="kvt-demo-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.clients: list[Any] = []
        self.endpoints = {
            name: f"ipc://{self.dir}/{name}.ipc" for name in ("sender", "receiver", "results")
        }
        self.dest = f"{RCV_ADDR}:{RECEIVER_PORT}"
        key_file = self.dir / "key"
        generate_key_file(key_file)  # per run: the demo's fixed transfer ids never meet a key twice
        self.tb = Testbed(profile, prefix=f"kvd{os.getpid() % 100000}", seed=seed, shaper=shaper)
        self.tb.up()
        try:
            cli = [sys.executable, "-m", "kvtransport"]
            rt = ["--realtime", str(DAEMON_PRIORITY), "--key-file", str(key_file)]
            ep = self.endpoints
            self._spawn("receiver", "rcv", [*cli, "receiver-daemon", "--listen", self.dest,
                        "--control", ep["receiver"], "--publish", ep["results"], *rt])  # fmt: skip
            # kernel netem drops or keeps a UDP GSO batch whole: one datagram per send there
            gso = ["--no-gso"] if self.tb.backend == "netem" else []
            self._spawn("sender", "snd", [*cli, "sender-daemon", "--control", ep["sender"],
                        "--rate-mbps", f"{self.tb.profile.rate_mbps:g}", *rt, *gso,
                        *sender_args])  # fmt: skip
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return (
            f"netns: sender-daemon in {self.tb.snd_ns}, receiver-daemon in {self.tb.rcv_ns}, "
            f"{self.tb.profile.describe()} each way via the {self.tb.backend} backend, "
            f"real time (SCHED_FIFO {DAEMON_PRIORITY})"
        )

    def _spawn(self, name: str, side: str, argv: list[str]) -> None:
        err = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 (the child writes it)
        try:
            self.procs[name] = subprocess.Popen(
                self.tb.command(side, argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        finally:
            err.close()

    def _wait_for(self, name: str, client_type: Any, timeout_s: float = 60.0) -> None:
        """Ping a daemon until it answers; a daemon that exits gives its last log line."""
        from kvtransport.daemons.api import ApiError

        end = time.monotonic() + timeout_s
        with client_type(self.endpoints[name], timeout_s=0.5) as client:
            while True:
                if self.procs[name].poll() is not None:
                    raise UserError(f"the {name} daemon failed to start: {self._last_log(name)}")
                try:
                    client.ping()
                    return
                except ApiError:
                    if time.monotonic() > end:
                        raise UserError(
                            f"the {name} daemon did not answer within {timeout_s:g} s"
                        ) from None

    def _last_log(self, name: str) -> str:
        text = (self.dir / f"{name}.log").read_text(errors="replace").strip()
        return text.splitlines()[-1] if text else "no output"

    def ready(self) -> None:
        """Wait for both daemons, subscribe to results, warm each policy up (one small
        transfer each: the daemons load its compiled code, RLC, Reed-Solomon or the DDQN
        network, before a measured transfer would pay for it inside its deadline), then
        measure the link's round trip with warm daemons (:attr:`rtt_s`: the median of
        ``RTT_PROBES`` small transfers' shortest round trips), which the plan and the
        measured transfers use.

        Every warm-up and probe gives its initial RTT (the profile's) and a deadline of
        ``WARM_UP_DEADLINE_MS``, so none is refused however slow the daemons were before
        it: left to itself, the sender daemon would assume the round trip the previous
        transfer to that receiver measured, and one taken while the receiver compiled its
        kernels leaves a short deadline no time to send."""
        from kvtransport.embed.client import ReceiverClient, ResultSubscriber, SenderClient

        self._wait_for("receiver", ReceiverClient)
        self._wait_for("sender", SenderClient)
        self.sender = SenderClient(self.endpoints["sender"], timeout_s=30)
        self.results = ResultSubscriber(self.endpoints["results"])
        self.clients = [self.sender, self.results]
        time.sleep(0.2)  # the subscription reaches the PUB socket before any result
        self.warm_up()

    def warm_up(self) -> None:
        """The warm-ups and the round-trip probes of :meth:`ready` (again, at any time)."""
        from kvtransport.core.transfer import synthetic_transfer

        for i, policy in enumerate(self.policies):
            self._small_transfer(synthetic_transfer(WARM_UP_BYTES, 16, "linear", seed=i),
                                 policy, "warm-up")  # fmt: skip
        probe = synthetic_transfer(RTT_PROBE_BYTES, 8, "linear", seed=99)
        rtts = [self._small_transfer(probe, "fixed:4/32", "rtt probe") for _ in range(RTT_PROBES)]
        self.rtt_s = measured_rtt(rtts)

    def _small_transfer(self, tr: Any, policy: str, label: str) -> float | None:
        """Send ``tr`` (a warm-up or a probe) and wait for it; its shortest RTT in seconds
        (None: it measured none)."""
        tid = self.sender.submit(tr, self.dest, deadline_ms=WARM_UP_DEADLINE_MS, policy=policy,
                                 initial_rtt_ms=INITIAL_RTT_S * 1e3, label=label)  # fmt: skip
        self.results.wait_for(tid, timeout_s=30)
        rtt_ms = self.sender.wait(tid, timeout_s=10).get("min_rtt_ms")
        return None if rtt_ms is None else rtt_ms * 1e-3

    def load(self, transfer: Any) -> None:
        self._loaded = transfer

    def _transfer(self, req: TransferRequest) -> LinkOutcome:
        from kvtransport.daemons.api import ApiError

        t0 = time.perf_counter()
        try:
            tid = self.sender.submit(
                self._loaded,
                self.dest,
                deadline_ms=req.deadline_s * 1e3,
                policy=req.policy,
                transfer_id=req.transfer_id,
                initial_rtt_ms=(self.rtt_s or INITIAL_RTT_S) * 1e3,
                label=f"demo {req.policy}",
            )
        except ApiError as exc:
            if refusal_is_no_time(str(exc)):
                raise NoTimeToSend(str(exc)) from None
            raise
        if self.on_submitted is not None:
            self.on_submitted()
        res = self._wait_result(tid, t0, req.deadline_s, req.progress)
        transfer_s = time.perf_counter() - t0
        st = self.sender.wait(tid, timeout_s=10)
        req.progress(1.0)
        rs = res.stats
        counters = {
            "datagrams_sent": st["datagrams_sent"],
            "datagrams_lost": rs.get("datagrams_lost"),
            "source_sent": st["source_sent"],
            "repair_sent": st["repair_sent"],
        }
        return LinkOutcome.from_result(res, transfer_s, counters)

    def tcp_transfer(self, deadline_s: float, congestion: str | None = None) -> LinkOutcome:
        """The loaded transfer over one TCP connection across the same link, cut
        ``deadline_s`` after its first byte (see :func:`tcp_across`)."""
        return tcp_across(self.tb, self._loaded, deadline_s, self.dir, congestion=congestion)

    def _wait_result(
        self, tid: str, t0: float, deadline_s: float, progress: Callable[[float], None]
    ) -> Any:
        """The transfer's published result; meanwhile the progress follows the clock."""
        from kvtransport.daemons.api import ApiError

        end = t0 + deadline_s + 30.0
        while True:
            try:
                return self.results.wait_for(tid, timeout_s=0.1)
            except ApiError:
                now = time.perf_counter()
                if now > end:
                    raise UserError(
                        f"no result for transfer {tid} {now - t0:.0f} s after it started "
                        f"(sender daemon: {self._last_log('sender')}; receiver daemon: "
                        f"{self._last_log('receiver')})"
                    ) from None
                progress(min((now - t0) / deadline_s, 1.0))

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            self.tb.down()
        shutil.rmtree(self.dir, ignore_errors=True)


def tcp_across(
    tb: Any,
    transfer: Any,
    deadline_s: float,
    workdir: Path,
    *,
    congestion: str | None = None,
    port: int = TCP_PORT,
    priority: int = DAEMON_PRIORITY,
) -> LinkOutcome:
    """The TCP baseline across testbed ``tb``: ``python -m kvtransport.demo.tcp_baseline recv``
    in the receiver namespace, ``send`` in the sender namespace (both at SCHED_FIFO
    ``priority``, like the daemons), one connection carrying ``transfer``
    (kvtransport.core.transfer.Transfer) until it is complete or ``deadline_s`` after its first
    byte, when the receiver cuts it.

    The outcome's ``arrival_s`` counts from the connection's first byte at the receiver
    (as the UDP receiver's deadline counts from the first datagram); ``transfer_s`` from
    the sender's connect() until the receiver finished (one host, one monotonic clock), so
    it includes the handshake (``counters["connect_s"]``). ``congestion``: the TCP
    congestion control (None: the namespace's default). Counters: payload bytes received,
    bytes of complete blocks, the sender's retransmitted segments and bytes (TCP_INFO).
    """
    from kvtransport.demo.tcp_baseline import write_stream
    from kvtransport.netem.testbed import RCV_ADDR

    workdir = Path(workdir)
    stream = workdir / "tcp-stream.bin"
    out = workdir / "tcp-rx"
    write_stream(stream, transfer)
    mod = [sys.executable, "-m", "kvtransport.demo.tcp_baseline"]
    rt = ["--realtime", str(priority)] if priority else []
    dest = f"{RCV_ADDR}:{port}"
    rx = tb.popen("rcv", [*mod, "recv", dest, "--deadline-s", f"{deadline_s:g}",
                  "--out", str(out), *rt], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                  text=True)  # fmt: skip
    tx = None
    try:
        started = select.select([rx.stdout], [], [], 30.0)[0]  # it imports numpy first
        line = rx.stdout.readline().strip() if started else ""
        if line != "ready":
            rx.kill()
            rx.wait(timeout=10)
            raise UserError(f"the TCP baseline receiver did not start: {_last(rx.stderr)}")
        cc = ["--congestion", congestion] if congestion else []
        tx = tb.popen("snd", [*mod, "send", dest, str(stream), "--timeout-s",
                      f"{deadline_s + 30:g}", *cc, *rt], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)  # fmt: skip
        tx_out, tx_err = tx.communicate(timeout=deadline_s + 60)
        rx_out, rx_err = rx.communicate(timeout=deadline_s + 60)
    finally:
        for proc in (tx, rx):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    if tx.returncode != 0:
        raise UserError(f"the TCP baseline sender failed: {_last_text(tx_err)}")
    if rx.returncode != 0:
        raise UserError(f"the TCP baseline receiver failed: {_last_text(rx_err)}")
    return _tcp_outcome(transfer, out, json.loads(tx_out.strip().splitlines()[-1]))


def _last(stream: Any) -> str:
    return _last_text(stream.read() if stream is not None else "")


def _last_text(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def _tcp_outcome(transfer: Any, out: Path, sent: dict[str, Any]) -> LinkOutcome:
    """The LinkOutcome of a TCP baseline run from the receiver's files in ``out`` and the
    sender's JSON report ``sent``."""
    import numpy as np

    from kvtransport.core.transfer import TransportManifest

    rec = json.loads((out / "result.json").read_text())
    mbytes = (out / "manifest.bin").read_bytes()
    manifest = TransportManifest.from_bytes(mbytes) if rec["manifest"] else None
    arrival = np.array([np.inf if a is None else a for a in rec["arrival_s"]], dtype=float)
    complete = np.isfinite(arrival)
    payload = np.fromfile(out / "payload.bin", dtype=np.uint8)
    if manifest is not None:
        blocks = manifest.blocks
        utility = float(blocks.utilities[complete].sum())
        delivered = int(blocks.lengths[complete].sum())
    else:
        utility, delivered = 0.0, 0
    timings, tcp = rec["timings"], sent["tcp"]
    finished = timings["finished_mono"]
    counters = {
        "bytes_received": rec["bytes_received"],
        "bytes_delivered": delivered,
        "retransmits": tcp.get("total_retrans"),
        "bytes_retransmitted": tcp.get("bytes_retrans"),
        "segments_sent": tcp.get("data_segs_out"),
        "connect_s": sent["connect_s"],
        "first_byte_s": timings.get("first_byte_s"),
        "min_rtt_ms": tcp["min_rtt_us"] / 1e3 if "min_rtt_us" in tcp else None,
        "congestion": tcp.get("congestion", ""),
        "sender": sent["reason"],
    }
    return LinkOutcome(
        utility=utility,
        reason=rec["reason"],
        complete=complete,
        payload=payload,
        app_metadata=manifest.app_metadata if manifest is not None else None,
        transfer_s=finished - sent["start_mono"],
        counters=counters,
        arrival_s=arrival,
    )
