#!/usr/bin/env python3
"""Transport benchmark: per-packet cost of the sender and receiver paths, and loopback
goodput, each configuration side by side in one run.

1. Per-packet cost (in memory, no socket): the real SenderSession and ReceiverSession on a
   virtual clock, 5% deterministic loss (``--loss-pct``), feedback as the receiver emits
   it. One recording run, then each session's inputs and each codec/framing call replayed
   alone on fresh objects and timed by CPU clock (see the comment at ``per_packet``), for the split:

     header/auth   Framer.finish / seal (header, AES-GCM) and Parser.parse (checks, open)
     coding        RLC encoder (add_source, add_stream_sources, repair_into) / decoder
                   (add_source, add_source_run, add_repair, read_into, release_before)
     state         the rest of the session: policy, feedback, loss accounting, block
                   completion (total minus the two above)

   The receiver's inputs are also replayed in runs of up to 64 consecutive datagrams
   through ReceiverSession.receive_datagrams (runs of data symbols decoded in one
   RLCDecoder.add_packets call; in-order sources in source runs), the total per datagram
   beside the per-datagram one and beside the runs without source runs; the
   sender's send calls in groups of 16 (one datagrams_to_send call for 16 due slots, as the
   goodput runs' engine asks: consecutive source slots go out in one source run), beside
   the same calls slot by slot (``SenderSession.source_runs`` off).

   The target (issue 4): the stages the PriorityFEC prototype measures (coding + state,
   i.e. feedback/state handling, policy, encoding, decoding; socket calls and
   authentication excluded; it spends about 30 us) under 5 us per packet.

2. Socket cost per datagram: a burst of 1324-byte datagrams over loopback, sendmsg with
   UDP GSO vs one send() each, recvmsg_into with UDP GRO vs one read each.

3. Loopback goodput: `kvtransport`'s own sender and receiver engines in two processes,
   --transfers transfers (default 1; rows "<config> later": the second and later ones) of
   --goodput-mb each, paced at an unreachable rate (the sender is then as fast as its CPU
   allows), with FEC (fixed RLC 1/16 or adaptive) and authentication on or
   off. Goodput = payload bytes the receiver decoded / seconds from its first datagram to
   completion. The machines are shared and noisy: the configurations are interleaved in
   --rounds rounds and medians reported, with the CPU seconds each process spent, and the
   CPU-bound goodput (bytes / the busier process's CPU seconds), i.e. what one core per
   side sustains, and each side's share of system time (socket work and first-touch page
   zeroing: on a VM whose host reclaims guest memory the latter swings from run to run)
   and page faults; --compare-prefault MB runs each beside ends that fault memory in at
   start-up (the daemons' --prefault-mb).
   Target: 1 Gbit/s with FEC and authentication on.

Writes results/bench_transport.json and prints tables. ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvtransport.hosts.receiver_host import DEFAULT_LINGER_S

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    ("fec+auth", "fixed:1/16", True),
    ("fec", "fixed:1/16", False),
    ("auth", "none", True),
    ("plain", "none", False),
    ("adaptive+auth", "adaptive", True),
    ("ddqn+auth", "ddqn", True),
]
KEY = bytes(range(32))
SYMBOL = 1280


# ------------------------------------------------------------------ per-packet cost
#
# Method: one recording run drives both sessions on a virtual clock and records (a) each
# session's inputs (the sender: its send times and the feedback it got; the receiver: the
# datagrams that survived the loss pattern, and its timer times) and (b) every call into
# the codec and the framing/parsing code, with copies of the inputs. Then each is replayed
# alone on fresh objects and timed with the process's CPU clock over the whole replay, so
# a busy machine's preemptions do not count: a session's replay gives its total per
# packet (the sessions are deterministic given their inputs), the call replays give the
# header/auth and coding shares, and state is the rest.


def _copy(x: object) -> object:
    if isinstance(x, memoryview | bytearray):
        return bytes(x)
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def _out_like(x: object) -> object:
    return np.zeros(len(x), dtype=np.uint8) if not isinstance(x, int) else x


# per method: which positional argument is an output buffer (replayed into a scratch one)
_OUTPUT_ARG = {"repair_into": 0, "read_into": 1}


class _Recorder:
    """Records constructor and method calls of the codec and framing classes, per side."""

    def __init__(self) -> None:
        self.side = "sender"
        self.calls: list[tuple] = []
        self.inside = False  # within a recorded call
        self._saved: list[tuple[type, str, object]] = []

    def _wrap(self, cls: type, name: str, stage: str) -> None:
        orig = getattr(cls, name)
        rec = self

        if name == "__init__":

            def f(obj: object, *a: object, **k: object) -> None:
                orig(obj, *a, **k)
                rec.calls.append((rec.side, stage, cls, id(obj), name, a, k))

        else:
            out_arg = _OUTPUT_ARG.get(name)

            def f(obj: object, *a: object, **k: object) -> object:
                if rec.inside:  # made by a recorded call (finish -> seal): its replay makes it
                    return orig(obj, *a, **k)
                args = tuple(_out_like(v) if i == out_arg else _copy(v) for i, v in enumerate(a))
                rec.calls.append((rec.side, stage, cls, id(obj), name, args, k))
                rec.inside = True
                try:
                    return orig(obj, *a, **k)
                finally:
                    rec.inside = False

        self._saved.append((cls, name, orig))
        setattr(cls, name, f)

    def install(self) -> _Recorder:
        from kvtransport.codecs.rlc import RLCDecoder, RLCEncoder

        from kvtransport.core.wire import Framer, Parser

        for cls, stage, methods in (
            (Framer, "header_auth", ("__init__", "finish", "seal")),
            (Parser, "header_auth", ("__init__", "parse")),
            (RLCEncoder, "coding", ("__init__", "add_source", "add_stream_sources",
                                    "repair_into")),
            (RLCDecoder, "coding", ("__init__", "add_source", "add_source_run", "add_repair",
                                    "read_into", "release_before")),
        ):  # fmt: skip
            for m in methods:
                self._wrap(cls, m, stage)
        return self

    def restore(self) -> None:
        for cls, name, orig in reversed(self._saved):
            setattr(cls, name, orig)
        self._saved.clear()

    def replay_seconds(self, side: str, stage: str) -> float:
        """CPU seconds the recorded calls of one side and stage take on fresh objects."""
        objs: dict[int, object] = {}
        todo = []
        for c_side, c_stage, cls, oid, name, a, k in self.calls:
            if c_side != side or c_stage != stage:
                continue
            if name == "__init__":
                objs[oid] = cls(*a, **k)
            elif oid in objs:
                todo.append((getattr(objs[oid], name), a, k))
        t0 = time.process_time()
        for fn, a, k in todo:
            try:
                fn(*a, **k)
            except Exception:  # a replayed parse of garbage raises, as it did live
                pass
        return time.process_time() - t0


def _make_pair(policy: str, key: bytes | None, n_packets: int) -> tuple:
    from kvtransport.core.receiver import ReceiverSession
    from kvtransport.core.sender import SenderSession
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.policies.registry import make_policy

    size = int(n_packets * SYMBOL * 0.9)
    tr = synthetic_transfer(size, max(1, size // 12_288), seed=1)

    def sender() -> object:
        return SenderSession(tr, make_policy(policy), rate_bps=1e9, deadline=1e3, key=key,
                             transfer_id=1, initial_rtt=1e-3)  # fmt: skip

    def receiver() -> object:
        return ReceiverSession(1, key=key, deadline=1e3)

    return sender, receiver


def _record_run(
    policy: str,
    key: bytes | None,
    n_packets: int,
    rec: _Recorder,
    owd: float = 50e-6,
    loss: float = 0.05,
) -> dict:
    """Both sessions on a virtual clock (``loss`` of the datagrams lost, deterministically;
    ``owd`` one way); records inputs and calls."""
    make_sender, make_receiver = _make_pair(policy, key, n_packets)
    rec.side = "sender"
    snd = make_sender()
    rec.side = "receiver"
    rcv = make_receiver()
    lost = np.random.default_rng(0).random(4 * n_packets) < loss
    s_in: list[tuple] = []  # ("send", t) | ("fb", t, data)
    r_in: list[tuple] = []  # ("rx", t, data) | ("timer", t)
    in_flight: list[tuple[float, bytes]] = []
    fb_flight: list[tuple[float, bytes]] = []
    sent = 0
    while not snd.done and sent < n_packets:
        cands = [x for x in (snd.next_timer(), rcv.next_timer()) if x is not None]
        cands += [in_flight[0][0]] if in_flight else []
        cands += [fb_flight[0][0]] if fb_flight else []
        now = min(cands)
        if fb_flight and fb_flight[0][0] <= now:
            _, f = fb_flight.pop(0)
            rec.side = "sender"
            s_in.append(("fb", now, f))
            snd.receive_datagram(f, now)
            continue
        if in_flight and in_flight[0][0] <= now:
            _, d = in_flight.pop(0)
            rec.side = "receiver"
            r_in.append(("rx", now, d))
            rcv.receive_datagram(d, now)
        elif (t := snd.next_timer()) is not None and t <= now:
            rec.side = "sender"
            s_in.append(("send", now))
            for d in snd.datagrams_to_send(now):
                if not lost[sent % lost.size]:
                    in_flight.append((now + owd, d))
                sent += 1
        else:
            rec.side = "receiver"
            r_in.append(("timer", now))
            rcv.handle_timer(now)
        rec.side = "receiver"
        for f in rcv.datagrams_to_send(now):
            fb_flight.append((now + owd, f))
    return {"s_in": s_in, "r_in": r_in, "sent": sent, "repairs": snd.repair_sent,
            "received": sum(1 for e in r_in if e[0] == "rx"), "factories": (make_sender,
            make_receiver)}  # fmt: skip


def _replay_sender(make_sender: object, s_in: list[tuple]) -> float:
    return _feed_sender(make_sender(), s_in)


def _feed_sender(snd: object, events: list[tuple]) -> float:
    """CPU seconds of feeding ``snd`` its recorded send calls and feedback."""
    t0 = time.process_time()
    for ev in events:
        if ev[0] == "send":
            snd.datagrams_to_send(ev[1])
        else:
            snd.receive_datagram(ev[2], ev[1])
    return time.process_time() - t0


def _replay_sender_runs(
    make_sender: object, s_in: list[tuple], source_runs: bool = True, compiled: bool = True
) -> float:
    """The sender's send calls in runs of up to SENDER_RUN consecutive ones (the goodput
    runs' engine asks for a burst's worth of slots at once, 17 to 49 a wake), each run one
    datagrams_to_send call at its last time: consecutive source slots then go out in one
    SenderSession._source_run (``source_runs`` False: slot by slot, the reference), sealed
    in one compiled call (``compiled`` False: one AESGCM call each, as before the run
    kernels)."""
    calls: list[tuple] = []
    for ev in s_in:
        if ev[0] == "send" and calls and calls[-1][0] == "send" and calls[-1][2] < SENDER_RUN:
            calls[-1] = ("send", ev[1], calls[-1][2] + 1)
        else:
            calls.append(("send", ev[1], 1) if ev[0] == "send" else ev)
    from kvtransport.codecs import aesgcm

    snd = make_sender()
    snd.source_runs = source_runs
    available = aesgcm.AVAILABLE
    aesgcm.AVAILABLE = compiled and available
    try:
        return _feed_sender(snd, calls)
    finally:
        aesgcm.AVAILABLE = available


def _replay_receiver(make_receiver: object, r_in: list[tuple]) -> float:
    rcv = make_receiver()
    t0 = time.process_time()
    for ev in r_in:
        if ev[0] == "rx":
            rcv.receive_datagram(ev[2], ev[1])
        else:
            rcv.handle_timer(ev[1])
        rcv.datagrams_to_send(ev[1])
    return time.process_time() - t0


RUN = 64
SENDER_RUN = 16  # MAX_CATCH_UP slots a call, none given up (kept for comparable rows)


def _replay_receiver_runs(
    make_receiver: object, r_in: list[tuple], source_runs: bool = True, laid_out: bool = False
) -> float:
    """The receiver's datagrams in runs of up to RUN consecutive ones (as a daemon reads a
    batch), through ReceiverSession.receive_datagrams at the run's last arrival time
    (``source_runs`` False: no source runs, the reference; ``laid_out``: each run in one
    buffer as a socket read leaves it, so source runs open in one compiled call)."""
    from kvtransport.core.wire import LaidOutDatagrams

    runs: list[tuple] = []
    for ev in r_in:
        if ev[0] == "rx" and runs and runs[-1][0] == "rx" and len(runs[-1][2]) < RUN:
            runs[-1] = ("rx", ev[1], runs[-1][2] + [ev[2]])
        else:
            runs.append(("rx", ev[1], [ev[2]]) if ev[0] == "rx" else ev)
    if laid_out:
        runs = [("rx", ev[1], LaidOutDatagrams.join(ev[2])) if ev[0] == "rx" else ev
                for ev in runs]  # fmt: skip
    rcv = make_receiver()
    rcv.source_runs = source_runs
    t0 = time.process_time()
    for ev in runs:
        if ev[0] == "rx":
            rcv.receive_datagrams(ev[2], ev[1])
        else:
            rcv.handle_timer(ev[1])
        rcv.datagrams_to_send(ev[1])
    return time.process_time() - t0


def per_packet(n_packets: int, repeats: int, owd: float = 50e-6, loss: float = 0.05) -> dict:
    from tqdm import tqdm

    out = {}
    warm = _Recorder()
    _record_run("fixed:1/16", KEY, 2000, warm)  # numba kernels loaded before timing
    bar = tqdm(total=len(CONFIGS), desc="per-packet cost", file=sys.stderr)
    for name, pol, auth in CONFIGS:
        key = KEY if auth else None
        rec = _Recorder().install()
        try:
            run = _record_run(pol, key, n_packets, rec, owd, loss)
        finally:
            rec.restore()
        make_sender, make_receiver = run["factories"]
        best: dict[str, float] = {}
        for _ in range(repeats):  # the minimum of repeats: least disturbed by the machine
            for k, v in (
                ("sender", _replay_sender(make_sender, run["s_in"])),
                ("sender_runs", _replay_sender_runs(make_sender, run["s_in"])),
                ("sender_slotwise", _replay_sender_runs(make_sender, run["s_in"], False)),
                (
                    "sender_runs_python_aead",
                    _replay_sender_runs(make_sender, run["s_in"], compiled=False),
                ),
                ("receiver", _replay_receiver(make_receiver, run["r_in"])),
                ("receiver_runs", _replay_receiver_runs(make_receiver, run["r_in"])),
                (
                    "receiver_runs_laid_out",
                    _replay_receiver_runs(make_receiver, run["r_in"], laid_out=True),
                ),
                (
                    "receiver_runs_off",
                    _replay_receiver_runs(make_receiver, run["r_in"], False),
                ),
                ("sender_header_auth", rec.replay_seconds("sender", "header_auth")),
                ("sender_coding", rec.replay_seconds("sender", "coding")),
                ("receiver_header_auth", rec.replay_seconds("receiver", "header_auth")),
                ("receiver_coding", rec.replay_seconds("receiver", "coding")),
            ):
                best[k] = min(best.get(k, v), v)
        row = {"policy": pol, "auth": auth, "loss": loss, "sent": run["sent"],
               "repairs": run["repairs"], "received": run["received"]}  # fmt: skip
        for side, n in (("sender", run["sent"]), ("receiver", run["received"])):
            total = best[side] / n * 1e6
            hdr = best[f"{side}_header_auth"] / n * 1e6
            cod = best[f"{side}_coding"] / n * 1e6
            state = total - hdr - cod
            row[side] = {
                "total_us": round(total, 3),
                "header_auth_us": round(hdr, 3),
                "coding_us": round(cod, 3),
                "state_us": round(state, 3),
                "priorityfec_stages_us": round(cod + state, 3),
            }
        row["receiver"]["runs_total_us"] = round(best["receiver_runs"] / run["received"] * 1e6, 3)
        row["receiver"]["runs_off_total_us"] = round(
            best["receiver_runs_off"] / run["received"] * 1e6, 3
        )
        row["receiver"]["runs_laid_out_total_us"] = round(
            best["receiver_runs_laid_out"] / run["received"] * 1e6, 3
        )
        row["sender"]["runs_total_us"] = round(best["sender_runs"] / run["sent"] * 1e6, 3)
        row["sender"]["runs_python_aead_total_us"] = round(
            best["sender_runs_python_aead"] / run["sent"] * 1e6, 3
        )
        row["sender"]["slotwise_total_us"] = round(best["sender_slotwise"] / run["sent"] * 1e6, 3)
        out[name] = row
        bar.update(1)
    bar.close()
    return out


# ------------------------------------------------------------------ socket cost


def socket_cost(n: int = 20000, repeats: int = 5) -> dict:
    from kvtransport.daemons.udp import DatagramSocket

    payload = [bytes(1324)] * 16
    res = {}
    for gso, gro in ((True, True), (False, False)):
        send_t, recv_t = [], []
        for _ in range(repeats):
            with DatagramSocket(("127.0.0.1", 0), gro=gro) as rx:
                with DatagramSocket(("127.0.0.1", 0), rx.address, gso=gso) as tx:
                    got = 0
                    s_acc = r_acc = 0.0
                    for _ in range(n // 16):
                        a = time.perf_counter()
                        tx.send(payload)
                        b = time.perf_counter()
                        got += len(rx.recv_batch())
                        c = time.perf_counter()
                        s_acc += b - a
                        r_acc += c - b
                    end = time.monotonic() + 1.0
                    while got < n and time.monotonic() < end:
                        a = time.perf_counter()
                        got += len(rx.recv_batch())
                        r_acc += time.perf_counter() - a
            send_t.append(s_acc / n * 1e6)
            recv_t.append(r_acc / max(got, 1) * 1e6)
        res["gso_gro" if gso else "plain"] = {
            "send_us": round(min(send_t), 3),
            "recv_us": round(min(recv_t), 3),
        }
    return res


# ------------------------------------------------------------------ goodput


def _role_recv(args: argparse.Namespace) -> None:
    """Child: receive --transfers transfers one after another (one host, as the daemon's);
    print each one's figures as a JSON line."""
    from kvtransport.daemons.daemon import warm_up
    from kvtransport.daemons.daemon_receiver import ReceiverEngine, ReceiverHost
    from kvtransport.daemons.udp import DatagramSocket, clock, set_realtime, wait_readable

    if args.realtime:
        set_realtime(5)
    _heap_setup(args)
    key = KEY if args.auth else None
    warm_up(key)
    if args.no_source_runs:  # the reference: no source runs
        from kvtransport.core.receiver import ReceiverSession

        ReceiverSession.source_runs = False
    results: list = []
    rows = []
    with DatagramSocket((args.rcv_addr, 0), buffer_bytes=32 << 20) as sock:
        host = ReceiverHost(key=key, max_bytes=2 << 30, budget_bytes=4 << 30)
        eng = ReceiverEngine(sock, host, on_result=results.append)
        print(sock.address[1], flush=True)
        end = time.monotonic() + 60 * args.transfers
        while len(rows) < args.transfers and time.monotonic() < end:
            cpu0, use0 = None, resource.getrusage(resource.RUSAGE_SELF)
            while not results and time.monotonic() < end:
                if wait_readable([sock], 0.05):
                    if cpu0 is None:  # this transfer's first datagram
                        cpu0 = time.process_time()
                        use0 = resource.getrusage(resource.RUSAGE_SELF)
                    eng.on_readable(clock())
                eng.run_due(clock())
            if not results:
                break
            cpu, use = time.process_time() - (cpu0 or 0.0), _usage_since(use0)
            s = results.pop().session
            first = s.timings["first_packet"]
            done = s.timings.get("complete", s.timings["finished"])
            nbytes = min(s.n_known * s.symbol_size, s.manifest.payload_len if s.manifest else 0)
            rows.append({
                "seconds": done - first, "bytes": nbytes, "reason": s.result.reason,
                "cpu_s": cpu, "received": s.source_received + s.repair_received,
                "lost": s.monitor.lost, "recovered": s.symbols_recovered,
                "socket": dict(sock.stats), **use,
            })  # fmt: skip
            del s  # its buffers may go once the host lets the session go (memory reuse)
            print(json.dumps(rows[-1]), flush=True)
    if len(rows) < args.transfers:
        print(json.dumps({"error": f"{len(rows)} of {args.transfers} results"}), flush=True)


def _role_send(args: argparse.Namespace) -> None:
    """Child: send --transfers transfers one after another (each --gap-s after the last
    has ended, a new transfer id each); print each one's figures as a JSON line."""
    from kvtransport.core.transfer import synthetic_transfer
    from kvtransport.daemons.daemon import warm_up
    from kvtransport.daemons.daemon_sender import SenderEngine, SenderHost
    from kvtransport.daemons.udp import DatagramSocket, clock, set_realtime, wait_readable

    if args.realtime:
        set_realtime(5)
    _heap_setup(args)
    key = KEY if args.auth else None
    warm_up(key, ("fixed:1/4", args.policy))  # as the sender daemon warms its default
    size = int(args.goodput_mb * 1e6)
    dest = (args.rcv_addr, args.port)
    with DatagramSocket(("0.0.0.0", 0), dest, buffer_bytes=32 << 20) as sock:
        # no queue guard unless asked: a receiver behind on CPU queues in its socket buffer,
        # and the bench measures what each side costs at the given rate, not how a guard
        # would pace (--queue-guard: how the product's guard copes with that receiver)
        host = SenderHost(rate_bps=args.rate_gbps * 1e9, key=key, burst_s=200e-6,
                          queue_guard=args.queue_guard)  # fmt: skip
        eng = SenderEngine(sock, host)
        for i in range(args.transfers):
            if i:
                time.sleep(args.gap_s)
            tr = synthetic_transfer(size, max(1, size // 12_288), seed=2 + i)
            cpu0 = time.process_time()
            use0 = resource.getrusage(resource.RUSAGE_SELF)
            out = eng.submit(tr, dest, now=clock(), deadline_s=30.0, policy=args.policy,
                             initial_rtt=1e-3)  # fmt: skip
            del tr  # the session holds the payload; nothing else keeps it past the transfer
            while host.active:
                eng.run_due(clock())
                wake = eng.next_wake()
                timeout = 0.0 if wake is None else max(0.0, min(0.01, wake - clock()))
                if wait_readable([sock], timeout):
                    eng.on_readable(clock())
            cpu = time.process_time() - cpu0
            use = _usage_since(use0)
            st = out.status(clock())
            del out  # as tr: the next transfer may reuse its memory
            print(json.dumps({"cpu_s": cpu, "status": st, "socket": dict(sock.stats), **use}),
                  flush=True)  # fmt: skip


def _heap_setup(args: argparse.Namespace) -> None:
    """Either end's memory as the daemon commands set it (--prefault-mb:
    kvtransport.daemons.heap)."""
    import logging

    from kvtransport.commands import _common

    _common.setup_memory(args, logging.getLogger("bench"))


def _usage_since(before: resource.struct_rusage) -> dict:
    """The process's system CPU seconds since ``before``: the kernel's socket work, and
    the zeroing of each page the process touches first (numpy asks for 2 MB pages), which
    on a VM whose host reclaims guest memory (a balloon, DAMON) can cost more than the
    protocol's own work and varies from run to run."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {"sys_s": now.ru_stime - before.ru_stime, "faults": now.ru_minflt - before.ru_minflt}


def _goodput_once(v: _Variant, args: argparse.Namespace) -> list[dict]:
    """--transfers transfers of set-up ``v``, one after another, between one pair of ends,
    on loopback or (``args.veth``) across the veth pair of ``_veth_pair``; the figures of
    each (``_Variant``'s fields say what each end runs)."""
    env = {**os.environ, **v.env}
    me = [sys.executable, str(Path(__file__).resolve())]
    rx_me, tx_me = me, me
    if args.veth:
        rx_me = ["ip", "netns", "exec", VETH_NS["rcv"], *me]
        tx_me = ["ip", "netns", "exec", VETH_NS["snd"], *me]
    common = ["--goodput-mb", str(args.goodput_mb), "--rate-gbps", str(args.rate_gbps)]
    common += ["--rcv-addr", VETH_ADDR["rcv"] if args.veth else "127.0.0.1"]
    common += ["--transfers", str(args.transfers), "--gap-s", str(args.gap_s)]
    common += ["--prefault-mb", str(v.prefault_mb)]
    common += ["--auth"] if v.auth else []
    common += ["--realtime"] if args.realtime else []
    common += ["--queue-guard"] if v.queue_guard else []
    rx_only = [] if v.source_runs else ["--no-source-runs"]
    rx = subprocess.Popen(
        [*rx_me, "_recv", *common, *rx_only], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        port = int(rx.stdout.readline())
        tx = subprocess.run(
            [*tx_me, "_send", "--port", str(port), "--policy", v.policy, *common],
            capture_output=True, text=True, timeout=120 * args.transfers, env=env,
        )  # fmt: skip
        rs = [json.loads(line) for line in rx.stdout.read().splitlines() if line.strip()]
        rx.wait(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    if tx.returncode != 0 or not rs or "error" in rs[-1]:
        raise RuntimeError(f"goodput run failed: {tx.stderr[-500:]} {rs[-1:]}")
    ss = [json.loads(line) for line in tx.stdout.strip().splitlines()[-len(rs) :]]
    return [_goodput_figures(r, s) for r, s in zip(rs, ss, strict=True)]


def _goodput_figures(r: dict, s: dict) -> dict:
    """One transfer's figures from the receiver's (``r``) and the sender's (``s``) lines."""
    gbps = r["bytes"] * 8 / r["seconds"] / 1e9
    busy = max(r["cpu_s"], s["cpu_s"])
    return {
        "goodput_gbps": gbps,
        "cpu_bound_gbps": r["bytes"] * 8 / busy / 1e9 if busy > 0 else None,
        "sender_cpu_s": s["cpu_s"],
        "receiver_cpu_s": r["cpu_s"],
        "seconds": r["seconds"],
        "reason": r["reason"],
        "loss": r["lost"] / max(r["lost"] + r["received"], 1),
        "recovered": r["recovered"],
        "repairs": s["status"]["repair_sent"],
        "srtt_ms": s["status"]["srtt_ms"] or 0.0,
        "sender_us_per_datagram": s["cpu_s"] / max(s["status"]["datagrams_sent"], 1) * 1e6,
        # the sender's own timing of its policy decisions, in the daemon between sendmsg
        # calls (every policy decides once per interval; 0 if the transfer made none)
        "decision_mean_us": (s["status"]["decisions"] or {}).get("mean_us", 0.0),
        "decision_p99_us": (s["status"]["decisions"] or {}).get("p99_us", 0.0),
        "receiver_us_per_datagram": r["cpu_s"] / max(r["received"], 1) * 1e6,
        "receiver_sys_share": r["sys_s"] / r["cpu_s"] if r["cpu_s"] > 0 else 0.0,
        "sender_sys_share": s["sys_s"] / s["cpu_s"] if s["cpu_s"] > 0 else 0.0,
        "receiver_faults": r["faults"],
        "sender_faults": s["faults"],
    }


VETH_NS = {"snd": "kvbench-snd", "rcv": "kvbench-rcv"}
VETH_ADDR = {"snd": "10.78.0.1", "rcv": "10.78.0.2"}


@contextlib.contextmanager
def _veth_pair() -> Iterator[None]:
    """Two network namespaces joined by a plain veth pair (no qdisc, the kernel's default
    offloads: UDP GSO and GRO cross it), removed afterwards. Needs root."""
    if os.geteuid() != 0:
        raise SystemExit("bench_transport.py: --veth needs root (network namespaces)")
    snd, rcv = VETH_NS["snd"], VETH_NS["rcv"]
    plan = [
        f"ip netns add {snd}", f"ip netns add {rcv}",
        f"ip link add kvb-s netns {snd} type veth peer name kvb-r netns {rcv}",
        f"ip -n {snd} addr add {VETH_ADDR['snd']}/24 dev kvb-s",
        f"ip -n {rcv} addr add {VETH_ADDR['rcv']}/24 dev kvb-r",
        f"ip -n {snd} link set dev kvb-s up", f"ip -n {rcv} link set dev kvb-r up",
        f"ip -n {snd} link set dev lo up", f"ip -n {rcv} link set dev lo up",
    ]  # fmt: skip
    try:
        for cmd in plan:
            done = subprocess.run(cmd.split(), capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"bench_transport.py: `{cmd}` failed: {done.stderr.strip()}")
        yield
    finally:
        for ns in (snd, rcv):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _aead_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """The cipher set-ups each goodput configuration is run beside (name suffix, both
    ends' extra environment): --compare-aead's per-datagram AESGCM calls, and
    --compare-libcrypto's other libcrypto for the compiled kernels."""
    from kvtransport.codecs import aesgcm

    out = []
    if args.compare_aead:
        out.append(("aead-python", {aesgcm.AEAD_ENV: "python"}))
    if args.compare_libcrypto:
        out.append(("other-libcrypto", {aesgcm.LIBCRYPTO_ENV: args.compare_libcrypto}))
    return out


def _libcrypto_version_of(path: str | None) -> str | None:
    """The OpenSSL version the kernels run on with KVTRANSPORT_LIBCRYPTO=``path`` (None:
    no path); exits with the loader's one-line reason where it does not load."""
    if not path:
        return None
    from kvtransport.codecs import aesgcm

    code = "from kvtransport.codecs import aesgcm; print(aesgcm.libcrypto_version())"
    env = {**os.environ, aesgcm.LIBCRYPTO_ENV: path}
    env.pop(aesgcm.AEAD_ENV, None)
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if got.returncode != 0:
        why = got.stderr.strip().splitlines()[-1].split("UserError: ", 1)[-1]
        raise SystemExit(f"bench_transport.py: --compare-libcrypto: {why}")
    return got.stdout.strip()


def goodput(args: argparse.Namespace) -> dict:
    with _veth_pair() if args.veth else contextlib.nullcontext():
        return _goodput_rounds(args)


class _Variant(NamedTuple):
    """One goodput row's set-up: its name, the sender's policy, authentication, the
    receiver's held source runs, both ends' extra environment (``_aead_variants``: one
    AESGCM call per datagram, another libcrypto), their --prefault-mb (_heap_setup), and
    the sender's queue guard."""

    name: str
    policy: str
    auth: bool
    source_runs: bool = True
    env: dict[str, str] = {}
    prefault_mb: float = 0.0
    queue_guard: bool = False


def _variants(args: argparse.Namespace) -> list[_Variant]:
    """The --configs, each beside the set-ups the --compare-* options ask for."""
    variants = [
        _Variant(name, pol, auth, queue_guard=args.queue_guard)
        for name, pol, auth in CONFIGS
        if name in args.configs
    ]
    others: list[tuple[str, dict]] = []  # (name suffix, what differs)
    if args.compare_receiver_runs:  # each beside its receiver without held source runs
        others.append(("rx-runs-off", {"source_runs": False}))
    for suffix, env in _aead_variants(args):  # each beside its other cipher set-ups
        others.append((suffix, {"env": env}))
    if args.compare_prefault:  # each beside ends that fault memory in at start-up
        others.append(("prefault", {"prefault_mb": args.compare_prefault}))
    if args.compare_queue_guard:  # each beside a sender under the queue guard
        others.append(("guarded", {"queue_guard": True}))
    for suffix, change in others:
        variants = [
            w for v in variants for w in (v, v._replace(name=f"{v.name} {suffix}", **change))
        ]
    return variants


def _goodput_rounds(args: argparse.Namespace) -> dict:
    """Each variant's medians over --rounds interleaved rounds: its first transfer per pair
    of ends under its name, with --transfers N the later ones under "<name> later"."""
    from tqdm import tqdm

    variants = _variants(args)
    runs: dict[str, list[dict]] = {}
    bar = tqdm(total=len(variants) * args.rounds, desc="loopback goodput", file=sys.stderr)
    for _ in range(args.rounds):
        for v in variants:  # interleaved: noise hits all alike
            first, *later = _goodput_once(v, args)
            runs.setdefault(v.name, []).append(first)
            if later:
                runs.setdefault(f"{v.name} later", []).extend(later)
            bar.update(1)
    bar.close()
    setups = {v.name: v for v in variants}
    out = {}
    for name, rs in runs.items():
        v = setups[name.removesuffix(" later")]
        med = {k: statistics.median(r[k] for r in rs)
               for k in rs[0] if isinstance(rs[0][k], int | float)}  # fmt: skip
        med["policy"], med["auth"], med["reasons"] = v.policy, v.auth, [r["reason"] for r in rs]
        med["goodput_gbps_runs"] = [round(r["goodput_gbps"], 3) for r in rs]
        med["cpu_bound_gbps_runs"] = [round(r["cpu_bound_gbps"] or 0.0, 3) for r in rs]
        med["receiver_us_per_datagram_runs"] = [round(r["receiver_us_per_datagram"], 2) for r in rs]
        med["receiver_sys_share_runs"] = [round(r["receiver_sys_share"], 3) for r in rs]
        med["receiver_faults_runs"] = [r["receiver_faults"] for r in rs]
        med["repairs_runs"] = [r["repairs"] for r in rs]
        out[name] = med
    return out


def _table(pp: dict, sock: dict, gp: dict | None, link: str = "loopback") -> str:
    loss = next(iter(pp.values()))["loss"] if pp else 0.05
    lines = [f"per-packet cost, us (1 Gbit/s, {100 * loss:g}% loss, in memory; 'stages' = "
             "coding + state, the PriorityFEC stages; target < 5)"]  # fmt: skip
    lines.append(f"{'config':15s} {'side':9s} {'hdr/auth':>9s} {'coding':>8s} {'state':>8s} "
                 f"{'stages':>8s} {'total':>8s}")  # fmt: skip
    for name, row in pp.items():
        for side in ("sender", "receiver"):
            c = row[side]
            lines.append(
                f"{name:15s} {side:9s} {c['header_auth_us']:9.2f} {c['coding_us']:8.2f} "
                f"{c['state_us']:8.2f} {c['priorityfec_stages_us']:8.2f} {c['total_us']:8.2f}"
            )
        c = row["sender"]
        lines.append(f"{name:15s} {'sender':9s} total in calls of {SENDER_RUN} slots: "
                     f"{c['runs_total_us']:.2f} in source runs (compiled sealing; "
                     f"{c['runs_python_aead_total_us']:.2f} one AESGCM call each), "
                     f"{c['slotwise_total_us']:.2f} slot by slot")  # fmt: skip
        c = row["receiver"]
        lines.append(f"{name:15s} {'receiver':9s} total in runs of {RUN} "
                     f"(receive_datagrams): {c['runs_laid_out_total_us']:.2f} laid out "
                     f"(compiled source runs), {c['runs_total_us']:.2f} as a list, source "
                     f"runs off {c['runs_off_total_us']:.2f}")  # fmt: skip
    lines.append("")
    lines.append("socket cost per datagram, us (1324-byte datagrams, loopback)")
    for name, c in sock.items():
        lines.append(f"  {name:10s} send {c['send_us']:6.2f}   recv {c['recv_us']:6.2f}")
    if gp:
        base = gp["plain"]["goodput_gbps"] if "plain" in gp else float("nan")
        lines.append("")
        lines.append(f"{link} goodput (medians; CPU-bound = bytes / busier process's CPU s)")
        w = max(15, *(len(name) for name in gp))
        lines.append(f"{'config':{w}s} {'Gbit/s':>7s} {'vs plain':>8s} {'CPU-bound':>9s} "
                     f"{'snd us/dg':>9s} {'rcv us/dg':>9s} {'snd/rcv sys':>11s} {'loss':>6s} "
                     f"{'decision us mean/p99':>21s}")  # fmt: skip
        for name, c in gp.items():
            lines.append(
                f"{name:{w}s} {c['goodput_gbps']:7.3f} {c['goodput_gbps'] / base:8.2f} "
                f"{c['cpu_bound_gbps']:9.3f} {c['sender_us_per_datagram']:9.2f} "
                f"{c['receiver_us_per_datagram']:9.2f} {100 * c['sender_sys_share']:4.0f}% / "
                f"{100 * c['receiver_sys_share']:3.0f}% {100 * c['loss']:5.1f}% "
                f"{c['decision_mean_us']:10.2f} / {c['decision_p99_us']:6.2f}"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", nargs="?", default="bench", choices=("bench", "_send", "_recv"),
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--packets", type=int, default=20000, help="per-packet run length")
    p.add_argument("--repeats", type=int, default=3, help="per-packet repeats (best kept)")
    p.add_argument("--loss-pct", type=float, default=5.0,
                   help="per-packet runs: datagrams lost, percent (default 5)")  # fmt: skip
    p.add_argument("--owd-us", type=float, default=50.0,
                   help="per-packet runs: one-way delay (default 50)")  # fmt: skip
    p.add_argument("--goodput-mb", type=float, default=40.0, help="goodput transfer size")
    p.add_argument("--rounds", type=int, default=3, help="goodput rounds (medians)")
    p.add_argument("--rate-gbps", type=float, default=20.0, help="pacing rate (unreachable)")
    p.add_argument("--realtime", action="store_true", help="run the goodput ends SCHED_FIFO")
    p.add_argument("--queue-guard", action="store_true",
                   help="the sender paces under the product's queue guard (off by default: "
                        "the rows measure each side's cost at an unreachable rate)")  # fmt: skip
    p.add_argument("--no-goodput", action="store_true", help="skip the loopback runs")
    p.add_argument(
        "--configs",
        default=",".join(c[0] for c in CONFIGS),
        help="goodput runs: the configurations, comma-separated (default all)",
    )
    p.add_argument(
        "--compare-receiver-runs",
        action="store_true",
        help="goodput runs: each configuration also with the receiver's source runs off "
        "(ReceiverSession.source_runs), interleaved",
    )
    p.add_argument(
        "--compare-aead",
        action="store_true",
        help="goodput runs: each configuration also with one AESGCM call per datagram at "
        "both ends instead of the compiled run kernels (KVTRANSPORT_AEAD=python), interleaved",
    )
    p.add_argument(
        "--compare-libcrypto",
        metavar="PATH",
        help="goodput runs: each configuration also with both ends' compiled AES-GCM "
        "kernels on this libcrypto (KVTRANSPORT_LIBCRYPTO, e.g. a newer OpenSSL than the "
        "system's), interleaved",
    )
    p.add_argument("--transfers", type=int, default=1,
                   help="goodput runs: transfers per pair of ends, one after another; the "
                   "rows '<config> later' are the second and later ones (default 1)")  # fmt: skip
    p.add_argument("--gap-s", type=float, default=DEFAULT_LINGER_S + 0.5,
                   help="goodput runs: seconds between one transfer's end and the next one's "
                   "start (default: the receiver's linger after a result, %(default)g s, "
                   "so that the last transfer's session has gone)")  # fmt: skip
    p.add_argument("--compare-queue-guard", action="store_true",
                   help="goodput runs: each configuration also with the sender under the "
                   "product's queue guard (--queue-guard), interleaved")  # fmt: skip
    p.add_argument("--compare-prefault", type=float, default=0.0, metavar="MB",
                   help="goodput runs: each configuration also with both ends faulting in MB "
                   "of memory at start-up (the daemons' --prefault-mb), interleaved")  # fmt: skip
    p.add_argument("--prefault-mb", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--veth",
        action="store_true",
        help="goodput runs: the two ends in two network namespaces joined by a veth pair "
        "(root; default offloads) instead of on loopback",
    )
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_transport.json"),
                   help="the JSON file to write, or a folder to write bench_transport.json "
                   "in (default results/bench_transport.json)")  # fmt: skip
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rcv-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="fixed:1/16", help=argparse.SUPPRESS)
    p.add_argument("--auth", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-source-runs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "_recv":
        _role_recv(args)
        return 0
    if args.role == "_send":
        _role_send(args)
        return 0
    if args.quick:
        args.packets, args.repeats, args.goodput_mb, args.rounds = 4000, 1, 8.0, 1
    if args.transfers < 1 or args.compare_prefault < 0 or args.gap_s < 0:
        p.error("--transfers must be at least 1, --compare-prefault and --gap-s not negative")
    if not 0.0 <= args.loss_pct < 100.0:
        p.error(f"--loss-pct must be in [0, 100), got {args.loss_pct:g}")
    out = Path(args.out)
    if out.is_dir() or not out.suffix:  # a folder, as bench_codec.py's --out
        out = out / "bench_transport.json"
    names = [c[0] for c in CONFIGS]
    args.configs = args.configs.split(",")
    if unknown := [c for c in args.configs if c not in names]:
        p.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
    from kvtransport.codecs import aesgcm

    other = _libcrypto_version_of(args.compare_libcrypto)  # a bad path stops here, at once
    pp = per_packet(args.packets, args.repeats, args.owd_us * 1e-6, args.loss_pct / 100.0)
    sock = socket_cost(n=4000 if args.quick else 20000, repeats=2 if args.quick else 5)
    gp = None if args.no_goodput else goodput(args)
    result = {
        "per_packet": pp,
        "socket": sock,
        "goodput": gp,
        "targets": {
            "stages_under_5us": {
                name: {
                    side: row[side]["priorityfec_stages_us"] < 5.0
                    for side in ("sender", "receiver")
                }
                for name, row in pp.items()
            },  # fmt: skip
            "goodput_fec_auth_1gbps": None
            if gp is None or "fec+auth" not in gp
            else gp["fec+auth"]["goodput_gbps"] >= 1.0,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "python": platform.python_version(),
            "libcrypto": aesgcm.libcrypto_version(),
            "other_libcrypto": other,
            "host": socket.gethostname(),
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("role", "port")},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(_table(pp, sock, gp, "veth-pair" if args.veth else "loopback"))
    print(f"\nAES-GCM kernels on {aesgcm.libcrypto_version()}"
          + (f"; other-libcrypto rows on {other}" if other else ""))  # fmt: skip
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
