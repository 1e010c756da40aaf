"""What the sender sends from and what it has sent (sans-I/O): :class:`SourceStream`
and :class:`SendProgress`.

``SourceStream`` is the transfer's payload cut into source symbols (views into it, the
last one zero-padded), with, per ESI, the last ESI of the block its first byte belongs to
(the tail rule's need) and the utility of the blocks not yet fully sent. ``SendProgress``
counts what went out: the next source's ESI, the next packet number, the slot, the
sources, repairs and reactive repairs sent, and the :class:`~kvtransport.core.feedback.
SentLog` of recent packets that feedback's echoes are looked up in.
"""

from __future__ import annotations

import numpy as np

from kvtransport.core.feedback import SEQ_RING, SentLog
from kvtransport.core.transfer import Transfer

SEQ_MASK = SEQ_RING - 1


class SourceStream:
    """The payload as source symbols of ``symbol_size`` bytes (module docstring)."""

    __slots__ = (
        "transfer",
        "symbol_size",
        "n_source",
        "payload",
        "last_symbol",
        "payload_array",
        "last_array",
        "finish_esi",
        "utility_after",
    )

    def __init__(self, transfer: Transfer, symbol_size: int) -> None:
        s = symbol_size
        self.transfer: Transfer | None = transfer  # None once released
        self.symbol_size = s
        self.n_source = n = -(-transfer.nbytes // s)
        self.payload = memoryview(transfer.payload)
        tail = transfer.nbytes - (n - 1) * s if n else 0
        self.last_symbol = bytes(self.payload[(n - 1) * s :]) + bytes(s - tail) if n else b""
        # the same, for Framer.seal_sources: read-only whatever the transfer's (the kernel
        # is compiled once for one kind of array, in the shells' warm_up)
        self.payload_array = transfer.payload.view()
        self.payload_array.flags.writeable = False
        self.last_array = np.frombuffer(self.last_symbol, np.uint8)
        self.finish_esi, utility_after = _block_progress(transfer, s)
        self.utility_after = utility_after.tolist()  # float32 values as Python floats

    def symbol(self, esi: int) -> memoryview | bytes:
        """Source symbol ``esi`` as it travels (the last one zero-padded)."""
        s = self.symbol_size
        return self.payload[esi * s : esi * s + s] if esi < self.n_source - 1 else self.last_symbol

    def release(self) -> None:
        """Drop every reference to the payload."""
        self.transfer = None
        self.payload = memoryview(b"")
        self.last_symbol = b""
        self.payload_array = self.last_array = np.zeros(0, np.uint8)


class SendProgress:
    """Counters of what went out and the log of recent packets (module docstring)."""

    __slots__ = ("next_esi", "seq", "slot", "source_sent", "repair_sent", "reactive_sent", "log")

    def __init__(self) -> None:
        self.next_esi = 0  # sources sent so far: ESIs 0 .. next_esi - 1
        self.seq = 0  # the next packet number
        self.slot = 0  # data-path slots used
        self.source_sent = 0
        self.repair_sent = 0  # RLC repairs, RS parities and retransmissions together
        self.reactive_sent = 0  # of which sent for holes feedback reported (RLC, ARQ)
        self.log = SentLog()

    def sent(self, t: float, source: bool, repair: bool, reactive: bool) -> None:
        """A data-path datagram left at ``t`` in the next slot, with packet number ``seq``."""
        if source:
            self.source_sent += 1
        elif repair:
            self.repair_sent += 1
            if reactive:
                self.reactive_sent += 1
        seq = self.seq
        i = seq & SEQ_MASK
        log = self.log
        log.t[i] = t
        log.src[i] = self.source_sent
        log.rep[i] = self.repair_sent
        log.rea[i] = self.reactive_sent
        log.newest = seq
        self.seq = seq + 1
        self.slot += 1


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
