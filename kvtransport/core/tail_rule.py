"""The sender's tail rule and what it counts (sans-I/O): :class:`TailRule`.

May the next source go out at ``t``? Only before the stop time, and (for a policy with
the rule, ``Policy.tail_rule``) only if the expected surviving slots before the stop time
(slots times one minus the loss estimate) cover the repairs still owed plus the symbols
that finish the block holding the source's first byte; a scheme may rule alone
(``SenderRepair.tail_ok``). ``owed`` is the repairs still owed for the sources already
sent: reported holes not yet answered, plus the expected losses among sources in flight,
minus the expected arrivals of proactive repairs in flight (counted as the scheme's
``owed_model`` says, kvtransport.core.observation ``OWED_*``). The stop time itself is the
sender's (kvtransport.core.sender): the rule keeps it where every caller reads it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtransport.core.feedback import FeedbackState
from kvtransport.core.observation import OWED_NONE, OWED_SEGMENTS
from kvtransport.core.pacing import Pacer
from kvtransport.core.schemes.base import SenderRepair
from kvtransport.core.sent import SendProgress


class TailRule:
    """The tail rule of one transfer (module docstring)."""

    __slots__ = ("enabled", "finish_esi", "owed_model", "scheme_tail", "fb", "progress",
                 "pacer", "repair", "stop_time")  # fmt: skip

    repair: SenderRepair  # the scheme's sender side (``attach``)
    owed_model: int
    scheme_tail: Callable[[int, int, int], bool] | None  # the scheme's own rule (None: this)

    def __init__(
        self,
        enabled: bool,
        finish_esi: list[int],
        fb: FeedbackState,
        progress: SendProgress,
        pacer: Pacer,
    ) -> None:
        self.enabled = enabled  # a policy class constant, read once
        self.finish_esi = finish_esi  # per ESI: the last ESI of its first byte's block
        self.fb = fb
        self.progress = progress
        self.pacer = pacer
        self.stop_time = 0.0  # last moment a datagram can leave and arrive before the deadline

    def attach(
        self, repair: SenderRepair, scheme_tail: Callable[[int, int, int], bool] | None
    ) -> None:
        """The scheme's sender side (made with a view of this rule), and its own rule if it
        has one: before the rule is first asked."""
        self.repair = repair
        self.owed_model = repair.owed_model
        self.scheme_tail = scheme_tail

    def slots_left(self, t: float) -> int:
        left = self.stop_time - t
        return int(left / self.pacer.slot_s) + 1 if left >= 0 else 0

    def in_flight(self) -> tuple[int, int]:
        """Sources and repairs sent after the last packet the receiver reported."""
        p, fb = self.progress, self.fb
        return p.source_sent - fb.src_mark, p.repair_sent - fb.rep_mark

    def reactive_needed(self) -> int:
        """Repairs the latest feedback asked for that none sent since then addresses."""
        if self.owed_model == OWED_SEGMENTS:
            return self.repair.needed
        fb = self.fb
        return max(0, fb.deficit - (self.progress.reactive_sent - fb.rea_mark))

    def owed(self) -> float:
        """Expected repair symbols still needed for the sources already sent (module
        docstring)."""
        if self.owed_model == OWED_NONE:
            return 0.0
        fb = self.fb
        p = fb.loss_estimate()
        src, rep = self.in_flight()
        proactive = rep - (self.progress.reactive_sent - fb.rea_mark)
        unseen = fb.unseen
        return max(0.0, self.reactive_needed() + unseen + p * src - (1.0 - p) * proactive)

    def fits(self, left: int, need: int) -> bool:
        """The loss-aware rule: do ``left`` slots, times one minus the loss estimate, cover
        the repairs owed plus ``need`` more?"""
        fb = self.fb
        surviving = left * (1.0 - fb.loss_estimate())
        # cheap bound first: owed() never exceeds what was asked for plus all in flight
        bound = fb.deficit + fb.unseen + self.progress.source_sent - fb.src_mark
        return surviving >= bound + need or surviving >= self.owed() + need

    def ok(self, t: float, esi: int) -> bool:
        """May source ``esi`` go at ``t``? Asked only for the next source in stream order
        (kvtransport.core.sender says why a refused one is never skipped)."""
        left_s = self.stop_time - t
        if left_s < 0.0:
            return False
        if not self.enabled:
            return True
        left = int(left_s / self.pacer.slot_s) + 1
        need = self.finish_esi[esi] - esi + 1
        if self.scheme_tail is not None:
            return self.scheme_tail(left, esi, need)
        return self.fits(left, need)

    def clear(self, t_end: float, esi: int, k: int) -> bool:
        """Does the rule let each of sources ``esi``..``esi + k - 1`` go at any slot time
        up to ``t_end``, with the state after the ones before it? A sufficient test in one
        call, with the state now: ``fits`` with the slots left at ``t_end`` and the need
        of the furthest block end among them, plus one. Each source sent adds one to the
        rule's bound (and at most one to ``owed``) and takes one from the need within its
        block, so each one's own test passes whenever this one does (the extra slot
        absorbs rounding). False (ask per source) for a scheme's own rule and past the
        stop time."""
        if not self.enabled:
            return True  # the stop time alone, which a run checks per slot
        left = self.slots_left(t_end)
        if self.scheme_tail is not None or left <= 0:
            return False
        return self.fits(left, max(self.finish_esi[esi : esi + k]) - esi + 2)
