"""The protocol's configuration: what the sender and receiver sessions must agree on, and
their timing defaults.

:class:`ProtocolConfig` (frozen) holds them; :data:`STANDARD` is the standard one, whose
values are the module constants below. The hosts and sessions take a ``config`` (default
``STANDARD``) and read every such value from it, so a shell or experiment that wants other
values builds its own config and passes it in; nothing patches this module.

The values are not negotiated on the wire: a receiver built with other values still
decodes everything, it only wastes repair symbols the sender aims below its window.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYMBOL_SIZE = 1280
"""Source/repair symbol bytes: 1280 + 28 header + 16 tag + 42 link overhead < 1500 MTU."""

MIN_DECODER_WINDOW = 4096
"""The smallest decoder window decoder_window() returns (0.45 s at 100 Mbit/s)."""


def decoder_window(
    rate_bps: float,
    rtt_s: float,
    symbol_size: int = DEFAULT_SYMBOL_SIZE,
    link_overhead: int | None = None,
) -> int:
    """Source ESIs a decoder must hold for a link of ``rate_bps`` and round trip ``rtt_s``.

    A hole is reported after about one round trip of sending and repaired one more round trip
    later, so the window spans two bandwidth-delay products of datagrams (symbol, 28-byte
    header, 16-byte tag, ``link_overhead``; None: LINK_OVERHEAD_BYTES), rounded up to a
    power of two, at least MIN_DECODER_WINDOW.
    """
    if not (rate_bps > 0 and rtt_s >= 0 and symbol_size > 0):
        raise ValueError("rate_bps and symbol_size must be positive, rtt_s non-negative")
    overhead = LINK_OVERHEAD_BYTES if link_overhead is None else link_overhead
    wire = symbol_size + 28 + 16 + overhead
    need = 2.0 * rate_bps * rtt_s / (8 * wire)
    window = MIN_DECODER_WINDOW
    while window < need:
        window *= 2
    return window


LINK_OVERHEAD_BYTES = 42
"""Ethernet (14) + IPv4 (20) + UDP (8): what a link shaper counts besides the datagram, so
the sender's pacing matches kvtransport.netem's channel and tbf on the testbed."""

DESIGN_RATE_BPS = 1e9
DESIGN_RTT_S = 0.040
"""The fastest link the fixed limits below are sized for: 1 Gbit/s with a 40 ms round trip
(a 20 ms one-way path)."""

DECODER_WINDOW = decoder_window(DESIGN_RATE_BPS, DESIGN_RTT_S)
"""Source ESIs the receiver's RLC decoder holds at least: 8192, two bandwidth-delay products
at the design link (10.5 MB of symbols at 1280 bytes; 0.9 s at 100 Mbit/s, 90 ms at 1
Gbit/s). A transfer on a longer or faster link gets a wider one (MAX_DECODER_WINDOW). The
sender's encoder keeps as many as the transfer's window, and no repair reaches below
``highest ESI sent - window + 1``; a hole reported below that is sent again as a source."""

MAX_DECODER_WINDOW = decoder_window(DESIGN_RATE_BPS, 4 * DESIGN_RTT_S)
"""The widest decoder window a sender asks for and a receiver grants: 32768 ESIs, two
bandwidth-delay products at 1 Gbit/s with a 160 ms round trip (42 MB of symbols at 1280
bytes per transfer at the receiver). A sender sizes each transfer's window from its link
(``ProtocolConfig.window_for``) and names it in the transport manifest; a receiver widens
its decoder to it on the manifest and refuses a transfer asking more than its own limit."""

MAX_PENDING_EQUATIONS = DECODER_WINDOW // 4
"""Repair equations the receiver's decoder holds pending at most (RLCDecoder max_pending):
its coefficient rows stay within MAX_PENDING_EQUATIONS * DECODER_WINDOW bytes (16 MB, what
the 4096-ESI window allowed before) whatever a peer sends; a quarter of the window
unrecovered at once is beyond any loss the repair policies can serve."""

RELEASE_LAG = 512
"""The receiver keeps this many decoded ESIs behind its decoded-through point before it
releases them from the decoder, so repairs aimed from slightly stale feedback still fit."""

RELEASE_CHUNK = 128
"""The receiver releases decoder state in steps of this many ESIs (amortizes the cost)."""

REPAIR_SEGMENT = 64
"""Reactive RLC repairs stay inside aligned segments of this many ESIs (see
kvtransport.core.sender); the receiver reports its pending equations per segment
(kvtransport.core.wire). The shortest proactive span a sender takes."""

MAX_REPAIR_SPAN = 1024
"""Most source symbols one proactive RLC repair covers (NSS); the sender spans one round
trip of slots plus a decision interval (set from rate and RTT), up to this. It caps CPU, not
memory: encoding and decoding a repair each cost NSS symbol multiply-adds (about 50 us at
1024 and 25 GB/s), paid per repair, so a 1 Gbit/s x 40 ms flight (3,700 symbols) would
cost ~0.2 ms per repair. Reactive repairs stay inside one aligned segment of
REPAIR_SEGMENT symbols. Must not exceed DECODER_WINDOW."""

DEFAULT_FEEDBACK_INTERVAL = 0.004
"""Seconds between periodic feedback reports (more on loss events)."""

MIN_FEEDBACK_GAP = 0.001
"""Loss-triggered feedback is sent at most this often."""

DEFAULT_INITIAL_RTT = 0.02
"""RTT the sender assumes before its first feedback (stop time = deadline - RTT/2 - slot)."""


def check_repair_span(span: int, decoder_window: int) -> int:
    """``span`` as a proactive RLC repair span: REPAIR_SEGMENT..``decoder_window``
    symbols (one reactive segment up to the window); ValueError (one line) otherwise."""
    if not REPAIR_SEGMENT <= span <= decoder_window:
        raise ValueError(
            f"max_repair_span must be {REPAIR_SEGMENT}..{decoder_window} (the decoder "
            f"window), not {span}"
        )
    return int(span)


@dataclass(frozen=True)
class ProtocolConfig:
    """The protocol's settings (the module constants give each one's meaning):

    - ``symbol_size``: DEFAULT_SYMBOL_SIZE, the symbol size a sender uses when not told;
    - ``link_overhead``: LINK_OVERHEAD_BYTES, the bytes per datagram pacing counts besides
      the datagram;
    - ``decoder_window``: DECODER_WINDOW, the ESIs the receiver's window decoder and the
      sender's encoder hold at least; ``max_decoder_window``: MAX_DECODER_WINDOW, the most
      a sender asks for (``window_for``) and a receiver grants;
    - ``max_pending_equations``: MAX_PENDING_EQUATIONS, at most 1..``decoder_window``;
    - ``release_lag``, ``release_chunk``: RELEASE_LAG, RELEASE_CHUNK;
    - ``max_repair_span``: MAX_REPAIR_SPAN, REPAIR_SEGMENT..``decoder_window``;
    - ``feedback_interval``: DEFAULT_FEEDBACK_INTERVAL (s); ``min_feedback_gap``:
      MIN_FEEDBACK_GAP (s);
    - ``initial_rtt``: DEFAULT_INITIAL_RTT (s), the RTT a sender assumes when not told.

    Out-of-range values raise ValueError (one line) at construction."""

    symbol_size: int = DEFAULT_SYMBOL_SIZE
    link_overhead: int = LINK_OVERHEAD_BYTES
    decoder_window: int = DECODER_WINDOW
    max_decoder_window: int = MAX_DECODER_WINDOW
    max_pending_equations: int = MAX_PENDING_EQUATIONS
    release_lag: int = RELEASE_LAG
    release_chunk: int = RELEASE_CHUNK
    max_repair_span: int = MAX_REPAIR_SPAN
    feedback_interval: float = DEFAULT_FEEDBACK_INTERVAL
    min_feedback_gap: float = MIN_FEEDBACK_GAP
    initial_rtt: float = DEFAULT_INITIAL_RTT

    def __post_init__(self) -> None:
        if not 16 <= self.symbol_size <= 65000:
            raise ValueError(f"symbol_size must be 16..65000 bytes ({self.symbol_size})")
        if self.link_overhead < 0:
            raise ValueError(f"link_overhead must be >= 0 ({self.link_overhead})")
        if self.decoder_window < 1:
            raise ValueError(f"decoder_window must be positive ({self.decoder_window})")
        if self.max_decoder_window < self.decoder_window:
            raise ValueError(
                f"max_decoder_window must be >= decoder_window ({self.max_decoder_window})"
            )
        if not 1 <= self.max_pending_equations <= self.decoder_window:
            raise ValueError(
                f"max_pending_equations must be 1..decoder_window ({self.max_pending_equations})"
            )
        if self.release_lag < 0 or self.release_chunk < 1:
            raise ValueError("release_lag must be >= 0 and release_chunk >= 1")
        check_repair_span(self.max_repair_span, self.decoder_window)
        if not (self.feedback_interval > 0 and self.min_feedback_gap >= 0):
            raise ValueError("feedback_interval must be positive, min_feedback_gap >= 0")
        if not self.initial_rtt > 0:
            raise ValueError(f"initial_rtt must be positive ({self.initial_rtt})")

    def window_for(
        self, rate_bps: float, rtt_s: float, n_source: int, symbol_size: int | None = None
    ) -> int:
        """The decoder window for a transfer of ``n_source`` symbols of ``symbol_size`` (None:
        the config's) on a link of ``rate_bps`` and round trip ``rtt_s``: ``decoder_window()``
        of that link (two bandwidth-delay products) within
        ``decoder_window``..``max_decoder_window``, and no wider than the transfer once it
        is wider than ``decoder_window``."""
        size = self.symbol_size if symbol_size is None else symbol_size
        want = decoder_window(rate_bps, rtt_s, size, self.link_overhead)
        return max(self.decoder_window, min(want, self.max_decoder_window, n_source))


STANDARD = ProtocolConfig()
"""The standard configuration: the module constants' values."""
