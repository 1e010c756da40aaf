"""The sender's pacer (sans-I/O): :class:`Pacer`.

One data-path datagram per slot; a slot lasts the datagram's bytes plus the config's
``link_overhead`` at the rate the sender paces to (as shapers count). The pacer keeps the
rate, the slot length, the next slot's time (None: nothing planned), whether the sender
sits idle (feedback may wake it), when a pause ended, and how many datagrams a late shell
may get at once (``catch_up_datagrams``).
"""

from __future__ import annotations

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


class Pacer:
    """Rate, slot length and the next slot's time (module docstring)."""

    __slots__ = (
        "rate_bps",
        "datagram_bytes",
        "link_overhead",
        "slot_s",
        "catch_up",
        "next_send",
        "idle",
        "resumed_at",
    )

    def __init__(self, rate_bps: float, datagram_bytes: int, link_overhead: int, now: float):
        self.rate_bps = rate_bps
        self.datagram_bytes = datagram_bytes
        self.link_overhead = link_overhead
        self.slot_s = (datagram_bytes + link_overhead) * 8.0 / rate_bps
        self.catch_up = catch_up_datagrams(self.slot_s, datagram_bytes)
        self.next_send: float | None = now  # the next slot's time (None: none planned)
        self.idle = False  # nothing to send: feedback wakes the sender
        self.resumed_at = now  # a paused sender expects no feedback: silence counts anew

    def set_rate(self, rate_bps: float) -> None:
        """Pace at ``rate_bps`` (> 0) from the next slot on."""
        self.slot_s *= self.rate_bps / rate_bps
        self.catch_up = catch_up_datagrams(self.slot_s, self.datagram_bytes)
        self.rate_bps = rate_bps
