"""Protocol constants the sender and receiver sessions must agree on.

They are not negotiated on the wire: a receiver built with other values still decodes
everything, it only wastes repair symbols the sender aims below its window.
"""

from __future__ import annotations

DEFAULT_SYMBOL_SIZE = 1280
"""Source/repair symbol bytes: 1280 + 28 header + 16 tag + 42 link overhead < 1500 MTU."""

DECODER_WINDOW = 4096
"""Source ESIs the receiver's RLC decoder holds (5 MB at 1280-byte symbols); the sender's
encoder keeps as many, and no repair reaches below ``highest ESI sent - DECODER_WINDOW + 1``.
A hole older than that is given up, so it must exceed a few bandwidth-delay products: at
100 Mbit/s it covers 0.45 s, at 1 Gbit/s 45 ms."""

RELEASE_LAG = 512
"""The receiver keeps this many decoded ESIs behind its decoded-through point before it
releases them from the decoder, so repairs aimed from slightly stale feedback still fit."""

RELEASE_CHUNK = 128
"""The receiver releases decoder state in steps of this many ESIs (amortizes the cost)."""

MAX_REPAIR_SPAN = 1024
"""Most source symbols one proactive RLC repair covers (NSS); encoding and decoding cost grow
with it. Reactive repairs stay inside one aligned segment of REPAIR_SEGMENT symbols."""

LINK_OVERHEAD_BYTES = 42
"""Ethernet (14) + IPv4 (20) + UDP (8): what a link shaper counts besides the datagram, so
the sender's pacing matches kvtransport.netem's channel and tbf on the testbed."""

DEFAULT_FEEDBACK_INTERVAL = 0.004
"""Seconds between periodic feedback reports (more on loss events)."""

MIN_FEEDBACK_GAP = 0.001
"""Loss-triggered feedback is sent at most this often."""

DEFAULT_INITIAL_RTT = 0.02
"""RTT the sender assumes before its first feedback (stop time = deadline - RTT/2 - slot)."""
