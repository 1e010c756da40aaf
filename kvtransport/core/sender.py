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
"""

from __future__ import annotations

import dataclasses
import secrets
import struct
from array import array
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING

import numpy as np

from kvtransport.core import schemes
from kvtransport.core.feedback import SEQ_RING, SentLog, refusal_reason
from kvtransport.core.manifest_fec import ManifestSender
from kvtransport.core.observation import (
    OBS_SIZE,
    RAW_DECISION,
    RAW_FEEDBACK,
    RAW_SIZE,
    RAW_TRANSFER,
    Obs,
    Raw,
    observe_into,
)
from kvtransport.core.policy_base import DEFER, Policy, PolicyContext
from kvtransport.core.protocol import REPAIR_SEGMENT, STANDARD, ProtocolConfig, check_repair_span
from kvtransport.core.schemes.base import SenderRepair
from kvtransport.core.schemes.rlc import RLCSender
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
    WireError,
    decode_feedback,
    feedback_epoch,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.codecs.rlc import RLCEncoder

SEQ_MASK = SEQ_RING - 1
_SOURCE = int(DatagramType.SOURCE)
_OWED_NONE = schemes.OWED_NONE
_OWED_SEGMENTS = schemes.OWED_SEGMENTS


def _packer(group: tuple[int, int]) -> tuple[Callable[..., None], int]:
    """``struct.pack_into`` for one group of ``Raw`` fields, and the group's byte offset."""
    first, end = group
    return struct.Struct(f"={end - first}d").pack_into, first * 8


_pack_decision, _AT_DECISION = _packer(RAW_DECISION)
_pack_feedback, _AT_FEEDBACK = _packer(RAW_FEEDBACK)
_pack_transfer, _AT_TRANSFER = _packer(RAW_TRANSFER)

OPEN_LOOP_RTTS = 4.0
"""Round trips without feedback after which the sender repairs open-loop."""
OPEN_LOOP_FIRST_RTTS = 2.0
"""... round trips (assumed, before any sample) without a first report: a receiver's
first report is due one round trip and a report interval after the first datagram."""
OPEN_LOOP_LOSS = 0.15
"""The least loss a sender assumes once its receiver has been silent long enough to count
as open loop (since the start, or since its last report): above the stationary loss of
every named link profile (ge-heavy's 12 % the highest), since the smoothed rate the last
report gave may lie below the loss (an EWMA) and no report will correct it, so ``owed``
and the tail rule leave room for the repairs that cover what went out unreported
(kvtransport.core.schemes.rlc walks them over the stream)."""
OPEN_LOOP_MIN_S = 0.02
"""... but never before this much silence."""
OPEN_LOOP_MAX_SHARE = 0.5
"""The most of the slots open-loop repair takes."""

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

MAX_CATCH_UP = 16
"""A shell that is late may get at most this many datagrams at once (then pacing resumes)
... """
CATCH_UP_S = 100e-6
"""... or, on a link fast enough that ``MAX_CATCH_UP`` slots are shorter, as many as this
much of its time holds (a sender that cannot keep up with a multi-Gbit/s pace then wakes
once per UDP GSO batch rather than once per 17 datagrams; a burst still lasts at most
100 us on the wire) ..."""
MAX_CATCH_UP_BYTES = 64_000
"""... but never more bytes than one UDP GSO batch carries."""


def catch_up_datagrams(slot_s: float, datagram_bytes: int) -> int:
    """The most datagrams a late shell gets from one call at slots of ``slot_s`` seconds:
    ``MAX_CATCH_UP``, or ``CATCH_UP_S`` of slots where that is more, within
    ``MAX_CATCH_UP_BYTES``."""
    fast = min(int(CATCH_UP_S / slot_s), MAX_CATCH_UP_BYTES // max(datagram_bytes, 1))
    return max(MAX_CATCH_UP, fast)


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
        key: bytes | None = None,
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
        self.transfer: Transfer | None = transfer  # None once released
        self.policy = policy
        self.config = config
        self.scheme = schemes.get(policy.scheme)
        self._tail_rule = bool(policy.tail_rule)  # a policy class constant, read once
        self.symbol_size = s = symbol_size
        self.transfer_id = secrets.randbits(64) if transfer_id is None else transfer_id
        self.framer = Framer(self.transfer_id, key, max_payload=max(s, 2048))
        self.parser = Parser(key)
        self.n_source = n = -(-transfer.nbytes // s)
        self.start = now
        self.deadline = deadline
        self.rate_bps = rate_bps
        self.datagram_bytes = HEADER_SIZE + s + (TAG_SIZE if key else 0)
        self.link_overhead = config.link_overhead
        self.slot_s = (self.datagram_bytes + self.link_overhead) * 8.0 / rate_bps
        self.catch_up = catch_up_datagrams(self.slot_s, self.datagram_bytes)
        self.decision_packets = decision_packets
        self._initial_rtt = initial_rtt
        self.prior_loss = _check_prior(prior_loss)
        self.srtt: float | None = None
        self.rttvar = 0.0  # smoothed mean deviation of the RTT samples (RFC 6298's RTTVAR)
        self.path_reorders = False  # feedback said the data path reorders (FB_REORDERED)
        self.min_rtt: float | None = None  # the shortest RTT sample (the path's, unqueued)
        self.rtt_sample: float | None = None  # the latest feedback's RTT sample (None: none)
        self.fb_data_received = 0  # data datagrams the receiver reported received
        self.stop_time = 0.0  # last moment a datagram can leave and arrive before the deadline
        self._max_span = self._check_span(
            config.max_repair_span if max_repair_span is None else max_repair_span
        )
        self.open_loop = False  # no feedback for a while: repair open-loop (_silent)
        self._resumed_at = now  # a paused sender expects no feedback: silence counts anew
        self._decision_t = now
        self._raw = np.zeros(RAW_SIZE, dtype=np.float64)  # the policy's input, see _state()
        self._raw_buf = memoryview(self._raw)

        self._wall_offset = wall_offset
        # the ESIs the encoder and the receiver's decoder hold (two bandwidth-delay products
        # of the link as given, within the config's bounds), named in the manifest
        self.decoder_window = config.window_for(rate_bps, initial_rtt, n, s)
        self.manifest = self._manifest(max(deadline - now, 0.0), now)

        # source symbols: views into the payload; the last one zero-padded
        self._payload = memoryview(transfer.payload)
        tail = transfer.nbytes - (n - 1) * s if n else 0
        self._last_symbol = bytes(self._payload[(n - 1) * s :]) + bytes(s - tail) if n else b""
        # the same, for Framer.seal_sources: read-only whatever the transfer's (the kernel
        # is compiled once for one kind of array, in the shells' warm_up)
        self._payload_array = transfer.payload.view()
        self._payload_array.flags.writeable = False
        self._last_array = np.frombuffer(self._last_symbol, np.uint8)
        self._finish_esi, utility_after = _block_progress(transfer, s)
        self._utility_after = utility_after.tolist()  # float32 values as Python floats

        # progress
        self.next_esi = 0
        self.seq = 0
        self.slot = 0
        self.source_sent = 0
        self.repair_sent = 0  # RLC repairs, RS parities and retransmissions together
        self.reactive_sent = 0  # of which sent for holes feedback reported (RLC, ARQ)
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
        self._next_send: float | None = now
        self._idle = False
        self._decision_slot = -1
        self._decision_stale = False  # set_rate raised the rate: ask the policy again
        self.share = 0.0
        self.admit = True
        self.awaiting_action = False
        self.done = False
        self.finish_reason = ""
        self.refused = ""  # the receiver's refusal (kvtransport.core.feedback.REFUSALS)
        self.finished_at: float | None = None
        self._pending: list[bytes] = []
        self._pending_at = now

        # feedback view
        self._log = SentLog()
        self.fb_time: float | None = None
        self._fb_seq = -1
        self._fb_epoch = -1  # the feedback epoch _fb_seq counts in (-1: no report yet)
        self._fb_echo = -1
        self.fb_loss = 0.0
        self.fb_loss_recent = 0.0
        self.fb_burst = 1.0
        self.fb_through = 0
        self.fb_esi_end = 0
        self.fb_deficit = 0
        self.fb_unseen = 0
        self._fb_src_mark = 0
        self._fb_rep_mark = 0
        self._fb_rea_mark = 0
        self._fb_prev = (0, 0)

        # the repair scheme's side of this transfer (what a repair is and how it is built)
        self._repair = rep = self.scheme.sender(self, policy)
        self._owed_model = rep.owed_model
        # the scheme's per-slot calls, bound once (None where the scheme has nothing to do)
        self._before_source = rep.before_source if _overrides(rep, "before_source") else None
        self._fill = rep.fill if rep.fills_idle else None
        self._scheme_tail = rep.tail_ok if _overrides(rep, "tail_ok") else None
        self._on_source = rep.on_source if rep.sees_sources else None
        if self.scheme.stat:
            self.stats.setdefault(self.scheme.stat, 0)
        self._rtt_changed()

        # policy
        self.obs = np.zeros(OBS_SIZE, dtype=np.float32)
        self._last = (0.0, 1.0, 0.0)  # last share, last admit, share before
        budget = max(self.stop_time - now, self.slot_s)
        policy.reset(PolicyContext(n, s, self.slot_s, decision_packets, budget))
        self._policy_decide = policy.decide
        self.decision_ns = array("q")
        """Latency of each decision (state packing + ``policy.decide``), in ns of
        ``perf_counter``: instrumentation only, it never changes what is sent."""
        self._budget = budget
        self._state_transfer()
        self._state_feedback()
        self.record = record
        self.history: list[tuple] = []

    # ------------------------------------------------------------------ shell API

    def next_timer(self) -> float | None:
        """When the shell must call ``datagrams_to_send`` next (None: nothing planned)."""
        if self._pending:
            return self._pending_at  # e.g. an ABORT queued by cancel()
        if self.done or self.awaiting_action:
            return None
        return self._next_send

    def handle_timer(self, now: float) -> None:
        """Timers only release datagrams; ``datagrams_to_send`` does the work."""

    def datagrams_to_send(self, now: float) -> list[bytes]:
        """Every datagram whose slot has come by ``now`` (normally one)."""
        out = self._pending
        self._pending = []
        t = self._next_send
        if self.done or t is None:
            return out
        slot_s = self.slot_s
        burst = 0
        while t <= now and not self.awaiting_action:
            if t > self.stop_time:
                self._finish(t, "deadline", out)
                return out
            if self.source_runs and t + slot_s <= now:  # a run needs two slots due
                t_run, burst_run = self._source_run(t, now, burst, out)
                if burst_run != burst:
                    t, burst = t_run, burst_run
                    continue
            d = self._emit(t)
            if d is None:
                if self.awaiting_action or self.done:
                    break
                # nothing useful now: poll again later (feedback also wakes us)
                self.stats["idle_polls"] += 1
                if self.n_source == self.next_esi and self._repair.finishes_when_sent:
                    self._finish(t, "all sent", out)
                    return out
                self._idle = True
                t = t + max(slot_s, min(self.srtt or self._initial_rtt, 0.005))
                break
            self._idle = False
            out.append(d)
            burst += 1
            t += slot_s
            if burst >= self.catch_up and t <= now:
                t = now  # give up the backlog rather than burst it out
        self._next_send = t
        return out

    def receive_datagram(self, data: bytes, now: float) -> None:
        """Feedback from the receiver (anything else is counted and dropped)."""
        try:
            d = self.parser.parse(data)
            if d.transfer_id != self.transfer_id:
                self._drop("foreign_transfer")
                return
            if d.type != DatagramType.FEEDBACK:
                self._drop("unexpected_type")
                return
            fb = decode_feedback(d.payload)
        except WireError as exc:
            self._drop(exc.reason)
            return
        why = refusal_reason(fb.flags)
        if why:  # sealed with the transfer's key: only the receiver can have sent it
            self.stats["feedback_received"] += 1
            if not self.done:
                self.refused = why
                self._mark_done(now, f"refused ({why})")
            return
        epoch = feedback_epoch(d)
        if self._restarted(fb):
            self._receiver_restarted(fb, now)
        elif not self._fresh(epoch, d.seq, fb):
            self.stats["feedback_stale"] += 1
            return
        self._fb_epoch, self._fb_seq = epoch, d.seq
        self.stats["feedback_received"] += 1
        self._on_feedback(fb, now)

    def _fresh(self, epoch: int, seq: int, fb: Feedback) -> bool:
        """Is a report newer than the last one taken? Within one feedback epoch (one
        receiving session, kvtransport.core.wire "Sealing") by its sequence number; from
        another epoch (a receiver restarted, or the host's answer before its session
        opened) only when it echoes a packet newer than any report before."""
        if epoch == self._fb_epoch:
            return seq > self._fb_seq
        return self._fb_epoch == -1 or fb.echo_seq > self._fb_echo

    def late_feedback(self, data: bytes, now: float) -> None:
        """Feedback that comes after the session is done (the receiver's final report
        overtaken by the sender's stop): read only for what it says was delivered (decoded
        through, the manifest decoded, a refusal); nothing else changes and nothing is
        sent. Garbage is counted and dropped as in :meth:`receive_datagram`."""
        try:
            d = self.parser.parse(data)
            if d.transfer_id != self.transfer_id or d.type != DatagramType.FEEDBACK:
                self._drop(
                    "foreign_transfer" if d.transfer_id != self.transfer_id else "unexpected_type"
                )
                return
            fb = decode_feedback(d.payload)
        except WireError as exc:
            self._drop(exc.reason)
            return
        self.stats["feedback_received"] += 1
        why = refusal_reason(fb.flags)
        if why:
            self.refused = self.refused or why
            return
        epoch = feedback_epoch(d)
        if not self._fresh(epoch, d.seq, fb):
            self.stats["feedback_stale"] += 1
            return
        self._fb_epoch, self._fb_seq = epoch, d.seq
        if self.fb_time is None:
            self.fb_time = now
        self.fb_through = max(self.fb_through, min(fb.decoded_through, self.next_esi))
        if fb.flags & FB_MANIFEST_DONE:
            self.manifest.acked = True

    def apply_action(self, action: int) -> None:
        """Supply the decision an ExternalPolicy deferred (Gymnasium environment)."""
        if not self.awaiting_action:
            raise RuntimeError("no decision is pending")
        self._set_action(int(action))
        self.awaiting_action = False

    def cancel(self, now: float) -> None:
        """Abort the transfer: one CONTROL ABORT tells the receiver to deliver now."""
        if not self.done:
            self._pending.append(self._control(ControlCode.ABORT))
            self._pending_at = now
            self._mark_done(now, "cancelled")

    def release(self) -> None:
        """Drop every reference to the payload (and the encoders that read it) once the
        session is done; counters, estimates and ``status`` figures stay. A shell that
        keeps finished sessions for reporting calls it, so their payloads can be freed.
        ``transfer`` is None afterwards."""
        if not self.done:
            raise RuntimeError("release() is for finished sessions")
        self.transfer = None
        self._payload = memoryview(b"")
        self._last_symbol = b""
        self._payload_array = self._last_array = np.zeros(0, np.uint8)
        self._repair.release()

    def set_rate(self, rate_bps: float, now: float) -> None:
        """Change the pacing rate mid-flight (a shell sharing one link among several
        transfers sets each one's rate per slot). The next slot follows the new rate; the
        policy's context sees the new slot length. 0 pauses: nothing is sent until the next
        call, and a sender still paused at its deadline finishes there (FIN)."""
        if not rate_bps >= 0.0:
            raise ValueError("rate_bps must be >= 0")
        if self.done:
            return
        if rate_bps == 0.0:
            self._idle = False  # feedback must not wake a paused sender
            self._next_send = self.deadline
            return
        if rate_bps > self.rate_bps * RATE_REDECIDE:
            self._decision_stale = True
        self.slot_s *= self.rate_bps / rate_bps
        self.catch_up = catch_up_datagrams(self.slot_s, self.datagram_bytes)
        self.rate_bps = rate_bps
        self._rtt_changed()  # stop time and proactive span are counted in slots
        self._state_transfer()
        if getattr(self.policy, "ctx", None) is not None:
            self.policy.ctx = dataclasses.replace(self.policy.ctx, slot_s=self.slot_s)
        if self._next_send is None or self._next_send >= self.deadline:  # was paused
            self._next_send = now
            self._resumed_at = now

    def set_prior_loss(self, loss: float | None) -> None:
        """What the shell knows of this path's loss before the receiver reports any (the
        link profile, or the loss the last transfer to the same receiver ended with; None:
        nothing). Until the first feedback it is the loss estimate (``loss_estimate``: the
        tail rule, ``owed`` and the policy observation use it), and the policy observes it
        throughout (``Obs.PRIOR_LOSS``, ``Obs.PRIOR_KNOWN``)."""
        self.prior_loss = _check_prior(loss)
        self._state_transfer()

    def decision_latency(self) -> dict[str, float] | None:
        """Count, mean, p50 and p99 (us) of this transfer's policy decisions as the
        session timed them (``decision_ns``); None before the first decision."""
        if not self.decision_ns:
            return None
        us = np.frombuffer(self.decision_ns, dtype=np.int64) / 1e3
        p50, p99 = np.percentile(us, (50, 99))
        return {"n": int(us.size), "mean_us": float(us.mean()), "p50_us": float(p50),
                "p99_us": float(p99)}  # fmt: skip

    # ------------------------------------------------------------------ estimates

    @property
    def owd(self) -> float:
        """One-way delay estimate: half the smoothed RTT (initial RTT before feedback)."""
        return 0.5 * (self.srtt if self.srtt is not None else self._initial_rtt)

    @property
    def jitter_margin(self) -> float:
        """Seconds the stop time keeps for the delay's spread: ``STOP_RTTVAR`` RTT mean
        deviations once feedback said the path reorders, else 0."""
        return STOP_RTTVAR * self.rttvar if self.path_reorders else 0.0

    @property
    def max_repair_span(self) -> int:
        """Most source symbols a proactive RLC repair covers (the constructor's
        ``max_repair_span``, default the config's); setting it applies at once."""
        return self._max_span

    @max_repair_span.setter
    def max_repair_span(self, span: int) -> None:
        self._max_span = self._check_span(span)
        self._rtt_changed()

    def _check_span(self, span: int) -> int:
        return check_repair_span(span, self.config.decoder_window)

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
        self._repair.rtt_changed()
        self.stop_time = self.deadline - self.owd - self.jitter_margin - self.slot_s
        self._raw[Raw.STOP_TIME] = self.stop_time

    def slots_left(self, t: float) -> int:
        left = self.stop_time - t
        return int(left / self.slot_s) + 1 if left >= 0 else 0

    def loss_estimate(self) -> float:
        """The receiver's smoothed loss rate; before its first report, the prior, else 0;
        open loop, at least ``OPEN_LOOP_LOSS``. (The session's own accounting: the policy
        observation keeps the reported rate, or the prior or 0 before feedback.)"""
        if self.fb_time is not None:
            p = self.fb_loss
        else:
            p = self.prior_loss if self.prior_loss is not None else 0.0
        return max(p, OPEN_LOOP_LOSS) if self.open_loop else p

    def in_flight(self) -> tuple[int, int]:
        """Sources and repairs sent after the last packet the receiver reported."""
        return self.source_sent - self._fb_src_mark, self.repair_sent - self._fb_rep_mark

    def reactive_needed(self) -> int:
        """Repairs the latest feedback asked for that none sent since then addresses."""
        if self._owed_model == _OWED_SEGMENTS:
            return self._repair.needed
        return max(0, self.fb_deficit - (self.reactive_sent - self._fb_rea_mark))

    def owed(self) -> float:
        """Expected repair symbols still needed for the sources already sent: reported
        holes not yet answered, plus the expected losses among sources in flight, minus
        the expected arrivals of proactive repairs in flight."""
        if self._owed_model == _OWED_NONE:
            return 0.0
        p = self.loss_estimate()
        src, rep = self.in_flight()
        proactive = rep - (self.reactive_sent - self._fb_rea_mark)
        unseen = self.fb_unseen
        return max(0.0, self.reactive_needed() + unseen + p * src - (1.0 - p) * proactive)

    def _tail_ok(self, t: float, esi: int) -> bool:
        """May source ``esi`` go at ``t``? Asked only for the next source in stream order
        (the module docstring says why a refused one is never skipped)."""
        left_s = self.stop_time - t
        if left_s < 0.0:
            return False
        if not self._tail_rule:
            return True
        left = int(left_s / self.slot_s) + 1
        need = self._finish_esi[esi] - esi + 1
        if self._scheme_tail is not None:
            return self._scheme_tail(left, esi, need)
        return self.tail_fits(left, need)

    def _tail_clear(self, t_end: float, esi: int, k: int) -> bool:
        """Does the tail rule let each of sources ``esi``..``esi + k - 1`` go at any slot
        time up to ``t_end``, with the state after the ones before it (``_source_run``)?
        A sufficient test in one call, with the state now: ``tail_fits`` with the slots
        left at ``t_end`` and the need of the furthest block end among them, plus one.
        Each source sent adds one to the rule's bound (and at most one to ``owed``) and
        takes one from the need within its block, so each one's own test passes whenever
        this one does (the extra slot absorbs rounding). False (ask per source) for a
        scheme's own rule and past the stop time."""
        if not self._tail_rule:
            return True  # the stop time alone, which the run checks per slot
        left = self.slots_left(t_end)
        if self._scheme_tail is not None or left <= 0:
            return False
        return self.tail_fits(left, max(self._finish_esi[esi : esi + k]) - esi + 2)

    def tail_fits(self, left: int, need: int) -> bool:
        """The loss-aware tail rule: do ``left`` slots, times one minus the loss estimate,
        cover the repairs owed plus ``need`` more? (Schemes may rule otherwise:
        ``SenderRepair.tail_ok``.)"""
        surviving = left * (1.0 - self.loss_estimate())
        # cheap bound first: owed() never exceeds what was asked for plus all in flight
        bound = self.fb_deficit + self.fb_unseen + self.source_sent - self._fb_src_mark
        return surviving >= bound + need or surviving >= self.owed() + need

    @property
    def fb_echo(self) -> int:
        """The highest packet number feedback reported (-1: none yet)."""
        return self._fb_echo

    # ------------------------------------------------------------------ emission

    def _emit(self, t: float) -> bytes | None:
        d: bytes | None
        slot = self.slot
        if (slot % self.decision_packets == 0 and self._decision_slot != slot) or (
            self._decision_stale
        ):
            self._decide(t)
            if self.awaiting_action:
                return None
        manifest = self.manifest
        if not manifest.acked and slot >= manifest.next_slot:
            d = manifest.emit(self.framer, self.seq, slot)
            self.stats["manifest_sent"] += 1
            return self._sent(d, t)
        before = self._before_source
        if before is not None:
            d = before(t)
            if d is not None:
                return self._sent(d, t, False, True, self._repair.reactive)
        esi = self.next_esi
        if esi < self.n_source:
            if self.admit and self._tail_ok(t, esi):
                return self._sent(self._source(esi), t, True)
        fill = self._fill
        if fill is not None:
            d = fill(t)
            if d is not None:
                return self._sent(d, t, False, True, self._repair.reactive)
            if esi < self.n_source and self._tail_ok(t, esi):
                return self._sent(self._source(esi), t, True)
        return None

    def _source_run(self, t: float, now: float, burst: int, out: list[bytes]) -> tuple[float, int]:
        """From slot time ``t``: the consecutive slots ``_emit`` would give the next source
        each, sent in one go, appended to ``out``; returns the next slot time and the burst
        count as ``datagrams_to_send`` steps them (pacing, ``catch_up``). The same
        datagrams, slot times, log entries, counters and scheme state as ``_emit`` and
        ``_sent`` slot by slot: the run stops before a decision slot, a manifest slot, a slot
        whose ``before_source`` the scheme cannot vouch for (``SenderRepair.quiet_slots``;
        ``passed`` afterwards), a slot past ``now`` or the stop time, and a source the tail
        rule refuses (tested once for the whole run where ``_tail_clear`` can vouch for it,
        otherwise per source with the state after the sources before it); none when the
        policy does not admit sources or the scheme sees each source, and while a decision
        is due after a rate rise (``_decision_stale``)."""
        esi, n = self.next_esi, self.n_source
        if not self.admit or esi >= n or self._on_source is not None:
            return t, burst
        slot, dp = self.slot, self.decision_packets
        if (slot % dp == 0 and self._decision_slot != slot) or self._decision_stale:
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
        tail_ok = self._tail_ok
        stop, slot_s = self.stop_time, self.slot_s
        log = self._log
        lt, lsrc, lrep, lrea = log.t, log.src, log.rep, log.rea
        rep_n, rea_n = self.repair_sent, self.reactive_sent
        seq, sent, k = self.seq, self.source_sent, 0
        seq0, esi0 = seq, esi
        clear = self._tail_clear(max(t + limit * slot_s, now), esi, limit)
        while k < limit and t <= now and t <= stop and (clear or tail_ok(t, esi)):
            i = seq & SEQ_MASK
            lt[i], lsrc[i], lrep[i], lrea[i] = t, sent + 1, rep_n, rea_n
            k += 1
            esi += 1
            seq += 1
            sent += 1
            if not clear:  # what the tail rule reads, as after each source slot by slot
                self.next_esi, self.seq, self.slot, self.source_sent = esi, seq, slot + k, sent
            burst += 1
            t += slot_s
            if burst >= self.catch_up and t <= now:
                t = now
        if k:
            out += self.framer.seal_sources(
                seq0, esi0, k, self._payload_array, self.symbol_size, n - 1, self._last_array
            )
            self.next_esi, self.seq, self.slot, self.source_sent = esi, seq, slot + k, sent
            log.newest = seq - 1
            self.stats["source_sent"] += k
            self._idle = False
            if self._before_source is not None:
                rep.passed(k)
        return t, burst

    def _sent(
        self, d: bytes, t: float, source: bool = False, repair: bool = False, reactive: bool = False
    ) -> bytes:
        if source:
            self.source_sent += 1
        elif repair:
            self.repair_sent += 1
            if reactive:
                self.reactive_sent += 1
        seq = self.seq
        i = seq & SEQ_MASK
        log = self._log
        log.t[i] = t
        log.src[i] = self.source_sent
        log.rep[i] = self.repair_sent
        log.rea[i] = self.reactive_sent
        log.newest = seq
        self.seq = seq + 1
        self.slot += 1
        return d

    def _source(self, esi: int) -> bytes:
        s = self.symbol_size
        sym = self._payload[esi * s : esi * s + s] if esi < self.n_source - 1 else self._last_symbol
        if self._on_source is not None:
            self._on_source(esi, sym)
        self.next_esi = esi + 1
        self.stats["source_sent"] += 1
        return self.framer.seal(_SOURCE, self.seq, sym, esi)  # sealed from where it lies

    def source_symbol(self, esi: int) -> memoryview | bytes:
        """Source symbol ``esi`` as it travels (the last one zero-padded)."""
        s = self.symbol_size
        return (
            self._payload[esi * s : esi * s + s] if esi < self.n_source - 1 else self._last_symbol
        )

    def _control(self, code: int) -> bytes:
        d = self.framer.build(DatagramType.CONTROL, self.seq, b"", esi=code)
        self.seq += 1
        self.stats["control_sent"] += 1
        return d

    def _finish(self, t: float, reason: str, out: list[bytes]) -> None:
        out.append(self._control(ControlCode.FIN))
        self._mark_done(t, reason)

    def _mark_done(self, t: float, reason: str) -> None:
        self.done = True
        self.finish_reason = reason
        self.finished_at = t
        self._next_send = None

    # ------------------------------------------------------------------ feedback

    def _on_feedback(self, fb: Feedback, now: float) -> None:
        self.fb_time = now
        self.fb_data_received = fb.received
        self.rtt_sample = None
        if fb.flags & FB_REORDERED and not self.path_reorders:
            self.path_reorders = True
            self._rtt_changed()
        echo = fb.echo_seq
        if echo > self._fb_echo and self._log.holds(echo):
            self._fb_echo = echo
            sent_t, src_mark, rep_mark, rea_mark = self._log.lookup(echo)
            rtt = now - sent_t - fb.echo_delay_us * 1e-6
            if rtt > 0:
                self.rtt_sample = rtt
                if self.srtt is not None:
                    self.rttvar += 0.25 * (abs(self.srtt - rtt) - self.rttvar)
                self.srtt = rtt if self.srtt is None else self.srtt + 0.125 * (rtt - self.srtt)
                if self.min_rtt is None or rtt < self.min_rtt:
                    self.min_rtt = rtt
                self._rtt_changed()
            self._fb_src_mark, self._fb_rep_mark, self._fb_rea_mark = src_mark, rep_mark, rea_mark
        prev_lost, prev_total = self._fb_prev
        dl = fb.lost - prev_lost
        dn = dl + fb.received - (prev_total - prev_lost)
        if dn > 0:
            self.fb_loss_recent = min(max(dl / dn, 0.0), 1.0)
        self._fb_prev = (fb.lost, fb.received + fb.lost)
        self.fb_loss = fb.loss_rate
        self.fb_burst = fb.burst_mean
        self.fb_through = max(self.fb_through, min(fb.decoded_through, self.next_esi))
        self.fb_esi_end = fb.esi_end if fb.esi_end > self.fb_esi_end else self.fb_esi_end
        # equations the receiver still needs to close the span of the holes it reported
        # (it already holds ``pending`` independent ones confined to that span), and the
        # sources sent before the echoed packet that it has not seen at all
        self.fb_deficit = max(0, fb.unrecovered - fb.pending)
        self.fb_unseen = max(0, self._fb_src_mark - fb.esi_end)
        self._repair.on_feedback(fb, now)
        if fb.flags & FB_MANIFEST_DONE:
            self.manifest.acked = True
        self._state_feedback()
        if fb.flags & (FB_ALL_DONE | FB_FINISHED):
            if not self.done:
                self._mark_done(
                    now, "receiver done" if fb.flags & FB_ALL_DONE else "receiver finished"
                )
            return
        if self._idle and not self.done:  # news may give the idle sender work: wake it
            self._idle = False
            self._next_send = now

    def _restarted(self, fb: Feedback) -> bool:
        """Feedback of a receiver that lost its state (restarted): the manifest was
        acknowledged, this report says it is not decoded, and it reports a packet newer
        than any report before (so it is not an old report overtaken by newer ones)."""
        return (
            self.manifest.acked and not fb.flags & FB_MANIFEST_DONE and fb.echo_seq > self._fb_echo
        )

    def _receiver_restarted(self, fb: Feedback, now: float) -> None:
        """Start over with a receiver that knows nothing: its feedback numbers restart, its
        decoded-through is its own; the manifest goes out again (the full protected run)
        with the time left to the deadline, so the new receiver delivers by it."""
        self.stats["receiver_restarts"] += 1
        self._fb_seq = -1
        self.fb_through = 0
        self.fb_esi_end = 0
        self._fb_prev = (0, 0)
        self._repair.restart()
        self.manifest = self._manifest(max(self.deadline - now, 0.0), now)
        self.manifest.next_slot = self.slot

    def _manifest(self, deadline_s: float, now: float) -> ManifestSender:
        """The transport manifest, made now (its send time is this moment's wall clock:
        a resent one is fresh, and newer than the one the receiver may have recorded)."""
        t = self.transfer
        assert t is not None  # released only once done
        manifest = TransportManifest(
            self.symbol_size, t.nbytes, t.blocks, t.app_metadata, deadline_s,
            max(now + self._wall_offset, 0.0), self.decoder_window,
        )  # fmt: skip
        return ManifestSender(manifest.to_bytes(), self.symbol_size)

    # ------------------------------------------------------------------ policy

    def observe(self, t: float) -> np.ndarray:
        """Fill ``self.obs`` (the policy's observation) for time ``t`` and return it."""
        observe_into(self._state(t), self.obs)
        return self.obs

    def _state(self, t: float) -> np.ndarray:
        """The raw sender state the observation is computed from (kvtransport.core.observation
        ``Raw``), its per-decision fields packed now; the others were written when they
        changed (``_state_feedback``, ``_state_transfer``, ``_rtt_changed``). One
        ``struct.pack_into`` per group: item-by-item numpy stores cost an index conversion
        and a cast each."""
        last_share, last_admit, prev_share = self._last
        _pack_decision(
            self._raw_buf,
            _AT_DECISION,
            t,  # T
            self.next_esi,  # NEXT_ESI
            self.source_sent,  # SOURCE_SENT
            self.repair_sent,  # REPAIR_SENT
            self.reactive_sent,  # REACTIVE_SENT
            self._repair.needed,  # SEG_NEEDED
            self._utility_after[self.next_esi],  # UTILITY_LEFT
            last_share,  # LAST_SHARE
            last_admit,  # LAST_ADMIT
            prev_share,  # PREV_SHARE
        )
        return self._raw

    def _state_feedback(self) -> None:
        """Pack the state feedback changes (the stop time it moves is written by
        ``_rtt_changed``, which a rate change calls too)."""
        _pack_feedback(
            self._raw_buf,
            _AT_FEEDBACK,
            self.fb_time is not None,  # HAS_FEEDBACK
            self.fb_time or 0.0,  # FB_TIME
            self.fb_loss,  # FB_LOSS
            self.fb_loss_recent,  # FB_LOSS_RECENT
            self.fb_burst,  # FB_BURST
            self.fb_deficit,  # FB_DEFICIT
            self.fb_unseen,  # FB_UNSEEN
            self.fb_through,  # FB_THROUGH
            self.srtt or 0.0,  # SRTT
            self._fb_src_mark,  # SOURCE_MARK
            self._fb_rep_mark,  # REPAIR_MARK
            self._fb_rea_mark,  # REACTIVE_MARK
            self.manifest.acked,  # MANIFEST_ACKED
        )

    def _state_transfer(self) -> None:
        """Pack the per-transfer state (at the start and when the rate changes)."""
        _pack_transfer(
            self._raw_buf,
            _AT_TRANSFER,
            self.slot_s,  # SLOT_S
            self._budget,  # BUDGET
            self.decision_packets,  # INTERVAL
            self.n_source,  # N_SOURCE
            self._initial_rtt,  # INITIAL_RTT
            self._owed_model,  # MODE
            -1.0 if self.prior_loss is None else self.prior_loss,  # PRIOR_LOSS
        )

    def _decide(self, t: float) -> None:
        self._decision_slot = self.slot
        self._decision_stale = False
        self._decision_t = t
        self.stats["decisions"] += 1
        t0 = perf_counter_ns()
        a = self._policy_decide(self._state(t), self.obs)
        self.decision_ns.append(perf_counter_ns() - t0)
        obs = self.obs
        if a == DEFER:
            self.awaiting_action = True
            return
        self._set_action(a)
        if self.record:
            self.history.append(
                (
                    t,
                    a,
                    self.share,
                    self.admit,
                    self.source_sent,
                    self.repair_sent,
                    float(obs[Obs.LOSS_RATE]),
                    self.fb_deficit,
                    float(obs[Obs.OWED]) * self.decision_packets,
                    self.slots_left(t),
                )  # fmt: skip
            )

    def _set_action(self, a: int) -> None:
        table = self.policy.actions
        if not 0 <= a < len(table):
            raise ValueError(f"action {a} outside the policy's table of {len(table)}")
        share, admit = float(table[a, 0]), bool(table[a, 1] > 0.5)
        self._last = (share, 1.0 if admit else 0.0, self._last[0])
        self.share = share if admit else 1.0
        self.admit = admit
        self.open_loop = self._repair.repairs_open_loop and self._silent(self._decision_t)
        if self.open_loop:
            self.share = max(self.share, self._open_loop_share(self._decision_t))

    def _silent(self, t: float) -> bool:
        """No feedback for OPEN_LOOP_RTTS round trips (at least OPEN_LOOP_MIN_S): since the
        start, the last report or the end of a pause (a sender its shell paused sent
        nothing to report on; counted from the report, a long pause looked like a dead
        feedback path and the resumed sender spent up to half its slots on blind repair).
        The sender then repairs open-loop."""
        since = max(self.fb_time if self.fb_time is not None else self.start, self._resumed_at)
        rtt = self.srtt if self.srtt is not None else self._initial_rtt
        rtts = OPEN_LOOP_RTTS if self.fb_time is not None else OPEN_LOOP_FIRST_RTTS
        return t - since > max(rtts * rtt, OPEN_LOOP_MIN_S)

    def _open_loop_share(self, t: float) -> float:
        """Open loop, nothing tells the sender what was lost, so the slack (slots before
        the stop time beyond the sources still to send) is spread evenly over the rest of
        the stream as proactive repairs over at least ``OPEN_LOOP_SPAN`` newest symbols:
        every part of the stream gets repairs while it is still inside the decoder's
        window, not only the newest span once all sources are out. At least the assumed
        loss (``loss_estimate``, open loop at least ``OPEN_LOOP_LOSS``) goes to repairs,
        between the sources (where the tail rule leaves no slack, they would otherwise all
        wait for the last source)."""
        left = self.slots_left(t)
        sources = self.n_source - self.next_esi
        if left <= 0:
            return 0.0
        share = max(left - sources, 0) / left
        share = max(share, self.loss_estimate())
        return min(share, OPEN_LOOP_MAX_SHARE)

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


def _block_progress(transfer: Transfer, s: int) -> tuple[list[int], np.ndarray]:
    """Per ESI: the last ESI of the block its first byte belongs to (a source is useful
    only if that block can finish), and the utility of blocks not yet fully sent once the
    sender is about to send that ESI (index n_source: after everything)."""
    n = -(-transfer.nbytes // s)
    b = transfer.blocks
    ends = (b.offsets + b.lengths).astype(np.int64)
    starts_byte = np.arange(n, dtype=np.int64) * s
    idx = np.searchsorted(ends, starts_byte, side="right")
    finish = np.arange(n, dtype=np.int64)
    inside = idx < len(b)
    finish[inside] = np.maximum((ends[idx[inside]] + s - 1) // s - 1, finish[inside])
    # utility still unsent before ESI e: blocks whose last byte lies at or beyond e*s
    last_sym = (ends - 1) // s
    done_by = np.zeros(n + 1, dtype=np.float64)
    np.add.at(done_by, np.minimum(last_sym + 1, n), b.utilities)
    sent_utility = np.cumsum(done_by)
    total = float(b.utilities.sum())
    left = np.clip(total - sent_utility, 0.0, 1.0).astype(np.float32)
    return finish.tolist(), left
