"""The receiver's parts, one concern each (sans-I/O), which
:class:`~kvtransport.core.receiver.ReceiverSession` is made of:

- :class:`BlockTracker`: which blocks are complete, when, and the utility they add
  (the incremental completion the receiver's module docstring describes);
- :class:`ReceiverFeedback`: the loss monitor, the feedback timer and what was sent;
- :class:`ReceiverLifecycle`: liveness (activity, deadline, FIN grace, idle timeout), the
  timings, and the end (finished, refused, the result);
- :class:`ReceiveBudget`: the memory the shell grants (``reserve``) and the replay
  record's admission (``admit``);
- :class:`DecodeState`: the window decoder, the side decoders of other schemes and where
  decoder state was released;
- :class:`ReceiverCounts`: what arrived and what was dropped, by reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from kvtransport.core import schemes
from kvtransport.core.feedback import LossMonitor
from kvtransport.core.lifecycle import ReceiverFinish
from kvtransport.core.protocol import ProtocolConfig
from kvtransport.core.transfer import TransferResult, TransportManifest
from kvtransport.core.wire import Framer, SealKey


class BlockTracker:
    """Per block (once the manifest came): its end (one past its last ESI) and its
    missing-symbol count, which counts only symbols known out of order; per symbol, the
    range of blocks it overlaps; the sweep resumes at block ``next``, the first one
    decoded-through had not passed. ``complete`` / ``complete_at`` per block,
    ``n_complete`` and ``utility`` as they stand; ``now`` is the time of the datagram
    being handled (a completion's time)."""

    __slots__ = ("first", "last", "end", "missing", "next", "util", "complete", "complete_at",
                 "n_complete", "utility", "now")  # fmt: skip

    def __init__(self, now: float) -> None:
        self.first: list[int] = []
        self.last: list[int] = []
        self.end: list[int] = []
        self.missing: list[int] = []
        self.next = 0
        self.util: list[float] = []
        self.complete = np.zeros(0, dtype=np.bool_)
        self.complete_at = np.zeros(0, dtype=np.float64)  # when each block completed
        self.n_complete = 0
        self.utility = 0.0
        self.now = now

    def start(self, m: TransportManifest, known: bytearray, through: int, now: float) -> None:
        """The manifest's block table, with the symbols ``known`` already and
        decoded-through ``through``: blocks complete by now are counted."""
        n = m.n_source
        first, last = m.blocks.symbol_ranges(m.symbol_size)
        # per symbol: the range of blocks it overlaps
        self.first = np.searchsorted(last, np.arange(n), side="right").tolist()
        self.last = (np.searchsorted(first, np.arange(n), side="right") - 1).tolist()
        self.end = last.tolist()
        # blocks decoded-through has passed are complete (counted just below)
        self.next = int(np.searchsorted(last, through, side="right"))
        held = np.frombuffer(known, dtype=np.uint8).astype(np.int64)
        csum = np.concatenate(([0], np.cumsum(held)))
        missing = (last - first) - (csum[last] - csum[first])
        self.missing = missing.tolist() if len(m.blocks) else []
        self.util = m.blocks.utilities.tolist()
        self.complete = missing == 0
        self.complete_at = np.where(self.complete, now, np.inf)
        self.n_complete = int(self.complete.sum())
        self.utility = float(m.blocks.utilities[self.complete].sum())

    def out_of_order(self, esi: int) -> None:
        """ESI ``esi`` became known beyond decoded-through: one less missing in each block
        it overlaps (usually one), completing those that reach zero."""
        missing = self.missing
        b, last = self.first[esi], self.last[esi]
        while b <= last:
            m = missing[b] - 1
            missing[b] = m
            if not m:
                self.done(b)
            b += 1

    def sweep(self, t: int) -> None:
        """Complete, in order, the blocks decoded-through ``t`` passed."""
        ends, b, missing = self.end, self.next, self.missing
        while b < len(ends) and ends[b] <= t:
            if missing[b]:
                missing[b] = 0
                self.done(b)
            b += 1
        self.next = b

    def done(self, b: int) -> None:
        self.complete[b] = True
        self.complete_at[b] = self.now
        self.n_complete += 1
        self.utility += self.util[b]


class ReceiverFeedback:
    """The data path's loss monitor (also the session's replay window), the framer
    feedback is sealed with (made with the first datagram counted), the feedback timer
    (``next_at``; None: no report planned), when the last report went, its sequence
    number, the reports waiting for the shell (``pending``), and the ESI end as it grew
    (``ends``; ``settled_end``: as of one reordering window ago)."""

    __slots__ = ("monitor", "key", "framer", "interval", "min_gap", "pending", "seq", "last",
                 "next_at", "sent", "ends", "settled_end")  # fmt: skip

    def __init__(self, key: SealKey | None, config: ProtocolConfig) -> None:
        self.monitor = LossMonitor()
        self.key = key
        self.framer: Framer | None = None
        self.interval = config.feedback_interval
        self.min_gap = config.min_feedback_gap
        self.pending: list[bytes] = []
        self.seq = 0
        self.last = -1e300
        self.next_at: float | None = None
        self.sent = 0
        self.ends: deque[tuple[float, int]] = deque()  # (when, esi_end) as it grew
        self.settled_end = 0  # esi_end as of the reordering window ago

    def settled(self, now: float, esi_end: int) -> int:
        """The ESI end of one reordering window ago (at most ``esi_end``): holes are
        reported only below it."""
        ends, cutoff = self.ends, now - self.monitor.window_s
        while ends and ends[0][0] <= cutoff:
            self.settled_end = ends.popleft()[1]
        return min(self.settled_end, esi_end)


class ReceiverLifecycle:
    """Liveness and the end: when the session was made and last heard from, its deadline
    (None: the manifest's, or the idle timeout), the FIN grace's end, the timings, and
    once finished the refusal (if any), the result and whether its final report waits
    for the shell (``report_held``)."""

    __slots__ = ("created", "last_activity", "idle_timeout", "deadline", "fin_at", "timings",
                 "finished", "refused", "result", "report_held")  # fmt: skip

    def __init__(self, now: float, deadline: float | None, idle_timeout: float) -> None:
        self.created = now
        self.last_activity = now
        self.idle_timeout = idle_timeout
        self.deadline = deadline
        self.fin_at: float | None = None
        self.timings: dict[str, float] = {}
        self.finished = False
        self.refused = ""  # why the transfer was refused (kvtransport.core.feedback.REFUSALS)
        self.result: TransferResult | None = None
        self.report_held = False  # the final report waits for report_kept

    def next_timer(self, feedback_at: float | None) -> float | None:
        """The earliest of the deadline (or idle timeout), the FIN grace's end and the
        next feedback (None once finished)."""
        if self.finished:
            return None
        t = self.deadline if self.deadline is not None else self.last_activity + self.idle_timeout
        if self.fin_at is not None and self.fin_at < t:
            t = self.fin_at
        if feedback_at is not None and feedback_at < t:
            t = feedback_at
        return t

    def expired(self, now: float) -> ReceiverFinish | None:
        """Why the session ends at ``now`` by its timers (None: it goes on)."""
        if self.deadline is not None and now >= self.deadline:
            return ReceiverFinish.DEADLINE
        if self.fin_at is not None and now >= self.fin_at:
            return ReceiverFinish.FIN
        if self.deadline is None and now >= self.last_activity + self.idle_timeout:
            return ReceiverFinish.IDLE
        return None


MAP_SHARE = 16
"""The known-symbol map (one byte per ESI, held whole once the manifest came) may take at
most ``1/MAP_SHARE`` of a session's reservation window: a manifest naming more symbols
(a large claim at tiny symbols) is refused, so a forged one holds at most a sixteenth of
the window beyond what arrived (:meth:`ReceiveBudget.map_fits`)."""


class ReceiveBudget:
    """The bounds on one transfer's state: at most ``max_bytes`` of payload
    (``max_symbols`` symbols once the symbol size is known), the buffers granted by the
    shell's ``reserve`` (``reserved`` so far), and the shell's replay record's ``admit``.

    ``window`` (None: unbounded) ties the reservation to what arrived: the output buffer
    covers ESIs up to ``window`` bytes beyond the symbols that arrived (``reach``), so a
    peer that announces a large transfer and sends little holds little. Once the manifest
    came: ``fixed``, the part granted whatever arrives (the known-symbol map, one byte
    per ESI); ``per_esi``, the bytes per ESI of the decoder window's ring and columns
    (its part beyond the config's window is charged as far as the output covers it)."""

    __slots__ = ("reserve", "admit", "reserved", "max_bytes", "max_symbols", "window", "fixed",
                 "per_esi")  # fmt: skip

    def __init__(
        self,
        max_bytes: int,
        reserve: Callable[[int], bool] | None,
        admit: Callable[[int, TransportManifest], str | None] | None,
        window: int | None = None,
    ) -> None:
        self.reserve = reserve
        self.admit = admit
        self.reserved = 0  # bytes ``reserve`` granted this session (output, wider window)
        self.max_bytes = max_bytes
        self.max_symbols = 0
        self.window = window
        self.fixed = 0
        self.per_esi = 0

    def grant(self, nbytes: int) -> bool:
        """Ask the shell's ``reserve`` for the session's buffers to reach ``nbytes``."""
        extra = nbytes - self.reserved
        if extra > 0 and self.reserve is not None and not self.reserve(extra):
            return False
        self.reserved = max(self.reserved, nbytes)
        return True

    def reach(self, arrived: int, symbol_size: int, cap: int) -> int:
        """How many ESIs the output buffer may cover when ``arrived`` symbols of
        ``symbol_size`` bytes arrived (at most ``cap``): ``window`` bytes beyond them."""
        if self.window is None:
            return cap
        return min(cap, arrived + max(1, self.window // symbol_size))

    def map_fits(self, n_source: int) -> bool:
        """Whether a manifest's ``n_source`` ESIs' known-symbol map is within
        ``MAP_SHARE``'s part of the window (always, without a window: all is charged)."""
        return self.window is None or n_source * MAP_SHARE <= self.window

    def shrink(self, nbytes: int) -> int:
        """Give back what is reserved beyond ``nbytes``: the bytes the shell frees."""
        freed = max(0, self.reserved - nbytes)
        self.reserved -= freed
        return freed


class DecodeState:
    """The window scheme (kvtransport.core.schemes.base) and its decoder, made with the
    first data symbol, holding every known source; ``window``: the ESIs it holds (the
    config's, or more once the manifest names more); where its state was released and the
    release's lag and chunk; per wire type, the side decoder of another scheme."""

    __slots__ = ("scheme", "wire_type", "decoder", "window", "side", "released", "release_lag",
                 "release_chunk")  # fmt: skip

    def __init__(self, config: ProtocolConfig) -> None:
        self.scheme = schemes.window()
        self.wire_type = self.scheme.wire_type
        self.decoder: schemes.WindowDecoder | None = None
        self.window = config.decoder_window
        self.side: dict[int, schemes.ReceiverRepair] = {}
        self.released = 0
        self.release_lag = config.release_lag
        self.release_chunk = config.release_chunk


class ReceiverCounts:
    """Datagrams taken, symbols recovered, duplicates, and drops by reason."""

    __slots__ = ("source_received", "repair_received", "symbols_recovered", "duplicates",
                 "dropped", "drop_reasons")  # fmt: skip

    def __init__(self) -> None:
        self.source_received = 0
        self.repair_received = 0
        self.symbols_recovered = 0
        self.duplicates = 0
        self.dropped = 0
        self.drop_reasons: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1
