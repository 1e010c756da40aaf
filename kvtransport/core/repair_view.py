"""What a repair scheme sees of its sender: :class:`RepairView`.

A scheme's sender side (kvtransport.core.schemes.base.SenderRepair) is handed this view,
not the session: read-only properties over the parts it needs (the feedback state, the
send progress and its log, the RTT estimate, the pacer's rates, the tail rule, the
policy's share), the framer it seals its repairs with at the next packet number, and the
session's counters (``stats``), which it counts its repairs in. It writes nothing else:
what it refines of the feedback (``SenderRepair.on_feedback``'s answer) the session
applies itself.
"""

from __future__ import annotations

import numpy as np

from kvtransport.core.feedback import FeedbackState
from kvtransport.core.pacing import Pacer
from kvtransport.core.policy_driver import PolicyDriver
from kvtransport.core.protocol import ProtocolConfig
from kvtransport.core.rtt import RttEstimator
from kvtransport.core.sent import SendProgress, SourceStream
from kvtransport.core.tail_rule import TailRule
from kvtransport.core.wire import Framer


class RepairView:
    """The read-only view of one sender a scheme gets (module docstring); it satisfies
    kvtransport.core.schemes.base.SenderView. ``max_repair_span`` is the session's
    setting, which the session updates here."""

    __slots__ = ("_stream", "_progress", "_fb", "_rtt", "_pacer", "_tail", "_driver",
                 "framer", "stats", "config", "decoder_window", "max_repair_span")  # fmt: skip

    def __init__(
        self,
        stream: SourceStream,
        progress: SendProgress,
        fb: FeedbackState,
        rtt: RttEstimator,
        pacer: Pacer,
        tail: TailRule,
        driver: PolicyDriver,
        framer: Framer,
        stats: dict[str, int],
        config: ProtocolConfig,
        decoder_window: int,
        max_repair_span: int,
    ) -> None:
        self._stream, self._progress, self._fb, self._rtt = stream, progress, fb, rtt
        self._pacer, self._tail, self._driver = pacer, tail, driver
        self.framer = framer  # builds every datagram; a repair is sealed at ``seq``
        self.stats = stats  # the session's counters: a scheme counts its repairs here
        self.config = config
        self.decoder_window = decoder_window
        self.max_repair_span = max_repair_span

    @property
    def payload(self) -> np.ndarray:
        """The transfer's payload (the encoders read sources in place)."""
        transfer = self._stream.transfer
        assert transfer is not None  # a scheme is made with a new session's transfer
        return transfer.payload

    @property
    def symbol_size(self) -> int:
        return self._stream.symbol_size

    @property
    def n_source(self) -> int:
        return self._stream.n_source

    def source_symbol(self, esi: int) -> memoryview | bytes:
        return self._stream.symbol(esi)

    @property
    def seq(self) -> int:
        return self._progress.seq

    @property
    def next_esi(self) -> int:
        return self._progress.next_esi

    @property
    def share(self) -> float:
        return self._driver.share

    @property
    def decision_packets(self) -> int:
        return self._driver.decision_packets

    @property
    def open_loop(self) -> bool:
        return self._fb.open_loop

    @property
    def fb_through(self) -> int:
        return self._fb.through

    @property
    def fb_esi_end(self) -> int:
        return self._fb.esi_end

    @property
    def fb_burst(self) -> float:
        return self._fb.burst

    @property
    def fb_echo(self) -> int:
        return self._fb.echo

    def loss_estimate(self) -> float:
        return self._fb.loss_estimate()

    @property
    def slot_s(self) -> float:
        return self._pacer.slot_s

    @property
    def srtt(self) -> float | None:
        return self._rtt.srtt

    @property
    def owd(self) -> float:
        return self._rtt.owd

    @property
    def stop_time(self) -> float:
        return self._tail.stop_time

    def in_flight(self) -> tuple[int, int]:
        return self._tail.in_flight()

    def tail_fits(self, left: int, need: int) -> bool:
        return self._tail.fits(left, need)
