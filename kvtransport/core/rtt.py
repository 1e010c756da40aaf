"""The sender's round-trip estimate (sans-I/O): :class:`RttEstimator`.

RFC 6298's estimator, as aioquic's ``QuicPacketRecovery`` keeps it: the smoothed RTT
(gain 1/8), the smoothed mean deviation of the samples (``rttvar``, gain 1/4), the shortest
sample, and the latest one. Before the first sample the initial RTT stands in for the
smoothed one. It also remembers whether feedback said the data path reorders, which is
what the sender's stop time reads the deviation for (kvtransport.core.sender).
"""

from __future__ import annotations


class RttEstimator:
    """Round-trip samples folded into the smoothed estimates (module docstring)."""

    __slots__ = ("initial", "srtt", "rttvar", "min_rtt", "latest", "path_reorders")

    def __init__(self, initial_rtt: float) -> None:
        self.initial = initial_rtt  # stands in for ``srtt`` before any sample
        self.srtt: float | None = None
        self.rttvar = 0.0  # smoothed mean deviation of the samples (RFC 6298's RTTVAR)
        self.min_rtt: float | None = None  # the shortest sample (the path's, unqueued)
        self.latest: float | None = None  # the latest report's sample (None: none)
        self.path_reorders = False  # feedback said the data path reorders (FB_REORDERED)

    def on_sample(self, rtt: float) -> None:
        """Fold in a positive sample ``rtt`` (seconds)."""
        self.latest = rtt
        srtt = self.srtt
        if srtt is not None:
            self.rttvar += 0.25 * (abs(srtt - rtt) - self.rttvar)
        self.srtt = rtt if srtt is None else srtt + 0.125 * (rtt - srtt)
        if self.min_rtt is None or rtt < self.min_rtt:
            self.min_rtt = rtt

    @property
    def smoothed(self) -> float:
        """The smoothed RTT, or the initial one before any sample."""
        return self.srtt if self.srtt is not None else self.initial

    @property
    def owd(self) -> float:
        """One-way delay estimate: half the smoothed RTT (the initial one before any)."""
        return 0.5 * (self.srtt if self.srtt is not None else self.initial)
