"""The repair-scheme interface: what a repair is, how it is built, what is owed, how it is
decoded.

The policy decides how much repair and when (its action: the repair share of the next
interval and whether new sources are admitted); the scheme decides how. A
:class:`RepairScheme` is registered by name (kvtransport.core.schemes) and a policy names the
one it uses (``Policy.scheme``).

**Sender side.** :class:`~kvtransport.core.sender.SenderSession` makes one :class:`SenderRepair`
per transfer (``scheme.sender(view, policy)``, the view a read-only :class:`SenderView` of
the sender: kvtransport.core.repair_view) and, slot by slot, after the manifest:

1. ``before_source(t)``: a repair datagram that goes before the next source (parities of a
   completed block, a retransmission, a reactive or credited RLC repair), or None;
2. otherwise the next source, if the policy admits sources and ``tail_ok`` agrees (the
   session's tail rule: ``left`` slots before the stop time, ``need`` slots to finish the
   block holding source ``esi``); the scheme sees every source sent in ``on_source`` when
   ``sees_sources`` is set;
3. otherwise, when ``fills_idle`` is set, ``fill(t)``: a repair of what was already sent
   instead of an idle slot (then a source the tail rule allows, admitted or not).

A repair the object returns is a sealed datagram built with ``view.framer`` at
``view.seq``; ``reactive`` tells the session whether it answered holes feedback reported.
The object also sees every feedback (``on_feedback``, before the policy's state is packed:
what it returns, if not None, becomes the session's ``fb_deficit``), a receiver restart
(``restart``), RTT and rate changes (``rtt_changed``) and the end of the transfer
(``release``). ``owed_model`` tells
the observation kernel and ``SenderSession.owed`` how repairs still owed are counted
(kvtransport.core.observation ``OWED_*``); ``needed`` is the reactive repairs the latest
feedback asked for, under ``OWED_SEGMENTS``.

**Receiver side.** :class:`~kvtransport.core.receiver.ReceiverSession` hands a datagram of
a scheme's ``wire_type`` to that scheme's decoder, after ``scheme.check(d)`` validated its
header fields and returned the highest ESI it names (checked against the transfer's range
and symbol size). There are two kinds of decoder:

- the **window decoder** (a :class:`WindowDecoder`) of the one scheme registered with
  ``window`` set, the sliding-window RLC: its repairs may combine any source in its window,
  so the receiver makes it with the first data symbol (``scheme.window_decoder(
  symbol_size, config)``) and it learns every known source (in runs, when no pending equation
  involves them); its pending equations are what feedback reports as pending, and the
  receiver's batched path (``receive_datagrams``) decodes runs of sources and its repairs
  in one call;
- a **side decoder** (a :class:`ReceiverRepair`) of any other scheme with a ``wire_type``,
  made on the transfer's first such datagram (``scheme.decoder(symbol_size, d)``), which
  sees every source from then on.

ESIs a side decoder recovers are read out once into the receiver's output and handed to
the window decoder, which holds every known source symbol. ARQ's retransmissions are
sources, so that scheme has no ``wire_type`` and no decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvtransport.core.observation import OWED_NONE, OWED_REPORTED, OWED_SEGMENTS
from kvtransport.core.wire import Datagram, WireError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

    from kvtransport.core.policy_base import Policy
    from kvtransport.core.protocol import ProtocolConfig
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
    "WindowDecoder",
]


class SenderView(Protocol):
    """What a :class:`SenderRepair` may read of its sender (kvtransport.core.repair_view.
    RepairView): read-only, so a scheme cannot change the session's state; it seals its
    repairs with ``framer`` at ``seq`` and counts them in ``stats``."""

    @property
    def config(self) -> ProtocolConfig: ...  # the protocol's settings
    @property
    def decoder_window(self) -> int: ...  # the ESIs the encoder and receiver decoder hold
    @property
    def framer(self) -> Framer: ...  # builds every datagram; a repair is sealed at ``seq``
    @property
    def stats(self) -> dict[str, int]: ...  # the session's counters
    @property
    def payload(self) -> np.ndarray: ...  # the transfer's payload
    @property
    def seq(self) -> int: ...
    @property
    def symbol_size(self) -> int: ...
    @property
    def n_source(self) -> int: ...
    @property
    def next_esi(self) -> int: ...  # sources sent so far: ESIs 0 .. next_esi - 1
    @property
    def share(self) -> float: ...  # the policy's repair share for this interval
    @property
    def open_loop(self) -> bool: ...  # no feedback for a while
    @property
    def fb_through(self) -> int: ...  # the receiver's decoded-through, as last reported
    @property
    def fb_esi_end(self) -> int: ...  # one past the highest ESI it had seen, as reported
    @property
    def fb_burst(self) -> float: ...  # its smoothed loss-burst length (1 before a report)
    @property
    def fb_echo(self) -> int: ...  # the highest packet number feedback reported (-1: none)
    @property
    def decision_packets(self) -> int: ...
    @property
    def slot_s(self) -> float: ...
    @property
    def srtt(self) -> float | None: ...
    @property
    def owd(self) -> float: ...  # one-way delay estimate
    @property
    def stop_time(self) -> float: ...  # the last moment a datagram can leave and arrive
    @property
    def max_repair_span(self) -> int: ...
    def loss_estimate(self) -> float: ...
    def in_flight(self) -> tuple[int, int]: ...
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

    def __init__(self, view: SenderView, policy: Policy) -> None:
        self.view = view
        self.reactive = False  # the repair returned last answered reported holes
        self.needed = 0  # OWED_SEGMENTS: repairs the latest feedback asked for, still owed

    @property
    def session(self) -> SenderView:
        """The view, by the name schemes written before it used."""
        return self.view

    def before_source(self, t: float) -> bytes | None:
        """A repair datagram that goes out before the next source, or None."""
        return None

    def fill(self, t: float) -> bytes | None:
        """A repair instead of an idle slot (``fills_idle`` schemes), or None."""
        return None

    def quiet_slots(self, limit: int) -> int:
        """How many of the next ``limit`` slots (at most) ``before_source`` would answer
        None, each with no effect but what ``passed(k)`` applies for k of them: the
        session sends that many sources in one run without calling it (SenderSession.
        _source_run). 0 (the default, for a scheme that overrides ``before_source``):
        unknown, the session calls ``before_source`` slot by slot."""
        return 0

    def passed(self, k: int) -> None:
        """``before_source`` answered None for ``k`` slots (see ``quiet_slots``)."""

    def on_source(self, esi: int, sym: memoryview | bytes) -> None:
        """Source ``esi`` (its zero-padded symbol ``sym``) is being sent."""

    def on_feedback(self, fb: Feedback, now: float) -> int | None:
        """A new feedback report (already applied to the session's estimates). Returns
        the repairs the reported holes still need as this scheme counts them (the
        session's ``fb_deficit`` becomes it), or None to keep the report's count."""
        return None

    def restart(self) -> None:
        """The receiver restarted: forget what its earlier feedback asked for."""

    def rtt_changed(self) -> None:
        """The RTT estimate, the rate or ``max_repair_span`` changed."""

    def tail_ok(self, left: int, esi: int, need: int) -> bool:
        """May source ``esi`` go out with ``left`` slots before the stop time, ``need`` of
        them to finish its block? By default the session's loss-aware rule
        (``tail_fits``: the expected surviving slots cover the repairs owed plus
        ``need``); a scheme that overrides this rules alone."""
        return self.view.tail_fits(left, need)

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


class WindowDecoder(Protocol):
    """The window scheme's receiver side (module docstring): one per transfer, made with
    the first data symbol. ESIs are held in a window of ``capacity`` consecutive ESIs from
    ``base`` up; an ESI beyond it slides the window. Every call returns the ESIs that
    became known through it, which the receiver reads out with ``read_into``."""

    symbol_size: int
    base: int
    capacity: int

    @property
    def max_involved(self) -> int:
        """The highest ESI a pending equation may involve (-1: none is pending)."""
        ...

    @property
    def pending_equations(self) -> int:
        """Repair equations held that still involve unknown sources (fed back)."""
        ...

    def involves(self, esi: int) -> bool:
        """May a pending equation involve source ``esi``? (If not, the receiver may hand
        it over later, in a run with its neighbours.)"""
        ...

    def add_source(self, esi: int, payload: Any) -> list[int]: ...

    def add_source_run(self, first: int, data: Any) -> list[int]:
        """Sources ``first``, ``first + 1``, ... cut from ``data``: as ``add_source`` once
        per symbol, in order."""
        ...

    def add_repair_datagram(self, d: Datagram) -> list[int]:
        """Take repair ``d`` (its ESIs checked by ``RepairScheme.check``); raise
        :class:`BadFEC` when its coding fields are unusable."""
        ...

    def repair_row(self, d: Datagram) -> tuple[int, int, int, int]:
        """Repair ``d``'s row for ``add_packets`` (first ESI, symbols covered, repair key,
        DT), its coding fields validated as ``add_repair_datagram`` would (BadFEC)."""
        ...

    def add_packets(self, meta: Any, payloads: Any, ends: Any, sources: Any) -> list[int]:
        """A run of sources and repairs (rows of ``repair_row``; a source's row is (esi,
        0, 0, 0) and its bytes are in ``sources``) in one call, exactly as the calls one
        by one; ``ends[i]``: how many of the returned ESIs packet i made known so far."""
        ...

    def read_into(self, esi: int, out: Any) -> bool: ...

    def widen(self, capacity: int) -> Any:
        """Hold ``capacity`` ESIs from now on when that is more (decoding goes on exactly
        as in a decoder made that wide); no change otherwise."""
        ...

    def release_before(self, esi: int) -> None:
        """Drop every ESI below ``esi`` (decoded through, and read out)."""
        ...

    def pending_pivots(self) -> Any:
        """The pivot (lowest unknown ESI) of each pending equation, ascending (int64
        array): the holes the receiver does not report as needing an equation."""
        ...


class RepairScheme:
    """A repair code, registered by ``name`` (kvtransport.core.schemes.register)."""

    name = ""
    wire_type: int | None = None
    """The datagram type of its repairs (None: it has none)."""
    window = False
    """Its decoder is the receiver's window decoder (``window_decoder``), made with the
    first data symbol; at most one registered scheme sets this."""
    stat = ""
    """The sender's ``stats`` key counting its repair datagrams ("" for none)."""

    def sender(self, view: SenderView, policy: Policy) -> SenderRepair:
        """The sender side for one transfer."""
        return SenderRepair(view, policy)

    def check(self, d: Datagram) -> int:
        """Validate a repair's header fields (raise :class:`BadFEC`); return the ESI the
        receiver checks its range and symbol size against."""
        raise BadFEC(f"{self.name} has no repair datagrams")

    def decoder(self, symbol_size: int, d: Datagram) -> ReceiverRepair:
        """The receiver side, made on the first repair ``d`` of a transfer."""
        raise BadFEC(f"{self.name} has no repair datagrams")

    def window_decoder(self, symbol_size: int, config: ProtocolConfig) -> WindowDecoder:
        """The receiver side of a ``window`` scheme, made with a transfer's first data
        symbol, sized by the receiver's protocol ``config`` (its ``decoder_window``,
        ``max_pending_equations``)."""
        raise NotImplementedError(f"{self.name} is not a window scheme")
