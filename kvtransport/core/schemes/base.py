"""The repair-scheme interface: what a repair is, how it is built, what is owed, how it is
decoded.

The policy decides how much repair and when (its action: the repair share of the next
interval and whether new sources are admitted); the scheme decides how. A
:class:`RepairScheme` is registered by name (kvtransport.core.schemes) and a policy names the
one it uses (``Policy.scheme``).

**Sender side.** :class:`~kvtransport.core.sender.SenderSession` makes one :class:`SenderRepair`
per transfer (``scheme.sender(session, policy)``) and, slot by slot, after the manifest:

1. ``before_source(t)``: a repair datagram that goes before the next source (parities of a
   completed block, a retransmission, a reactive or credited RLC repair), or None;
2. otherwise the next source, if the policy admits sources and ``tail_ok`` agrees (the
   session's tail rule: ``left`` slots before the stop time, ``need`` slots to finish the
   block holding source ``esi``); the scheme sees every source sent in ``on_source`` when
   ``sees_sources`` is set;
3. otherwise, when ``fills_idle`` is set, ``fill(t)``: a repair of what was already sent
   instead of an idle slot (then a source the tail rule allows, admitted or not).

A repair the object returns is a sealed datagram built with ``session.framer`` at
``session.seq``; ``reactive`` tells the session whether it answered holes feedback reported.
The object also sees every feedback (``on_feedback``, before the policy's state is packed:
it may refine ``session.fb_deficit``), a receiver restart (``restart``), RTT and rate
changes (``rtt_changed``) and the end of the transfer (``release``). ``owed_model`` tells
the observation kernel and ``SenderSession.owed`` how repairs still owed are counted
(kvtransport.core.observation ``OWED_*``); ``needed`` is the reactive repairs the latest
feedback asked for, under ``OWED_SEGMENTS``.

**Receiver side.** A scheme whose repairs travel in a datagram type of their own
(``wire_type``) is decoded by a :class:`ReceiverRepair` that
:class:`~kvtransport.core.receiver.ReceiverSession` makes on the first such datagram
(``scheme.decoder(symbol_size, d)``, after ``scheme.check(d)`` validated its header
fields) and that sees every source from then on. ESIs it recovers are read out once into
the receiver's output and handed to the receiver's RLC decoder, which holds every known
source symbol. The sliding-window RLC's own repairs (``DatagramType.REPAIR``) and ARQ's
retransmissions (sources) are decoded by that core, so those schemes have no
``wire_type``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvtransport.core.observation import OWED_NONE, OWED_REPORTED, OWED_SEGMENTS
from kvtransport.core.wire import Datagram, WireError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.policy_base import Policy
    from kvtransport.core.transfer import Transfer
    from kvtransport.core.wire import Feedback, Framer

__all__ = [
    "OWED_NONE",
    "OWED_REPORTED",
    "OWED_SEGMENTS",
    "BadFEC",
    "ReceiverRepair",
    "RepairScheme",
    "SenderRepair",
    "SenderView",
    "SymbolStore",
]


class SenderView(Protocol):
    """What a :class:`SenderRepair` may read (and, for ``fb_deficit``, refine) of its
    :class:`~kvtransport.core.sender.SenderSession`."""

    transfer: Transfer | None
    framer: Framer  # builds every datagram; a repair is sealed at ``seq``
    seq: int
    symbol_size: int
    n_source: int
    next_esi: int  # sources sent so far: ESIs 0 .. next_esi - 1
    stats: dict[str, int]
    share: float  # the policy's repair share for this interval
    open_loop: bool  # no feedback for a while
    fb_through: int  # the receiver's decoded-through, as last reported
    fb_deficit: int  # reported holes still owed repairs
    decision_packets: int
    slot_s: float
    srtt: float | None

    @property
    def owd(self) -> float: ...
    @property
    def fb_echo(self) -> int: ...
    @property
    def max_repair_span(self) -> int: ...
    def source_symbol(self, esi: int) -> memoryview | bytes: ...
    def tail_fits(self, left: int, need: int) -> bool: ...


class BadFEC(WireError):
    """A repair whose coding fields the scheme cannot use (counted as ``bad_fec``)."""

    reason = "bad_fec"


class SenderRepair:
    """One transfer's sender side of a scheme (the module docstring gives the calls).

    The base class sends no repair and applies the loss-aware tail rule; subclasses
    override what their scheme does."""

    owed_model = OWED_REPORTED
    sees_sources = False  # on_source is called for every source sent
    fills_idle = False  # fill() may repair instead of an idle slot
    finishes_when_sent = False  # the session finishes once every source is sent
    repairs_open_loop = False  # without feedback, the session raises the repair share

    def __init__(self, session: SenderView, policy: Policy) -> None:
        self.session = session
        self.reactive = False  # the repair returned last answered reported holes
        self.needed = 0  # OWED_SEGMENTS: repairs the latest feedback asked for, still owed

    def before_source(self, t: float) -> bytes | None:
        """A repair datagram that goes out before the next source, or None."""
        return None

    def fill(self, t: float) -> bytes | None:
        """A repair instead of an idle slot (``fills_idle`` schemes), or None."""
        return None

    def on_source(self, esi: int, sym: memoryview | bytes) -> None:
        """Source ``esi`` (its zero-padded symbol ``sym``) is being sent."""

    def on_feedback(self, fb: Feedback, now: float) -> None:
        """A new feedback report (already applied to the session's estimates)."""

    def restart(self) -> None:
        """The receiver restarted: forget what its earlier feedback asked for."""

    def rtt_changed(self) -> None:
        """The RTT estimate, the rate or ``max_repair_span`` changed."""

    def tail_ok(self, left: int, esi: int, need: int) -> bool:
        """May source ``esi`` go out with ``left`` slots before the stop time, ``need`` of
        them to finish its block? By default the session's loss-aware rule
        (``tail_fits``: the expected surviving slots cover the repairs owed plus
        ``need``); a scheme that overrides this rules alone."""
        return self.session.tail_fits(left, need)

    def release(self) -> None:
        """The transfer is over: drop every reference to its payload."""


class SymbolStore(Protocol):
    """What a :class:`ReceiverRepair` may read of its receiver."""

    def known_symbol(self, esi: int) -> memoryview | bytes | None:
        """The bytes of ESI ``esi`` if known (b"" for the zero padding beyond the stream's
        end, once the manifest gave it), else None."""
        ...


class ReceiverRepair:
    """One transfer's receiver side of a scheme with its own ``wire_type``."""

    def add_repair(self, d: Datagram, store: SymbolStore) -> list[int]:
        """Take repair datagram ``d`` (its header checked by ``RepairScheme.check``); raise
        :class:`BadFEC` if it does not fit this decoder. Returns the ESIs it recovers."""
        raise NotImplementedError

    def add_source(self, esi: int, payload: memoryview | bytes) -> list[int]:
        """A source symbol arrived; returns the ESIs it lets the decoder recover."""
        return []

    def read_into(self, esi: int, out: memoryview) -> None:
        """Copy recovered ESI ``esi`` into ``out``."""
        raise NotImplementedError


class RepairScheme:
    """A repair code, registered by ``name`` (kvtransport.core.schemes.register)."""

    name = ""
    wire_type: int | None = None
    """The datagram type of its repairs when a :class:`ReceiverRepair` decodes them."""
    stat = ""
    """The sender's ``stats`` key counting its repair datagrams ("" for none)."""

    def sender(self, session: SenderView, policy: Policy) -> SenderRepair:
        """The sender side for one transfer."""
        return SenderRepair(session, policy)

    def check(self, d: Datagram) -> int:
        """Validate a repair's header fields (raise :class:`BadFEC`); return the ESI the
        receiver checks its range and symbol size against."""
        raise BadFEC(f"{self.name} has no repair datagrams")

    def decoder(self, symbol_size: int, d: Datagram) -> ReceiverRepair:
        """The receiver side, made on the first repair ``d`` of a transfer."""
        raise BadFEC(f"{self.name} has no repair datagrams")
