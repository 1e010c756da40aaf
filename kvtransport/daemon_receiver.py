"""The receiving side over real UDP: :class:`ReceiverEngine` and :class:`ReceiverDaemon`.

:class:`ReceiverEngine` is the data plane: one UDP socket (GRO, kvtransport.udp) and one
:class:`~kvtransport.receiver.ReceiverSession` per transfer, found by the transfer id in
the datagram header. ``on_readable(now)`` reads every waiting datagram in one batch and
hands each to its session, then sends the feedback the batch produced back to the address
the transfer's datagrams come from; ``run_due(now)`` fires the sessions' timers (periodic
feedback, deadline, idle expiry).

A transfer's session is created by its first datagram that authenticates and parses (with
the daemon's key; any data-path type). Waiting for the manifest instead would drop the
sources that arrive before the first manifest datagram that survives the link (the
manifest is interleaved with data; on ge-heavy the first one is lost one time in eight);
the session holds them until the manifest says what they are.

What bounds the state (every datagram is attacker-controlled):

- ``max_transfers`` sessions at once (a session that finished inside the current batch
  no longer counts); a new transfer beyond that is dropped and counted
  (``over_capacity``), never an old one evicted;
- ``max_bytes`` per transfer: the session refuses symbols beyond it and a manifest
  announcing more (``too_large``);
- ``budget_bytes`` for all of them: the output buffers of the sessions held (receiving,
  or finished and lingering) never exceed it; a session that would is refused its
  symbols (``over_budget``) or, at its manifest, the whole transfer (result reason
  ``refused``);
- every session ends by itself: at its deadline (from the manifest, counted from its first
  datagram), on the sender's ABORT, when everything is decoded, or ``idle_timeout``
  seconds after its last datagram when no manifest came;
- a finished session lingers ``linger_s`` to remind a sender that missed the final
  feedback; then its id goes to a bounded list of recent ids whose late datagrams are
  dropped (``finished_transfer``) instead of opening a new session;
- with a ``replay`` record (kvtransport.replay; the daemon and the ``recv`` command keep
  one on disk), a manifest that is stale or was accepted before (a captured transfer
  played again, even after a restart) ends its session with nothing delivered (reason
  ``replayed``, no result handed on, counted in ``replays_refused`` and by reason in the
  drops); the record is saved after each batch that accepted a manifest, before any
  result of that batch goes out.

Garbage never reaches a session unless it carries a known transfer id; there it is
counted by reason in the session's ``drop_reasons`` (bad tag, truncated, ...), elsewhere
in the engine's. Each finished transfer goes to ``on_result(incoming)``.

:class:`ReceiverDaemon` adds the ZeroMQ control socket (status, abort, stats, ping), the
PUB socket that publishes every result (kvtransport.api) and ``--out-dir`` result files.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from kvtransport.api import load_json_header
from kvtransport.daemon import DaemonShell, DropCounts
from kvtransport.errors import UserError
from kvtransport.receiver import ReceiverSession
from kvtransport.replay import DEFAULT_WINDOW_S, ReplayRecord, open_record
from kvtransport.transfer import TransportManifest
from kvtransport.udp import DatagramSocket, clock
from kvtransport.wire import HEADER_SIZE, DatagramType, Parser, WireError

log = logging.getLogger("kvtransport.receiver-daemon")

DEFAULT_MAX_TRANSFERS = 16
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_LINGER_S = 1.0
DEFAULT_BUDGET_BYTES = 1 << 30
"""Output-buffer bytes all transfers held at once may take (``budget_bytes``)."""
MAX_IDLE_TIMEOUT_S = 3600.0
PUB_HWM = 64
"""Results queued per subscriber in ZeroMQ before the daemon's own backlog takes over."""
PUB_BACKLOG = 1024
"""Results the daemon holds for lagging subscribers before it gives the oldest up."""
RECENT_IDS = 4096
BATCH = 256
"""Datagrams handled between two feedback flushes: a backlog is worked off in slices, so
feedback (and its echo of the highest packet) is never held back by a long batch."""
_TID = struct.Struct("!Q")


@dataclass
class Incoming:
    """One transfer the engine receives (or received), and its reporting."""

    transfer_id: int
    session: ReceiverSession
    peer: Any
    created: float
    state: str = "receiving"
    finished: float | None = None
    datagrams: int = 0

    def stats(self, now: float) -> dict[str, Any]:
        s = self.session
        res = s.result
        t0 = s.timings.get("first_packet", self.created)
        timings = {k: round(v - t0, 6) for k, v in s.timings.items() if k != "first_packet"}
        m = s.manifest
        mon = s.monitor
        return {
            "transfer_id": f"{self.transfer_id:016x}",
            "state": self.state,
            "reason": res.reason if res is not None else "",
            "from": f"{self.peer[0]}:{self.peer[1]}",
            "utility": round(float(res.utility_recovered if res else s.utility), 6),
            "manifest": m is not None,
            "bytes": m.payload_len if m is not None else None,
            "blocks": len(m.blocks) if m is not None else None,
            "blocks_complete": s.blocks_complete,
            "n_source": s.n_source,
            "symbols_known": s.n_known,
            "decoded_through": s.through,
            "datagrams": self.datagrams,
            "source_received": s.source_received,
            "repair_received": s.repair_received,
            "symbols_recovered": s.symbols_recovered,
            "duplicates": s.duplicates,
            "datagrams_lost": mon.lost,
            "highest_seq": mon.highest,
            "loss_rate": round(float(mon.loss_rate), 5),
            "dropped": s.dropped,
            "drop_reasons": dict(s.drop_reasons),
            "feedback_sent": s.feedback_sent,
            "timings_s": timings,
            "elapsed_s": round((self.finished if self.finished is not None else now) - t0, 6),
        }


class ReceiverEngine(DropCounts):
    """Receiver sessions behind one UDP socket (see the module docstring).

    ``single``: the ``recv`` command's mode: the first transfer is the only one; datagrams
    of any other transfer id are dropped as ``foreign_transfer``.
    """

    def __init__(
        self,
        sock: DatagramSocket,
        *,
        key: bytes | None = None,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        linger_s: float = DEFAULT_LINGER_S,
        single: bool = False,
        on_result: Any = None,
        budget_bytes: int | None = None,
        replay: ReplayRecord | None = None,
    ) -> None:
        if max_transfers < 1 or max_bytes < 1 or not 0 < idle_timeout <= MAX_IDLE_TIMEOUT_S:
            raise UserError(
                "max transfers and max bytes must be positive, the idle timeout in "
                f"(0, {MAX_IDLE_TIMEOUT_S:g}] s"
            )
        self.budget_bytes = (
            max(max_bytes, DEFAULT_BUDGET_BYTES) if budget_bytes is None else budget_bytes
        )
        if self.budget_bytes < 1:
            raise UserError("the memory budget must be positive")
        self.held_bytes = 0  # output buffers granted to sessions not yet forgotten
        self.sock = sock
        self.key = key
        self.parser = Parser(key)
        self.max_transfers = max_transfers
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self.linger_s = linger_s
        self.single = single
        self.on_result = on_result
        self.replay = replay
        self.replays_refused = 0
        self.active: dict[int, Incoming] = {}
        self.lingering: OrderedDict[int, Incoming] = OrderedDict()
        self.recent: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.adopted: int | None = None
        self.drop_reasons: dict[str, int] = {}
        self.dropped = 0
        self.results = 0
        self._retired_drops: dict[str, int] = {}  # sessions' drops, once they are forgotten
        self._retired_dropped = 0

    # ------------------------------------------------------------------ datagrams

    def on_readable(self, now: float) -> None:
        """The waiting datagrams (at most ``BATCH`` of them) to their sessions; then the
        feedback they caused goes out, stamped with the time it really leaves."""
        active = self.active
        touched: dict[int, Incoming] = {}
        t0 = clock()
        unpack = _TID.unpack_from
        # consecutive datagrams: one lookup, and one receive_datagrams call per run of
        # them (the run goes to its session before anything of another transfer); the
        # first datagram (tid != -1) sets both
        last_tid = -1
        inc = cast(Incoming, None)
        receive = cast(Callable[[list[memoryview], float], object], None)
        run: list[memoryview] = []
        for data, addr in self.sock.recv_batch(BATCH):
            if len(data) < HEADER_SIZE:
                self._drop("truncated")
                continue
            tid = unpack(data, 8)[0]
            if tid != last_tid:
                if run:
                    receive(run, now)
                    run = []
                found = active.get(tid)
                if found is None:
                    found = self.lingering.get(tid)
                    if found is None:
                        found = self._admit(tid, data, addr, now)
                        if found is None:
                            last_tid = -1
                            continue
                inc = found
                last_tid, receive = tid, inc.session.receive_datagrams
                touched[tid] = inc
            inc.datagrams += 1
            run.append(data)
        if run:
            receive(run, now)
        replay = self.replay
        if replay is not None and replay.dirty:
            replay.persist()  # the batch accepted a transfer: on disk before any result
        if touched:
            later = now + (clock() - t0)  # the batch took time: the sender's RTT must not
            for inc in touched.values():  # count it as network delay
                self._flush(inc, later)

    def _admit(self, tid: int, data: memoryview, addr: Any, now: float) -> Incoming | None:
        """A datagram of a transfer without a session: open one if it is genuine."""
        if tid in self.recent:
            self._drop("finished_transfer")
            return None
        if self.single and self.adopted is not None:
            self._drop("foreign_transfer")
            return None
        try:
            d = self.parser.parse(data)
        except WireError as exc:
            self._drop(exc.reason)
            return None
        if d.type == DatagramType.FEEDBACK:
            self._drop("unexpected_type")
            return None
        if len(self.active) >= self.max_transfers and self._live() >= self.max_transfers:
            self._drop("over_capacity")
            return None
        session = ReceiverSession(
            tid,
            key=self.key,
            now=now,
            max_bytes=self.max_bytes,
            idle_timeout=self.idle_timeout,
            reserve=self._reserve,
            admit=self._admit_manifest if self.replay is not None else None,
        )
        inc = Incoming(tid, session, addr, now)
        self.active[tid] = inc
        self.adopted = tid
        log.info("transfer %016x: first datagram from %s:%d", tid, addr[0], addr[1])
        return inc

    def _admit_manifest(self, tid: int, manifest: TransportManifest) -> str | None:
        """A session's manifest checked against the replay record (kvtransport.replay)
        at this host's wall clock; the refusal's reason, or None."""
        assert self.replay is not None  # sessions get this check only with a record
        why = self.replay.admit(tid, manifest.sent_at, time.time())
        if why is not None:
            log.warning(
                "transfer %016x refused (%s): manifest sent %.1f s from this host's clock "
                "(window %g s); a replay, or clocks out of sync",
                tid,
                why,
                manifest.sent_at - time.time(),
                self.replay.window_s,
            )
        return why

    def _live(self) -> int:
        """Sessions still receiving: one that finished earlier in this batch (its result
        goes out when the batch is flushed) no longer counts against admission."""
        return sum(not inc.session.finished for inc in self.active.values())

    def _reserve(self, nbytes: int) -> bool:
        """A session's request for ``nbytes`` more output buffer (kvtransport.receiver):
        granted while everything held stays within ``budget_bytes``."""
        if self.held_bytes + nbytes > self.budget_bytes:
            return False
        self.held_bytes += nbytes
        return True

    def _flush(self, inc: Incoming, now: float) -> None:
        out = inc.session.datagrams_to_send(now)
        if out:
            self.sock.send(out, inc.peer)
        if inc.state == "receiving" and inc.session.finished:
            self._finished(inc, now)

    # ------------------------------------------------------------------ timers

    def next_wake(self) -> float | None:
        wake = None
        for inc in self.active.values():
            t = inc.session.next_timer()
            if t is not None and (wake is None or t < wake):
                wake = t
        if self.lingering:
            first = next(iter(self.lingering.values()))
            assert first.finished is not None  # a lingering transfer has finished
            t = first.finished + self.linger_s
            if wake is None or t < wake:
                wake = t
        return wake

    def run_due(self, now: float) -> None:
        for inc in list(self.active.values()):
            s = inc.session
            t = s.next_timer()
            if t is not None and t <= now:
                s.handle_timer(now)
                self._flush(inc, now)
        while self.lingering:
            tid, inc = next(iter(self.lingering.items()))
            assert inc.finished is not None  # a lingering transfer has finished
            if inc.finished + self.linger_s > now:
                break
            del self.lingering[tid]
            self.held_bytes -= inc.session.reserved  # its buffers go with it
            self._remember(tid, inc.stats(now))
            self._retired_dropped += inc.session.dropped
            for k, v in inc.session.drop_reasons.items():
                self._retired_drops[k] = self._retired_drops.get(k, 0) + v

    def abort(self, transfer_id: int, now: float, reason: str = "abort") -> bool:
        """Deliver a transfer's partial result now (an API request, or shutdown)."""
        inc = self.active.get(transfer_id)
        if inc is None:
            return False
        inc.session.close(now, reason)
        self._flush(inc, now)
        return True

    def close(self, now: float) -> None:
        """Shutdown: every transfer still receiving delivers what it holds."""
        for tid in list(self.active):
            self.abort(tid, now, "shutdown")

    # ------------------------------------------------------------------ results

    def _finished(self, inc: Incoming, now: float) -> None:
        inc.state = "finished"
        inc.finished = now
        del self.active[inc.transfer_id]
        self.lingering[inc.transfer_id] = inc
        res = inc.session.result
        assert res is not None  # the session has finished
        if res.reason == "replayed":  # nothing to deliver; its later datagrams are dropped
            self.replays_refused += 1
            if self.single and self.adopted == inc.transfer_id:
                self.adopted = None  # the recv command waits for a genuine transfer
            return
        self.results += 1
        log.info(
            "transfer %016x %s: utility %.4f, %d of %d blocks complete, %d datagrams",
            inc.transfer_id,
            res.reason,
            res.utility_recovered,
            int(res.complete.sum()),
            res.complete.size,
            inc.datagrams,
        )
        if self.on_result is not None:
            self.on_result(inc)

    def _remember(self, tid: int, stats: dict[str, Any]) -> None:
        self.recent[tid] = stats
        while len(self.recent) > RECENT_IDS:
            self.recent.popitem(last=False)

    def status(self, now: float, transfer_id: int | None = None) -> list[dict[str, Any]]:
        if transfer_id is not None:
            inc = self.active.get(transfer_id) or self.lingering.get(transfer_id)
            if inc is not None:
                return [inc.stats(now)]
            if transfer_id in self.recent:
                return [self.recent[transfer_id]]
            raise UserError(f"no transfer {transfer_id:016x}")
        live = [i.stats(now) for i in (*self.active.values(), *self.lingering.values())]
        return live + list(self.recent.values())[-64:]

    def stats(self) -> dict[str, Any]:
        reasons = dict(self.drop_reasons)
        for k, v in self._retired_drops.items():
            reasons[k] = reasons.get(k, 0) + v
        dropped = self.dropped + self._retired_dropped
        for inc in (*self.active.values(), *self.lingering.values()):
            dropped += inc.session.dropped
            for k, v in inc.session.drop_reasons.items():
                reasons[k] = reasons.get(k, 0) + v
        return {
            "active": len(self.active),
            "results": self.results,
            "dropped": dropped,
            "drop_reasons": reasons,
            "engine_dropped": self.dropped,
            "held_bytes": self.held_bytes,
            "budget_bytes": self.budget_bytes,
            "replays_refused": self.replays_refused,
            "replay_record": (
                {
                    "entries": len(self.replay.entries),
                    "floor": self.replay.floor,
                    "persist_errors": self.replay.persist_errors,
                }
                if self.replay is not None
                else None
            ),
            "socket": dict(self.sock.stats),
        }


class ReceiverDaemon(DaemonShell):
    """`kvtransport receiver-daemon`: a :class:`ReceiverEngine`, its control socket, the
    results publisher and optional result files."""

    role = "receiver"
    STOP_TEXT = "partial result(s) delivered"
    log = log

    def __init__(
        self,
        *,
        bind: tuple[str, int],
        control: str,
        publish: str,
        key: bytes | None,
        out_dir: str | None = None,
        gro: bool = True,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        budget_bytes: int | None = None,
        stats: Any = None,
        replay_file: str | None = None,
        replay_window_s: float = DEFAULT_WINDOW_S,
        curve_secret_file: str | None = None,
    ) -> None:
        from kvtransport.api import check_endpoint
        from kvtransport.daemon import StatsWriter, curve_secret, warm_up

        self.curve_secret = curve_secret(curve_secret_file)
        curve = self.curve_secret is not None
        check_endpoint(control, "control", curve=curve)  # before the slow warm-up
        check_endpoint(publish, "publish", curve=curve)
        self.out_dir = out_dir
        if out_dir is not None:
            from pathlib import Path

            if not Path(out_dir).is_dir():
                raise UserError(f"--out-dir {out_dir} is not a directory")
        replay = open_record(replay_file, bind[1], replay_window_s)
        self.stats_out = stats if stats is not None else StatsWriter(None)
        self.warm_up_s = warm_up(key)
        self.sock = DatagramSocket(bind, gro=gro)
        self.engine = ReceiverEngine(
            self.sock,
            key=key,
            max_transfers=max_transfers,
            max_bytes=max_bytes,
            idle_timeout=idle_timeout,
            budget_bytes=budget_bytes,
            on_result=self._result,
            replay=replay,
        )
        self.publish_endpoint = publish
        self.published = 0  # results handed to the PUB socket
        self.publish_lost = 0  # results given up (see _publish)
        self._seq = 0
        self._backlog: deque[list] = deque()
        self._start_control(
            control, {"status": self._status, "abort": self._abort}, before=self._open_publisher
        )

    def _open_publisher(self) -> None:
        import zmq

        from kvtransport.daemon import bind_endpoint

        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 2000)
        self.pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        # a subscriber's full queue makes send() fail (EAGAIN) instead of dropping the
        # result unseen: it waits in the backlog instead (see _publish)
        self.pub.setsockopt(zmq.XPUB_NODROP, 1)
        bind_endpoint(self.pub, self.publish_endpoint, self.curve_secret)

    def _publish(self, frames: list | None, now: float = 0.0) -> None:
        """Send ``frames`` (a result; None: only retry the backlog) after the results
        still waiting: in order, none dropped while the backlog has room.

        A subscriber that lags fills its queue (``PUB_HWM`` results); results then wait
        here, up to ``PUB_BACKLOG``; beyond that the oldest is given up, counted in
        ``publish_lost``, logged with its transfer id (and its file, with --out-dir: the
        result stays retrievable there). Each result header carries ``seq`` (1, 2, ... per
        daemon run) so a subscriber sees a gap too (ResultSubscriber.lost)."""
        import zmq

        backlog = self._backlog
        if frames is not None:
            backlog.append(frames)
            while len(backlog) > PUB_BACKLOG:
                lost = backlog.popleft()
                self.publish_lost += 1
                tid = load_json_header(lost[1]).get("transfer_id")
                log.warning("result %s given up: subscribers lag (%d lost)", tid, self.publish_lost)
        while backlog:
            try:
                self.pub.send_multipart(backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # a subscriber's queue is full: retried from the loop
            except zmq.ZMQError as exc:
                lost = backlog.popleft()
                self.publish_lost += 1
                log.warning("result not published: %s", exc)
                continue
            backlog.popleft()
            self.published += 1

    def _on_idle(self, now: float) -> None:
        if self._backlog:
            self._publish(None, now)

    def _result(self, inc: Incoming) -> None:
        """Write, publish and log a finished transfer. It runs inside the data plane's
        receive loop on what the network sent: a failure is logged, never raised."""
        try:
            self._deliver(inc)
        except Exception:
            log.exception("transfer %016x: result not delivered", inc.transfer_id)

    def _deliver(self, inc: Incoming) -> None:
        from kvtransport.api import result_frames, write_result_file

        res = inc.session.result
        assert res is not None  # delivered once finished
        stats = inc.stats(clock())
        if self.out_dir is not None:  # first, so that subscribers learn where it is
            try:
                path = write_result_file(self.out_dir, res, stats)
                stats["file"] = str(path)
                log.info("transfer %016x written to %s", inc.transfer_id, path)
            except OSError as exc:
                log.error("transfer %016x: cannot write result: %s", inc.transfer_id, exc)
        self._seq += 1
        self._publish(result_frames(res, {**stats, "seq": self._seq}))
        self.stats_out.write({"event": "transfer", "role": "receiver", **stats})

    def _abort(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        from kvtransport.api import parse_tid

        return {"aborted": self.engine.abort(parse_tid(head["transfer_id"]), clock())}

    def _stats(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        return {
            "stats": {
                **self.engine.stats(),
                "published": self.published,
                "publish_backlog": len(self._backlog),
                "publish_lost": self.publish_lost,
            }
        }

    def _ping(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        return {**super()._ping(head, frames), "publish": self.publish_endpoint}

    def _describe(self) -> str:
        return f"results {self.publish_endpoint}, GRO {'on' if self.sock.gro else 'off'}"

    def close(self) -> None:
        from kvtransport.daemon import remove_ipc_file

        self.pub.close(linger=2000)
        remove_ipc_file(self.publish_endpoint)
        super().close()
