"""The sending side over real UDP: :class:`SenderEngine` and :class:`SenderDaemon`.

:class:`SenderEngine` is the data plane: several :class:`~kvtransport.sender.SenderSession`
s on one UDP socket (GSO batching, kvtransport.udp), each sending to its own receiver. It
is driven by :func:`kvtransport.daemon.serve` in the daemon and by a plain loop in
``kvtransport send``: ``run_due(now)`` sends what is due, ``on_readable(now)`` hands
feedback to its session (demultiplexed by the header's transfer id), ``next_wake()`` says
when to come back.

Pacing. Each session paces itself at its rate (its timer is its next slot). The engine
wakes ``burst_s`` before the earliest slot and asks every session for what is due up to
``now + burst_s``: datagrams leave in small bursts (a 200 us lead is about two datagrams at
100 Mbit/s and eighteen at 1 Gbit/s) that the socket sends in one GSO call, and the
system-call and wake-up costs are shared by the burst. A late loop is caught up by the
sessions themselves (at most ``MAX_CATCH_UP`` datagrams at once, then pacing resumes).

Several transfers on one link. The engine's :class:`~kvtransport.link_share.LinkShare`
(the same code the multi-user simulator runs) re-plans every ``slot_s`` and whenever a
transfer starts or ends: kvtransport.allocator's weighted utility water-filling with
admission gives each transfer a share of the link, which becomes its pacing rate (a
deferred transfer pauses, and still finishes at its deadline); the link's one-way delay
it plans with is half the shortest round trip the sessions measured. Each transfer's
utility curve is what its submitter gave (sigmoid parameters, or a model and context
length looked up in the ``fit-utility`` table), else :func:`stream_utility_curve`. A
transfer alone on the link gets all of it. The engine remembers the loss each receiver's
last transfer ended with (``RECEIVER_MEMORY`` receivers) and a new transfer to that
receiver starts its repair from it (status ``prior_loss``).

:class:`SenderDaemon` adds the ZeroMQ control socket (kvtransport.api: submit, status,
cancel, stats, ping), logs and one ``--stats`` JSON line per finished transfer.
"""

from __future__ import annotations

import logging
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransport import bounds
from kvtransport.bounds import MAX_DEADLINE_S, MAX_INITIAL_RTT_S, MIN_DEADLINE_S
from kvtransport.daemon import DaemonShell, DropCounts
from kvtransport.errors import UserError
from kvtransport.link_share import LinkShare, Member
from kvtransport.policy import make_policy
from kvtransport.protocol import DEFAULT_INITIAL_RTT, DEFAULT_SYMBOL_SIZE
from kvtransport.sender import SenderSession
from kvtransport.transfer import Transfer
from kvtransport.udp import DatagramSocket, wall_offset
from kvtransport.utility_model import SigmoidUtility
from kvtransport.wire import HEADER_SIZE, full_send_time

log = logging.getLogger("kvtransport.sender-daemon")

DEFAULT_BURST_S = 200e-6
DEFAULT_SLOT_S = 0.01
DEFAULT_MAX_TRANSFERS = 64
HISTORY = 256
RECEIVER_MEMORY = 1024
"""Receivers whose last transfer's loss the engine remembers (the oldest forgotten)."""
_TID = struct.Struct("!Q")


def stream_utility_curve(transfer: Transfer) -> SigmoidUtility:
    """The utility-of-delivered-fraction curve the stream itself implies, as a sigmoid.

    A stream in utility order delivers, after a fraction x of its bytes, the utility of
    the blocks wholly inside that prefix. The logistic a / (1 + exp(-b (x - c))) with a =
    the stream's total utility, c = the fraction where half of it is in and b = 2 ln 3 /
    (x75 - x25) (the logistic reaches a/4 and 3a/4 exactly ln 3 / b either side of c)
    matches that curve's middle and spread in closed form: no fit, microseconds. Used for
    scheduling when the submitter gave no measured accuracy curve.
    """
    b = transfer.blocks
    total = float(b.utilities.sum())
    if len(b) == 0 or total <= 0.0:
        return SigmoidUtility(a=1.0, b=4.0, c=0.5)
    x = (b.offsets + b.lengths).astype(np.float64) / max(transfer.nbytes, 1)
    y = np.cumsum(b.utilities)
    x25, x50, x75 = (
        x[min(int(np.searchsorted(y, q * total)), len(x) - 1)] for q in (0.25, 0.5, 0.75)
    )
    spread = max(float(x75 - x25), 1e-3)
    return SigmoidUtility(a=total, b=min(2.0 * math.log(3.0) / spread, 1e3), c=float(x50))


@dataclass
class Outgoing:
    """One transfer in the engine, and what status reports about it."""

    link: Member  # the session and its place on the shared link (kvtransport.link_share)
    dest: tuple[str, int]
    policy: str
    label: str = ""
    keep: Any = None  # the buffers the payload views (zero-copy ZeroMQ frames)
    state: str = "sending"
    finished: float | None = None
    sent_datagrams: int = 0
    max_lag: float = 0.0  # worst lateness of the loop behind this session's timer (s)

    @property
    def transfer_id(self) -> int:
        return self.link.id

    @property
    def session(self) -> SenderSession:
        return self.link.session

    @property
    def size(self) -> int:
        return self.link.size

    @property
    def submitted(self) -> float:
        return self.link.arrival

    @property
    def deadline(self) -> float:
        return self.link.deadline

    def status(self, now: float) -> dict[str, Any]:
        s = self.session
        m = self.link
        st = s.stats
        end = self.finished if self.finished is not None else now
        return {
            "transfer_id": f"{self.transfer_id:016x}",
            "label": self.label,
            "state": self.state,
            "finish_reason": s.finish_reason,
            "to": f"{self.dest[0]}:{self.dest[1]}",
            "policy": self.policy,
            "bytes": self.size,
            "n_source": s.n_source,
            "source_sent": st["source_sent"],
            "repair_sent": s.repair_sent,
            "manifest_sent": st["manifest_sent"],
            "retransmit_sent": st["retransmit_sent"],
            "datagrams_sent": self.sent_datagrams,
            "idle_polls": st["idle_polls"],
            "max_lag_ms": round(self.max_lag * 1e3, 3),
            "feedback_received": st["feedback_received"],
            "feedback_dropped": st["dropped"],
            "receiver_restarts": st["receiver_restarts"],
            "drop_reasons": dict(s.drop_reasons),
            "decoded_through": s.fb_through,
            "delivered_bytes": min(s.fb_through * s.symbol_size, self.size),
            "loss_estimate": round(s.loss_estimate(), 5),
            "decisions": s.decision_latency(),
            "srtt_ms": None if s.srtt is None else round(s.srtt * 1e3, 3),
            "rate_mbps": round(m.rate_bps / 1e6, 6),
            "share": round(m.share, 5),
            "admitted": m.admitted,
            "weight": m.weight,
            "prior_loss": None if m.prior_loss is None else round(m.prior_loss, 5),
            "deadline_s": round(self.deadline - self.submitted, 6),
            "elapsed_s": round(end - self.submitted, 6),
        }


class SenderEngine(DropCounts):
    """Sender sessions over one UDP socket (see the module docstring).

    ``rate_bps``: the link rate shared by all transfers. ``on_finish(outgoing)`` is called
    once per transfer when its session is done (sent FIN or ABORT, or the receiver said it
    is finished).
    """

    def __init__(
        self,
        sock: DatagramSocket,
        *,
        rate_bps: float,
        key: bytes | None = None,
        symbol_size: int = DEFAULT_SYMBOL_SIZE,
        burst_s: float = DEFAULT_BURST_S,
        slot_s: float = DEFAULT_SLOT_S,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        on_finish: Any = None,
    ) -> None:
        if not (rate_bps > 0 and math.isfinite(rate_bps)):
            raise UserError("the link rate must be a positive number")
        self.sock = sock
        self.rate_bps = float(rate_bps)
        self.key = key
        self.symbol_size = symbol_size
        self.burst_s = burst_s
        self.slot_s = slot_s
        self.max_transfers = max_transfers
        self.on_finish = on_finish
        self.active: dict[int, Outgoing] = {}
        self.finished: OrderedDict[int, Outgoing] = OrderedDict()
        self.drop_reasons: dict[str, int] = {}
        self.dropped = 0
        # the loss each receiver's last transfer ended with (at most RECEIVER_MEMORY of
        # them): a new transfer to it starts its repair from that, not a blind prior
        self.receiver_loss: OrderedDict[tuple[str, int], float] = OrderedDict()
        self.link = LinkShare(
            self.rate_bps, slot_s=slot_s, symbol_size=symbol_size, tagged=key is not None
        )
        self._sched_at: float | None = None
        self._reschedule_now = False

    # ------------------------------------------------------------------ transfers

    def submit(
        self,
        transfer: Transfer,
        dest: tuple[str, int],
        *,
        now: float,
        deadline_s: float,
        policy: str = "adaptive",
        transfer_id: int | None = None,
        weight: float = 1.0,
        utility: SigmoidUtility | None = None,
        label: str = "",
        initial_rtt: float = DEFAULT_INITIAL_RTT,
        keep: Any = None,
    ) -> Outgoing:
        """Start sending ``transfer`` to ``dest`` with ``deadline_s`` from ``now``."""
        if len(self.active) >= self.max_transfers:
            raise UserError(f"{len(self.active)} transfers in flight (the limit): try later")
        if not MIN_DEADLINE_S <= deadline_s <= MAX_DEADLINE_S:
            raise UserError(
                f"the deadline must be {MIN_DEADLINE_S:g}..{MAX_DEADLINE_S:g} s ({deadline_s})"
            )
        if not 0.0 < initial_rtt <= bounds.MAX_INITIAL_RTT_S:
            raise UserError(
                f"the initial RTT must be in (0, {bounds.MAX_INITIAL_RTT_S * 1e3:g}] ms "
                f"({initial_rtt * 1e3:g})"
            )
        if not (weight >= 0 and math.isfinite(weight)):
            raise UserError("the weight must be a non-negative number")
        if transfer_id is not None and (transfer_id in self.active or transfer_id in self.finished):
            raise UserError(f"transfer id {transfer_id:016x} is already in use")
        pol = make_policy(policy)
        try:
            session = SenderSession(
                transfer,
                pol,
                rate_bps=self.rate_bps,
                deadline=now + deadline_s,
                now=now,
                transfer_id=transfer_id,
                key=self.key,
                symbol_size=self.symbol_size,
                initial_rtt=initial_rtt,
                wall_offset=wall_offset(),
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if session.transfer_id in self.active or session.transfer_id in self.finished:
            raise UserError("transfer id collision (random 64-bit): submit again")
        member = Member(
            id=session.transfer_id,
            session=session,
            size=transfer.nbytes,
            deadline=now + deadline_s,
            utility=utility if utility is not None else stream_utility_curve(transfer),
            weight=float(weight),
            arrival=now,
            prior_loss=self.receiver_loss.get(dest),
            rate_bps=self.rate_bps,
        )
        out = Outgoing(link=member, dest=dest, policy=pol.name, label=label, keep=keep)
        self.active[out.transfer_id] = out
        self.link.join(member)
        try:
            self._reschedule(now)  # shares are right from the first status reply on
        except Exception:
            del self.active[out.transfer_id]  # refused: nothing of it may run
            self.link.leave(out.transfer_id, "refused")
            self._reschedule_now = True
            raise
        log.info(
            "transfer %016x: %d bytes to %s:%d, deadline %.1f ms, policy %s%s",
            out.transfer_id,
            out.size,
            dest[0],
            dest[1],
            deadline_s * 1e3,
            out.policy,
            f" ({label})" if label else "",
        )
        return out

    def cancel(self, transfer_id: int, now: float) -> bool:
        """Abort a transfer in flight (its receiver is told to deliver what it has)."""
        out = self.active.get(transfer_id)
        if out is None:
            return False
        out.session.cancel(now)
        self._flush(out, now)
        return True

    def close(self, now: float) -> None:
        """Abort everything still in flight (daemon shutdown)."""
        for tid in list(self.active):
            self.cancel(tid, now)

    def status(self, now: float, transfer_id: int | None = None) -> list[dict[str, Any]]:
        """Status of one transfer (in flight or recently finished) or of all of them."""
        if transfer_id is not None:
            out = self.active.get(transfer_id) or self.finished.get(transfer_id)
            if out is None:
                raise UserError(f"no transfer {transfer_id:016x}")
            return [out.status(now)]
        return [o.status(now) for o in (*self.active.values(), *self.finished.values())]

    def stats(self) -> dict[str, Any]:
        return {
            "active": len(self.active),
            "finished": len(self.finished),
            "dropped": self.dropped,
            "drop_reasons": dict(self.drop_reasons),
            "socket": dict(self.sock.stats),
            "rate_mbps": self.rate_bps / 1e6,
        }

    # ------------------------------------------------------------------ the loop

    def next_wake(self) -> float | None:
        """When ``run_due`` has work next (a burst's lead before the earliest slot)."""
        wake = self._sched_at
        if self._reschedule_now:
            return 0.0
        for out in self.active.values():
            t = out.session.next_timer()
            if t is not None:
                t -= self.burst_s
                if wake is None or t < wake:
                    wake = t
        return wake

    def run_due(self, now: float) -> None:
        """Send every datagram due up to ``now + burst_s``; finish what is done."""
        if self._reschedule_now or (self._sched_at is not None and now >= self._sched_at):
            self._reschedule(now)
        horizon = now + self.burst_s
        for out in list(self.active.values()):
            t = out.session.next_timer()
            if t is not None and t <= horizon:
                if now - t > out.max_lag:
                    out.max_lag = now - t
                self._flush(out, horizon)
            elif out.session.done:
                self._flush(out, now)

    def _flush(self, out: Outgoing, t: float) -> None:
        s = out.session
        datagrams = s.datagrams_to_send(t)
        if datagrams:
            out.sent_datagrams += self.sock.send(datagrams, out.dest)
        if s.done:
            self._finish(out, t)

    def on_readable(self, now: float) -> None:
        """Feedback: every datagram waiting, to the session its transfer id names."""
        active = self.active
        for data, _addr in self.sock.recv_batch():
            if len(data) < HEADER_SIZE:
                self._drop("truncated")
                continue
            out = active.get(_TID.unpack_from(data, 8)[0])
            if out is None:
                tid = _TID.unpack_from(data, 8)[0]
                self._drop("finished_transfer" if tid in self.finished else "foreign_transfer")
                continue
            out.session.receive_datagram(data, now)
            if out.session.done:  # the receiver is finished: nothing more to send
                self._flush(out, now)

    def _finish(self, out: Outgoing, now: float) -> None:
        if out.state == "done":
            return
        out.state = "done"
        out.finished = now
        out.keep = None
        out.session.release()  # the payload goes now, the status figures stay
        del self.active[out.transfer_id]
        self.finished[out.transfer_id] = out
        while len(self.finished) > HISTORY:
            self.finished.popitem(last=False)
        self.link.leave(out.transfer_id, out.session.finish_reason or "finished")
        self._reschedule_now = True
        if out.session.fb_time is not None:  # its receiver reported: remember its path
            self.receiver_loss[out.dest] = out.session.loss_estimate()
            self.receiver_loss.move_to_end(out.dest)
            while len(self.receiver_loss) > RECEIVER_MEMORY:
                self.receiver_loss.popitem(last=False)
        s = out.session
        dec = s.decision_latency() or {"n": 0, "mean_us": 0.0, "p99_us": 0.0}
        log.info(
            "transfer %016x done (%s): %d source + %d repair datagrams in %.1f ms, "
            "receiver decoded through %d of %d; %d %s decisions, %.1f us mean, %.1f us p99",
            out.transfer_id,
            s.finish_reason,
            s.stats["source_sent"],
            s.repair_sent,
            (now - out.submitted) * 1e3,
            s.fb_through,
            s.n_source,
            dec["n"],
            out.policy,
            dec["mean_us"],
            dec["p99_us"],
        )
        if self.on_finish is not None:
            self.on_finish(out)

    # ------------------------------------------------------------------ link sharing

    def _reschedule(self, now: float) -> None:
        self._reschedule_now = False
        # the link's one-way delay, for the allocator's last useful send time: half the
        # shortest smoothed round trip any transfer measured (0 until one has)
        rtts = [o.session.srtt for o in self.active.values() if o.session.srtt is not None]
        if rtts:
            self.link.one_way_s = min(rtts) / 2.0
        self._sched_at = self.link.step(now)


# ---------------------------------------------------------------------- the daemon


def deadline_from(
    head: dict[str, Any], nbytes: int, rate_bps: float, symbol_size: int, tagged: bool
) -> float:
    """Seconds to the deadline from a request's ``deadline_ms`` or ``rho``, bounded to
    [MIN_DEADLINE_S, MAX_DEADLINE_S] (kvtransport.bounds); UserError otherwise.

    rho is the deadline over the time the whole stream takes loss-free at the link rate
    (kvtransport.wire.full_send_time), as in ``kvtransport simulate``.
    """
    if head.get("deadline_ms") is not None:
        if head.get("rho") is not None:
            raise UserError("give deadline_ms or rho, not both")
        ms = bounds.number(
            head["deadline_ms"], "deadline_ms", 0.0, 1e3 * MAX_DEADLINE_S, lo_open=True
        )
        value = ms * 1e-3
    elif head.get("rho") is not None:
        rho = bounds.number(head["rho"], "rho", 0.0, bounds.MAX_RHO, lo_open=True)
        value = rho * full_send_time(nbytes, rate_bps, symbol_size, tagged)
    else:
        raise UserError("a transfer needs deadline_ms or rho")
    if not MIN_DEADLINE_S <= value <= MAX_DEADLINE_S:
        raise UserError(
            f"the deadline must be {MIN_DEADLINE_S * 1e3:g} ms to {MAX_DEADLINE_S:g} s "
            f"(got {value:.6g} s)"
        )
    return value


class SenderDaemon(DaemonShell):
    """`kvtransport sender-daemon`: a :class:`SenderEngine` behind a ZeroMQ control socket.

    ``utility_table``: a ``fit-utility`` table for requests naming a model and context
    length. ``stats``: where the per-transfer JSON lines go (kvtransport.daemon.StatsWriter).
    """

    role = "sender"
    STOP_TEXT = "transfer(s) aborted"
    log = log

    def __init__(
        self,
        *,
        bind: tuple[str, int],
        control: str,
        rate_bps: float,
        key: bytes | None,
        policy: str = "adaptive",
        symbol_size: int = DEFAULT_SYMBOL_SIZE,
        gso: bool = True,
        burst_s: float = DEFAULT_BURST_S,
        slot_s: float = DEFAULT_SLOT_S,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        utility_table: str | None = None,
        stats: Any = None,
        curve_secret_file: str | None = None,
    ) -> None:
        from kvtransport.api import check_endpoint
        from kvtransport.daemon import StatsWriter, curve_secret, warm_up

        self.curve_secret = curve_secret(curve_secret_file)
        # before the slow warm-up
        check_endpoint(control, "control", curve=self.curve_secret is not None)
        make_policy(policy)  # a bad default fails at start, not at the first submit
        self.policy = policy
        self.table = None
        if utility_table:
            from kvtransport.utility_model import UtilityTable

            self.table = UtilityTable.load(utility_table)
        self.stats_out = stats if stats is not None else StatsWriter(None)
        self.warm_up_s = warm_up(key, ("fixed:1/4", policy), allocator=True)
        self.sock = DatagramSocket(bind, gso=gso)
        self.engine = SenderEngine(
            self.sock,
            rate_bps=rate_bps,
            key=key,
            symbol_size=symbol_size,
            burst_s=burst_s,
            slot_s=slot_s,
            max_transfers=max_transfers,
            on_finish=self._finished,
        )
        self._start_control(
            control, {"submit": self._submit, "status": self._status, "cancel": self._cancel}
        )

    # ------------------------------------------------------------------ requests

    def _submit(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        """Validate the whole request (kvtransport.bounds), then start the transfer: a
        request answered ``ok: false`` changes nothing."""
        from kvtransport.api import ApiError, parse_tid, transfer_from_frames
        from kvtransport.udp import clock, parse_address

        if "to" not in head:
            raise ApiError("submit needs 'to': the receiver's HOST:PORT")
        dest = parse_address(bounds.text(head["to"], "to", 300), what="receiver")
        transfer = transfer_from_frames(frames)
        e = self.engine
        deadline_s = deadline_from(
            head, transfer.nbytes, e.rate_bps, e.symbol_size, e.key is not None
        )
        tid = parse_tid(head["transfer_id"]) if head.get("transfer_id") is not None else None
        policy = head.get("policy")
        policy = bounds.text(policy, "policy", 200) if policy is not None else self.policy
        rtt_ms = head.get("initial_rtt_ms")
        if rtt_ms is None:
            rtt_ms = DEFAULT_INITIAL_RTT * 1e3
        rtt_ms = bounds.number(rtt_ms, "initial_rtt_ms", 0.0, 1e3 * MAX_INITIAL_RTT_S, lo_open=True)
        out = e.submit(
            transfer,
            dest,
            now=clock(),
            deadline_s=deadline_s,
            policy=policy,
            transfer_id=tid,
            weight=bounds.number(head.get("weight", 1.0), "weight", 0.0, bounds.MAX_WEIGHT),
            utility=self._utility(head),
            label=bounds.text(head.get("label", ""), "label", 200),
            initial_rtt=rtt_ms * 1e-3,
            keep=frames,
        )
        return {
            "transfer_id": f"{out.transfer_id:016x}",
            "deadline_s": deadline_s,
            "n_source": out.session.n_source,
            "share": out.link.share,
        }

    def _utility(self, head: dict[str, Any]) -> SigmoidUtility | None:
        spec = head.get("utility")
        if spec is not None:
            if not isinstance(spec, dict):
                raise UserError("utility must be an object {a, b, c, d}")
            extra = set(spec) - {"a", "b", "c", "d"}
            if extra:
                raise UserError(f"utility has unknown fields {sorted(extra)[:4]}")
            params = {k: bounds.number(v, f"utility.{k}", -1e6, 1e6) for k, v in spec.items()}
            return SigmoidUtility(**params)
        if head.get("model") is not None:
            if self.table is None:
                raise UserError("this daemon has no --utility-table to look the model up in")
            model = bounds.text(head["model"], "model", 500)
            ctx = bounds.whole(head.get("context_tokens"), "context_tokens", 1, 1 << 24)
            try:
                return self.table.lookup(model, ctx).utility
            except KeyError as exc:
                raise UserError(str(exc).strip("'\"")) from None
        return None

    def _cancel(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        from kvtransport.api import parse_tid
        from kvtransport.udp import clock

        tid = parse_tid(head["transfer_id"])
        done = self.engine.cancel(tid, clock())
        if done:
            log.info("transfer %016x cancelled by a client", tid)
        return {"cancelled": done}

    def _finished(self, out: Outgoing) -> None:
        from kvtransport.udp import clock

        self.stats_out.write({"event": "transfer", "role": "sender", **out.status(clock())})

    def _describe(self) -> str:
        return (
            f"link {self.engine.rate_bps / 1e6:.1f} Mbit/s, GSO {'on' if self.sock.gso else 'off'}"
        )
