"""The receiving side over real UDP: :class:`ReceiverEngine` and :class:`ReceiverDaemon`.

:class:`ReceiverEngine` is the shell of a :class:`~kvtransport.hosts.receiver_host.
ReceiverHost` (one session per transfer, admission, memory bounds, replay protection,
results as events, the status view: all sans-I/O, see kvtransport.hosts.receiver_host) on one
UDP socket (GRO, kvtransport.daemons.udp), built from one: ``ReceiverEngine(sock, host)``.
``on_readable(now)`` reads every waiting datagram in
one batch (at most ``BATCH``) and hands it to the host (``receive_datagrams``: each
transfer's run of datagrams to its session in one call), hands the replay record to its
background writer when the batch changed it (kvtransport.core.replay: the save is off the
data path), then sends the feedback the batch produced, stamped with the time it really
leaves; ``run_due(now)`` runs the host's timers. Each finished transfer goes to
``on_result(incoming)``, but only once the replay record that accepted it is on disk
(held until then, the loop polling every ``HELD_POLL_S``; at close, a result whose
record could not be saved is withheld and logged: a restart could accept its replay).
``on_result`` returns False when it could not write the result where it was asked to:
with a host that holds reports (``hold_reports``), the transfer's final report then names
``result_unsaved`` (kvtransport.core.feedback), and goes out once ``on_result`` returned.
Datagrams that fail authentication before any transfer
holds them (another key) are logged as a warning when they start, and again at most every
``AUTH_WARN_S`` while more come.

:class:`ReceiverDaemon` adds the ZeroMQ control socket (status, abort, stats, ping), the
PUB socket that publishes every result (kvtransport.daemons.api), ``--out-dir`` result files
and, with ``--race-dir``, every transfer mirrored while it arrives for a model process on
the same host to race it (kvtransport.daemons.race_share).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.replay import DEFAULT_WINDOW_S, open_record
from kvtransport.core.wire import SealKey
from kvtransport.daemons.api import load_json_header
from kvtransport.daemons.daemon import DaemonShell
from kvtransport.daemons.race_share import KEEP_S, RaceDir
from kvtransport.daemons.udp import DatagramSocket, clock
from kvtransport.hosts.receiver_host import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_TRANSFERS,
    Incoming,
    ReceiverHost,
    ResultReady,
    TransferStarted,
    auth_failures,
)

log = logging.getLogger("kvtransport.receiver-daemon")

PUB_HWM = 64
"""Results queued per subscriber in ZeroMQ before the daemon's own backlog takes over."""
PUB_BACKLOG = 1024
"""Results the daemon holds for lagging subscribers before it gives the oldest up."""
BATCH = 256
"""Datagrams handled between two feedback flushes: a backlog is worked off in slices, so
feedback (and its echo of the highest packet) is never held back by a long batch."""
AUTH_WARN_S = 10.0
"""Least time between two warnings about datagrams that fail authentication."""
HELD_POLL_S = 0.002
"""How often the loop looks whether a held result's replay record is on disk yet."""


class ReceiverEngine:
    """A :class:`~kvtransport.hosts.receiver_host.ReceiverHost` behind one UDP socket (module
    docstring): the engine is the socket and the loop's calls; every figure of the
    transfers is the host's (``engine.host``). Each finished transfer goes to
    ``on_result(incoming)`` (False: its result was not written where asked)."""

    def __init__(
        self,
        sock: DatagramSocket,
        host: ReceiverHost,
        *,
        on_result: Callable[[Incoming], bool | None] | None = None,
        race_dir: RaceDir | None = None,
    ) -> None:
        self.host = host
        self.race_dir = race_dir  # transfers mirrored for local racers (race_share)
        # Any: its batches are memoryviews, which the sessions take (they annotate bytes)
        self.sock: Any = sock
        self.on_result = on_result
        self._auth_warned = 0  # the host's bad_tag count at the last warning
        self._auth_warn_at = -1e300  # when the next warning may come
        # finished transfers waiting for their replay record generation to be on disk
        self._held: deque[tuple[int, Incoming]] = deque()

    def fileno(self) -> int:
        return self.sock.fileno()

    # ------------------------------------------------------------------ the loop

    def on_readable(self, now: float) -> None:
        """The waiting datagrams (at most ``BATCH`` of them) to the host; then the
        feedback they caused goes out, stamped with the time it really leaves."""
        t0 = clock()
        batch = self.sock.recv_batch(BATCH)
        n = len(batch)
        self.host.receive_datagrams(batch, now)  # each transfer's runs in one call
        self._save_replay()
        if self.race_dir is not None:
            self.race_dir.update(self.host, now)
        if n:
            # the batch took time: the sender's RTT must not count it as network delay
            self._transmit(now + (clock() - t0))
            self._warn_auth(now)

    def _warn_auth(self, now: float) -> None:
        """Log datagrams that failed authentication outside any transfer (module
        docstring): at the first, then at most every AUTH_WARN_S while more come."""
        bad = self.host.drop_reasons.get("bad_tag", 0)
        if bad > self._auth_warned and now >= self._auth_warn_at:
            log.warning("%s", auth_failures(bad, self.host.key))
            self._auth_warned = bad
            self._auth_warn_at = now + AUTH_WARN_S

    def _save_replay(self) -> int:
        """The replay record to its writer if it changed; the generation on disk before
        a result finished now may be handed on (0 without a record)."""
        replay = self.host.replay
        return 0 if replay is None else replay.save_soon()

    def _release(self) -> bool:
        """Hand on the held results whose replay record is on disk, in order; each one's
        final report is released as kept or not (``ReceiverHost.result_kept``). Whether
        any was handed on."""
        replay, held = self.host.replay, self._held
        handed = False
        while held and (replay is None or replay.durable(held[0][0])):
            _, inc = held.popleft()
            kept = self.on_result(inc) if self.on_result is not None else None
            self.host.result_kept(inc.transfer_id, clock(), kept is not False)
            handed = True
        return handed

    def _send(self, now: float) -> None:
        """Send the feedback the host produced, stamped ``now``."""
        for datagrams, peer in self.host.datagrams_to_send(now):
            self.sock.send(datagrams, peer)

    def next_wake(self) -> float | None:
        wake = self.host.get_timer()
        if self._held:
            soon = clock() + HELD_POLL_S
            return soon if wake is None else min(wake, soon)
        return wake

    def run_due(self, now: float) -> None:
        self._release()
        self.host.handle_timer(now)
        if self.race_dir is not None:
            self.race_dir.update(self.host, now)
        self._transmit(now)

    def abort(self, transfer_id: int, now: float, reason: str = "abort") -> bool:
        """Deliver a transfer's partial result now (an API request, or shutdown)."""
        done = self.host.abort(transfer_id, now, reason)
        self._transmit(now)
        return done

    def close(self, now: float) -> None:
        """Shutdown: every transfer still receiving delivers what it holds."""
        self.host.close(now)
        self._transmit(now)
        replay = self.host.replay
        if replay is not None:
            replay.close()  # on this thread: what is left is saved now, or never
        if self._release():
            self._send(now)  # their final reports
        for _, inc in self._held:
            log.error(
                "transfer %016x: result withheld: the replay record that accepted it could "
                "not be saved (a restart could accept its replay)",
                inc.transfer_id,
            )
        self._held.clear()
        if self.race_dir is not None:
            self.race_dir.close()

    def _transmit(self, now: float) -> None:
        """Send the feedback the host produced (stamped ``now``), then its events."""
        host = self.host
        self._send(now)
        generation = self._save_replay()
        while (ev := host.next_event()) is not None:
            inc = ev.transfer
            if isinstance(ev, TransferStarted):
                log.info(
                    "transfer %016x: first datagram from %s:%d",
                    inc.transfer_id,
                    inc.peer[0],
                    inc.peer[1],
                )
            elif isinstance(ev, ResultReady):
                res = inc.session.result
                assert res is not None  # the session has finished
                log.info(
                    "transfer %016x %s: utility %.4f, %d of %d blocks complete, %d datagrams",
                    inc.transfer_id,
                    res.reason,
                    res.utility_recovered,
                    int(res.complete.sum()),
                    res.complete.size,
                    inc.datagrams,
                )
                self._held.append((generation, inc))
        if self._release():
            self._send(now)  # the final reports the results' keeping released

    # ------------------------------------------------------------------ results

    def stats(self) -> dict[str, Any]:
        return {**self.host.stats(), "socket": dict(self.sock.stats)}


class ReceiverDaemon(DaemonShell):
    """`kvtransport receiver-daemon`: a :class:`ReceiverEngine`, its control socket, the
    results publisher and optional result files. ``config``: the protocol's settings its
    host builds every session with (kvtransport.core.protocol)."""

    role = "receiver"
    STOP_TEXT = "partial result(s) delivered"
    log = log

    def __init__(
        self,
        *,
        bind: tuple[str, int],
        control: str,
        publish: str,
        key: SealKey | None,
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
        pub_backlog: int = PUB_BACKLOG,
        config: ProtocolConfig = STANDARD,
        race_dir: str | None = None,
        race_keep_s: float | None = None,
    ) -> None:
        from kvtransport.daemons.api import check_endpoint
        from kvtransport.daemons.daemon import StatsWriter, curve_secret, warm_up

        self.curve_secret = curve_secret(curve_secret_file)
        curve = self.curve_secret is not None
        check_endpoint(control, "control", curve=curve)  # before the slow warm-up
        check_endpoint(publish, "publish", curve=curve)
        self.out_dir = out_dir
        if out_dir is not None:
            from kvtransport.daemons.api import probe_result_dir

            probe_result_dir(out_dir, "--out-dir")
        shared = None  # before the slow warm-up: a bad folder fails at once
        if race_dir is not None:
            keep_s = KEEP_S if race_keep_s is None else race_keep_s
            shared = RaceDir(race_dir, keep_s=keep_s)
        replay = open_record(replay_file, bind[1], replay_window_s)
        self.stats_out = stats if stats is not None else StatsWriter(None)
        self.warm_up_s = warm_up(key, note=self.log.info)
        self.sock = DatagramSocket(bind, gro=gro)
        host = ReceiverHost(
            key=key,
            max_transfers=max_transfers,
            max_bytes=max_bytes,
            idle_timeout=idle_timeout,
            budget_bytes=budget_bytes,
            replay=replay,
            wall_clock=time.time,
            config=config,
            hold_reports=out_dir is not None,  # a sender learns of a result not written
        )
        self.engine = ReceiverEngine(self.sock, host, on_result=self._result, race_dir=shared)
        self.publish_endpoint = publish
        self.published = 0  # results handed to the PUB socket
        self.publish_lost = 0  # results given up (see _publish)
        self._seq = 0
        self._backlog: deque[list] = deque()
        self.pub_backlog = pub_backlog  # results held for lagging subscribers (_publish)
        self._start_control(
            control, {"status": self._status, "abort": self._abort}, before=self._open_publisher
        )

    def _open_publisher(self) -> None:
        import zmq

        from kvtransport.daemons.daemon import bind_endpoint

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
        here, up to ``pub_backlog`` (default PUB_BACKLOG); beyond that the oldest is given
        up, counted in ``publish_lost``, logged with its transfer id (and its file, with
        --out-dir: the result stays retrievable there). Each result header carries ``seq``
        (1, 2, ... per daemon run) so a subscriber sees a gap too (ResultSubscriber.lost)."""
        import zmq

        backlog = self._backlog
        if frames is not None:
            backlog.append(frames)
            while len(backlog) > self.pub_backlog:
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

    def _result(self, inc: Incoming) -> bool:
        """Write, publish and log a finished transfer; False when its result was not
        written into ``--out-dir``. It runs inside the data plane's receive loop on what
        the network sent: a failure is logged, never raised."""
        try:
            return self._deliver(inc)
        except Exception:
            log.exception("transfer %016x: result not delivered", inc.transfer_id)
            return False

    def _deliver(self, inc: Incoming) -> bool:
        from kvtransport.daemons.api import keep_result, result_frames

        res = inc.session.result
        assert res is not None  # delivered once finished
        stats = inc.stats(clock())
        saved = True
        if self.out_dir is not None:  # first, so that subscribers learn where it is
            try:
                path, kept = keep_result(self.out_dir, res, stats)
                stats["file"] = str(path)
                if kept is not None:
                    saved = False
                    stats["file_error"] = kept
                    log.error("transfer %016x: %s: kept in %s", inc.transfer_id, kept, path)
                else:
                    log.info("transfer %016x written to %s", inc.transfer_id, path)
            except OSError as exc:
                saved = False
                stats["file_error"] = str(exc)
                log.error("transfer %016x: cannot write result: %s", inc.transfer_id, exc)
        self._seq += 1
        self._publish(result_frames(res, {**stats, "seq": self._seq}))
        self.stats_out.write({"event": "transfer", "role": "receiver", **stats})
        return saved

    def _abort(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        from kvtransport.daemons.api import parse_tid

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
        from kvtransport.daemons.daemon import remove_ipc_file

        self.pub.close(linger=2000)
        remove_ipc_file(self.publish_endpoint)
        super().close()
