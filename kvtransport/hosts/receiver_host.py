"""The receiving endpoint, sans-I/O: :class:`ReceiverHost`, one session per transfer.

A host is what one receiving endpoint runs above its :class:`~kvtransport.core.receiver.
ReceiverSession` s, in the style of aioquic's ``QuicConnection``: no socket, no clock
(every call takes ``now``; the wall time for replay protection is the shell's
``wall_clock``), and the shell moves the datagrams:

- :meth:`ReceiverHost.receive_datagram` ``(data, addr, now)`` hands a datagram to the
  session its header's transfer id names, opening one for a new transfer (below);
- :meth:`ReceiverHost.get_timer` / :meth:`ReceiverHost.handle_timer` run the sessions'
  timers (periodic feedback, deadline, idle expiry) and forget finished sessions after
  ``linger_s``;
- :meth:`ReceiverHost.datagrams_to_send` ``(now)`` returns the feedback the calls since the
  last one produced, as ``(datagrams, address)`` pairs (to the address the transfer's
  datagrams come from), stamped ``now``: a shell that handled a batch passes the time the
  feedback really leaves, so the sender's RTT does not count the batch as network delay;
  sessions that finished are settled here;
- :meth:`ReceiverHost.next_event` returns the typed events, oldest first:
  :class:`TransferStarted` (a session opened: its manifest was admitted),
  :class:`ResultReady` (a finished transfer's result), :class:`TransferRefused` (a
  session opened ahead whose manifest was a replay: nothing is delivered).

Nothing before a fresh manifest (as WireGuard answers nothing before its handshake): a
transfer has no session, no slot, no feedback, no result and no timer until a manifest
that authenticates has decoded and passed the checks (``max_transfers``, then the replay
record's freshness and once checks). Its datagrams that arrive before (the manifest is
interleaved with data, and its first datagram may be lost) are authenticated and wait in
a bounded pool (:class:`Pending`: per transfer at most ``POOL_DATAGRAMS`` datagrams and
``POOL_TRANSFER_BYTES``, ``POOL_BYTES`` in all, ``POOL_TRANSFERS`` transfers, the oldest
evicted first; each lives ``POOL_TIMEOUT_S`` after its creation or its latest manifest
datagram); the symbols its manifest decoder holds count as pooled bytes too, charged as
they arrive; what does not fit is dropped and counted (``pool_full``, ``pool_expired``,
a repeated packet number ``duplicate_packet``). The session opens with the pool's
datagrams (:meth:`ReceiverSession.open_validated`), its deadline counted from the first
of them. A replayed datagram without its manifest thus opens nothing, and a replayed
manifest is refused before anything exists.

Before its session opens, a transfer's replies stay within ``AMPLIFICATION`` (3, QUIC's
limit before address validation) times the bytes received from its peer: the sealed
refusals (kvtransport.core.feedback.refusal_datagram: at most one per manifest datagram)
and the probe: a transfer of which ``PROBE_EVERY`` datagrams arrived and no manifest
datagram is answered with one small sealed report that it has no manifest (what a
receiver restarted mid-transfer sends, so its sender sends a fresh manifest). A reply
beyond the limit is withheld and counted (``replies_withheld``).

A shell that shares the sender's clock (the simulator) may open a session ahead instead,
with the exact deadline (:meth:`ReceiverHost.expect`); such a session checks its manifest
against the replay record itself.

What bounds the state (every datagram is attacker-controlled):

- ``max_transfers`` sessions at once (a session that finished but is not yet settled no
  longer counts); a new transfer beyond that is dropped and counted (``over_capacity``),
  never an old one evicted; each of its manifest datagrams is answered with one small
  sealed refusal (kvtransport.core.feedback.refusal_datagram, within the amplification
  limit), so its sender stops and says why;
- ``max_bytes`` per transfer: the session refuses symbols beyond it and a manifest
  announcing more (``too_large``), or more symbols than a sixteenth of ``window`` (its
  known-symbol map, a byte per symbol held whole: kvtransport.core.receiver_parts.MAP_SHARE;
  a large claim at tiny symbols); its decoder holds at most the config's
  ``max_decoder_window`` ESIs, and a manifest naming more is refused (``decoder_window``);
- ``budget_bytes`` for all of them: the output buffers of the sessions held (receiving,
  or finished and lingering) never exceed it; a session that would is refused its
  symbols (``over_budget``) or, at its manifest, the whole transfer (result reason
  ``refused``). A session's reservation follows what arrived, not what its manifest
  claims: it covers the symbols that arrived plus ``window`` bytes (``RESERVE_WINDOW``,
  at most a quarter of the budget's share per transfer, at least
  ``MIN_RESERVE_WINDOW``), a symbol further ahead is dropped (``ahead_of_data``), and
  when the budget is short the sessions silent for ``RECLAIM_IDLE_S`` give their window
  back (``reclaimed_bytes``), so transfers announced and left idle cannot keep a later
  one out;
- every session ends by itself: at its deadline (from the manifest, counted from its first
  datagram), on the sender's ABORT, when everything is decoded, or (a session opened
  ahead by :meth:`ReceiverHost.expect`) ``idle_timeout`` seconds after its last datagram
  when no manifest came;
- a finished session lingers ``linger_s`` to remind a sender that missed the final
  feedback; then its id goes to a bounded list of recent ids whose late datagrams are
  dropped (``finished_transfer``) instead of opening a new session;
- with a ``replay`` record (kvtransport.core.replay), a manifest that is stale or was accepted
  before opens nothing: the reason is counted (and in ``replays_refused``), the refusal
  answered, the transfer's later datagrams dropped as ``replayed`` until its pool entry
  expires; persisting the record is the shell's (before it hands on any result of the
  batch that accepted a manifest: ``replay.dirty``).

Garbage never reaches a session unless it carries a known transfer id; there it is
counted by reason in the session's ``drop_reasons`` (bad tag, truncated, ...), elsewhere
in the host's. :meth:`ReceiverHost.failure_note` names, in one line, what a user most
likely got wrong from those counters: datagrams that failed authentication (another key),
of another protocol version, transfers refused (and why).

``single``: the ``recv`` command's mode, where the first transfer is the only one and
datagrams of any other transfer id are dropped as ``foreign_transfer``.

``hold_reports``: the shell writes results (``recv --out``, ``--out-dir``) before their
senders may take them as delivered: a finished session's final report waits
(kvtransport.core.receiver: ``hold_report``) until the shell calls
:meth:`ReceiverHost.result_kept` with whether the result was written (else the report
names ``result_unsaved``); the session lingers at least until then.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtransport.core.feedback import refusal_datagram, refusal_text
from kvtransport.core.manifest_fec import ManifestReceiver
from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.receiver import ReceiverSession
from kvtransport.core.replay import ReplayRecord
from kvtransport.core.transfer import TransportManifest
from kvtransport.core.wire import (
    HEADER_SIZE,
    Datagram,
    DatagramType,
    Feedback,
    Framer,
    Parser,
    PeerKeys,
    ReceivedBatch,
    SealKey,
    UnknownPeer,
    WireError,
    encode_feedback,
    feedback_size,
)
from kvtransport.errors import UserError

log = logging.getLogger("kvtransport.receiver-daemon")

DEFAULT_MAX_TRANSFERS = 16
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_LINGER_S = 1.0
DEFAULT_BUDGET_BYTES = 1 << 30
"""Output-buffer bytes all transfers held at once may take (``budget_bytes``)."""
RESERVE_WINDOW = 64 << 20
"""The most a transfer's reservation may run ahead of the bytes that arrived (the
window is also at most a quarter of the budget's share per transfer)."""
MIN_RESERVE_WINDOW = 256 << 10
"""The least it may (a small budget shared by many transfers)."""
RECLAIM_IDLE_S = 1.0
"""A session silent this long gives its window back when the budget is short."""
MAX_IDLE_TIMEOUT_S = 3600.0
RECENT_IDS = 4096
REFUSAL_CACHE = 64
"""Over-capacity refusals kept (their bytes are fixed per transfer: made once each)."""
_TID = struct.Struct("!Q")
_MANIFEST_TYPES = (int(DatagramType.MANIFEST), int(DatagramType.MANIFEST_REPAIR))

POOL_TRANSFERS = 64
"""Transfers whose datagrams may wait for their manifest at once (beyond: the entry that
expires first is evicted)."""
POOL_DATAGRAMS = 1024
"""Datagrams one transfer may hold in the pool."""
POOL_TRANSFER_BYTES = 2 << 20
"""Bytes one transfer may hold in the pool."""
POOL_BYTES = 16 << 20
"""Bytes all transfers may hold in the pool."""
POOL_TIMEOUT_S = 1.0
"""A pool entry lives this long after its creation or its latest manifest datagram."""
AMPLIFICATION = 3
"""Reply bytes allowed per byte received before a transfer's session opens (QUIC's 3x)."""
PROBE_EVERY = 16
"""A transfer that sent this many datagrams (and multiples) and no manifest datagram is
answered with one probe (a report with no manifest)."""

Address = Any
"""A peer's address as the shell knows it (a (host, port) tuple over UDP)."""


def auth_failures(n: int, key: SealKey | None = None) -> str:
    """The one line that names ``n`` datagrams that failed authentication, and what to
    check for a receiver sealing with ``key`` (identities: the allowlist and the sender's
    --peer-pub; else the pre-shared key)."""
    plural = "s" if n != 1 else ""
    if isinstance(key, PeerKeys):
        check = (
            "is the sender's public key in --allow-pub, and does its --peer-pub name this "
            "receiver's (and its --key, if any, match)?"
        )
    else:
        check = "do both ends have the same key?"
    return f"{n} datagram{plural} failed authentication: {check}"


@dataclass
class Incoming:
    """One transfer the host receives (or received), and its reporting."""

    transfer_id: int
    session: ReceiverSession
    peer: Address
    created: float
    state: str = "receiving"
    finished: float | None = None
    datagrams: int = 0

    def stats(self, now: float) -> dict[str, Any]:
        """The status view of this transfer (the control API's ``status`` entry)."""
        s = self.session
        res = s.result
        t0 = s.timings.get("first_packet", self.created)
        timings = {k: round(v - t0, 6) for k, v in s.timings.items() if k != "first_packet"}
        m = s.manifest
        mon = s.monitor
        return {
            "transfer_id": f"{self.transfer_id:016x}",
            "state": self.state,
            "reason": res.reason if res is not None else "",
            "refused": s.refused,
            "from": f"{self.peer[0]}:{self.peer[1]}",
            "utility": round(float(res.utility_recovered if res else s.utility), 6),
            "manifest": m is not None,
            "bytes": m.payload_len if m is not None else None,
            "blocks": len(m.blocks) if m is not None else None,
            "blocks_complete": s.blocks_complete,
            "n_source": s.n_source,
            "symbols_known": s.n_known,
            "decoded_through": s.through,
            "datagrams": self.datagrams,
            "source_received": s.source_received,
            "repair_received": s.repair_received,
            "symbols_recovered": s.symbols_recovered,
            "duplicates": s.duplicates,
            "datagrams_lost": mon.lost,
            "highest_seq": mon.highest,
            "loss_rate": round(float(mon.loss_rate), 5),
            "dropped": s.dropped,
            "drop_reasons": dict(s.drop_reasons),
            "feedback_sent": s.feedback_sent,
            "timings_s": timings,
            "elapsed_s": round((self.finished if self.finished is not None else now) - t0, 6),
        }


@dataclass
class Pending:
    """A transfer's datagrams waiting for its manifest (the pool, module docstring)."""

    transfer_id: int
    peer: Address
    first: float  # when its first datagram arrived
    expires: float
    rx: ManifestReceiver
    datagrams: list[bytes]
    seqs: set[int]
    nbytes: int = 0  # pooled bytes
    received: int = 0  # bytes of authenticated datagrams from ``peer``
    replied: int = 0  # bytes answered to ``peer``
    seen: int = 0  # authenticated datagrams
    manifests: int = 0  # of which manifest datagrams
    highest: int = -1  # highest packet number and its arrival (the probe's echo)
    highest_at: float = 0.0
    refused: str = ""  # why its admitted-or-not manifest was refused ("": not refused)
    framer: Framer | None = None  # its probes' (an epoch of their own)
    probes: int = 0


@dataclass(frozen=True)
class TransferStarted:
    """A new transfer's admitted manifest opened a session."""

    transfer: Incoming


@dataclass(frozen=True)
class ResultReady:
    """A transfer finished: ``transfer.session.result`` is its result (at ``at``)."""

    transfer: Incoming
    at: float


@dataclass(frozen=True)
class TransferRefused:
    """A transfer ended with nothing delivered: its manifest was a replay (``reason``)."""

    transfer: Incoming
    at: float
    reason: str


ReceiverEvent = TransferStarted | ResultReady | TransferRefused


class ReceiverHost:
    """Receiver sessions of one endpoint (see the module docstring).

    ``wall_clock``: the wall time (Unix seconds) for the replay check, read only when a
    manifest is checked against ``replay``. ``config``: the protocol's settings every
    session of the host is built with (kvtransport.core.protocol).
    """

    def __init__(
        self,
        *,
        key: SealKey | None = None,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        linger_s: float = DEFAULT_LINGER_S,
        single: bool = False,
        budget_bytes: int | None = None,
        replay: ReplayRecord | None = None,
        wall_clock: Callable[[], float] | None = None,
        config: ProtocolConfig = STANDARD,
        hold_reports: bool = False,
    ) -> None:
        if max_transfers < 1 or max_bytes < 1 or not 0 < idle_timeout <= MAX_IDLE_TIMEOUT_S:
            raise UserError(
                "max transfers and max bytes must be positive, the idle timeout in "
                f"(0, {MAX_IDLE_TIMEOUT_S:g}] s"
            )
        self.budget_bytes = (
            max(max_bytes, DEFAULT_BUDGET_BYTES) if budget_bytes is None else budget_bytes
        )
        if self.budget_bytes < 1:
            raise UserError("the memory budget must be positive")
        if replay is not None and wall_clock is None:
            raise ValueError("a replay record needs the shell's wall clock")
        self.held_bytes = 0  # output buffers granted to sessions not yet forgotten
        self.window = min(
            RESERVE_WINDOW,
            max(MIN_RESERVE_WINDOW, self.budget_bytes // (4 * max_transfers)),
        )  # how far a session's reservation may run ahead of what arrived
        self.reclaimed = 0  # bytes taken back from idle sessions (_reclaim)
        self._now = 0.0  # the time of the call being handled (_reclaim's idleness)
        self.key = key
        self.config = config
        self.parser = Parser(key)
        self.max_transfers = max_transfers
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self.linger_s = linger_s
        self.single = single
        self.hold_reports = hold_reports
        self.replay = replay
        self.wall_clock = wall_clock
        self.replays_refused = 0
        self.active: dict[int, Incoming] = {}
        self.lingering: OrderedDict[int, Incoming] = OrderedDict()
        self.recent: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.adopted: int | None = None
        self.drop_reasons: dict[str, int] = {}
        self.dropped = 0
        self.results = 0
        self._retired_drops: dict[str, int] = {}  # sessions' drops, once they are forgotten
        self._retired_dropped = 0
        self._touched: dict[int, Incoming] = {}  # sessions with feedback or a finish to settle
        self._last_tid = -1  # the previous datagram's transfer (consecutive: one lookup)
        self._last: Incoming | None = None
        self._events: deque[ReceiverEvent] = deque()
        self._replies: list[tuple[list[bytes], Address]] = []  # refusals without a session
        self._refusals: OrderedDict[tuple[int, str], bytes] = OrderedDict()
        self.pending: OrderedDict[int, Pending] = OrderedDict()  # by expiry, first first
        self.pool_bytes = 0
        self.replies_withheld = 0  # replies beyond the amplification limit
        self.last_refusal = ""  # the latest refused transfer, in one line (failure_note)

    # ------------------------------------------------------------------ datagrams

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        """One datagram to its transfer's session (opened if the transfer is new and the
        datagram genuine; otherwise dropped and counted)."""
        self._now = now
        inc = self._route(data, addr, now)
        if inc is not None:
            inc.session.receive_datagram(data, now)

    def receive_datagrams(self, batch: Iterable[tuple[bytes, Address]], now: float) -> None:
        """``receive_datagram`` for each (data, addr) of ``batch`` in order, with the same
        outcome, but each run of consecutive datagrams of one transfer reaches its session
        in one ``ReceiverSession.receive_datagrams`` call (its data symbols in one decoder
        call). A run is handed over before the next datagram of any other transfer is
        looked at, so admitting a new transfer sees the sessions as it would otherwise.
        A run of a :class:`ReceivedBatch` (a socket read) goes as :class:`LaidOutDatagrams`,
        so its sessions open runs of sources in one compiled call."""
        laid = batch if isinstance(batch, ReceivedBatch) else None
        self._now = now
        run: list[bytes] = []
        owner: Incoming | None = None
        owner_tid = -1
        first = 0  # the run's first pair in the batch
        unpack = _TID.unpack_from
        for j, (data, addr) in enumerate(batch):
            if len(data) >= HEADER_SIZE and unpack(data, 8)[0] == owner_tid:
                # the run's transfer again: what _route would do for it (its session is
                # the one it cached for this transfer), without a call per datagram
                assert owner is not None  # owner_tid is set with owner
                owner.datagrams += 1
                run.append(data)
                continue
            if owner is not None:
                owner.session.receive_datagrams(run if laid is None else laid.run(first, run), now)
                run, owner, owner_tid = [], None, -1
            inc = self._route(data, addr, now)
            if inc is not None:
                owner, owner_tid, first = inc, inc.transfer_id, j
                run.append(data)
        if owner is not None:
            owner.session.receive_datagrams(run if laid is None else laid.run(first, run), now)

    def _route(self, data: bytes, addr: Address, now: float) -> Incoming | None:
        """The session ``data`` goes to (its transfer's; a new one if the transfer is new
        and the datagram genuine), counted; None when it is dropped (and counted)."""
        if len(data) < HEADER_SIZE:
            self._drop("truncated")
            return None
        tid = _TID.unpack_from(data, 8)[0]
        inc = self._last
        if tid != self._last_tid or inc is None:
            inc = self.active.get(tid)
            if inc is None:
                inc = self.lingering.get(tid)
                if inc is None:
                    inc = self._admit(tid, data, addr, now)
                    if inc is None:
                        return None
            self._last_tid, self._last = tid, inc
            self._touched[tid] = inc
        inc.datagrams += 1
        return inc

    def datagrams_to_send(self, now: float) -> list[tuple[list[bytes], Address]]:
        """The feedback since the last call, stamped ``now``, as (datagrams, address)
        pairs; sessions that finished are settled (their events queued)."""
        touched = self._touched
        self._touched = {}
        self._last_tid, self._last = -1, None
        out, self._replies = self._replies, []
        for inc in touched.values():
            datagrams = inc.session.datagrams_to_send(now)
            if datagrams:
                out.append((datagrams, inc.peer))
            if inc.state == "receiving" and inc.session.finished:
                self._finished(inc, now)
        return out

    def next_event(self) -> ReceiverEvent | None:
        """The oldest event not yet taken (None: none)."""
        return self._events.popleft() if self._events else None

    # ------------------------------------------------------------------ timers

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` has work next (None: nothing planned)."""
        wake = None
        for inc in self.active.values():
            t = inc.session.next_timer()
            if t is not None and (wake is None or t < wake):
                wake = t
        if self.lingering:
            first = next(iter(self.lingering.values()))
            assert first.finished is not None  # a lingering transfer has finished
            t = first.finished + self.linger_s
            if wake is None or t < wake:
                wake = t
        if self.pending:
            t = next(iter(self.pending.values())).expires
            if wake is None or t < wake:
                wake = t
        return wake

    def handle_timer(self, now: float) -> None:
        """Fire the sessions' timers due by ``now``; forget sessions lingered out."""
        self._last_tid, self._last = -1, None
        self._now = now
        for inc in list(self.active.values()):
            s = inc.session
            t = s.next_timer()
            if t is not None and t <= now:
                s.handle_timer(now)
                self._touched[inc.transfer_id] = inc
        while self.lingering:
            tid, inc = next(iter(self.lingering.items()))
            assert inc.finished is not None  # a lingering transfer has finished
            if inc.finished + self.linger_s > now or inc.session.life.report_held:
                break  # (a held report: the shell saves its result, in order)
            del self.lingering[tid]
            self.held_bytes -= inc.session.reserved  # its buffers go with it
            self._remember(tid, inc.stats(now))
            self._retired_dropped += inc.session.dropped
            for k, v in inc.session.drop_reasons.items():
                self._retired_drops[k] = self._retired_drops.get(k, 0) + v
        while self.pending:
            entry = next(iter(self.pending.values()))
            if entry.expires > now:
                break
            self._forget_pending(entry, "pool_expired")

    # ------------------------------------------------------------------ control

    def expect(self, transfer_id: int, peer: Address, now: float, deadline: float) -> Incoming:
        """Open a transfer's session before its first datagram, with its deadline known
        on this host's clock (a shell that shares the sender's clock, as the simulator does):
        the session ends at ``deadline`` instead of the manifest's deadline counted from its
        first datagram, and its feedback goes to ``peer``. Raises UserError (changing
        nothing) for an id in use or when ``max_transfers`` are receiving."""
        if transfer_id in self.active or transfer_id in self.lingering:
            raise UserError(f"transfer id {transfer_id:016x} is already in use")
        if self.single and self.adopted is not None:
            raise UserError("this host receives a single transfer and has one")
        if len(self.active) >= self.max_transfers and self._live() >= self.max_transfers:
            raise UserError(f"{self.max_transfers} transfers receiving (the limit)")
        return self._open(transfer_id, peer, now, deadline)

    def abort(self, transfer_id: int, now: float, reason: str = "abort") -> bool:
        """Deliver a transfer's partial result now (its events and final feedback come
        with the next :meth:`datagrams_to_send`)."""
        inc = self.active.get(transfer_id)
        if inc is None:
            return False
        inc.session.close(now, reason)
        self._touched[transfer_id] = inc
        return True

    def result_kept(self, transfer_id: int, now: float, saved: bool = True) -> None:
        """The shell wrote a finished transfer's result (``saved``) or could not
        (``hold_reports``): its final report goes with the next :meth:`datagrams_to_send`,
        naming ``result_unsaved`` when not saved."""
        inc = self.get(transfer_id)
        if inc is not None and inc.session.life.report_held:
            inc.session.report_kept(now, saved)
            self._touched[transfer_id] = inc

    def close(self, now: float) -> None:
        """Shutdown: every transfer still receiving delivers what it holds."""
        for tid in list(self.active):
            self.abort(tid, now, "shutdown")

    def get(self, transfer_id: int) -> Incoming | None:
        """A transfer receiving or lingering."""
        return self.active.get(transfer_id) or self.lingering.get(transfer_id)

    def status(self, now: float, transfer_id: int | None = None) -> list[dict[str, Any]]:
        """Status of one transfer (receiving, lingering or remembered) or of all of them
        (the remembered ones: the last 64)."""
        if transfer_id is not None:
            inc = self.get(transfer_id)
            if inc is not None:
                return [inc.stats(now)]
            if transfer_id in self.recent:
                return [self.recent[transfer_id]]
            raise UserError(f"no transfer {transfer_id:016x}")
        live = [i.stats(now) for i in (*self.active.values(), *self.lingering.values())]
        return live + list(self.recent.values())[-64:]

    def stats(self) -> dict[str, Any]:
        """Counters of the host and its sessions (the shell adds its socket's)."""
        reasons = dict(self.drop_reasons)
        for k, v in self._retired_drops.items():
            reasons[k] = reasons.get(k, 0) + v
        dropped = self.dropped + self._retired_dropped
        for inc in (*self.active.values(), *self.lingering.values()):
            dropped += inc.session.dropped
            for k, v in inc.session.drop_reasons.items():
                reasons[k] = reasons.get(k, 0) + v
        return {
            "active": len(self.active),
            "results": self.results,
            "dropped": dropped,
            "drop_reasons": reasons,
            "engine_dropped": self.dropped,
            "held_bytes": self.held_bytes,
            "budget_bytes": self.budget_bytes,
            "reserve_window": self.window,
            "reclaimed_bytes": self.reclaimed,
            "replays_refused": self.replays_refused,
            "pending": len(self.pending),
            "pool_bytes": self.pool_bytes,
            "replies_withheld": self.replies_withheld,
            **self._peer_stats(),
            "replay_record": (
                {
                    "entries": len(self.replay.entries),
                    "floor": self.replay.floor,
                    "persist_errors": self.replay.persist_errors,
                }
                if self.replay is not None
                else None
            ),
        }

    def _peer_stats(self) -> dict[str, int]:
        """With identities: pairwise secrets tried on transfers of no known peer
        (``peer_tries``, as recv --json) and replies not sealed for want of a known peer
        (``peer_unsealable``); nothing with a pre-shared key."""
        key = self.key
        if not isinstance(key, PeerKeys):
            return {}
        return {"peer_tries": key.tries, "peer_unsealable": key.unsealable}

    # ------------------------------------------------------------------ internals

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def _admit(self, tid: int, data: bytes, addr: Address, now: float) -> Incoming | None:
        """A datagram of a transfer without a session: into its pool entry if it is
        genuine; the session it opened when its manifest was admitted (module docstring).
        Returns None: the datagram is held, answered or dropped (counted) here."""
        if tid in self.recent:
            self._drop("finished_transfer")
            return None
        if self.single and self.adopted is not None:
            self._drop("foreign_transfer")
            return None
        try:
            d = self.parser.parse(data)
        except WireError as exc:
            self._drop(exc.reason)
            return None
        if d.type == DatagramType.FEEDBACK:
            self._drop("unexpected_type")
            return None
        entry = self.pending.get(tid)
        if entry is None:
            entry = self._new_pending(tid, addr, now)
        if addr == entry.peer:
            entry.received += len(data)
        if entry.refused:
            self._drop("over_capacity" if entry.refused == "over_capacity" else "replayed")
            if d.type in _MANIFEST_TYPES:
                self._reply(entry, self._refusal(tid, entry.refused))
            return None
        self._pool(entry, d, data, now)
        return None

    def _new_pending(self, tid: int, addr: Address, now: float) -> Pending:
        while len(self.pending) >= POOL_TRANSFERS:
            self._forget_pending(next(iter(self.pending.values())), "pool_full")
        entry = Pending(tid, addr, now, now + POOL_TIMEOUT_S, ManifestReceiver(), [], set())
        self.pending[tid] = entry
        return entry

    def _forget_pending(self, entry: Pending, reason: str) -> None:
        """Drop a pool entry and its datagrams (counted as ``reason``)."""
        del self.pending[entry.transfer_id]
        self._drop_held(entry, reason)

    def _drop_held(self, entry: Pending, reason: str) -> None:
        n = len(entry.datagrams)
        if n:
            self.dropped += n
            self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + n
        self.pool_bytes -= entry.nbytes
        entry.datagrams, entry.nbytes = [], 0

    def _pool(self, entry: Pending, d: Datagram, data: bytes, now: float) -> None:
        """An authenticated datagram of a transfer without a session (module docstring)."""
        seq = d[3]
        if seq in entry.seqs:
            self._drop("duplicate_packet")
            return
        entry.seqs.add(seq)
        entry.seen += 1
        if seq > entry.highest:
            entry.highest, entry.highest_at = seq, now
        n = len(data)
        if (
            len(entry.datagrams) >= POOL_DATAGRAMS
            or entry.nbytes + n > POOL_TRANSFER_BYTES
            or self.pool_bytes + n > POOL_BYTES
        ):
            self._drop("pool_full")
        else:
            entry.datagrams.append(bytes(data))  # a socket's buffer is reused: a copy
            entry.nbytes += n
            self.pool_bytes += n
        if d[0] not in _MANIFEST_TYPES:
            if not entry.manifests and entry.seen % PROBE_EVERY == 0:
                self._probe(entry, now)
            return
        entry.manifests += 1
        entry.expires = now + POOL_TIMEOUT_S
        self.pending.move_to_end(entry.transfer_id)
        if self.pool_bytes + len(d[7]) > POOL_BYTES:  # its decoder shares the pool's bound
            self._drop("pool_full")
            return
        before = entry.rx.nbytes
        try:
            m = entry.rx.add(d)
        except WireError as exc:
            self._drop(exc.reason)
            return
        finally:  # the decoder's symbol bytes count as pooled (issue 44, item 7)
            entry.nbytes += entry.rx.nbytes - before
            self.pool_bytes += entry.rx.nbytes - before
        if m is not None:
            self._validated(entry, m, now)

    def _validated(self, entry: Pending, m: TransportManifest, now: float) -> None:
        """A transfer's manifest decoded: refused for capacity or as a replay, else its
        session opens with the pool's datagrams."""
        tid = entry.transfer_id
        if len(self.active) >= self.max_transfers and self._live() >= self.max_transfers:
            self._refuse_pending(entry, "over_capacity")
            return
        if self.replay is not None:
            why = self._admit_manifest(tid, m)
            if why is not None:
                self.replays_refused += 1
                self._drop(why)
                self._refuse_pending(entry, why)
                return
        del self.pending[tid]
        self.pool_bytes -= entry.nbytes
        inc = self._open(tid, entry.peer, now, admit=False)
        inc.datagrams += len(entry.datagrams)
        inc.session.open_validated(entry.rx, entry.first, entry.datagrams, now)
        self._touched[tid] = inc

    def _refuse_pending(self, entry: Pending, why: str) -> None:
        """Refuse a transfer before its session: its held datagrams dropped, the refusal
        answered (within the amplification limit); its later datagrams are dropped."""
        entry.refused = why
        self._drop_held(entry, "over_capacity" if why == "over_capacity" else "replayed")
        tid = entry.transfer_id
        if why == "over_capacity":
            addr = entry.peer
            self.last_refusal = (
                f"transfer {tid:016x} from {addr[0]}:{addr[1]} refused: "
                f"{self.max_transfers} transfers are receiving (the limit)"
            )
            log.warning("%s", self.last_refusal)
        self._reply(entry, self._refusal(tid, why))

    def _refusal(self, tid: int, why: str) -> bytes | None:
        """The sealed refusal of ``tid`` for ``why`` (the same bytes each time, made once
        per transfer and reason); None while no peer is known to seal it for
        (``UnknownPeer``, counted by the keys)."""
        reply = self._refusals.get((tid, why))
        if reply is None:
            try:
                reply = refusal_datagram(self.key, tid, why)
            except UnknownPeer:
                return None
            self._refusals[(tid, why)] = reply
            while len(self._refusals) > REFUSAL_CACHE:
                self._refusals.popitem(last=False)
        return reply

    def _probe(self, entry: Pending, now: float) -> None:
        """Tell the sender this receiver has no manifest of the transfer (a report with
        its packet count, nothing decoded): a sender whose receiver restarted sends a fresh
        manifest on it (kvtransport.core.sender). Sealed under a feedback epoch of the
        entry's own (random with a key; 1 without, sessions' being 0 there)."""
        if entry.framer is None:
            try:
                entry.framer = Framer(
                    entry.transfer_id, self.key, epoch=None if self.key is not None else 1
                )
            except UnknownPeer:  # its peer's binding forgotten: no probe (counted)
                return
        delay = min(int((now - entry.highest_at) * 1e6), 0xFFFFFFFF)
        fb = Feedback(entry.highest, delay, entry.seen, 0, 0, 0, 0, 0, 0, 0, 0.0, 1.0, 0, ())
        f = entry.framer
        n = encode_feedback(fb, f.payload_view(feedback_size(0)))
        datagram = f.finish(DatagramType.FEEDBACK, entry.probes, n)
        entry.probes += 1
        self._reply(entry, datagram)

    def _reply(self, entry: Pending, datagram: bytes | None) -> None:
        """A reply to a transfer without a session, to its peer, if it stays within
        ``AMPLIFICATION`` times what the peer sent (else withheld, counted); None (no
        reply could be sealed) sends nothing."""
        if datagram is None:
            return
        n = len(datagram)
        if entry.replied + n > AMPLIFICATION * entry.received:
            self.replies_withheld += 1
            return
        entry.replied += n
        self._replies.append(([datagram], entry.peer))

    def _open(
        self,
        tid: int,
        peer: Address,
        now: float,
        deadline: float | None = None,
        *,
        admit: bool = True,
    ) -> Incoming:
        session = ReceiverSession(
            tid,
            key=self.key,
            now=now,
            deadline=deadline,
            max_bytes=self.max_bytes,
            idle_timeout=self.idle_timeout,
            reserve=self._reserve,
            admit=self._admit_manifest if admit and self.replay is not None else None,
            config=self.config,
            window=self.window,
        )
        session.hold_report = self.hold_reports
        inc = Incoming(tid, session, peer, now)
        self.active[tid] = inc
        self.adopted = tid
        self._events.append(TransferStarted(inc))
        return inc

    def _admit_manifest(self, tid: int, manifest: TransportManifest) -> str | None:
        """A session's manifest checked against the replay record (kvtransport.core.replay)
        at the shell's wall clock; the refusal's reason, or None."""
        assert self.replay is not None and self.wall_clock is not None  # see __init__
        wall = self.wall_clock()
        why = self.replay.admit(tid, manifest.sent_at, wall)
        if why is not None:
            self.last_refusal = (
                f"transfer {tid:016x} refused ({why}): its manifest was sent "
                f"{manifest.sent_at - wall:+.1f} s from this host's clock (replay window "
                f"{self.replay.window_s:g} s): a replay, or the hosts' clocks are out of sync"
            )
            log.warning("%s", self.last_refusal)
        return why

    def failure_note(self, refusals: bool = True) -> str:
        """One line naming what most likely went wrong, from the counters ("" when
        nothing did): datagrams that failed authentication (``bad_tag``: another key, or
        tampered with), datagrams of another protocol version, and (``refusals``) the
        latest transfer refused (also logged as a warning when it happened)."""
        reasons = self.stats()["drop_reasons"]
        notes = []
        bad = reasons.get("bad_tag", 0)
        if bad:
            notes.append(auth_failures(bad, self.key))
        other = reasons.get("bad_version", 0)
        if other:
            notes.append(
                f"{other} datagram{'s' if other != 1 else ''} of another protocol version: "
                "do both ends run the same kvtransport release?"
            )
        if refusals and self.last_refusal:
            notes.append(self.last_refusal)
        return "; ".join(notes)

    def _live(self) -> int:
        """Sessions still receiving: one that finished but is not yet settled (its result
        goes out with the next datagrams_to_send) no longer counts against admission."""
        return sum(not inc.session.finished for inc in self.active.values())

    def _reserve(self, nbytes: int) -> bool:
        """A session's request for ``nbytes`` more output buffer (kvtransport.core.receiver):
        granted while everything held stays within ``budget_bytes``, after taking back
        the windows of idle sessions if it would not (``_reclaim``)."""
        if self.held_bytes + nbytes > self.budget_bytes:
            self._reclaim()
            if self.held_bytes + nbytes > self.budget_bytes:
                return False
        self.held_bytes += nbytes
        return True

    def _reclaim(self) -> None:
        """The budget is short: every session still receiving that was silent for
        ``RECLAIM_IDLE_S`` gives back its reservation beyond what arrived
        (kvtransport.core.receiver.ReceiverSession.reclaim)."""
        for inc in self.active.values():
            s = inc.session
            if self._now - s.last_activity >= RECLAIM_IDLE_S:
                freed = s.reclaim()
                self.held_bytes -= freed
                self.reclaimed += freed

    def _finished(self, inc: Incoming, now: float) -> None:
        inc.state = "finished"
        inc.finished = now
        del self.active[inc.transfer_id]
        self.lingering[inc.transfer_id] = inc
        res = inc.session.result
        assert res is not None  # the session has finished
        why = inc.session.refused
        if why and res.reason != "replayed":  # (a replay's line is _admit_manifest's)
            self.last_refusal = f"transfer {inc.transfer_id:016x} refused ({why}): " + (
                refusal_text(why).replace("the receiver", "this receiver")
            )
            log.warning("%s", self.last_refusal)
        if res.reason == "replayed":  # nothing to deliver; its later datagrams are dropped
            self.replays_refused += 1
            if self.single and self.adopted == inc.transfer_id:
                self.adopted = None  # the recv command waits for a genuine transfer
            self._events.append(TransferRefused(inc, now, res.reason))
            return
        self.results += 1
        self._events.append(ResultReady(inc, now))

    def _remember(self, tid: int, stats: dict[str, Any]) -> None:
        self.recent[tid] = stats
        while len(self.recent) > RECENT_IDS:
            self.recent.popitem(last=False)
