"""The sending side over real UDP: :class:`SenderEngine` and :class:`SenderDaemon`.

:class:`SenderEngine` is the shell of a :class:`~kvtransport.hosts.sender_host.SenderHost`
(the transfers, their admission, the shared link's rates, finish events, the status view:
all sans-I/O) on one UDP socket (GSO batching, kvtransport.daemons.udp). It is driven by
:func:`kvtransport.daemons.daemon.serve` in the daemon and by a plain loop in ``kvtransport
send``: ``run_due(now)`` runs the host's timer and sends what it released,
``on_readable(now)`` hands every waiting datagram to the host, ``next_wake()`` is the
host's timer. Pacing, link sharing, admission and the status view are the host's
(kvtransport.hosts.sender_host; the engine is built from one: ``SenderEngine(sock, host)``).

:class:`SenderDaemon` adds the ZeroMQ control socket (kvtransport.daemons.api: submit, status,
cancel, stats, ping), logs and one ``--stats`` JSON line per finished transfer (its
``delivered`` as of the finish); a transfer that delivered nothing is named in a warning
with why, once its receiver's last report is in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtransport import bounds
from kvtransport.bounds import MAX_DEADLINE_S, MAX_INITIAL_RTT_S, MIN_DEADLINE_S
from kvtransport.core.protocol import LINK_OVERHEAD_BYTES, STANDARD, ProtocolConfig
from kvtransport.core.transfer import Transfer
from kvtransport.core.wire import SealKey, full_send_time
from kvtransport.daemons.daemon import DaemonShell
from kvtransport.daemons.udp import DatagramSocket, wall_offset
from kvtransport.errors import UserError
from kvtransport.hosts.policy_choice import (
    FAST_LINK_POLICY,
    LONG_LINK_HANDOFF_POLICY,
    default_policy_for,
)
from kvtransport.hosts.sender_host import (  # noqa: F401 (HISTORY: re-exported for the tests)
    DEFAULT_BURST_S,
    DEFAULT_MAX_TRANSFERS,
    DEFAULT_SLOT_S,
    HISTORY,
    Outgoing,
    SenderHost,
    TransferFinished,
)
from kvtransport.policies.registry import default_policy, make_policy
from kvtransport.scheduling.utility_model import SigmoidUtility

log = logging.getLogger("kvtransport.sender-daemon")


class SenderEngine:
    """A :class:`~kvtransport.hosts.sender_host.SenderHost` on one UDP socket (module docstring):
    the engine is the socket and the loop's calls; every figure of the transfers is the
    host's (``engine.host``).

    ``on_finish(outgoing)`` is called once per transfer when its session is done (sent FIN
    or ABORT, or the receiver said it is finished), after its last datagrams went out.
    """

    def __init__(
        self,
        sock: DatagramSocket,
        host: SenderHost,
        *,
        on_finish: Callable[[Outgoing], None] | None = None,
    ) -> None:
        self.host = host
        # Any: its batches are memoryviews, which the sessions take (they annotate bytes)
        self.sock: Any = sock
        self.on_finish = on_finish

    def fileno(self) -> int:
        return self.sock.fileno()

    # ------------------------------------------------------------------ transfers

    def submit(self, transfer: Transfer, dest: tuple[str, int], **kw: Any) -> Outgoing:
        """Start sending ``transfer`` to ``dest`` (arguments as SenderHost.submit)."""
        kw.setdefault("wall_offset", wall_offset())
        out = self.host.submit(transfer, dest, **kw)
        log.info(
            "transfer %016x: %d bytes to %s:%d, deadline %.1f ms, policy %s%s",
            out.transfer_id,
            out.size,
            dest[0],
            dest[1],
            (out.deadline - out.submitted) * 1e3,
            out.policy,
            f" ({out.label})" if out.label else "",
        )
        return out

    def cancel(self, transfer_id: int, now: float) -> bool:
        """Abort a transfer in flight (its receiver is told to deliver what it has)."""
        done = self.host.cancel(transfer_id, now)
        self._transmit(now)
        return done

    def close(self, now: float) -> None:
        """Abort everything still in flight (daemon shutdown)."""
        self.host.close(now)
        self._transmit(now)

    def stats(self) -> dict[str, Any]:
        return {
            **self.host.stats(),
            "socket": dict(self.sock.stats),
            "rate_mbps": self.host.rate_bps / 1e6,
        }

    # ------------------------------------------------------------------ the loop

    def next_wake(self) -> float | None:
        """When ``run_due`` has work next (a burst's lead before the earliest slot)."""
        return self.host.get_timer()

    def run_due(self, now: float) -> None:
        """Send every datagram due up to ``now + burst_s``; finish what is done."""
        self.host.handle_timer(now)
        self._transmit(now)

    def on_readable(self, now: float) -> None:
        """Feedback: every datagram waiting, to the host."""
        receive = self.host.receive_datagram
        for data, addr in self.sock.recv_batch():
            receive(data, addr, now)
        self._transmit(now)

    def _transmit(self, now: float) -> None:
        """Send what the host released, then handle its events."""
        host = self.host
        for datagrams, dest in host.datagrams_to_send(now):
            self.sock.send(datagrams, dest)
        while (ev := host.next_event()) is not None:
            self._finished(ev)

    def _finished(self, ev: TransferFinished) -> None:
        out = ev.transfer
        s = out.session
        dec = s.decision_latency() or {"n": 0, "mean_us": 0.0, "p99_us": 0.0}
        log.info(
            "transfer %016x done (%s): %d source + %d repair datagrams in %.1f ms, "
            "receiver decoded through %d of %d; %d %s decisions, %.1f us mean, %.1f us p99",
            out.transfer_id,
            s.finish_reason,
            s.stats["source_sent"],
            s.repair_sent,
            (ev.at - out.submitted) * 1e3,
            s.fb_through,
            s.n_source,
            dec["n"],
            out.policy,
            dec["mean_us"],
            dec["p99_us"],
        )
        if self.on_finish is not None:
            self.on_finish(out)


# ---------------------------------------------------------------------- the daemon


def transfer_policy(
    transfer: Transfer,
    initial_rtt_s: float,
    rate_bps: float | None,
    deadline_s: float | None = None,
    prior_known: bool = False,
) -> str:
    """The policy for ``transfer`` when the caller names none
    (kvtransport.hosts.policy_choice.default_policy_for), from the stream's kind as its
    producer declared it (``Transfer.whole_ranges``); the link's one-way delay is half
    ``initial_rtt_s``, the RTT the sender assumes before feedback; ``rate_bps`` the
    link's rate; ``deadline_s`` the transfer's deadline (None: not known);
    ``prior_known``: the sender starts from a loss prior (SenderHost.has_prior_for)."""
    return default_policy_for(
        initial_rtt_s / 2, transfer.whole_ranges, rate_bps, deadline_s, prior_known
    )


def deadline_from(
    head: dict[str, Any],
    nbytes: int,
    rate_bps: float,
    symbol_size: int,
    tagged: bool,
    *,
    link_overhead: int = LINK_OVERHEAD_BYTES,
) -> float:
    """Seconds to the deadline from a request's ``deadline_ms`` or ``rho``, bounded to
    [MIN_DEADLINE_S, MAX_DEADLINE_S] (kvtransport.bounds); UserError otherwise.

    rho is the deadline over the time the whole stream takes loss-free at the link rate
    with ``link_overhead`` bytes per datagram (kvtransport.core.wire.full_send_time), as in
    ``kvtransport simulate``.
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
        value = rho * full_send_time(
            nbytes, rate_bps, symbol_size, tagged, link_overhead=link_overhead
        )
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
    length. ``policy``: the policy of requests that name none (None: each transfer's
    :func:`transfer_policy`, from its stream and initial RTT). ``stats``: where the
    per-transfer JSON lines go
    (kvtransport.daemons.daemon.StatsWriter). ``config``: the protocol's settings its host
    builds every session with (kvtransport.core.protocol; ``symbol_size`` None is its
    symbol size, a request without ``initial_rtt_ms`` gets the shortest round trip its
    receiver's last transfer measured, else the config's initial RTT, and ``rho`` counts
    its link overhead). ``queue_guard``: while one transfer is in flight, the host
    paces below the link rate while the path's queue builds (kvtransport.hosts.queue_guard).
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
        key: SealKey | None,
        policy: str | None = "adaptive",
        symbol_size: int | None = None,
        gso: bool = True,
        burst_s: float = DEFAULT_BURST_S,
        slot_s: float = DEFAULT_SLOT_S,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        utility_table: str | None = None,
        stats: Any = None,
        curve_secret_file: str | None = None,
        config: ProtocolConfig = STANDARD,
        queue_guard: bool = True,
    ) -> None:
        from kvtransport.daemons.api import check_endpoint
        from kvtransport.daemons.daemon import StatsWriter, curve_secret, warm_up

        self.curve_secret = curve_secret(curve_secret_file)
        # before the slow warm-up
        check_endpoint(control, "control", curve=self.curve_secret is not None)
        # None: each transfer's own default (transfer_policy), so all its picks warm up
        picks = (default_policy(), LONG_LINK_HANDOFF_POLICY, FAST_LINK_POLICY)
        warm = (policy,) if policy is not None else tuple(dict.fromkeys(picks))
        for name in warm:
            make_policy(name)  # a bad default fails at start, not at the first submit
        self.policy = policy
        self.table = None
        if utility_table:
            from kvtransport.scheduling.utility_model import UtilityTable

            self.table = UtilityTable.load(utility_table)
        self.stats_out = stats if stats is not None else StatsWriter(None)
        self.warm_up_s = warm_up(key, warm, allocator=True, note=self.log.info)
        self.sock = DatagramSocket(bind, gso=gso)
        host = SenderHost(
            rate_bps=rate_bps,
            key=key,
            symbol_size=symbol_size,
            burst_s=burst_s,
            slot_s=slot_s,
            max_transfers=max_transfers,
            config=config,
            queue_guard=queue_guard,
        )
        self.engine = SenderEngine(self.sock, host, on_finish=self._finished)
        self._reporting: list[Outgoing] = []  # finished, their receivers' last word awaited
        self._start_control(
            control, {"submit": self._submit, "status": self._status, "cancel": self._cancel}
        )

    # ------------------------------------------------------------------ requests

    def _submit(self, head: dict[str, Any], frames: list) -> dict[str, Any]:
        """Validate the whole request (kvtransport.bounds), then start the transfer: a
        request answered ``ok: false`` changes nothing."""
        from kvtransport.daemons.api import ApiError, parse_tid, transfer_from_frames
        from kvtransport.daemons.udp import clock, parse_address

        if "to" not in head:
            raise ApiError("submit needs 'to': the receiver's HOST:PORT")
        dest = parse_address(bounds.text(head["to"], "to", 300), what="receiver")
        transfer = transfer_from_frames(frames, whole_ranges=head.get("whole_ranges", False))
        e = self.engine
        h = e.host
        deadline_s = deadline_from(
            head,
            transfer.nbytes,
            h.rate_bps,
            h.symbol_size,
            h.key is not None,
            link_overhead=h.config.link_overhead,
        )
        tid = parse_tid(head["transfer_id"]) if head.get("transfer_id") is not None else None
        rtt_ms = head.get("initial_rtt_ms")
        if rtt_ms is None:  # what this receiver's last transfer measured, else the config's
            rtt_ms = h.initial_rtt_for(dest) * 1e3
        rtt_ms = bounds.number(rtt_ms, "initial_rtt_ms", 0.0, 1e3 * MAX_INITIAL_RTT_S, lo_open=True)
        policy = head.get("policy")
        if policy is not None:
            policy = bounds.text(policy, "policy", 200)
        else:
            policy = self.policy or transfer_policy(
                transfer, rtt_ms * 1e-3, h.rate_bps, deadline_s, h.has_prior_for(dest)
            )
        out = e.submit(
            transfer,
            dest,
            now=clock(),
            deadline_s=deadline_s,
            policy=policy,
            name=tid,  # a client's id names the transfer; its wire id is random (core.wire)
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
        from kvtransport.daemons.api import parse_tid
        from kvtransport.daemons.udp import clock

        tid = parse_tid(head["transfer_id"])
        done = self.engine.cancel(tid, clock())
        if done:
            log.info("transfer %016x cancelled by a client", tid)
        return {"cancelled": done}

    def _finished(self, out: Outgoing) -> None:
        from kvtransport.daemons.udp import clock

        self.stats_out.write({"event": "transfer", "role": "sender", **out.status(clock())})
        self._reporting.append(out)

    def _on_idle(self, now: float) -> None:
        """Name the transfers that delivered nothing (no feedback, a refusal, no manifest)
        in a warning, once their receivers' last report is in (Outgoing.outcome_final)."""
        if not self._reporting:
            return
        waiting = []
        for out in self._reporting:
            if not out.outcome_final(now):
                waiting.append(out)
                continue
            delivered, note = out.outcome()
            if note:
                log.warning("transfer %016x: %s delivered: %s", out.transfer_id, delivered, note)
        self._reporting = waiting

    def _describe(self) -> str:
        rate = self.engine.host.rate_bps
        return f"link {rate / 1e6:.1f} Mbit/s, GSO {'on' if self.sock.gso else 'off'}"
