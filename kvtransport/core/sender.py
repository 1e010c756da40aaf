"""The sending half of the protocol core (sans-I/O): :class:`SenderSession`.

The session never reads a clock (save a performance counter that times its policy
decisions, ``decision_ns``, which nothing it sends depends on) or touches a socket. The
shell (UDP daemon, simulator, Gymnasium environment) calls ``datagrams_to_send(now)``
whenever ``next_timer()`` has come, hands every feedback datagram to
``receive_datagram(data, now)``, and sends what comes out.

What it sends, slot by slot (one data-path datagram per slot, slots paced at the link
rate counting the config's ``link_overhead`` bytes per datagram, as shapers do):

1. the transport manifest, protected as kvtransport.core.manifest_fec describes (its first
   datagram takes slot 0; repetition stops once feedback acknowledges it);
2. a repair that goes first, as the policy's repair scheme has it (kvtransport.core.schemes,
   ``SenderRepair.before_source``): Reed-Solomon parities of the block just completed
   (block-rs); retransmissions of what feedback NACKed, at most once per 1.5 RTT each
   (arq); for rlc, first the *reactive* repairs feedback asked for (when the policy is
   ``reactive``), then a *proactive* repair whenever the repair credit (the interval's
   repair share, added per slot) reaches one;
3. otherwise the next source symbol in stream order, if the policy admits new sources and
   the tail rule allows it: the expected surviving slots before the stop time (slots times
   1 - loss estimate) must cover the repairs still owed plus the symbols that finish the
   block holding this source's first byte. A source whose block cannot finish in time is
   useless, so it is not sent;
4. otherwise, for a scheme that fills idle slots (rlc: ``SenderRepair.fill``), repairs
   for what was already sent, until the stop time (when nothing is left to repair, a
   source that passes the tail rule goes out rather than an idle slot).

**Sources go in stream order, never skipped.** The sources sent are always the stream's
first ``next_esi`` symbols. When the tail rule refuses the next source, the session does
not look past it for a later, smaller block that would still fit: it sends repairs (4.)
or idles, and sends that source once a later slot's check passes (feedback lowered what is
owed or the loss estimate); past the stop time, the rest of the stream is cut. The order
is the producer's priority and the protocol's frame:

- the receiver reads an ESI below the highest it has seen as lost (feedback counts it as a
  hole and asks for repair) and RLC repairs combine contiguous sources, so a skipped
  source would cost repair for a symbol that was never sent;
- a utility-ordered stream (kvtransport.model.utility.stream_order ``utility``) puts the
  blocks worth most first, so a later block is worth less than the refused one. With
  blocks of one size none fits where the refused one does not; with mixed sizes (a card
  of ``mixed:BYTES`` precision) a later, smaller one may, but the refusal leaves fewer
  slots than the refused block plus what is owed, so skipping could add at most about
  one block's bytes of the least useful blocks, and with rlc those slots protect the
  blocks already sent instead, which are worth more;
- a prefix-ordered (``position``, ``back``) stream is whole token ranges, each with a
  block in every layer, which the receiver loads only when every layer arrived and
  otherwise recomputes (kvtransport.model.race). A later block of the refused block's
  range is useless without it, and a later whole range needs a block in every layer: at
  least as many symbols as the refused block's rest whenever there are at least as many
  layers as the ratio of the largest to the smallest precision (fp16 / int4 = 4), so it
  would not pass the tail rule either. Skipping ahead could only deliver partial ranges,
  which the receiver does not use; cutting the stream's end costs the receiver the
  compute of the cut ranges, not exactness.

A producer that wants a different trade sizes or orders its stream for the budget
(kvtransport.model.plan plans precisions and a prefix to fit it).

The scheme decides how a repair is built (kvtransport.core.schemes.rlc has the RLC repair
windows; their proactive span is at most ``max_repair_span``, default the config's);
the policy decides how much repair and when.

Stop time = deadline - one-way delay estimate (half the smoothed RTT) - one slot: a datagram
sent later cannot arrive before the deadline; on a path that reorders (jitters), less
``STOP_RTTVAR`` mean deviations of the RTT (``jitter_margin``), past which one is unlikely
to. Then a CONTROL FIN goes out and the session is done. Feedback ALL_DONE or FINISHED
ends it early; a FINISHED that carries a refusal (kvtransport.core.feedback) ends it with
``refused`` naming the receiver's reason and ``finish_reason`` "refused (REASON)".

The policy is asked once per ``decision_packets`` slots with an observation built in place
(kvtransport.core.observation documents the fields), and at the next slot after ``set_rate``
raises the rate by more than ``RATE_REDECIDE``. An ``ExternalPolicy`` defers: the session stops
emitting with ``awaiting_action`` set until the shell calls ``apply_action``.

The session is its parts, each with one concern (as aioquic splits recovery, pacing and
congestion control): the source stream and the send progress (kvtransport.core.sent), the
pacer (kvtransport.core.pacing), the RTT estimator (kvtransport.core.rtt), the feedback
state (kvtransport.core.feedback ``FeedbackState``), the tail rule
(kvtransport.core.tail_rule), the policy driver (kvtransport.core.policy_driver) and the
lifecycle (kvtransport.core.lifecycle: ``state``, ``finish_reason``); the scheme's
sender side sees them through a read-only view (kvtransport.core.repair_view). The
session's public attributes of old are properties over those parts.
"""

from __future__ import annotations

import dataclasses
import secrets
from array import array
from typing import TYPE_CHECKING

import numpy as np

from kvtransport.core import schemes
from kvtransport.core.feedback import OPEN_LOOP_LOSS, FeedbackState, refusal_reason
from kvtransport.core.lifecycle import FinishReason, SenderLifecycle, SenderState
from kvtransport.core.manifest_fec import ManifestSender
from kvtransport.core.observation import Raw
from kvtransport.core.pacing import (
    CATCH_UP_S,
    MAX_CATCH_UP,
    MAX_CATCH_UP_BYTES,
    Pacer,
    catch_up_datagrams,
)
from kvtransport.core.policy_base import Policy
from kvtransport.core.policy_driver import (
    OPEN_LOOP_FIRST_RTTS,
    OPEN_LOOP_MAX_SHARE,
    OPEN_LOOP_MIN_S,
    OPEN_LOOP_RTTS,
    PolicyDriver,
)
from kvtransport.core.protocol import REPAIR_SEGMENT, STANDARD, ProtocolConfig, check_repair_span
from kvtransport.core.repair_view import RepairView
from kvtransport.core.rtt import RttEstimator
from kvtransport.core.schemes.base import SenderRepair
from kvtransport.core.schemes.rlc import RLCSender
from kvtransport.core.sent import SEQ_MASK, SendProgress, SourceStream
from kvtransport.core.tail_rule import TailRule
from kvtransport.core.transfer import Transfer, TransportManifest
from kvtransport.core.wire import (
    FB_ALL_DONE,
    FB_FINISHED,
    FB_MANIFEST_DONE,
    FB_REORDERED,
    HEADER_SIZE,
    TAG_SIZE,
    ControlCode,
    DatagramType,
    Feedback,
    Framer,
    Parser,
    SealKey,
    WireError,
    decode_feedback,
    feedback_epoch,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.codecs.rlc import RLCEncoder

__all__ = [
    "CATCH_UP_S",
    "MAX_CATCH_UP",
    "MAX_CATCH_UP_BYTES",
    "OPEN_LOOP_FIRST_RTTS",
    "OPEN_LOOP_LOSS",
    "OPEN_LOOP_MAX_SHARE",
    "OPEN_LOOP_MIN_S",
    "OPEN_LOOP_RTTS",
    "RATE_REDECIDE",
    "STOP_RTTVAR",
    "FinishReason",
    "SenderSession",
    "SenderState",
    "catch_up_datagrams",
]

_SOURCE = int(DatagramType.SOURCE)

STOP_RTTVAR = 2.0
"""On a path that reorders (the receiver's feedback says so, ``FB_REORDERED``), the stop
time keeps this many smoothed mean deviations of the RTT samples (``rttvar``, RFC 6298's
estimator) for the delay's spread. Reordering is what tells jitter from a queue: a FIFO
queue that fills and drains moves the RTT as much, but in order, and there the smoothed
RTT already errs late (it lags a draining queue), so a margin only cut the transfer
short. When both directions jitter alike, the RTT's mean deviation is about 1.13
standard deviations of one direction's delay, so two of them put the last datagram about
2.3 of those beyond the mean one-way delay."""

RATE_REDECIDE = 1.5
"""A rate raised (``set_rate``) by more than this factor in one step makes the policy
decide again at the next slot instead of at the interval's end: its last decision counted
the slots left at the old rate (a sender a shared link throttled stopped admitting for
lack of slots, and kept sending repairs after its share grew back). A rate cut needs no
new decision: the tail rule counts each source's slots at the rate of the moment. Smaller
steps that add up past the factor within one interval wait for its end (counting from
the rate of the last decision instead cost the multi-user allocator accuracy; see
docs/results.md, section 6)."""


class SenderSession:
    """Sends one transfer before a deadline (see the module docstring).

    ``deadline`` and ``now`` are in the shell's clock (seconds). ``rate_bps`` is the link
    rate the sender paces to. ``key`` seals every datagram (AES-256-GCM, kvtransport.core.wire).
    ``wall_offset`` is the shell's wall clock (Unix seconds) minus its ``now`` clock: the
    manifest carries ``now + wall_offset`` as its send time, which a daemon receiver checks
    for freshness (kvtransport.core.replay); shells without a real receiver leave it 0.
    ``config``: the protocol's settings (kvtransport.core.protocol.ProtocolConfig: the
    bounds of the encoder's window, pacing overhead, and the defaults of ``symbol_size``,
    ``initial_rtt`` and ``max_repair_span``). ``decoder_window`` (the ESIs the encoder and
    the receiver's decoder hold, named in the manifest) is sized once, from ``rate_bps``
    and ``initial_rtt`` (``ProtocolConfig.window_for``).
    """

    source_runs = True
    """Runs of plain source slots go out in one ``_source_run`` each (False: every slot
    through ``_emit``, the reference the runs are tested against)."""

    def __init__(
        self,
        transfer: Transfer,
        policy: Policy,
        *,
        rate_bps: float,
        deadline: float,
        now: float = 0.0,
        transfer_id: int | None = None,
        key: SealKey | None = None,
        symbol_size: int | None = None,
        decision_packets: int = 32,
        initial_rtt: float | None = None,
        record: bool = False,
        wall_offset: float = 0.0,
        max_repair_span: int | None = None,
        prior_loss: float | None = None,
        config: ProtocolConfig = STANDARD,
    ) -> None:
        if symbol_size is None:
            symbol_size = config.symbol_size
        if initial_rtt is None:
            initial_rtt = config.initial_rtt
        if not rate_bps > 0:
            raise ValueError("rate_bps must be positive")
        if not 16 <= symbol_size <= 65000:
            raise ValueError("symbol_size must be 16..65000 bytes")
        if decision_packets < 1:
            raise ValueError("decision_packets must be >= 1")
        self.config = config
        self.scheme = schemes.get(policy.scheme)
        s = symbol_size
        self.transfer_id = secrets.randbits(64) if transfer_id is None else transfer_id
        self.framer = Framer(self.transfer_id, key, max_payload=max(s, 2048))
        self.parser = Parser(key)
        self.deadline = deadline
        self.source = stream = SourceStream(transfer, s)
        n = stream.n_source
        self.pacer = pacer = Pacer(
            rate_bps, HEADER_SIZE + s + (TAG_SIZE if key else 0), config.link_overhead, now
        )
        self.rtt = RttEstimator(initial_rtt)
        self.fb = FeedbackState(_check_prior(prior_loss))
        self.progress = SendProgress()
        self.life = SenderLifecycle(now)
        span = check_repair_span(
            config.max_repair_span if max_repair_span is None else max_repair_span,
            config.decoder_window,
        )
        self._wall_offset = wall_offset
        # the ESIs the encoder and the receiver's decoder hold (two bandwidth-delay products
        # of the link as given, within the config's bounds), named in the manifest
        self.decoder_window = config.window_for(rate_bps, initial_rtt, n, s)
        self.manifest = self._manifest(max(deadline - now, 0.0), now)
        self.stats = {
            "manifest_sent": 0,
            "source_sent": 0,
            "rlc_repair_sent": 0,
            "block_repair_sent": 0,
            "retransmit_sent": 0,
            "control_sent": 0,
            "idle_polls": 0,
            "decisions": 0,
            "feedback_received": 0,
            "feedback_stale": 0,
            "receiver_restarts": 0,
            "dropped": 0,
        }
        self.drop_reasons: dict[str, int] = {}

        # the tail rule and the policy driver; the scheme's side of this transfer (what a
        # repair is and how it is built) is made with a read-only view of them and attached
        tail = self.tail = TailRule(
            bool(policy.tail_rule), stream.finish_esi, self.fb, self.progress, pacer
        )
        self.driver = PolicyDriver(
            policy, decision_packets, record, now, stream, self.progress, self.fb, self.rtt,
            pacer, tail,
        )  # fmt: skip
        self._view = RepairView(
            stream, self.progress, self.fb, self.rtt, pacer, tail, self.driver, self.framer,
            self.stats, config, self.decoder_window, span,
        )  # fmt: skip
        self._repair = rep = self.scheme.sender(self._view, policy)
        tail.attach(rep, rep.tail_ok if _overrides(rep, "tail_ok") else None)
        # the scheme's per-slot calls, bound once (None where the scheme has nothing to do)
        self._before_source = rep.before_source if _overrides(rep, "before_source") else None
        self._fill = rep.fill if rep.fills_idle else None
        self._on_source = rep.on_source if rep.sees_sources else None
        if self.scheme.stat:
            self.stats.setdefault(self.scheme.stat, 0)
        self._rtt_changed()
        self.driver.begin(now, self.manifest.acked)

    # ------------------------------------------------------------------ parts as attributes

    @property
    def transfer(self) -> Transfer | None:
        """The transfer (None once released)."""
        return self.source.transfer

    @property
    def start(self) -> float:
        """When the session started (the shell's clock)."""
        return self.driver.start

    @property
    def policy(self) -> Policy:
        return self.driver.policy

    @property
    def symbol_size(self) -> int:
        return self.source.symbol_size

    @property
    def n_source(self) -> int:
        return self.source.n_source

    @property
    def rate_bps(self) -> float:
        return self.pacer.rate_bps

    @property
    def slot_s(self) -> float:
        return self.pacer.slot_s

    @property
    def datagram_bytes(self) -> int:
        return self.pacer.datagram_bytes

    @property
    def link_overhead(self) -> int:
        return self.pacer.link_overhead

    @property
    def catch_up(self) -> int:
        return self.pacer.catch_up

    @property
    def decision_packets(self) -> int:
        return self.driver.decision_packets

    @property
    def prior_loss(self) -> float | None:
        return self.fb.prior_loss

    @property
    def srtt(self) -> float | None:
        return self.rtt.srtt

    @property
    def rttvar(self) -> float:
        return self.rtt.rttvar

    @property
    def min_rtt(self) -> float | None:
        return self.rtt.min_rtt

    @property
    def rtt_sample(self) -> float | None:
        return self.rtt.latest

    @property
    def path_reorders(self) -> bool:
        return self.rtt.path_reorders

    @property
    def stop_time(self) -> float:
        """The last moment a datagram can leave and arrive before the deadline."""
        return self.tail.stop_time

    @property
    def next_esi(self) -> int:
        return self.progress.next_esi

    @next_esi.setter
    def next_esi(self, esi: int) -> None:
        self.progress.next_esi = esi

    @property
    def seq(self) -> int:
        return self.progress.seq

    @property
    def slot(self) -> int:
        return self.progress.slot

    @property
    def source_sent(self) -> int:
        return self.progress.source_sent

    @source_sent.setter
    def source_sent(self, n: int) -> None:
        self.progress.source_sent = n

    @property
    def repair_sent(self) -> int:
        return self.progress.repair_sent

    @property
    def reactive_sent(self) -> int:
        return self.progress.reactive_sent

    @property
    def fb_time(self) -> float | None:
        return self.fb.time

    @property
    def fb_data_received(self) -> int:
        return self.fb.data_received

    @property
    def fb_loss(self) -> float:
        return self.fb.loss

    @property
    def fb_loss_recent(self) -> float:
        return self.fb.loss_recent

    @property
    def fb_burst(self) -> float:
        return self.fb.burst

    @property
    def fb_through(self) -> int:
        return self.fb.through

    @property
    def fb_esi_end(self) -> int:
        return self.fb.esi_end

    @property
    def fb_deficit(self) -> int:
        return self.fb.deficit

    @property
    def fb_unseen(self) -> int:
        return self.fb.unseen

    @property
    def fb_echo(self) -> int:
        """The highest packet number feedback reported (-1: none yet)."""
        return self.fb.echo

    @property
    def open_loop(self) -> bool:
        """No feedback for a while: the scheme repairs open-loop."""
        return self.fb.open_loop

    @property
    def share(self) -> float:
        return self.driver.share

    @property
    def admit(self) -> bool:
        return self.driver.admit

    @property
    def awaiting_action(self) -> bool:
        return self.driver.awaiting

    @property
    def obs(self) -> np.ndarray:
        return self.driver.obs

    @property
    def record(self) -> bool:
        return self.driver.record

    @record.setter
    def record(self, on: bool) -> None:
        self.driver.record = on

    @property
    def history(self) -> list[tuple]:
        return self.driver.history

    @property
    def decision_ns(self) -> array[int]:
        """Latency of each decision in ns (``PolicyDriver.decision_ns``)."""
        return self.driver.decision_ns

    @property
    def state(self) -> SenderState:
        """SENDING, AWAITING_ACTION (an ExternalPolicy deferred) or DONE."""
        return self.life.state(self.driver.awaiting)

    @property
    def done(self) -> bool:
        return self.life.done

    @property
    def finish_reason(self) -> str:
        """Why the session finished ("" while it sends): a ``FinishReason`` value, or
        "refused (REASON)"."""
        return self.life.finish_reason

    @property
    def refused(self) -> str:
        """The receiver's refusal (kvtransport.core.feedback.REFUSALS; "" for none)."""
        return self.life.refused

    @property
    def finished_at(self) -> float | None:
        return self.life.finished_at

    # ------------------------------------------------------------------ shell API

    def next_timer(self) -> float | None:
        """When the shell must call ``datagrams_to_send`` next (None: nothing planned)."""
        life = self.life
        if life.pending:
            return life.pending_at  # e.g. an ABORT queued by cancel()
        if life.done or self.driver.awaiting:
            return None
        return self.pacer.next_send

    def handle_timer(self, now: float) -> None:
        """Timers only release datagrams; ``datagrams_to_send`` does the work."""

    def datagrams_to_send(self, now: float) -> list[bytes]:
        """Every datagram whose slot has come by ``now`` (normally one)."""
        life, pacer, driver, tail = self.life, self.pacer, self.driver, self.tail
        out = life.pending
        life.pending = []
        t = pacer.next_send
        if life.done or t is None:
            return out
        slot_s = pacer.slot_s
        burst = 0
        while t <= now and not driver.awaiting:
            if t > tail.stop_time:
                self._finish(t, FinishReason.DEADLINE, out)
                return out
            if self.source_runs and t + slot_s <= now:  # a run needs two slots due
                t_run, burst_run = self._source_run(t, now, burst, out)
                if burst_run != burst:
                    t, burst = t_run, burst_run
                    continue
            d = self._emit(t)
            if d is None:
                if driver.awaiting or life.done:
                    break
                # nothing useful now: poll again later (feedback also wakes us)
                self.stats["idle_polls"] += 1
                if self.source.n_source == self.progress.next_esi and (
                    self._repair.finishes_when_sent
                ):
                    self._finish(t, FinishReason.ALL_SENT, out)
                    return out
                pacer.idle = True
                t = t + max(slot_s, min(self.rtt.srtt or self.rtt.initial, 0.005))
                break
            pacer.idle = False
            out.append(d)
            burst += 1
            t += slot_s
            if burst >= pacer.catch_up and t <= now:
                t = now  # give up the backlog rather than burst it out
        pacer.next_send = t
        return out

    def receive_datagram(self, data: bytes, now: float) -> None:
        """Feedback from the receiver (anything else is counted and dropped)."""
        got = self._parse_feedback(data)
        if got is None:
            return
        fb, epoch, seq = got
        why = refusal_reason(fb.flags)
        if why:  # sealed with the transfer's key: only the receiver can have sent it
            self.stats["feedback_received"] += 1
            if not self.life.done:
                self.life.refused = why
                self._mark_done(now, FinishReason.REFUSED)
            return
        if self._restarted(fb):
            self._receiver_restarted(fb, now)
        elif not self.fb.fresh(epoch, seq, fb):
            self.stats["feedback_stale"] += 1
            return
        self.fb.epoch, self.fb.seq = epoch, seq
        self.stats["feedback_received"] += 1
        self._on_feedback(fb, now)

    def _parse_feedback(self, data: bytes) -> tuple[Feedback, int, int] | None:
        """A feedback datagram of this transfer: (the report, its feedback epoch, its
        sequence number); anything else is counted and dropped (None)."""
        try:
            d = self.parser.parse(data)
            if d.transfer_id != self.transfer_id:
                self._drop("foreign_transfer")
                return None
            if d.type != DatagramType.FEEDBACK:
                self._drop("unexpected_type")
                return None
            fb = decode_feedback(d.payload)
        except WireError as exc:
            self._drop(exc.reason)
            return None
        return fb, feedback_epoch(d), d.seq

    def late_feedback(self, data: bytes, now: float) -> None:
        """Feedback that comes after the session is done (the receiver's final report
        overtaken by the sender's stop): read only for what it says was delivered (decoded
        through, the manifest decoded, a refusal); nothing else changes and nothing is
        sent. Garbage is counted and dropped as in :meth:`receive_datagram`."""
        got = self._parse_feedback(data)
        if got is None:
            return
        fb, epoch, seq = got
        self.stats["feedback_received"] += 1
        why = refusal_reason(fb.flags)
        if why:
            self.life.refused = self.life.refused or why
            return
        state = self.fb
        if not state.fresh(epoch, seq, fb):
            self.stats["feedback_stale"] += 1
            return
        state.epoch, state.seq = epoch, seq
        if state.time is None:
            state.time = now
        state.through = max(state.through, min(fb.decoded_through, self.progress.next_esi))
        if fb.flags & FB_MANIFEST_DONE:
            self.manifest.acked = True

    def apply_action(self, action: int) -> None:
        """Supply the decision an ExternalPolicy deferred (Gymnasium environment)."""
        if not self.driver.awaiting:
            raise RuntimeError("no decision is pending")
        self.driver.set_action(int(action))
        self.driver.awaiting = False

    def cancel(self, now: float) -> None:
        """Abort the transfer: one CONTROL ABORT tells the receiver to deliver now."""
        life = self.life
        if not life.done:
            life.pending.append(self._control(ControlCode.ABORT))
            life.pending_at = now
            self._mark_done(now, FinishReason.CANCELLED)

    def release(self) -> None:
        """Drop every reference to the payload (and the encoders that read it) once the
        session is done; counters, estimates and ``status`` figures stay. A shell that
        keeps finished sessions for reporting calls it, so their payloads can be freed.
        ``transfer`` is None afterwards."""
        if not self.life.done:
            raise RuntimeError("release() is for finished sessions")
        self.source.release()
        self._repair.release()

    def set_rate(self, rate_bps: float, now: float) -> None:
        """Change the pacing rate mid-flight (a shell sharing one link among several
        transfers sets each one's rate per slot). The next slot follows the new rate; the
        policy's context sees the new slot length. 0 pauses: nothing is sent until the next
        call, and a sender still paused at its deadline finishes there (FIN)."""
        if not rate_bps >= 0.0:
            raise ValueError("rate_bps must be >= 0")
        if self.life.done:
            return
        pacer = self.pacer
        if rate_bps == 0.0:
            pacer.idle = False  # feedback must not wake a paused sender
            pacer.next_send = self.deadline
            return
        if rate_bps > pacer.rate_bps * RATE_REDECIDE:
            self.driver.stale = True
        pacer.set_rate(rate_bps)
        self._rtt_changed()  # stop time and proactive span are counted in slots
        self.driver.pack_transfer()
        policy = self.driver.policy
        if getattr(policy, "ctx", None) is not None:
            policy.ctx = dataclasses.replace(policy.ctx, slot_s=pacer.slot_s)
        if pacer.next_send is None or pacer.next_send >= self.deadline:  # was paused
            pacer.next_send = now
            pacer.resumed_at = now

    def set_prior_loss(self, loss: float | None) -> None:
        """What the shell knows of this path's loss before the receiver reports any (the
        link profile, or the loss the last transfer to the same receiver ended with; None:
        nothing). Until the first feedback it is the loss estimate (``loss_estimate``: the
        tail rule, ``owed`` and the policy observation use it), and the policy observes it
        throughout (``Obs.PRIOR_LOSS``, ``Obs.PRIOR_KNOWN``)."""
        self.fb.prior_loss = _check_prior(loss)
        self.driver.pack_transfer()

    def decision_latency(self) -> dict[str, float] | None:
        """Count, mean, p50 and p99 (us) of this transfer's policy decisions as the
        session timed them (``decision_ns``); None before the first decision."""
        return self.driver.decision_latency()

    # ------------------------------------------------------------------ estimates

    @property
    def owd(self) -> float:
        """One-way delay estimate: half the smoothed RTT (initial RTT before feedback)."""
        return self.rtt.owd

    @property
    def jitter_margin(self) -> float:
        """Seconds the stop time keeps for the delay's spread: ``STOP_RTTVAR`` RTT mean
        deviations once feedback said the path reorders, else 0."""
        rtt = self.rtt
        return STOP_RTTVAR * rtt.rttvar if rtt.path_reorders else 0.0

    @property
    def max_repair_span(self) -> int:
        """Most source symbols a proactive RLC repair covers (the constructor's
        ``max_repair_span``, default the config's); setting it applies at once."""
        return self._view.max_repair_span

    @max_repair_span.setter
    def max_repair_span(self, span: int) -> None:
        self._view.max_repair_span = check_repair_span(span, self.config.decoder_window)
        self._rtt_changed()

    @property
    def encoder(self) -> RLCEncoder | None:
        """The RLC scheme's encoder (None for other schemes, or once released)."""
        rep = self._repair
        return rep.encoder if isinstance(rep, RLCSender) else None

    @property
    def _proactive_span(self) -> int:
        """The RLC scheme's proactive repair span (kvtransport.core.schemes.rlc)."""
        rep = self._repair
        return rep.span if isinstance(rep, RLCSender) else REPAIR_SEGMENT

    def _rtt_changed(self) -> None:
        """The RTT estimate, the rate or the repair span changed: the scheme's span and
        the stop time follow."""
        self._repair.rtt_changed()
        stop = self.deadline - self.rtt.owd - self.jitter_margin - self.pacer.slot_s
        self.tail.stop_time = stop
        self.driver.raw[Raw.STOP_TIME] = stop

    def slots_left(self, t: float) -> int:
        return self.tail.slots_left(t)

    def loss_estimate(self) -> float:
        """The receiver's smoothed loss rate; before its first report, the prior, else 0;
        open loop, at least ``OPEN_LOOP_LOSS``. (The session's own accounting: the policy
        observation keeps the reported rate, or the prior or 0 before feedback.)"""
        return self.fb.loss_estimate()

    def in_flight(self) -> tuple[int, int]:
        """Sources and repairs sent after the last packet the receiver reported."""
        return self.tail.in_flight()

    def reactive_needed(self) -> int:
        """Repairs the latest feedback asked for that none sent since then addresses."""
        return self.tail.reactive_needed()

    def owed(self) -> float:
        """Expected repair symbols still needed for the sources already sent: reported
        holes not yet answered, plus the expected losses among sources in flight, minus
        the expected arrivals of proactive repairs in flight."""
        return self.tail.owed()

    def tail_fits(self, left: int, need: int) -> bool:
        """The loss-aware tail rule: do ``left`` slots, times one minus the loss estimate,
        cover the repairs owed plus ``need`` more? (Schemes may rule otherwise:
        ``SenderRepair.tail_ok``.)"""
        return self.tail.fits(left, need)

    # ------------------------------------------------------------------ emission

    def _emit(self, t: float) -> bytes | None:
        d: bytes | None
        progress, driver = self.progress, self.driver
        slot = progress.slot
        if (slot % driver.decision_packets == 0 and driver.decision_slot != slot) or (driver.stale):
            self._decide(t)
            if driver.awaiting:
                return None
        manifest = self.manifest
        if not manifest.acked and slot >= manifest.next_slot:
            d = manifest.emit(self.framer, progress.seq, slot)
            self.stats["manifest_sent"] += 1
            progress.sent(t, False, False, False)
            return d
        before = self._before_source
        if before is not None:
            d = before(t)
            if d is not None:
                progress.sent(t, False, True, self._repair.reactive)
                return d
        esi = progress.next_esi
        n = self.source.n_source
        tail_ok = self.tail.ok
        if esi < n:
            if driver.admit and tail_ok(t, esi):
                d = self._source(esi)
                progress.sent(t, True, False, False)
                return d
        fill = self._fill
        if fill is not None:
            d = fill(t)
            if d is not None:
                progress.sent(t, False, True, self._repair.reactive)
                return d
            if esi < n and tail_ok(t, esi):
                d = self._source(esi)
                progress.sent(t, True, False, False)
                return d
        return None

    def _source_run(self, t: float, now: float, burst: int, out: list[bytes]) -> tuple[float, int]:
        """From slot time ``t``: the consecutive slots ``_emit`` would give the next source
        each, sent in one go, appended to ``out``; returns the next slot time and the burst
        count as ``datagrams_to_send`` steps them (pacing, ``catch_up``). The same
        datagrams, slot times, log entries, counters and scheme state as ``_emit``
        slot by slot: the run stops before a decision slot, a manifest slot, a slot
        whose ``before_source`` the scheme cannot vouch for (``SenderRepair.quiet_slots``;
        ``passed`` afterwards), a slot past ``now`` or the stop time, and a source the tail
        rule refuses (tested once for the whole run where ``TailRule.clear`` can vouch for
        it, otherwise per source with the state after the sources before it); none when the
        policy does not admit sources or the scheme sees each source, and while a decision
        is due after a rate rise (``PolicyDriver.stale``)."""
        p, driver, stream = self.progress, self.driver, self.source
        esi, n = p.next_esi, stream.n_source
        if not driver.admit or esi >= n or self._on_source is not None:
            return t, burst
        slot, dp = p.slot, driver.decision_packets
        if (slot % dp == 0 and driver.decision_slot != slot) or driver.stale:
            return t, burst
        limit = min(n - esi, (slot // dp + 1) * dp - slot)
        manifest = self.manifest
        if not manifest.acked:
            limit = min(limit, manifest.next_slot - slot)
        rep = self._repair
        if self._before_source is not None and limit > 0:
            limit = rep.quiet_slots(limit)
        if limit <= 0:
            return t, burst
        tail = self.tail
        tail_ok = tail.ok
        stop, slot_s = tail.stop_time, self.pacer.slot_s
        catch_up = self.pacer.catch_up
        log = p.log
        lt, lsrc, lrep, lrea = log.t, log.src, log.rep, log.rea
        rep_n, rea_n = p.repair_sent, p.reactive_sent
        seq, sent, k = p.seq, p.source_sent, 0
        seq0, esi0 = seq, esi
        clear = tail.clear(max(t + limit * slot_s, now), esi, limit)
        while k < limit and t <= now and t <= stop and (clear or tail_ok(t, esi)):
            i = seq & SEQ_MASK
            lt[i], lsrc[i], lrep[i], lrea[i] = t, sent + 1, rep_n, rea_n
            k += 1
            esi += 1
            seq += 1
            sent += 1
            if not clear:  # what the tail rule reads, as after each source slot by slot
                p.next_esi, p.seq, p.slot, p.source_sent = esi, seq, slot + k, sent
            burst += 1
            t += slot_s
            if burst >= catch_up and t <= now:
                t = now
        if k:
            out += self.framer.seal_sources(
                seq0, esi0, k, stream.payload_array, stream.symbol_size, n - 1, stream.last_array
            )
            p.next_esi, p.seq, p.slot, p.source_sent = esi, seq, slot + k, sent
            log.newest = seq - 1
            self.stats["source_sent"] += k
            self.pacer.idle = False
            if self._before_source is not None:
                rep.passed(k)
        return t, burst

    def _source(self, esi: int) -> bytes:
        sym = self.source.symbol(esi)
        if self._on_source is not None:
            self._on_source(esi, sym)
        self.progress.next_esi = esi + 1
        self.stats["source_sent"] += 1
        return self.framer.seal(_SOURCE, self.progress.seq, sym, esi)  # sealed where it lies

    def source_symbol(self, esi: int) -> memoryview | bytes:
        """Source symbol ``esi`` as it travels (the last one zero-padded)."""
        return self.source.symbol(esi)

    def _control(self, code: int) -> bytes:
        p = self.progress
        d = self.framer.build(DatagramType.CONTROL, p.seq, b"", esi=code)
        p.seq += 1
        self.stats["control_sent"] += 1
        return d

    def _finish(self, t: float, reason: FinishReason, out: list[bytes]) -> None:
        out.append(self._control(ControlCode.FIN))
        self._mark_done(t, reason)

    def _mark_done(self, t: float, reason: FinishReason) -> None:
        self.life.finish(t, reason)
        self.pacer.next_send = None

    # ------------------------------------------------------------------ feedback

    def _on_feedback(self, fb: Feedback, now: float) -> None:
        state, rtt = self.fb, self.rtt
        state.time = now
        state.data_received = fb.received
        rtt.latest = None
        if fb.flags & FB_REORDERED and not rtt.path_reorders:
            rtt.path_reorders = True
            self._rtt_changed()
        sent_t = state.take_echo(fb, self.progress.log)
        if sent_t is not None:
            sample = now - sent_t - fb.echo_delay_us * 1e-6
            if sample > 0:
                rtt.on_sample(sample)
                self._rtt_changed()
        state.take_counts(fb, self.progress.next_esi)
        deficit = self._repair.on_feedback(fb, now)
        if deficit is not None:
            state.deficit = deficit
        if fb.flags & FB_MANIFEST_DONE:
            self.manifest.acked = True
        self.driver.pack_feedback(self.manifest.acked)
        life = self.life
        if fb.flags & (FB_ALL_DONE | FB_FINISHED):
            if not life.done:
                self._mark_done(
                    now,
                    FinishReason.RECEIVER_DONE
                    if fb.flags & FB_ALL_DONE
                    else FinishReason.RECEIVER_FINISHED,
                )
            return
        pacer = self.pacer
        if pacer.idle and not life.done:  # news may give the idle sender work: wake it
            pacer.idle = False
            pacer.next_send = now

    def _restarted(self, fb: Feedback) -> bool:
        """Feedback of a receiver that lost its state (restarted): the manifest was
        acknowledged, this report says it is not decoded, and it reports a packet newer
        than any report before (so it is not an old report overtaken by newer ones)."""
        return (
            self.manifest.acked and not fb.flags & FB_MANIFEST_DONE and fb.echo_seq > self.fb.echo
        )

    def _receiver_restarted(self, fb: Feedback, now: float) -> None:
        """Start over with a receiver that knows nothing: its feedback numbers restart, its
        decoded-through is its own; the manifest goes out again (the full protected run)
        with the time left to the deadline, so the new receiver delivers by it."""
        self.stats["receiver_restarts"] += 1
        self.fb.restart()
        self._repair.restart()
        self.manifest = self._manifest(max(self.deadline - now, 0.0), now)
        self.manifest.next_slot = self.progress.slot

    def _manifest(self, deadline_s: float, now: float) -> ManifestSender:
        """The transport manifest, made now (its send time is this moment's wall clock:
        a resent one is fresh, and newer than the one the receiver may have recorded)."""
        t = self.source.transfer
        s = self.source.symbol_size
        assert t is not None  # released only once done
        manifest = TransportManifest(
            s, t.nbytes, t.blocks, t.app_metadata, deadline_s,
            max(now + self._wall_offset, 0.0), self.decoder_window,
        )  # fmt: skip
        return ManifestSender(manifest.to_bytes(), s)

    # ------------------------------------------------------------------ policy

    def observe(self, t: float) -> np.ndarray:
        """Fill ``obs`` (the policy's observation) for time ``t`` and return it."""
        return self.driver.observe(t)

    def _state(self, t: float) -> np.ndarray:
        """The raw sender state the observation is computed from (``PolicyDriver.state``)."""
        return self.driver.state(t)

    def _decide(self, t: float) -> None:
        self.stats["decisions"] += 1
        self.driver.decide(t)

    def _drop(self, reason: str) -> None:
        self.stats["dropped"] += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1


def _overrides(rep: SenderRepair, method: str) -> bool:
    """Does the scheme's sender side define ``method`` (not the base class's)?"""
    return getattr(type(rep), method) is not getattr(SenderRepair, method)


def _check_prior(loss: float | None) -> float | None:
    if loss is not None and not 0.0 <= loss <= 1.0:
        raise ValueError(f"the loss prior must be in 0..1 ({loss})")
    return None if loss is None else float(loss)
