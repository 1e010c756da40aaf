"""The receiving half of the protocol core (sans-I/O): :class:`ReceiverSession`.

Feed it every datagram of its transfer with ``receive_datagram(data, now)``; send what
``datagrams_to_send(now)`` returns (feedback) back to the sender; call ``handle_timer(now)``
when ``next_timer()`` has come. When ``finished`` turns true, ``result`` holds the
:class:`~kvtransport.core.transfer.TransferResult`.

Per datagram: authenticate and parse (kvtransport.core.wire); drop and count garbage by reason
(``drop_reasons``: truncated, bad_magic, bad_tag, foreign_transfer, bad_symbol_size,
out_of_range, bad_fec, bad_payload, ...); account its packet number (loss and burst
estimates); then

- SOURCE: into the output buffer and the window decoder (below); every ESI that becomes
  known (received or recovered) is copied once into the output buffer and counted towards
  its blocks;
- a repair scheme's type (kvtransport.core.schemes): into that scheme's decoder. The window
  scheme's (REPAIR, the sliding-window RLC's) is the window decoder, made with the first
  data symbol, which holds every known source; its pending equations are what feedback
  reports as pending. Any other scheme's (BLOCK_REPAIR, the block Reed-Solomon parities)
  is a side decoder, made on its first repair, which from then on also sees every source;
  what it recovers is copied into the output buffer and handed to the window decoder;
- MANIFEST / MANIFEST_REPAIR: into the manifest decoder (kvtransport.core.manifest_fec); once
  the manifest decodes, the block table is known and completion is counted from the
  symbols already held;
- CONTROL: ABORT delivers now; FIN (sender gone) delivers at the deadline, or after a
  short grace when no deadline is known.

Block completion is incremental and costs nothing per symbol on the common path: a symbol
that becomes known in order (at the decoded-through point) only moves that point, and the
blocks it passes are completed in one sweep; a symbol known out of order (beyond a hole)
decrements the missing-symbol count of the one or few blocks it overlaps. A block is
complete when its count reaches zero or the decoded-through point passes its end, whichever
comes first, i.e. exactly when its last symbol becomes known; it then adds its utility.

Feedback goes out every ``feedback_interval`` seconds while the transfer is active, at once
on a newly detected loss (at most every ``min_feedback_gap``), when the manifest decodes and
when everything is decoded. It reports the highest packet number seen (and how long ago,
for the sender's RTT), datagrams received and lost, highest ESI, decoded-through ESI,
unrecovered count, pending repair equations, loss rate, burst length and up to 96 ranges
of the missing ESIs that still need an equation (the NACK list: a hole a pending equation
is pivoted on is left out). See kvtransport.core.wire for the layout.

The result comes at the deadline (given, or the manifest's deadline counted from the first
datagram's arrival, which is late by one one-way delay), when everything is decoded, on
ABORT, or after ``idle_timeout`` without datagrams when no deadline is known. State is
bounded: symbols beyond ``max_bytes`` are dropped (a manifest announcing more is refused),
the output buffer grows only as far as the shell's ``reserve(extra_bytes)`` allows (a
daemon's budget for all transfers in flight: beyond it symbols are dropped as
``over_budget`` and a manifest is refused) and, with a ``window``, covers only ESIs up to
``window`` bytes beyond the symbols that arrived (further ones are dropped as
``ahead_of_data``; ``reclaim`` gives the rest back while the session is idle), the
decoder holds ``decoder_window`` ESIs, or
as many as the manifest names up to ``max_decoder_window`` (it widens when the manifest
comes, the wider ring and coefficient columns reserved like output buffer; a manifest
naming more is refused, ``decoder_window``; the wider part is charged as the output
covers it), and at most
``max_pending_equations`` pending repair equations (the session's ``config``,
kvtransport.core.protocol.ProtocolConfig), rings are fixed size.

Duplicates: the loss monitor's ring of recent packet numbers is the session's sliding
replay window (as WireGuard's): a data-path datagram whose number was seen before, or
that is older than the ring, is dropped as ``duplicate_packet`` before it changes
anything (no liveness, no symbol, no feedback). Runs of in-order sources taken in one
call (``receive_datagrams``) continue the highest number, so they cannot repeat one.

Replays: a shell with a replay record (kvtransport.core.replay) passes ``admit(transfer_id,
manifest)``; when it names a reason (a stale or already accepted manifest), the session
counts it in ``drop_reasons``, finishes at once with reason ``replayed`` and nothing of the
transfer (no block, no payload byte), and drops its later datagrams as ``replayed``.

Refusals (a stale or replayed manifest, or one refused for bounded state: ``too_large``,
``decoder_window``, ``over_budget``) are named in ``refused`` and in the final feedback
(kvtransport.core.feedback: the flags' refusal code), so the sender learns why. A refused
session answers only manifest datagrams afterwards, with that feedback again, at most one
per feedback interval: a peer replaying a captured transfer gets at most one small reply
per manifest datagram it sends, never more bytes than it sent.

Results a shell saves (``hold_report``): the final report of a transfer that delivers
something waits for the shell's :meth:`ReceiverSession.report_kept` (nothing answers late
datagrams until then); a result that could not be written where the shell was asked to
is reported as refusal ``result_unsaved`` (kvtransport.core.feedback), so its sender does
not take it for delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import repeat

import numpy as np

from kvtransport.codecs.rlc import decoder_bytes_per_esi
from kvtransport.core import schemes
from kvtransport.core.feedback import RESULT_UNSAVED, LossMonitor, loss_ranges, refusal_flags
from kvtransport.core.lifecycle import ReceiverFinish
from kvtransport.core.manifest_fec import ManifestReceiver
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.receiver_parts import (
    BlockTracker,
    DecodeState,
    ReceiveBudget,
    ReceiverCounts,
    ReceiverFeedback,
    ReceiverLifecycle,
)
from kvtransport.core.transfer import TransferResult, TransportManifest
from kvtransport.core.wire import (
    FB_ALL_DONE,
    FB_FINISHED,
    FB_MANIFEST_DONE,
    FB_REORDERED,
    MAX_FEEDBACK_RANGES,
    ControlCode,
    Datagram,
    DatagramType,
    Feedback,
    Framer,
    Parser,
    SealKey,
    UnknownPeer,
    WireError,
    encode_feedback,
    feedback_size,
)

_SOURCE = int(DatagramType.SOURCE)
_FEEDBACK = int(DatagramType.FEEDBACK)
_MANIFEST_TYPES = (int(DatagramType.MANIFEST), int(DatagramType.MANIFEST_REPAIR))
FIN_GRACE = 0.05
FEEDBACK_QUIET_S = 1.0
"""Periodic feedback pauses after this long without a datagram (a sender paused by its
link share, or gone, or a forger that sent a few datagrams) and resumes with the next one."""
DEFAULT_MAX_BYTES = 1 << 30
BATCH_MAX = 256
"""Most data datagrams ``receive_datagrams`` decodes in one window-decoder add_packets call
(fewer when that many symbols would pass ``BATCH_BYTES``)."""
BATCH_BYTES = 1 << 20
"""Most bytes of a session's run buffer (one symbol per datagram of a run)."""
QUEUED = 2
"""``_known`` of a source in a run not yet decoded (1: known; 0: not)."""


class ReceiverSession:
    """Receives one transfer (see the module docstring).

    ``transfer_id=None`` adopts the id of the first valid datagram (a daemon demultiplexes
    by id before creating the session, so it normally passes the id). ``deadline`` is in the
    receiver's clock; None takes it from the manifest. ``config``: the protocol's settings
    (kvtransport.core.protocol; the feedback interval and gap, the window decoder's size,
    when decoder state is released).
    """

    source_runs = True
    """``receive_datagrams`` takes the in-order sources that continue a held run
    (``_held_run``), the lazy run beyond a hole (``_lazy_run``) or the open decoder run
    (``_queue_run``) in one ``Parser.source_run`` call each (False: each through
    ``_accept`` and ``_hold``, ``_dispatch`` or ``_queue_source``, the reference the runs
    are tested against)."""

    hold_report = False
    """Whether the final report of a result waits for :meth:`report_kept` (module
    docstring; set by a shell that saves results before its sender may stop)."""

    def __init__(
        self,
        transfer_id: int | None = None,
        *,
        key: SealKey | None = None,
        now: float = 0.0,
        deadline: float | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        idle_timeout: float = 10.0,
        reserve: Callable[[int], bool] | None = None,
        admit: Callable[[int, TransportManifest], str | None] | None = None,
        config: ProtocolConfig = STANDARD,
        window: int | None = None,
    ) -> None:
        self.config = config
        self.transfer_id = transfer_id
        self.parser = Parser(key)
        self.life = ReceiverLifecycle(now, deadline, idle_timeout)
        self.budget = ReceiveBudget(max_bytes, reserve, admit, window)
        self.fb = ReceiverFeedback(key, config)
        self.dec = DecodeState(config)
        self.counts = ReceiverCounts()
        self.blocks = BlockTracker(now)
        self.manifest_rx = ManifestReceiver()
        self.manifest: TransportManifest | None = None

        self.symbol_size = 0
        self._limit = 0  # ESIs at or beyond this are out of range (0: no symbol size yet)
        self.n_source = 0  # known once the manifest arrives
        self._known = bytearray(0)
        self._out = np.zeros(0, dtype=np.uint8)
        self._out_mv = memoryview(self._out)
        self.n_known = 0
        self.esi_end = 0
        self.through = 0
        # a run of sources [_lazy_from, _lazy_to) not yet handed to the decoder
        self._lazy_from = self._lazy_to = -1
        # receive_datagrams: in-order sources [_held_from, _lazy_to) in the output buffer and
        # counted, whose marking (_mark_held) is still to come (-1: none), and the ESI the
        # held run stops before (set when it starts)
        self._held_from = -1
        self._hold_end = 0
        self._batch = _Run()  # receive_datagrams' run of data symbols not yet decoded

    # ------------------------------------------------------------------ parts as attributes

    @property
    def deadline(self) -> float | None:
        return self.life.deadline

    @property
    def created(self) -> float:
        return self.life.created

    @property
    def last_activity(self) -> float:
        return self.life.last_activity

    @property
    def idle_timeout(self) -> float:
        return self.life.idle_timeout

    @property
    def timings(self) -> dict[str, float]:
        return self.life.timings

    @property
    def finished(self) -> bool:
        return self.life.finished

    @property
    def refused(self) -> str:
        """Why the transfer was refused (kvtransport.core.feedback.REFUSALS; "" for none)."""
        return self.life.refused

    @property
    def result(self) -> TransferResult | None:
        return self.life.result

    @property
    def reserved(self) -> int:
        return self.budget.reserved

    @property
    def max_bytes(self) -> int:
        return self.budget.max_bytes

    @property
    def max_symbols(self) -> int:
        return self.budget.max_symbols

    @property
    def monitor(self) -> LossMonitor:
        return self.fb.monitor

    @property
    def framer(self) -> Framer | None:
        return self.fb.framer

    @property
    def feedback_interval(self) -> float:
        return self.fb.interval

    @property
    def feedback_sent(self) -> int:
        return self.fb.sent

    @property
    def decoder(self) -> schemes.WindowDecoder | None:
        return self.dec.decoder

    @property
    def decoder_window(self) -> int:
        return self.dec.window

    @property
    def source_received(self) -> int:
        return self.counts.source_received

    @property
    def repair_received(self) -> int:
        return self.counts.repair_received

    @property
    def symbols_recovered(self) -> int:
        return self.counts.symbols_recovered

    @property
    def duplicates(self) -> int:
        return self.counts.duplicates

    @property
    def dropped(self) -> int:
        return self.counts.dropped

    @property
    def drop_reasons(self) -> dict[str, int]:
        return self.counts.drop_reasons

    @property
    def complete(self) -> np.ndarray:
        """Per block: complete (its bytes in place)."""
        return self.blocks.complete

    @property
    def complete_at(self) -> np.ndarray:
        """Per block: when it completed (inf: not yet)."""
        return self.blocks.complete_at

    @property
    def blocks_complete(self) -> int:
        return self.blocks.n_complete

    @property
    def utility(self) -> float:
        return self.blocks.utility

    @property
    def payload_buffer(self) -> np.ndarray | None:
        """The payload as it is received (a view; None before the manifest): a block's
        bytes are in place, and stay as they are, once ``complete`` marks it (read
        ``complete`` first when another thread receives)."""
        m = self.manifest
        return None if m is None else self._out[: m.payload_len]

    # ------------------------------------------------------------------ shell API

    def next_timer(self) -> float | None:
        return self.life.next_timer(self.fb.next_at)

    def handle_timer(self, now: float) -> None:
        if self.life.finished:
            return
        why = self.life.expired(now)
        if why is not None:
            self._finish(now, why)
        elif self.fb.next_at is not None and now >= self.fb.next_at:
            if now - self.life.last_activity > FEEDBACK_QUIET_S:
                self.fb.next_at = None  # nobody is sending: stop reporting until data comes
            else:
                self._send_feedback(now)

    def close(self, now: float, reason: str = ReceiverFinish.SHUTDOWN) -> None:
        """Yield the result now, with what has arrived (the shell is shutting down, or a
        user asked for the partial result early)."""
        if not self.life.finished:
            self._finish(now, reason)

    def report_kept(self, now: float, saved: bool = True) -> None:
        """The shell wrote the result where it was asked to (``saved``) or could not: the
        final report held since the session finished goes out, naming ``result_unsaved``
        when not saved. Nothing when no report is held."""
        life = self.life
        if not life.report_held:
            return
        life.report_held = False
        if not saved:
            life.refused = RESULT_UNSAVED
        self._send_feedback(now)

    def datagrams_to_send(self, now: float) -> list[bytes]:
        fb = self.fb
        out = fb.pending
        fb.pending = []
        return out

    def receive_datagram(self, data: bytes, now: float) -> None:
        """Process one datagram; garbage is counted in ``drop_reasons`` and dropped."""
        got = self._accept(data, now)
        if got is not None:
            self._dispatch(got[0], got[1], now)

    def receive_datagrams(self, datagrams: Iterable[bytes | memoryview], now: float) -> None:
        """Process datagrams that arrived together (at ``now``), in order: exactly as
        ``receive_datagram`` once per datagram (the same output bytes, blocks, counters,
        drops and feedback, feedback included in the middle of the run on a loss), but
        the runs of SOURCE datagrams and window-scheme repairs (REPAIR) that need the window
        decoder reach it in one ``add_packets`` call per run instead of a call per datagram.

        A run ends (is decoded, and what it made known accounted in arrival order) before
        any other datagram type, before feedback, at the end of ``datagrams``, after
        ``BATCH_MAX`` datagrams (fewer for large symbols: ``BATCH_BYTES``), and before a
        datagram whose outcome could depend on where the run ends: one that could complete
        the transfer, one that would slide the decoder's window, or a repair reaching below
        where a release during the run could move the window's base (see ``_joinable``). Those,
        and everything while a block Reed-Solomon decoder is active, take the per-datagram
        path.

        Outside a run, sources that arrive in order at decoded-through with no equation
        pending are counted and copied at once and marked known per stretch (``_hold``,
        ``_mark_held``); a repair that covers only known ESIs is dropped on the
        per-datagram path rather than opening a run. Once a source has been held, or taken
        beyond a hole as the lazy run's next, or queued in the open decoder run, the sources
        after it that continue it in order (the next packet numbers and ESIs) are opened and
        accounted in one go (``_held_run``, ``_lazy_run``, ``_queue_run``: source runs;
        ``source_runs`` False turns them off).
        """
        b = self._batch
        accept, batchable, dispatch = self._accept, self._batchable, self._dispatch
        hold, mark_held = self._hold, self._mark_held
        window_type = self.dec.wire_type
        min_gap = self.fb.min_gap
        batch = datagrams if isinstance(datagrams, list | tuple) else list(datagrams)
        runs = self.source_runs
        i, n = 0, len(batch)
        while i < n:
            data = batch[i]
            i += 1
            got = accept(data, now)
            if got is None:
                continue
            d, gap = got
            t = d[0]
            if t == _SOURCE and not b.n and d[6] == self._lazy_to:
                # the common case, in order with no run open: _batchable's first "no" (the
                # per-datagram lazy path is cheaper), without the call; at decoded-through
                # with nothing pending, its marking waits for the rest of its kind (_hold)
                if self._held_from >= 0:
                    if gap <= 0 and hold(d[6], d[7]):
                        if runs:
                            i = self._held_run(batch, i, now)
                        continue
                    mark_held(now)
                elif gap <= 0 and d[6] == self.through and hold(d[6], d[7]):
                    if runs:
                        i = self._held_run(batch, i, now)
                    continue
                dispatch(d, gap, now)
                if runs and self.through < self._lazy_to:
                    i = self._lazy_run(batch, i, now)
                continue
            if self._held_from >= 0:
                mark_held(now)
            if t == window_type and not b.n and self._redundant(d):
                # every ESI it covers is known: the per-datagram path drops it at once,
                # and the in-order sources after it stay on the lazy path
                dispatch(d, gap, now)
                continue
            if (t != _SOURCE and t != window_type) or not batchable(d):
                if b.n:
                    self._flush_batch(now)
                dispatch(d, gap, now)
                continue
            try:
                if t == _SOURCE:
                    self._queue_source(d[6], d[7])
                else:
                    self._queue_repair(d)
            except WireError as exc:
                self._drop(exc.reason)
                continue
            if self.fb.next_at is None:
                self.fb.next_at = now + self.fb.interval
            if b.n >= b.rows or (gap > 0 and now - self.fb.last >= min_gap):
                self._flush_batch(now)
                if gap > 0 and now - self.fb.last >= min_gap:
                    self._send_feedback(now)
            elif runs and t == _SOURCE:
                i = self._queue_run(batch, i, d[6] + 1, now)
        if self._held_from >= 0:
            mark_held(now)
        self._flush_batch(now)

    def _accept(self, data: bytes | memoryview, now: float) -> tuple[Datagram, int] | None:
        """Parse and admit one datagram: (it, the packet-number gap it revealed), or None
        when it was dropped or answered (after the result) here."""
        try:
            d = self.parser.parse(data)
        except WireError as exc:
            self._drop(exc.reason)
            return None
        t, _, tid, seq = d[0], d[1], d[2], d[3]
        if tid != self.transfer_id:
            if self.transfer_id is None and t != _FEEDBACK:
                self.transfer_id = tid
            else:
                self._drop("foreign_transfer")
                return None
        if t == _FEEDBACK:
            self._drop("unexpected_type")
            return None
        life, fb = self.life, self.fb
        if life.finished:
            assert life.result is not None  # set when the session finished
            if life.report_held:
                pass  # the final report waits for the shell (report_kept)
            elif not life.refused or life.refused == RESULT_UNSAVED:
                self._answer_after_finish(now)
            elif t in _MANIFEST_TYPES:
                self._answer_after_finish(now)  # the refusal again (module docstring)
            elif life.result.reason == ReceiverFinish.REPLAYED:
                self._drop("replayed")  # no answer: the peer may replay a captured transfer
            return None
        gap = fb.monitor.on_packet(seq, now)
        if gap < 0:  # the replay window: a packet number seen before, or too old to tell
            self._drop("duplicate_packet")
            return None
        if fb.framer is None:
            self._make_framer()
            life.timings.setdefault("first_packet", now)
        life.last_activity = now
        self.blocks.now = now
        return d, gap

    def _dispatch(self, d: Datagram, gap: int, now: float) -> None:
        """One admitted datagram (see ``_accept``), handled at once."""
        t = d[0]
        end0 = self.esi_end
        try:
            if t == _SOURCE:
                self._on_source(d[6], d[7])
            elif t == self.dec.wire_type:
                self._on_window_repair(d)
            elif t == DatagramType.MANIFEST or t == DatagramType.MANIFEST_REPAIR:
                self._on_manifest(d, now)
            elif t == DatagramType.CONTROL:
                self._on_control(d.esi, now)
            else:
                self._on_scheme_repair(d)
        except WireError as exc:
            self._drop(exc.reason)
            return
        if self.esi_end > end0:
            self.fb.ends.append((now, self.esi_end))
        if self.life.finished:
            return
        if self.manifest is not None and self.n_known == self.n_source:
            self.life.timings["complete"] = now
            self._finish(now, ReceiverFinish.COMPLETE)
            return
        if self.fb.next_at is None:
            self.fb.next_at = now + self.fb.interval
        if gap > 0 and now - self.fb.last >= self.fb.min_gap:
            self._send_feedback(now)

    # ------------------------------------------------------------------ symbols

    def _symbol_slot(self, esi: int, size: int) -> None:
        """Validate a data symbol's ESI and size; size the buffers on first use, cover more
        ESIs (``_cover``) or grow them (``_grow``) as it needs."""
        if self.symbol_size == 0:
            if not 16 <= size <= 65000:
                raise _Drop("bad_symbol_size")
            self._set_symbol_size(size)
        elif size != self.symbol_size:
            raise _Drop("bad_symbol_size")
        if esi >= self._limit:
            if self.manifest is None or esi >= self.n_source:
                raise _Drop("out_of_range")
            self._cover(esi + 1)
        if esi >= len(self._known):
            self._grow(esi + 1)

    def _set_symbol_size(self, size: int) -> None:
        self.symbol_size = size
        self.budget.max_symbols = max(1, self.budget.max_bytes // size)
        self._limit = self.n_source if self.manifest is not None else self.budget.max_symbols
        self.dec.decoder = self.dec.scheme.window_decoder(size, self.config)
        self.dec.decoder.widen(self.dec.window)  # a manifest came first and names more

    def _grant(self, nbytes: int) -> bool:
        """Ask the shell's ``reserve`` for the output buffer to reach ``nbytes``."""
        return self.budget.grant(nbytes)

    def _arrived(self) -> int:
        """Symbols that arrived (sources and repairs, duplicates included), counting the
        one being taken: what the reservation's window is measured from."""
        return self.counts.source_received + self.counts.repair_received + 1

    def _charge(self, cover: int) -> int:
        """The bytes a reservation covering ESIs [0, ``cover``) takes once the manifest
        came: the known-symbol map, ``cover`` output symbols and the decoder window's part
        beyond the config's as far as ``cover`` reaches into it (a ring is filled as the
        ESIs pass)."""
        b = self.budget
        wider = max(0, min(cover, self.dec.window) - self.config.decoder_window)
        return b.fixed + cover * self.symbol_size + wider * b.per_esi

    def _cover(self, need: int) -> None:
        """After the manifest: the ESIs the reservation covers (``_limit``) reach at
        least ``need``, as far as what arrived allows (``ReceiveBudget.reach``: beyond
        it, ``ahead_of_data``) and the shell grants (else ``over_budget``). The buffers
        exist whole (their pages are committed as symbols are written): only the charge
        grows."""
        reach = self.budget.reach(self._arrived(), self.symbol_size, self.n_source)
        if need > reach:
            raise _Drop("ahead_of_data")
        if not self._grant(self._charge(reach)):
            if not self._grant(self._charge(need)):
                raise _Drop("over_budget")
            reach = need
        self._limit = reach

    def reclaim(self) -> int:
        """Give back the reservation beyond the ESIs known or involved so far (its shell's
        budget is short and this session idle): it covers more again as data comes
        (``_cover``). Returns the bytes given back (0 before the manifest, once finished,
        or without a window)."""
        if self.manifest is None or self.life.finished or self.budget.window is None:
            return 0
        keep = self.esi_end
        if self.dec.decoder is not None:
            keep = max(keep, self.dec.decoder.max_involved + 1)
        keep = min(keep, self._limit)
        self._limit = keep
        return self.budget.shrink(self._charge(keep))

    def _grow(self, need: int) -> None:
        """Grow the buffers to ``need`` ESIs at least. Before the manifest by doubling, as
        far as what arrived allows (``ReceiveBudget.reach``: beyond it, ``ahead_of_data``)
        and the shell grants (else ``over_budget``); with it, to the whole payload at once,
        charged by ``_cover``."""
        if self.manifest is not None:
            cap = self.n_source
        else:
            b = self.budget
            allowed = b.reach(self._arrived(), self.symbol_size, b.max_symbols)
            if need > allowed:
                raise _Drop("ahead_of_data")
            cap = min(max(need, 2 * len(self._known), 256), allowed)
            if not self._grant(cap * self.symbol_size):
                if not self._grant(need * self.symbol_size):
                    raise _Drop("over_budget")
                cap = need
        known = bytearray(cap)
        known[: len(self._known)] = self._known
        out = np.zeros(cap * self.symbol_size, dtype=np.uint8)
        out[: self._out.shape[0]] = self._out
        self._known, self._out = known, out
        self._out_mv = memoryview(out)

    def _source_new(self, esi: int, payload: memoryview) -> bool:
        """Validate and count a source symbol: is its ESI still unknown? (A known one is
        counted as a duplicate.)"""
        if len(payload) != self.symbol_size or esi >= self._limit or esi >= len(self._known):
            self._symbol_slot(esi, len(payload))  # first symbol, growth, or a bad one
        self.counts.source_received += 1
        if self._known[esi]:
            self.counts.duplicates += 1
            return False
        return True

    def _on_source(self, esi: int, payload: memoryview) -> None:
        if not self._source_new(esi, payload):
            return
        s, known = self.symbol_size, self._known
        decoder = self.dec.decoder
        assert decoder is not None  # made with the first symbol (_symbol_slot)
        if esi == self._lazy_to or not decoder.involves(esi):
            # No repair equation waits on it: the decoder learns it later, with the rest of
            # its run of consecutive arrivals, in one call (see _sync_decoder).
            if esi != self._lazy_to:
                self._sync_decoder()
                self._lazy_from = esi
            self._lazy_to = esi + 1
            self._out_mv[esi * s : esi * s + s] = payload
            self._mark(esi)
        else:
            self._sync_decoder()
            got = decoder.add_source(esi, payload)
            self._out_mv[esi * s : esi * s + s] = payload
            self._mark(esi)
            if len(got) > 1:  # the source also completed some equations
                for e in got:
                    if e != esi and not known[e]:
                        self._recovered(e)
        if self.dec.side:
            for dec in self.dec.side.values():
                self._side_recovered(dec, dec.add_source(esi, payload))

    def _window_repair_slot(self, d: Datagram) -> None:
        """Validate (the slot of the highest ESI it covers, ``check``) and count a window
        scheme's repair; the decoder checks the coding fields."""
        last = self.dec.scheme.check(d)
        payload = d[7]
        s = self.symbol_size
        if s == 0 or len(payload) != s or last >= self._limit or last >= len(self._known):
            self._symbol_slot(last, len(payload))  # first symbol, growth, or a bad one
        self.counts.repair_received += 1

    def _on_window_repair(self, d: Datagram) -> None:
        self._window_repair_slot(d)
        self._sync_decoder()
        decoder = self.dec.decoder
        assert decoder is not None  # made with the first symbol (_symbol_slot)
        got = decoder.add_repair_datagram(d)
        if got:
            known = self._known
            for e in got:
                if not known[e]:
                    self._recovered(e)

    # ------------------------------------------------------------------ runs (batches)

    def _batchable(self, d: Datagram) -> bool:
        """May this SOURCE / window-scheme repair join the run of ``receive_datagrams``, i.e.
        will its outcome and every later one be the same whether the run is decoded before
        or after it? No when: a side decoder is active; no decoder exists yet (the first symbol
        sizes it); the run is empty and the source needs no decoder (the per-datagram lazy
        path is cheaper); or the run's bounds refuse it (``_joinable``)."""
        dec, b = self.dec.decoder, self._batch
        if dec is None or self.dec.side:
            return False
        lo = d[6]
        if d[0] == _SOURCE:
            hi, first = lo, -1
        else:
            hi, first = self.dec.scheme.check(d), lo
        if not b.n:
            if first < 0 and (lo == self._lazy_to or not dec.involves(lo)):
                return False
            b.start(dec, max(self.esi_end, dec.max_involved + 1), self.through - 1)
        if not self._joinable(hi, 1, first):
            return False
        if hi >= b.top:
            b.top = hi + 1
        return True

    def _joinable(self, hi: int, n: int, first: int = -1) -> int:
        """The run's bounds, the one place they are kept (``_batchable`` asks for one
        datagram, ``_queue_run`` for a run of sources): how many of ``n`` data datagrams may
        join the open run (``_Run.start``) one after the other, the first reaching up to ESI
        ``hi`` (a repair from ESI ``first``; -1: a source), each next one source ``hi + 1``,
        ``hi + 2``, ... (0: not even the first). One may when its outcome and every later
        one are the same whether the run is decoded before or after it, i.e. unless:

        - the run could complete the transfer (each packet makes at most one ESI known,
          plus one per pending equation it solves);
        - it reaches beyond the decoder's window (it would slide the window, dropping
          symbols the run recovered before they are read out);
        - it is a repair, a release of decoder state (``_mark``: after a packet of the run,
          when the decoder has taken the whole run) could happen within the run, and the
          repair reaches below where that would move the window's base (one datagram at a
          time it would be stale). A source never does: a release moves the base to at most
          decoded-through - ``release_lag``, and decoded-through stays at or below every
          ESI not yet known, a new source's included, until its own turn (pending
          equations involve only unknown ESIs, so the release leaves them as they are).

        The caller raises the run's ``top`` past the ESIs of those that joined."""
        dec, b = self.dec.decoder, self._batch
        assert dec is not None  # _batchable: only with a decoder
        if first >= 0 and b.n:
            # decoded-through after the packets so far is at most ``top``, and at most the
            # (k+1)-th unknown ESI from here, k = the symbols they can make known at most
            # (looked for only when ``top`` alone does not rule a release out)
            lag, chunk = self.dec.release_lag, self.dec.release_chunk
            t = b.top - lag
            if first < t and t - self.dec.released >= chunk:
                t = self._unknown_bound(b) - lag
                if first < t and t - self.dec.released >= chunk:
                    return 0
        k = min(n, b.base + dec.capacity - hi)  # hi + j < base + capacity, each j < k
        if self.manifest is not None:  # n_known + (b.n + j) + 1 + pending0 < n_source
            k = min(k, self.n_source - self.n_known - b.n - 1 - b.pending0)
        return k if k > 0 else 0

    def _unknown_bound(self, b: _Run) -> int:
        """The (k+1)-th ESI not known from decoded-through on, k = ``b.pending0 + b.n`` (the
        most the run's packets can make known): decoded-through stays at or below it. Found
        from where the last call left off (``b.hole``, the ``b.holes``-th)."""
        known, esi = self._known, b.hole
        for _ in range(b.pending0 + b.n + 1 - b.holes):
            esi = known.find(0, esi + 1) if esi + 1 < len(known) else -1
            if esi < 0:
                return b.top  # every further ESI is unknown: the other bound holds
            b.hole, b.holes = esi, b.holes + 1
        return esi

    def _queue_source(self, esi: int, payload: memoryview) -> None:
        if not self._source_new(esi, payload):
            return
        # QUEUED until the run is accounted: a second copy in the run is a duplicate (the
        # first, or something before it, makes the ESI known)
        self._known[esi] = QUEUED
        s = self.symbol_size
        self._out_mv[esi * s : esi * s + s] = payload  # where add_packets reads it
        self._batch.add_sources(esi, 1)

    def _queue_repair(self, d: Datagram) -> None:
        self._window_repair_slot(d)
        assert self.dec.decoder is not None  # _batchable: only with a decoder
        first, nss, key, dt = self.dec.decoder.repair_row(d)
        self._batch.add_repair(first, nss, key, dt, d[7], self.symbol_size)

    def _flush_batch(self, now: float) -> None:
        """Decode the run (one window-decoder add_packets call) and account, packet by packet
        in arrival order, what each made known: as ``_on_source`` / ``_on_window_repair`` would
        have, call by call."""
        b = self._batch
        n = b.n
        if not n:
            return
        self._sync_decoder()
        decoder = self.dec.decoder
        assert decoder is not None  # the run holds symbols
        s = self.symbol_size
        rows = b.meta
        meta = np.array(rows, dtype=np.int64).reshape(n, 4)
        got = decoder.add_packets(meta, b.pay[: n * s], b.ends, self._out)
        ends = b.ends[:n].tolist()
        b.clear()
        known = self._known
        for i in range(0, 4 * n, 4):
            if rows[i + 1] == 0:
                known[rows[i]] = 0  # QUEUED: known once its turn comes below
        pos = 0
        for i in range(n):
            end, end0 = ends[i], self.esi_end
            if rows[4 * i + 1] == 0:  # a source, in the output buffer already
                if end == pos:  # an earlier datagram of the run made it known
                    self.counts.duplicates += 1
                else:
                    self._mark(got[pos])
                    if end - pos > 1:
                        for e in got[pos + 1 : end]:
                            if not known[e]:
                                self._recovered(e)
            elif end > pos:
                for e in got[pos:end]:
                    if not known[e]:
                        self._recovered(e)
            pos = end
            if self.esi_end > end0:
                self.fb.ends.append((now, self.esi_end))

    def _sync_decoder(self) -> None:
        """Hand the decoder the run of sources it has not seen yet.

        A source that no pending repair equation involves (the common case) needs nothing
        from the decoder now: the receiver writes it to its output and marks it, and the
        decoder learns the whole run of consecutive ESIs that arrived one after the other
        later, in one bulk call, before anything else reaches or reads it. Its state then is
        exactly what it would have been, call for call: such a source only fills its slot.
        """
        lo, hi = self._lazy_from, self._lazy_to
        if hi > lo:
            self._lazy_from = self._lazy_to = -1
            s = self.symbol_size
            assert self.dec.decoder is not None  # sources have arrived
            got = self.dec.decoder.add_source_run(lo, self._out[lo * s : hi * s])
            known = self._known
            for e in got:  # all known here already, unless the decoder also recovered
                if not known[e]:  # something with them: as in _on_source
                    self._recovered(e)

    def _recovered(self, esi: int) -> None:
        s = self.symbol_size
        assert self.dec.decoder is not None  # it recovered esi
        self.dec.decoder.read_into(esi, self._out_mv[esi * s : esi * s + s])
        self.counts.symbols_recovered += 1
        self._mark(esi)

    def _mark(self, esi: int) -> None:
        """ESI ``esi`` became known (its bytes are in the output buffer)."""
        known = self._known
        known[esi] = 1
        self.n_known += 1
        if esi >= self.esi_end:
            self.esi_end = esi + 1
        if esi == self.through:  # in order: move decoded-through, sweep the blocks it passed
            t = esi + 1
            if t < len(known) and known[t]:
                t = known.find(0, t)
                if t < 0:
                    t = len(known)
            self.through = t
            dec = self.dec
            if t - dec.release_lag - dec.released >= dec.release_chunk:
                self._release(t)
            blocks = self.blocks
            if blocks.missing:
                ends, b = blocks.end, blocks.next
                if b < len(ends) and ends[b] <= t:
                    self.blocks.sweep(t)
        elif self.blocks.missing:  # out of order: count it against its blocks
            self.blocks.out_of_order(esi)

    def _release(self, t: int) -> None:
        """Decoded-through reached ``t``, a release chunk past the last release: the
        decoder drops its state below ``t - release_lag`` (after taking the lazy run)."""
        self.dec.released = t - self.dec.release_lag
        self._sync_decoder()
        assert self.dec.decoder is not None  # symbols have arrived
        self.dec.decoder.release_before(self.dec.released)

    # ------------------------------------------------------------------ held in-order runs

    def _hold(self, esi: int, payload: memoryview) -> bool:
        """``receive_datagrams``, for source ``esi`` that continues the lazy run
        (``_lazy_to``) and revealed no gap: hold its marking for ``_mark_held`` (count it
        and put its bytes in place now) when the outcome is the same as marking it at once,
        i.e. when the held run starts at decoded-through with no repair equation pending
        and no side decoder (nothing can be recovered, and no block completes out of
        order), it is a new symbol of the right size in range, and it cannot complete the
        transfer (that one takes the per-datagram path). Anything else the session does
        first calls ``_mark_held``, so nothing sees the held state. (A lazy run never
        outlives a repair or reaches a source a pending equation involves, and a side
        decoder ends it with every source, so the first two conditions hold whenever a
        source continues one at decoded-through; they are checked once per held run.)"""
        lo = self._held_from
        if lo < 0:
            dec = self.dec.decoder
            if esi != self.through or dec is None or dec.pending_equations or self.dec.side:
                return False
            # the held run may reach up to (not including) the first of: the end of the
            # range or the buffer, the next known ESI, the source that would complete
            end = self._unknown_to(esi)
            if self.manifest is not None:
                end = min(end, esi + self.n_source - self.n_known - 1)
            self._hold_end = end
            lo = esi
        s = self.symbol_size
        if esi >= self._hold_end or len(payload) != s:
            return False
        self._held_from = lo
        self.counts.source_received += 1
        self._out_mv[esi * s : esi * s + s] = payload
        self._lazy_to = esi + 1
        return True

    def _unknown_to(self, esi: int) -> int:
        """Where the unknown stretch from ``esi`` ends: the next known ESI, else the end of
        the range or the buffer (the furthest a run of sources from ``esi`` may reach)."""
        known = self._known
        end = min(self._limit, len(known))
        nxt = known.find(1, esi, end)
        return nxt if nxt >= 0 else end

    def _held_run(self, batch: list | tuple, i: int, now: float) -> int:
        """After ``_hold`` took a source: take the datagrams from ``batch[i]`` on that
        continue the held run in order, as many as ``Parser.source_run`` opens (the next
        packet numbers, the next ESIs, before ``_hold_end``), in one go; returns the index
        of the first one left for the per-datagram path. For each, exactly what ``_accept``
        and ``_hold`` did one at a time: the same packet accounting (no gap), activity
        times, count and bytes in place; its marking is held as theirs."""
        k = self._take_sources(batch, i, self._lazy_to, self._hold_end, now)
        self._lazy_to += k
        return i + k

    def _take_sources(self, batch: list | tuple, i: int, esi: int, end: int, now: float) -> int:
        """The source runs' common part: ``Parser.source_run`` from ``batch[i]`` on, for
        sources ``esi``, ``esi + 1``, ... before ESI ``end``, bytes in place; their packet
        numbers (in order, no gap: the time of the highest is ``now``) and count accounted.
        Returns how many it took."""
        stop = min(len(batch), i + end - esi)
        if stop <= i:
            return 0
        mon = self.fb.monitor
        assert self.transfer_id is not None  # _accept has admitted a datagram
        k = (
            self.parser.source_run(
                batch, i, stop, self.transfer_id, mon.highest + 1, esi, self.symbol_size,
                self._out_mv,
            )
            - i
        )  # fmt: skip
        if k:
            mon.on_run(k, now)
            self.counts.source_received += k
        return k

    def _queue_run(self, batch: list | tuple, i: int, esi: int, now: float) -> int:
        """After source ``esi - 1`` came to the open decoder run (``_queue_source``): take
        the datagrams from ``batch[i]`` on that continue it in order, as many as
        ``Parser.source_run`` opens (the next packet numbers, the next ESIs from ``esi``)
        and the run's bounds let join (``_joinable``, as ``_batchable`` asks one at a
        time), before the next known or queued ESI, the end of the range or buffer and the
        run's last row, in one go; returns the index of the first one left for the
        per-datagram path. For each, exactly what ``_accept``, ``_batchable`` and
        ``_queue_source`` did one at a time: packet accounting (no gap), count, bytes in
        place, QUEUED, its row, the run's top; the run is decoded once full, as there."""
        b = self._batch
        end = self._unknown_to(esi)
        queued = self._known.find(QUEUED, esi, end)
        if queued >= 0:
            end = queued
        n = min(len(batch) - i, end - esi, b.rows - b.n)
        k = self._joinable(esi, n) if n > 0 else 0
        if not k:
            return i
        k = self._take_sources(batch, i, esi, esi + k, now)
        if k:
            hi = esi + k
            self._known[esi:hi] = bytes((QUEUED,)) * k
            b.add_sources(esi, k)
            if hi > b.top:
                b.top = hi
            if b.n >= b.rows:
                self._flush_batch(now)
        return i + k

    def _lazy_run(self, batch: list | tuple, i: int, now: float) -> int:
        """After ``_dispatch`` took a source that continues the lazy run beyond a hole
        (decoded-through below it): take the datagrams from ``batch[i]`` on that continue it
        in order, as many as ``Parser.source_run`` opens (the next packet numbers, the next
        ESIs, before the next known ESI and the end of the range or buffer), in one go;
        returns the index of the first one left for the per-datagram path. For each,
        exactly what ``_accept`` and ``_dispatch`` (``_on_source``'s lazy path, ``_mark``
        out of order) did one at a time: packet accounting (no gap), count, bytes in
        place, known, ``esi_end`` steps, block counts and completions in ESI order. Not
        with a side decoder (it sees every source) or a finished session; the run cannot
        complete the transfer (the hole at decoded-through stays unknown)."""
        esi = self._lazy_to
        if self.dec.side or self.life.finished or self.dec.decoder is None:
            return i
        known = self._known
        k = self._take_sources(batch, i, esi, self._unknown_to(esi), now)
        if k:
            self._lazy_to = hi = esi + k
            known[esi:hi] = b"\x01" * k
            self.n_known += k
            end0 = self.esi_end
            if hi > end0:  # one step per source at or past esi_end, as _dispatch records them
                self.esi_end = hi
                self.fb.ends.extend(zip(repeat(now), range(max(esi, end0) + 1, hi + 1)))
            if self.blocks.missing:
                for e in range(esi, hi):
                    self.blocks.out_of_order(e)
        return i + k

    def _mark_held(self, now: float) -> None:
        """Mark the held run [_held_from, _lazy_to) in one go: exactly what ``_mark`` (and
        ``_dispatch`` after it) did one source at a time, i.e. the same known symbols,
        decoded-through, ``esi_end`` steps, decoder releases (each after the decoder took
        the sources up to the one whose marking made it), blocks and feedback timer."""
        lo = self._held_from
        if lo < 0:
            return
        self._held_from = -1
        hi = self._lazy_to
        known = self._known
        known[lo:hi] = b"\x01" * (hi - lo)
        self.n_known += hi - lo
        end0 = self.esi_end
        if hi > end0:  # one step per source at or past esi_end, as _dispatch records them
            self.esi_end = hi
            self.fb.ends.extend(zip(repeat(now), range(max(lo, end0) + 1, hi + 1)))
        t = hi  # decoded-through after the last one (after each earlier one e: e + 1)
        if t < len(known) and known[t]:
            t = known.find(0, t)
            if t < 0:
                t = len(known)
        self.through = t
        lag, chunk = self.dec.release_lag, self.dec.release_chunk
        step = lo + 1  # the least decoded-through the next earlier source can make
        while (at := max(self.dec.released + lag + chunk, step)) < hi:
            self._lazy_to = at  # the lazy run as it stood when source at - 1 was marked
            self._release(at)
            self._lazy_from, self._lazy_to = at, hi
            step = at + 1
        if t - lag - self.dec.released >= chunk:
            self._release(t)
        if self.blocks.missing:
            ends = self.blocks.end
            if self.blocks.next < len(ends) and ends[self.blocks.next] <= t:
                self.blocks.sweep(t)
        if self.fb.next_at is None:
            self.fb.next_at = now + self.fb.interval

    def _redundant(self, d: Datagram) -> bool:
        """Does window repair ``d`` cover only ESIs below decoded-through (all known)?"""
        try:
            return self.dec.scheme.check(d) < self.through
        except WireError:
            return False  # the per-datagram path drops it

    # ------------------------------------------------------------------ manifest

    def open_validated(
        self,
        manifest_rx: ManifestReceiver,
        first_at: float,
        datagrams: list[bytes],
        now: float,
    ) -> None:
        """Start with a manifest the shell decoded and admitted (fresh, not replayed) from
        ``datagrams``, the transfer's datagrams it held until then (the first at
        ``first_at``, from which the manifest's deadline counts): they are received in
        order, then the manifest is taken, as if it had decoded with the last of them.
        ``manifest_rx`` is the shell's decoder, done: later manifest datagrams change
        nothing."""
        m = manifest_rx.manifest
        if m is None:
            raise ValueError("the manifest receiver has not decoded a manifest")
        self.manifest_rx = manifest_rx
        self.life.timings["first_packet"] = first_at
        self.receive_datagrams(datagrams, now)
        if self.life.finished:
            return
        if self.fb.framer is None:  # every held datagram was dropped here: feedback still goes
            self._make_framer()
        try:
            self._take_manifest(m, now)
        except WireError as exc:
            self._drop(exc.reason)
            return
        if not self.life.finished and self.n_known == self.n_source:
            self.life.timings["complete"] = now
            self._finish(now, ReceiverFinish.COMPLETE)
        elif self.fb.next_at is None:
            self.fb.next_at = now + self.fb.interval

    def _make_framer(self) -> None:
        """The feedback framer, under a random epoch of this session's own
        (kvtransport.core.wire); none while the transfer's peer is unknown (its binding
        forgotten: ``UnknownPeer``, counted by the keys), so feedback is withheld, not
        raised into the shell, and the next datagram tries again."""
        try:
            self.fb.framer = Framer(self._tid(), self.fb.key, max_payload=2048)
        except UnknownPeer:
            self.fb.framer = None

    def _tid(self) -> int:
        if self.transfer_id is None:
            raise ValueError("a session opened by its shell needs its transfer id")
        return self.transfer_id

    def _on_manifest(self, d: Datagram, now: float) -> None:
        m = self.manifest_rx.add(d)
        if m is None:
            return
        self._take_manifest(m, now)

    def _take_manifest(self, m: TransportManifest, now: float) -> None:
        """The decoded manifest: checked (replay, bounds, budget), then the block table."""
        self._sync_decoder()
        if (self.symbol_size and m.symbol_size != self.symbol_size) or not (
            16 <= m.symbol_size <= 65000
        ):
            raise _Drop("bad_manifest")
        if self.budget.admit is not None:
            assert self.transfer_id is not None  # a manifest came with its transfer id
            why = self.budget.admit(self.transfer_id, m)
            if why is not None:  # stale or replayed (kvtransport.core.replay): nothing delivered
                self._refuse(why, now, ReceiverFinish.REPLAYED)
                return
        if m.payload_len > self.budget.max_bytes or not self.budget.map_fits(m.n_source):
            # bounded state: a transfer too large, or of too many symbols for the window
            # (its known-symbol map is held whole: ReceiveBudget.map_fits), is refused
            self._refuse("too_large", now)
            return
        if m.decoder_window > self.config.max_decoder_window:
            self._refuse("decoder_window", now)  # bounded state: a window wider than allowed
            return
        # the reservation: the known-symbol map, and the output (and a wider window's
        # ring and coefficient columns) as far as what arrived allows (_cover)
        n, held = m.n_source, min(len(self._known), m.n_source)
        b = self.budget
        b.fixed = n
        b.per_esi = decoder_bytes_per_esi(m.symbol_size, self.config.max_pending_equations)
        self.dec.window = max(self.dec.window, m.decoder_window)
        self.n_source, self.symbol_size = n, m.symbol_size  # what _charge reads
        cover = max(held, b.reach(self._arrived() - 1, m.symbol_size, n))
        if not self._grant(self._charge(cover)):
            self._refuse("over_budget", now)  # the shell's memory budget is spent
            return
        self.manifest = m
        self.life.timings["manifest"] = now
        if self.dec.decoder is not None:
            self.dec.decoder.widen(self.dec.window)  # before any repair reaches further
        else:
            self._set_symbol_size(m.symbol_size)
        self._limit = cover
        if self.life.deadline is None and m.deadline_s > 0:
            self.life.deadline = self.life.timings["first_packet"] + m.deadline_s
        # symbols beyond the payload (a forger's, before the manifest) are forgotten
        if len(self._known) > n:
            for e in range(n, len(self._known)):
                if self._known[e]:
                    self.n_known -= 1
            self._known = self._known[:n]
            self._out = self._out[: n * self.symbol_size].copy()
            self._out_mv = memoryview(self._out)
            self.esi_end = min(self.esi_end, n)
            self.through = min(self.through, n)
        if len(self._known) < n:
            self._grow(n)
        self.blocks.start(m, self._known, self.through, now)
        if not (self.hold_report and self.n_known == n):  # (complete: the held final one)
            self._send_feedback(now)

    # ------------------------------------------------------------------ other schemes

    def _on_scheme_repair(self, d: Datagram) -> None:
        """A repair of a scheme with its own wire type (kvtransport.core.schemes)."""
        scheme = schemes.by_wire_type(d.type)
        if scheme is None:  # a type the parser accepts but no scheme decodes any more
            raise _Drop("unexpected_type")
        self._symbol_slot(scheme.check(d), len(d.payload))
        self.counts.repair_received += 1
        dec = self.dec.side.get(d.type)
        if dec is None:
            dec = self.dec.side[d.type] = scheme.decoder(self.symbol_size, d)
        self._side_recovered(dec, dec.add_repair(d, self))

    def known_symbol(self, esi: int) -> memoryview | bytes | None:
        """The bytes of ESI ``esi`` if known (a view of the output buffer; b"" for the zero
        padding beyond the stream's end once the manifest gave it), else None: what a
        scheme's decoder may read (kvtransport.core.schemes.SymbolStore)."""
        known = self._known
        if esi < len(known):
            if known[esi]:
                s = self.symbol_size
                return self._out_mv[esi * s : esi * s + s]
            return None
        if self.manifest is not None and esi >= self.n_source:
            return b""
        return None

    def _side_recovered(self, dec: schemes.ReceiverRepair, esis: list[int]) -> None:
        self._sync_decoder()
        s, known, decoder = self.symbol_size, self._known, self.dec.decoder
        assert decoder is not None  # a repair has arrived
        for e in esis:
            if e < len(known) and not known[e] and (self.manifest is None or e < self.n_source):
                dec.read_into(e, self._out_mv[e * s : e * s + s])
                decoder.add_source(e, self._out_mv[e * s : e * s + s])
                self.counts.symbols_recovered += 1
                self._mark(e)

    # ------------------------------------------------------------------ control, feedback

    def _on_control(self, code: int, now: float) -> None:
        if code == ControlCode.ABORT:
            self._finish(now, ReceiverFinish.ABORT)
        elif code == ControlCode.FIN:
            if self.life.deadline is None:
                self.life.fin_at = now + FIN_GRACE
            self.fb.next_at = None  # the sender is gone: stop reporting
        else:
            raise _Drop("bad_control")

    def _feedback(self, now: float) -> Feedback:
        mon = self.fb.monitor
        mon.sample(now)
        # holes are reported only below the ESI end of one reordering window ago: a
        # datagram that is merely late (jitter) is not asked for again
        end = self.fb.settled(now, self.esi_end)
        flags = 0
        if self.manifest is not None:
            flags |= FB_MANIFEST_DONE
            if self.n_known == self.n_source:
                flags |= FB_ALL_DONE
        if self.life.finished:
            flags |= FB_FINISHED | refusal_flags(self.life.refused)
        if mon.reorder_s > 0.0:
            flags |= FB_REORDERED
        ranges = ()
        holes = self.esi_end - self.n_known
        if holes and end < self.esi_end:
            holes -= self._known.count(0, end, self.esi_end)  # those still in the window
        if holes:
            # only the holes no pending equation is pivoted on: each needs one more equation
            # (a pivoted one is decoded once the equations' other unknowns are), and so the
            # capped list reaches as far as the holes that still need anything
            pivots = self.dec.decoder.pending_pivots() if self.dec.decoder is not None else ()
            ranges = loss_ranges(self._known, self.through, end, MAX_FEEDBACK_RANGES, pivots)
        # the echo: the highest number as of one reordering window ago (the highest one
        # without reordering), so a datagram merely late still counts as in flight; there is
        # one, as the framer is made where the first datagram is counted
        pair = mon.echo()
        assert pair is not None
        echo, echo_at = pair
        return Feedback(
            echo,
            min(int((now - echo_at) * 1e6), 0xFFFFFFFF),
            mon.received,
            mon.lost,
            self.esi_end,
            self.through,
            holes,
            self.dec.decoder.pending_equations if self.dec.decoder is not None else 0,
            self.counts.source_received,
            self.counts.repair_received,
            mon.loss_rate,
            mon.burst_mean,
            flags,
            ranges,
        )

    def _send_feedback(self, now: float) -> None:
        out = self.fb
        framer = out.framer
        if framer is None:
            return
        fb = self._feedback(now)
        size = feedback_size(len(fb.ranges), len(fb.segments))
        n = encode_feedback(fb, framer.payload_view(size))
        out.pending.append(framer.finish(DatagramType.FEEDBACK, out.seq, n))
        out.seq += 1
        out.sent += 1
        out.last = now
        if not self.life.finished and out.next_at is not None:
            out.next_at = now + out.interval

    def _answer_after_finish(self, now: float) -> None:
        """Data after the result: remind the sender (at most once per feedback interval)."""
        if now - self.fb.last >= self.fb.interval:
            self._send_feedback(now)

    # ------------------------------------------------------------------ result

    def _finish(self, now: float, reason: str) -> None:
        """Finish now with ``reason`` (a ``ReceiverFinish`` value, or the shell's own word
        for ``close``); the result carries it as a plain string."""
        life = self.life
        life.finished = True
        life.timings["finished"] = now
        m = self.manifest
        if m is not None:
            payload = self._out[: m.payload_len]
            complete = self.blocks.complete.copy()
            complete_at = self.blocks.complete_at.copy()
            missing = np.flatnonzero(~complete)
            utility = min(self.blocks.utility, 1.0)
        else:
            payload = np.zeros(0, dtype=np.uint8)
            complete = np.zeros(0, dtype=np.bool_)
            complete_at = np.zeros(0, dtype=np.float64)
            missing = np.zeros(0, dtype=np.int64)
            utility = 0.0
        life.result = TransferResult(
            self.transfer_id or 0, m, payload, complete, missing, utility, str(reason),
            life.timings, complete_at,
        )  # fmt: skip
        self.fb.next_at = None
        self._sync_decoder()
        self.dec.decoder = None  # free the decoding window
        self._batch = _Run()  # and the run buffer (receive_datagrams: nothing is held)
        if self.hold_report and not life.refused:
            life.report_held = True  # the shell saves the result first (report_kept)
        else:
            self._send_feedback(now)
        # the final count (``lost``) settles every gap; the loss rate is left as it was:
        # datagrams still in flight now are not a loss sample
        self.fb.monitor.settle(float("inf"))

    def _refuse(self, why: str, now: float, reason: str = ReceiverFinish.REFUSED) -> None:
        """Refuse the transfer: ``why`` counted as a drop and named in ``refused`` and the
        final feedback; the result (reason ``reason``) delivers nothing."""
        self._drop(why)
        self.life.refused = why
        self._finish(now, reason)

    def _drop(self, reason: str) -> None:
        self.counts.drop(reason)


class _Run:
    """The run of data symbols ``receive_datagrams`` holds for one add_packets call: their
    (esi, nss, repair_key, dt) rows, flat; the repairs' bytes (a source's are in the
    output buffer); and what ``_joinable`` needs: the decoder's pending
    equations and base when the run began, and two bounds on decoded-through once the run
    is decoded (one past the highest ESI that can be known; an unknown ESI that stays
    unknown)."""

    def __init__(self) -> None:
        self.n = 0
        self.meta: list[int] = []
        self.pay = np.zeros(0, dtype=np.uint8)
        self.pay_mv = memoryview(self.pay)
        self.ends = np.zeros(BATCH_MAX, dtype=np.int64)
        self.pending0 = self.base = self.top = self.hole = self.holes = 0
        self.rows = 0  # datagrams a run holds at most (set with the symbol size)

    def start(self, decoder: schemes.WindowDecoder, top: int, before: int) -> None:
        self.pending0 = decoder.pending_equations
        self.base = decoder.base
        self.top = top
        self.hole, self.holes = before, 0  # the holes-th unknown ESI after ``before``
        if not self.rows:
            self.rows = max(1, min(BATCH_MAX, BATCH_BYTES // decoder.symbol_size))
            self.pay = np.zeros(self.rows * decoder.symbol_size, dtype=np.uint8)
            self.pay_mv = memoryview(self.pay)

    def add_sources(self, esi: int, k: int) -> None:
        """Rows for sources ``esi`` .. ``esi + k - 1`` (their bytes are in the output)."""
        meta = self.meta
        for e in range(esi, esi + k):
            meta += (e, 0, 0, 0)
        self.n += k

    def add_repair(self, a: int, b: int, c: int, d: int, payload: memoryview, size: int) -> None:
        i = self.n
        self.pay_mv[i * size : i * size + size] = payload
        self.meta += (a, b, c, d)
        self.n = i + 1

    def clear(self) -> None:
        self.n = 0
        self.meta = []


class _Drop(WireError):
    """Internal: a datagram that parsed but cannot be used (reason set per instance)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
