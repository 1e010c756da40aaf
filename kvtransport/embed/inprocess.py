"""Send and receive a KV cache from your own Python code, no daemon: the embeddable API.

::

    import kvtransport

    with kvtransport.Receiver(listen="127.0.0.1:0") as rx:   # bound; receives in a thread
        opts = kvtransport.SendOptions(deadline_ms=300)
        sent = kvtransport.send("ctx.card", to=rx.address, options=opts)  # a SentResult
        got = rx.result(timeout_s=10)                         # a DeliveredResult
    partial = kvtransport.partial_cache(got)                  # KVCache + presence mask

The same runs under asyncio: ``await kvtransport.send_async(...)`` and ``await rx`` (or
``await rx.result_async()``, ``await kvtransport.receive_async(...)``) never block the
event loop; the UDP loop runs in a worker thread.

What travels is exactly what ``kvtransport send`` / ``recv`` and the daemons send: the
same engines (kvtransport.daemons.daemon_sender.SenderEngine, kvtransport.daemons.daemon_receiver.
ReceiverEngine) on the same loop (kvtransport.daemons.daemon.serve). :func:`run_send` and
:func:`run_receive` are that loop for one transfer, shared with the two commands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvtransport.core.protocol import DEFAULT_INITIAL_RTT, DEFAULT_SYMBOL_SIZE
from kvtransport.core.transfer import Transfer
from kvtransport.daemons.api import DeliveredResult
from kvtransport.daemons.daemon import StopSignal, serve, warm_up
from kvtransport.daemons.udp import DatagramSocket, clock, parse_address
from kvtransport.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.core.wire import SealKey
    from kvtransport.model.cache_builder import ComputeSpeed
    from kvtransport.model.race import RaceResult

DEFAULT_LISTEN = "0.0.0.0:9400"
REFUSED_GRACE_S = 1.0
"""How long :func:`run_receive` goes on waiting after it refused a transfer (a stale or
replayed manifest) before it gives up: long enough that a genuine transfer racing a
replayed capture is still received, short against any wait for a transfer."""
_warmed: set[tuple[bool, str]] = set()
_warm_lock = threading.Lock()


# ---------------------------------------------------------------------- one transfer


def run_send(
    sock: DatagramSocket,
    transfer: Transfer,
    dest: tuple[str, int],
    *,
    rate_bps: float,
    deadline_s: float,
    stop: StopSignal,
    key: SealKey | None = None,
    policy: str = "adaptive",
    symbol_size: int = DEFAULT_SYMBOL_SIZE,
    burst_s: float | None = None,
    initial_rtt: float = DEFAULT_INITIAL_RTT,
) -> tuple[dict[str, Any], bool]:
    """Send one transfer on ``sock`` until it is done or ``stop`` is requested.

    Returns ``(status, interrupted)``: the sender's final status (as ``send --json``
    prints it, with the socket's counters) and whether ``stop`` cut it short.
    """
    from kvtransport.daemons.daemon_sender import DEFAULT_BURST_S, SenderEngine, SenderHost

    host = SenderHost(
        rate_bps=rate_bps,
        key=key,
        symbol_size=symbol_size,
        burst_s=DEFAULT_BURST_S if burst_s is None else burst_s,
    )
    engine = SenderEngine(sock, host)
    out = engine.submit(
        transfer, dest, now=clock(), deadline_s=deadline_s, policy=policy, initial_rtt=initial_rtt
    )
    try:
        # once sent, wait for the receiver's last report: the status says what it holds
        serve(
            engine,
            [],
            stop,
            on_idle=lambda now: None if not out.outcome_final(now) else stop.request(),
        )
    finally:
        interrupted = bool(host.active)
        engine.close(clock())
    status = out.status(clock())
    status["socket"] = dict(sock.stats)
    return status, interrupted


def run_receive(
    sock: DatagramSocket,
    *,
    stop: StopSignal,
    key: SealKey | None = None,
    timeout_s: float = 60.0,
    idle_timeout_s: float = 10.0,
    max_bytes: int = 1 << 30,
    replay: Any = None,
    on_engine: Callable[[Any], None] | None = None,
    keep: Callable[[Any], bool] | None = None,
) -> tuple[Any, Any]:
    """Receive the first transfer that reaches ``sock`` (datagrams of others are dropped).

    Ends at the transfer's result, when no transfer started within ``timeout_s``, or on
    ``stop`` (a transfer in progress then delivers what it holds). ``replay``: a
    :class:`~kvtransport.core.replay.ReplayRecord` (a replayed transfer is refused and the wait
    goes on). ``on_engine``: called with the engine before it serves (a live reader of its
    host's sessions, kvtransport.embed.live_race). ``keep``: writes the finished transfer's
    result before its sender is told (its final report waits), returning whether it was
    written where asked (False: the report names ``result_unsaved``). Returns
    ``(incoming, engine)``: the :class:`~kvtransport.daemons.daemon_receiver.Incoming` (None when
    no transfer arrived) and the engine, whose counters say what was dropped.

    A refused transfer (``host.last_refusal``) ends the wait ``REFUSED_GRACE_S`` later
    unless a transfer was adopted by then: ``stop.signal_name`` is then "refused".
    """
    import time

    from kvtransport.daemons.daemon_receiver import ReceiverEngine, ReceiverHost

    results: list[Any] = []
    host = ReceiverHost(
        key=key,
        max_transfers=1,
        max_bytes=max_bytes,
        idle_timeout=idle_timeout_s,
        single=True,
        replay=replay,
        wall_clock=time.time,
        hold_reports=keep is not None,
    )

    def on_result(inc: Any) -> bool | None:
        results.append(inc)
        return keep(inc) if keep is not None else None

    engine = ReceiverEngine(sock, host, on_result=on_result)
    if on_engine is not None:
        on_engine(engine)
    started = clock()
    refused_at: list[float] = []  # when the first refusal was seen

    def check(now: float) -> None:
        if results:
            stop.request("done")
        elif host.adopted is None:
            if host.last_refusal and not refused_at:
                refused_at.append(now)
            if refused_at and now - refused_at[0] >= REFUSED_GRACE_S:
                stop.request("refused")
            elif now - started > timeout_s:
                stop.request("timeout")

    try:
        serve(engine, [], stop, on_idle=check)
    finally:
        if not results:
            engine.close(clock())  # cut short mid-transfer: deliver what arrived
    return (results[0] if results else None), engine


def delivered(incoming: Any, engine: Any) -> DeliveredResult:
    """An engine's finished transfer as the result a subscriber would get."""
    stats = incoming.stats(clock())
    stats["engine_drops"] = dict(engine.host.drop_reasons)
    stats["socket"] = dict(engine.sock.stats)
    stats["note"] = engine.host.failure_note()  # e.g. datagrams of another key, refusals
    return DeliveredResult.from_result(incoming.session.result, stats)


# ---------------------------------------------------------------------- inputs


def handoff_plan(
    deadline_ms: float | None,
    precision: str | tuple[str, ...],
    rate_mbps: float,
    *,
    loss_estimate: float = 0.05,
    initial_rtt_ms: float = DEFAULT_INITIAL_RTT * 1e3,
    symbol_size: int = DEFAULT_SYMBOL_SIZE,
    receiver_speed: ComputeSpeed | None = None,
    question_tokens: int | None = None,
) -> tuple | None:
    """What :func:`as_transfer` plans a cache with (its ``plan``) for :func:`send`'s
    options (and a sender daemon submit's, kvtransport.embed.client): None without a
    deadline or with ``precision`` "keep"; UserError for bad levels, loss estimate or
    question length."""
    if deadline_ms is None or precision == "keep":
        return None
    from kvtransport.model.plan import LinkEstimate, parse_levels

    try:
        levels = parse_levels(precision)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not 0 <= loss_estimate < 0.9:
        raise UserError(f"loss_estimate must be in [0, 0.9), not {loss_estimate}")
    if question_tokens is not None and not 0 < question_tokens <= 100_000:
        raise UserError(f"question_tokens must be a positive count, not {question_tokens}")
    if question_tokens is not None and receiver_speed is None:
        raise UserError("question_tokens needs receiver_speed (the receiver's compute speed)")
    link = LinkEstimate(float(rate_mbps) * 1e6, loss_estimate, initial_rtt_ms * 5e-4,
                        symbol_size)  # fmt: skip
    return (link, float(deadline_ms) * 1e-3, levels, receiver_speed, question_tokens)


def as_transfer(what: Any, plan: Any = None) -> Transfer:
    """A :class:`Transfer` from a transfer, a cache card (path or CacheCard), a block
    stream (kvtransport.kvformat.blocks.EncodedStream) or a KVCache (encoded with the card
    defaults: utility order, utilities from its attention statistics or the prior).

    plan: None, or ``(link, budget_s, levels[, speed[, question_tokens]])`` to send a
    cache, card or stream as the handoff plan encodes it for that budget
    (kvtransport.model.plan.planned_stream; ``speed``: the receiver's compute speed, None: it
    computes nothing; ``question_tokens``: the length of the question the receiver runs
    while the stream's last ranges arrive layer by layer, None: no such tail); a
    :class:`Transfer` is opaque bytes and is sent as it is.
    """
    from kvtransport.kvformat import blocks, card
    from kvtransport.kvformat.kvcache import KVCache
    from kvtransport.model import encoding

    if isinstance(what, Transfer):
        return what
    if isinstance(what, str | os.PathLike):
        what = card.read_card(what)
    if isinstance(what, card.CacheCard):
        m = what.manifest
        what = blocks.EncodedStream(m, m.to_bytes(), what.payload)
    elif isinstance(what, KVCache):
        what = encoding.encode_cache(what)
    if not isinstance(what, blocks.EncodedStream):
        raise UserError(
            f"cannot send a {type(what).__name__}: give a cache card (path), a KVCache, "
            "a kvtransport.kvformat.blocks.EncodedStream or a kvtransport.core.transfer.Transfer"
        )
    if plan is not None:
        from kvtransport.model.plan import planned_stream

        link, budget_s, levels, *racer = plan
        speed = racer[0] if racer else None
        question = racer[1] if len(racer) > 1 else None
        answer_s = 0.0
        if speed is not None and question:  # it runs the question while the tail arrives
            answer_s = speed.answer_seconds(question, what.manifest.geometry.num_tokens)
        try:
            # a racing receiver answers soonest with the split that finishes first (the
            # deadline a cap); without one, the plan spends the deadline on precision
            objective = "ttft" if speed is not None else "fidelity"
            _, what = planned_stream(what, link=link, budget_s=budget_s, levels=levels,
                                     speed=speed, answer_s=answer_s,
                                     objective=objective)  # fmt: skip
        except ValueError as exc:
            raise UserError(f"cannot plan this cache: {exc}") from None
    return what.to_transfer()


def _address(to: str | tuple[str, int], what: str) -> tuple[str, int]:
    if isinstance(to, tuple):
        return parse_address(f"{to[0]}:{to[1]}", what=what)
    return parse_address(str(to), what=what)


def api_key(key: bytes | str | None, insecure: bool = False) -> bytes | None:
    """Secure by default, as the commands: raw bytes as they are; text is a key file or
    hex digits (as ``--key``); None is the default key file (made on first use), or no key
    at all only with ``insecure`` (kvtransport.core.keys.resolve_key)."""
    from kvtransport.core.keys import check_key, resolve_key

    if isinstance(key, bytes | bytearray):
        if insecure:
            raise UserError("insecure runs without a key; drop key= or insecure=")
        return check_key(bytes(key), "key")
    return resolve_key(None, key, insecure)


def warm_kernels(key: SealKey | None, policy: str) -> None:
    """Load (or compile) the numba kernels once per process and policy before the first
    transfer (kvtransport.daemons.daemon.warm_up): a stall inside a transfer would count as RTT."""
    with _warm_lock:
        if (key is not None, policy) not in _warmed:
            warm_up(key, ("fixed:1/4", policy))
            _warmed.add((key is not None, policy))


# ---------------------------------------------------------------------- sending


@dataclass(frozen=True)
class SendOptions:
    """How :func:`send` sends (everything but the payload and the destination).

    ``deadline_ms``: the deadline from the call, or None: ``rho`` times the loss-free send
    time at ``rate_mbps`` (default rho 1). ``key``: the pre-shared key (bytes, a key file or
    hex digits; None: the default key file, as the commands use; ``insecure=True`` sends
    in the clear); both ends must agree. ``rate_mbps``: the pacing rate. ``policy``: the
    repair policy (None: kvtransport.daemons.daemon_sender.transfer_policy, the shipped
    DDQN but for a stream of whole token ranges over a link whose ``initial_rtt_ms`` is
    long). ``bind``: the local HOST:PORT. ``symbol_size``, ``initial_rtt_ms``: the
    protocol's symbol size and the RTT assumed before the first sample. ``gso``: UDP
    generic segmentation offload (False: one send() per datagram). With ``deadline_ms`` a
    cache, card or stream is sent as the handoff plan encodes it for that deadline
    (kvtransport.model.plan: ``precision`` "auto" = fp16, int8 or int4 per block by
    utility, int4 only down to the plan's fidelity floor, for ``rate_mbps`` and
    ``loss_estimate``, token ranges front first; "keep" sends it as it is; e.g. "fp32"
    only when asked). ``receiver_speed``: the receiver's
    :class:`~kvtransport.model.cache_builder.ComputeSpeed` when it races
    (:meth:`Receiver.race`): the plan leaves it the context's front to compute while the
    rest streams in, and does not send that front, splitting where the whole cache is in
    place soonest (kvtransport.model.plan's ``ttft`` objective; the deadline is then a
    cap); None sends every token range. ``question_tokens`` (with ``receiver_speed``): the
    receiver races with its question (``Receiver.race(question_ids=...)``) of about this
    many tokens: the plan sends the context's last ranges layer by layer, so that the
    receiver runs the question through its model while they arrive. Bad values are a
    :class:`~kvtransport.errors.UserError` when :func:`send` uses them.
    """

    deadline_ms: float | None = None
    rho: float | None = None
    key: bytes | str | None = field(default=None, repr=False)
    insecure: bool = False
    rate_mbps: float = 100.0
    policy: str | None = None
    bind: str = "0.0.0.0:0"
    symbol_size: int = DEFAULT_SYMBOL_SIZE
    initial_rtt_ms: float = DEFAULT_INITIAL_RTT * 1e3
    gso: bool = True
    precision: str | tuple[str, ...] = "auto"
    loss_estimate: float = 0.05
    receiver_speed: ComputeSpeed | None = None
    question_tokens: int | None = None


NOT_SENT = "no time to send"
"""``finish_reason`` of a transfer :func:`send` did not start: its deadline left no time."""


@dataclass(frozen=True)
class SentResult:
    """What :func:`send` did, as the sender last knew it (the sending side's counterpart of
    :class:`~kvtransport.daemons.api.DeliveredResult`).

    ``delivered``: "complete", "partial" or "nothing" as the receiver last reported;
    ``note``: one line naming why when it is not complete (no feedback at all, the
    receiver's refusal, no time to send: kvtransport.hosts.sender_host.Outgoing.outcome),
    else empty. ``transfer_id``: the id the receiver's result carries, None when nothing
    was sent (``finish_reason`` :data:`NOT_SENT`, with the sender's one line in
    ``reason``). ``decoded_through`` of ``n_source`` symbols
    (``delivered_bytes`` of ``bytes``) are in order at the receiver as it last reported.
    ``stats``: the sender's other counters and estimates (RTT, drops, the socket's, ...).
    :meth:`to_dict` is the status as ``kvtransport send --json`` prints it.
    """

    transfer_id: int | None
    state: str
    finish_reason: str | None
    delivered: str
    note: str
    to: str
    policy: str
    bytes: int
    n_source: int | None
    decoded_through: int
    delivered_bytes: int
    source_sent: int
    repair_sent: int
    datagrams_sent: int
    loss_estimate: float | None
    loss_measured: float | None
    deadline_s: float
    elapsed_s: float | None
    reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        """The receiver reported every block of the transfer in place."""
        return self.delivered == "complete"

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> SentResult:
        """A sender status (kvtransport.hosts.sender_host.Outgoing.status, plus the socket's
        counters; or :func:`not_sent`'s) as a result: its named keys become the fields,
        the rest ``stats``."""
        rest = dict(status)
        tid = rest.pop("transfer_id", None)
        named = {f: rest.pop(f, None) for f in _RESULT_FIELDS}
        return cls(transfer_id=None if tid is None else int(tid, 16), **named, stats=rest)

    def to_dict(self) -> dict[str, Any]:
        """The status as JSON would hold it (``transfer_id`` in hex, as the CLI prints it)."""
        tid = None if self.transfer_id is None else f"{self.transfer_id:016x}"
        named = {f: getattr(self, f) for f in _RESULT_FIELDS}
        return {"transfer_id": tid, **named, **self.stats}


_RESULT_FIELDS = tuple(f.name for f in fields(SentResult) if f.name not in ("transfer_id", "stats"))


def send(
    cache_or_card: Any, to: str | tuple[str, int], *, options: SendOptions | None = None
) -> SentResult:
    """Send a KV cache to a receiver (``kvtransport.Receiver``, ``kvtransport recv`` or a
    receiver daemon) at ``to`` and return when the transfer is over.

    cache_or_card: see :func:`as_transfer`; ``options``: how (:class:`SendOptions`; None:
    the defaults). Returns the :class:`SentResult`. Blocks the calling thread for at most
    the deadline plus a round trip; see :func:`send_async`.

    A deadline that leaves no time to send (by ``initial_rtt_ms`` a datagram sent now
    would arrive after it) is not an error: nothing is sent and the result says so
    (``state`` "not sent", ``finish_reason`` :data:`NOT_SENT`, ``reason`` the sender's
    one line, nothing delivered); a racing receiver then computes the whole cache itself.
    """
    from kvtransport.daemons.daemon_sender import deadline_from, transfer_policy
    from kvtransport.hosts.sender_host import NoTimeToSend
    from kvtransport.policies.registry import make_policy

    o = SendOptions() if options is None else options
    if not isinstance(o, SendOptions):
        raise UserError(f"options must be a kvtransport.SendOptions, not {type(o).__name__}")
    raw_key = api_key(o.key, o.insecure)
    dest = _address(to, "receiver")
    local = parse_address(o.bind, what="bind")
    plan = handoff_plan(o.deadline_ms, o.precision, o.rate_mbps, loss_estimate=o.loss_estimate,
                        initial_rtt_ms=o.initial_rtt_ms, symbol_size=o.symbol_size,
                        receiver_speed=o.receiver_speed,
                        question_tokens=o.question_tokens)  # fmt: skip
    transfer = as_transfer(cache_or_card, plan)
    rate = float(o.rate_mbps) * 1e6
    if not rate > 0:
        raise UserError("rate_mbps must be a positive number")
    rho = 1.0 if o.deadline_ms is None and o.rho is None else o.rho
    spec = {"deadline_ms": o.deadline_ms, "rho": rho}
    deadline_s = deadline_from(spec, transfer.nbytes, rate, o.symbol_size, raw_key is not None)
    policy = o.policy or transfer_policy(transfer, o.initial_rtt_ms * 1e-3, rate, deadline_s)
    make_policy(policy)
    warm_kernels(raw_key, policy)
    stop = StopSignal()  # not installed: signals stay the application's
    sock = DatagramSocket(local, dest, gso=o.gso)
    try:
        status, _ = run_send(
            sock,
            transfer,
            dest,
            rate_bps=rate,
            deadline_s=deadline_s,
            stop=stop,
            key=raw_key,
            policy=policy,
            symbol_size=o.symbol_size,
            initial_rtt=o.initial_rtt_ms * 1e-3,
        )
    except NoTimeToSend as exc:  # the main job degrades: the receiver computes it all
        status = not_sent(transfer, dest, policy, deadline_s, str(exc))
    finally:
        sock.close()
        stop.close()
    return SentResult.from_status(status)


def not_sent(
    transfer: Transfer, dest: tuple[str, int], policy: str, deadline_s: float, reason: str
) -> dict[str, Any]:
    """The status of a transfer that was not sent (the keys a finished transfer's status
    has that say what crossed, all nothing)."""
    return {
        "transfer_id": None,
        "state": "not sent",
        "finish_reason": NOT_SENT,
        "delivered": "nothing",
        "note": reason,
        "reason": reason,
        "to": f"{dest[0]}:{dest[1]}",
        "policy": policy,
        "bytes": transfer.nbytes,
        "source_sent": 0,
        "repair_sent": 0,
        "datagrams_sent": 0,
        "decoded_through": 0,
        "delivered_bytes": 0,
        "deadline_s": round(deadline_s, 6),
    }


async def send_async(
    cache_or_card: Any, to: str | tuple[str, int], *, options: SendOptions | None = None
) -> SentResult:
    """:func:`send` in a worker thread: awaiting it never blocks the event loop."""
    return await asyncio.to_thread(send, cache_or_card, to, options=options)


# ---------------------------------------------------------------------- receiving


class Receiver:
    """Receive one transfer in a background thread; the UDP port is bound on creation.

    ``listen``: HOST:PORT (port 0: any; :attr:`address` says which). Get the result with
    :meth:`result` (blocking), ``await receiver`` or :meth:`result_async`. Closing (or
    leaving the ``with`` block) stops the loop; a transfer still in progress then delivers
    what it holds. One Receiver serves one transfer, as ``kvtransport recv`` does; run the
    receiver daemon for many. A replayed transfer is refused (kvtransport.core.replay): the
    record is ``replay_file``, else the port's default file (in memory for port 0).
    """

    def __init__(
        self,
        listen: str = DEFAULT_LISTEN,
        *,
        key: bytes | str | None = None,
        insecure: bool = False,
        timeout_s: float = 60.0,
        idle_timeout_s: float = 10.0,
        max_mb: float = 1024.0,
        gro: bool = True,
        replay_file: str | None = None,
    ) -> None:
        from kvtransport.core.replay import open_record

        if not (timeout_s > 0 and idle_timeout_s > 0 and max_mb > 0):
            raise UserError("timeout_s, idle_timeout_s and max_mb must be positive")
        raw_key = api_key(key, insecure)
        bind = parse_address(listen, what="listen")
        replay = open_record(replay_file, bind[1])
        warm_kernels(raw_key, "fixed:1/4")
        self.sock = DatagramSocket(bind, gro=gro)
        self._stop = StopSignal()
        self._future: concurrent.futures.Future[DeliveredResult] = concurrent.futures.Future()
        self._timeout_s = timeout_s
        self._engine: Any = None  # the receiving engine, once the thread runs it
        self._thread = threading.Thread(
            target=self._run,
            kwargs=dict(
                key=raw_key,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                max_bytes=int(max_mb * 1e6),
                replay=replay,
                on_engine=self._set_engine,
            ),  # fmt: skip
            name="kvtransport-receiver",
            daemon=True,
        )
        self._thread.start()

    @property
    def address(self) -> str:
        """``HOST:PORT`` the receiver listens on (what a sender's ``to`` names)."""
        host, port = self.sock.address
        return f"{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    def _set_engine(self, engine: Any) -> None:
        self._engine = engine

    def race(self, model: Any, token_ids: Sequence[int], **kwargs: Any) -> RaceResult:
        """Build the context's whole KV cache while this receiver receives it, and return
        it (a :class:`~kvtransport.model.race.RaceResult`) as soon as the last token is in place:
        the receiver computes what has not arrived (the sender's plan leaves it the context's
        front), loads token ranges as their blocks complete, recomputes exactly what never
        comes; with nothing arriving it computes everything (about one prefill). Call it when
        the handoff is announced: the race clock starts then. ``token_ids``: the context the
        cache is of (a transfer of another context or model is not loaded). Options
        (kvtransport.embed.live_race.live_race): ``speed`` (the model's
        :class:`~kvtransport.model.cache_builder.ComputeSpeed`; None measures it once per model),
        ``rate_mbps`` (the link rate the sender was given), ``split`` (tokens to compute
        first, before the link is looked at: the plan's ``first_call`` when the receiver
        knows it; without it the receiver computes the front the transfer does not carry
        in one call once its manifest is in), ``block_tokens``, ``hello_ms``,
        ``max_chunk``, ``question_ids`` (the race ends with the question's first answer
        token, run through the model while the stream's layer-by-layer tail arrives: its
        ``first_token`` and ``answer_s``). The transfer goes on
        receiving; :meth:`result` still gives it."""
        from kvtransport.embed.live_race import adopted_session, live_race

        return live_race(lambda: adopted_session(self._engine), model, token_ids, **kwargs)

    def _run(self, **kwargs: Any) -> None:
        try:
            inc, engine = run_receive(self.sock, stop=self._stop, **kwargs)
            if inc is None:
                why = self._stop.signal_name
                note = engine.host.failure_note()
                raise UserError(
                    (
                        f"no transfer arrived on {self.address} within {self._timeout_s:g} s"
                        if why == "timeout"
                        else f"receiver closed ({why}) before any transfer arrived"
                    )
                    + (f"; {note}" if note else "")
                )
            self._future.set_result(delivered(inc, engine))
        except BaseException as exc:  # handed to whoever waits for the result
            self._future.set_exception(exc)

    def result(self, timeout_s: float | None = None) -> DeliveredResult:
        """The transfer's result (blocks until its deadline, completion or abort)."""
        try:
            return self._future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise UserError(f"no result within {timeout_s:g} s") from None

    async def result_async(self) -> DeliveredResult:
        """:meth:`result` for asyncio."""
        return await asyncio.wrap_future(self._future)

    def __await__(self) -> Generator[Any, None, DeliveredResult]:
        return self.result_async().__await__()

    def close(self) -> None:
        """Stop the loop (a transfer in progress delivers what it holds) and unbind."""
        self._stop.request("closed")
        self._thread.join()
        self.sock.close()
        self._stop.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def receive(listen: str = DEFAULT_LISTEN, **kwargs: Any) -> DeliveredResult:
    """Wait for one transfer on ``listen`` and return its result (see :class:`Receiver`
    for the options). Bind and send in that order: start it before the sender."""
    with Receiver(listen, **kwargs) as rx:
        return rx.result()


def race_receive(
    model: Any, token_ids: Sequence[int], listen: str = DEFAULT_LISTEN, **kwargs: Any
) -> RaceResult:
    """Bind ``listen``, race the first transfer that arrives (:meth:`Receiver.race`) and
    return the whole cache as soon as it is built; the receiver then closes (a transfer
    still in flight is cut off). ``kwargs``: :class:`Receiver`'s options (``key``,
    ``insecure``, ...) and :meth:`Receiver.race`'s (``speed``, ``rate_mbps``, ...)."""
    import inspect

    own = set(inspect.signature(Receiver.__init__).parameters) - {"self", "listen"}
    with Receiver(listen, **{k: v for k, v in kwargs.items() if k in own}) as rx:
        return rx.race(model, token_ids, **{k: v for k, v in kwargs.items() if k not in own})


async def receive_async(listen: str = DEFAULT_LISTEN, **kwargs: Any) -> DeliveredResult:
    """:func:`receive` for asyncio (the port is bound when this coroutine starts)."""
    rx = await asyncio.to_thread(Receiver, listen, **kwargs)
    try:
        return await rx
    finally:
        await asyncio.to_thread(rx.close)
