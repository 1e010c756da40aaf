"""Block Reed-Solomon: after every k source symbols, p parity symbols of that block.

Blocks are ESIs b*k .. b*k+k-1 (kvtransport.codecs.blockrs, reedsolo-compatible RS over
GF(2^8), k + p <= 255); the last block of a stream whose length is not a multiple of k is
completed with zero symbols that never travel (the receiver knows them from the manifest).
The policy gives k and p (``block_k``, ``block_p``); parities are blind to feedback. A
parity is a BLOCK_REPAIR datagram (kvtransport.core.wire): key ``p << 8 | index``, NSS = k,
ESI the block's first.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvtransport.core.schemes.base import (
    BadFEC,
    ReceiverRepair,
    RepairScheme,
    SenderRepair,
    SenderView,
    SymbolStore,
)
from kvtransport.core.wire import Datagram, DatagramType, block_repair_key

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.codecs.blockrs import BlockRSDecoder
    from kvtransport.core.policy_base import Policy

RS_BLOCKS_HELD = 16
"""Blocks the receiver's decoder holds."""
_BLOCK_REPAIR = int(DatagramType.BLOCK_REPAIR)


class BlockRSSender(SenderRepair):
    """The block encoder and the parities waiting to be sent."""

    sees_sources = True

    def __init__(self, view: SenderView, policy: Policy) -> None:
        from kvtransport.codecs.blockrs import BlockRSEncoder

        super().__init__(view, policy)
        self.k, self.p, self.n_source = policy.block_k, policy.block_p, view.n_source
        self.encoder = BlockRSEncoder(view.symbol_size, self.k, self.p, max_blocks=2)
        self.queue: deque[tuple[int, int, int, bytes]] = deque()

    def on_source(self, esi: int, sym: memoryview | bytes) -> None:
        enc = self.encoder
        enc.add_source(sym)
        if esi + 1 == self.n_source:
            while enc.next_esi % self.k:
                enc.add_source(b"")
        if enc.next_esi % self.k == 0 and esi + 1 >= enc.next_esi - self.k + 1:
            block = enc.next_esi // self.k - 1
            for i, parity in enumerate(enc.repairs(block)):
                self.queue.append((block * self.k, self.p, i, parity))

    def before_source(self, t: float) -> bytes | None:
        if not self.queue:
            return None
        first, p, index, parity = self.queue.popleft()
        s = self.view
        size = s.symbol_size
        s.framer.payload_view(size)[:] = parity
        s.stats["block_repair_sent"] += 1
        return s.framer.finish(
            _BLOCK_REPAIR, s.seq, size, esi=first, key=block_repair_key(p, index), dt_nss=self.k
        )

    def tail_ok(self, left: int, esi: int, need: int) -> bool:
        # the source's block and its parities must fit
        end = min((esi // self.k + 1) * self.k, self.n_source)
        return left >= max(need, end - esi + self.p)

    def release(self) -> None:
        self.queue.clear()
        del self.encoder


class BlockRSReceiver(ReceiverRepair):
    """A BlockRSDecoder holding ``RS_BLOCKS_HELD`` blocks of one (k, p)."""

    def __init__(self, symbol_size: int, k: int, p: int) -> None:
        from kvtransport.codecs.blockrs import BlockRSDecoder

        self.rs: BlockRSDecoder = BlockRSDecoder(symbol_size, k, p, max_blocks=RS_BLOCKS_HELD)

    def add_repair(self, d: Datagram, store: SymbolStore) -> list[int]:
        first, k = d.esi, d.dt_nss
        rs = self.rs
        if rs.k != k or rs.p != d.key >> 8:
            raise BadFEC("block RS parameters changed mid-transfer")
        # the decoder learns the block's sources from what the receiver already knows (and
        # the zero symbols that pad the stream's last block)
        for e in range(first, first + k):
            if not rs.known(e):
                sym = store.known_symbol(e)
                if sym is not None:
                    rs.add_source(e, sym)
        return rs.add_repair(first, k, d.key & 0xFF, 15, d.payload)

    def add_source(self, esi: int, payload: memoryview | bytes) -> list[int]:
        return self.rs.add_source(esi, payload)

    def read_into(self, esi: int, out: memoryview) -> None:
        self.rs.read_into(esi, out)


class BlockRS(RepairScheme):
    name = "block-rs"
    wire_type = _BLOCK_REPAIR
    stat = "block_repair_sent"

    def sender(self, view: SenderView, policy: Policy) -> SenderRepair:
        return BlockRSSender(view, policy)

    def check(self, d: Datagram) -> int:
        first, k = d.esi, d.dt_nss
        p, index = d.key >> 8, d.key & 0xFF
        if not (1 <= k and 1 <= p and index < p and k + p <= 255) or first % k:
            raise BadFEC("block repair fields out of range")
        return first

    def decoder(self, symbol_size: int, d: Datagram) -> ReceiverRepair:
        return BlockRSReceiver(symbol_size, d.dt_nss, d.key >> 8)


SCHEME = BlockRS()
