"""The receiver's race, live: build the context's cache while its KV streams in.

::

    import kvtransport
    from kvtransport.model import hf
    from kvtransport.model.cache_builder import ComputeSpeed

    speed = ComputeSpeed.measure(model, some_context_ids)   # once, at start-up
    with kvtransport.Receiver(listen="0.0.0.0:9400") as rx:  # bound; receives in a thread
        res = rx.race(model, context_ids, speed=speed)       # when the handoff is announced
    res.kv                                                   # the whole cache (a KVCache)
    hf.greedy_generate(model, res.model_cache, question_ids) # answered from the cache built

:meth:`kvtransport.embed.inprocess.Receiver.race` (or
:func:`kvtransport.embed.inprocess.race_receive`, which binds, races and closes; or
:func:`race_daemon`, which races a transfer that a receiver daemon on the same host is
receiving, kvtransport.daemons.race_share) runs the decision loop of kvtransport.model.race
(:func:`kvtransport.model.race.race`, the same one the demo's replay runs) on the wall clock
against :class:`LiveArrivals`: what the receiving session (in process, or a receiver
daemon's mirror of it) holds right now. The race computes what has not arrived, loads token
ranges whose blocks are complete in every layer, waits when a range is due sooner than
computing it would take, and returns as soon as the last token is in place: the whole
cache, exact where computed, up to the precision the sender chose where loaded.

What the receiver knows of the sender's plan comes from the transfer itself: the blocks
manifest (first on the wire) says which token ranges are sent and how many bytes each one
takes; ranges not sent (the plan's prefix for the receiver) are computed; the transport
manifest's deadline says when the sender stops. The expected arrivals are the bytes owed
at ``rate_mbps`` when given (what the sender was told), otherwise spread evenly up to the
deadline; once ranges arrive, the delivery rate seen takes over (kvtransport.model.race.LinkView).
Before the manifest the receiver expects a first arrival within ``hello_ms``: it computes
what it can by then, and once the link is silent well past it (three times ``hello_ms``)
it stops waiting and computes from the front in chunks that double (``max_chunk`` tokens
first): a dead link costs about one prefill after that short wait, plus a few calls, and a
transfer that starts late still loads what the race has not computed yet. Once the
transfer's first datagram is in, its manifest is due at once: the race waits for it (for
at most ``hello_ms``, then it is silent as above) instead of computing ahead. A transfer of
another context, model or token range size is not loaded: the race computes everything.

A token range's blocks are checked (CRC-32) and decoded into one preallocated cache
(kvtransport.kvformat.blocks.RangeDecoder), each block once, by a decoding thread as soon as
the range is complete, so that while the model computes on one core the ranges arriving
are decoded on the other and loading them is a copy (the race decodes what the thread has
not reached yet itself). The receiving
thread writes blocks while the race reads complete ones; a complete block's bytes never
change afterwards (kvtransport.core.receiver.ReceiverSession.payload_buffer).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtransport.core.wire import full_send_time
from kvtransport.daemons.udp import clock
from kvtransport.kvformat import blocks
from kvtransport.model.cache_builder import ComputeSpeed
from kvtransport.model.race import (
    DEFAULT_HOLE_WAIT_S,
    DEFAULT_MAX_CHUNK,
    LinkView,
    RaceResult,
    layer_ready_at,
    layered_tail,
    race,
    range_ready_at,
    stream_rank,
)

log = logging.getLogger("kvtransport.race")

DEFAULT_HELLO_S = 0.05
"""When the receiver expects the first range before it knows anything of the plan."""
DEFAULT_WAIT_S = 10.0
"""How long :func:`race_daemon` waits for a transfer of its context to appear."""
WAIT_POLL_S = 0.001
LOOK_POLL_S = 0.01
_speeds: weakref.WeakKeyDictionary[Any, ComputeSpeed] = weakref.WeakKeyDictionary()


def adopted_session(engine: Any) -> Any:
    """The session of the first transfer an in-process receiving engine
    (kvtransport.daemons.daemon_receiver.ReceiverEngine; None before it runs) adopted, or
    None: the session source of :meth:`kvtransport.embed.inprocess.Receiver.race`."""
    tid = engine.host.adopted if engine is not None else None
    inc = engine.host.get(tid) if tid is not None else None
    return inc.session if inc is not None else None


class LiveArrivals:
    """A transfer being received, as the race sees it (kvtransport.model.race.Arrivals).

    session: returns the transfer's receiver session (kvtransport.core.receiver.ReceiverSession,
    or a daemon's mirror of it, kvtransport.daemons.race_share.SharedTransfer) once there is
    one, else None. The race clock counts from this object's creation. Times and views are
    read from the session; nothing here writes to it. Contract of the views: ``ready_at``
    reports a range when every one of its blocks (all layers) is complete and not known
    to be corrupt; ``received`` decodes a range's blocks once, into one cache of the whole
    context.
    """

    def __init__(
        self,
        session: Callable[[], Any],
        token_ids: Sequence[int],
        *,
        block_tokens: int = blocks.DEFAULT_BLOCK_TOKENS,
        model_id: str | None = None,
        rate_bps: float | None = None,
        hello_s: float = DEFAULT_HELLO_S,
        hole_wait_s: float = DEFAULT_HOLE_WAIT_S,
    ) -> None:
        self._t0 = clock()
        self._source = session
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.block_tokens = block_tokens
        self.ranges = -(-len(self.token_ids) // block_tokens)
        self.model_id = model_id
        self.rate_bps = rate_bps
        self.hole_wait_s = hole_wait_s
        self.refused = ""  # why the transfer is not loaded ("" while it may be)
        self._session: Any = None
        self._manifest: blocks.Manifest | None = None
        self._decoder: blocks.RangeDecoder | None = None
        self._never = np.full(self.ranges, np.inf)
        self._hello_s = hello_s
        self._hello = LinkView(np.full(self.ranges, hello_s), np.ones(self.ranges), np.inf,
                               hole_wait_s, settled=False)  # fmt: skip
        self._dead = LinkView(np.full(self.ranges, np.inf), np.zeros(self.ranges), -np.inf,
                              hole_wait_s)  # fmt: skip
        self._view: LinkView | None = None
        self._announced: LinkView | None = None  # the transfer's first datagram is in
        self._decoding = threading.Lock()  # the decoder: the race's loads and the thread's
        self._stop = threading.Event()
        self._decoder_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ Arrivals

    def now(self) -> float:
        return clock() - self._t0

    def ready_at(self) -> np.ndarray:
        arrival = self._arrival()
        return self._never if arrival is None else range_ready_at(self._manifest, arrival)

    def block_ready_at(self) -> np.ndarray:
        arrival = self._arrival()
        if arrival is None:
            return self._never[None, :]
        return layer_ready_at(self._manifest, arrival)

    def _arrival(self) -> np.ndarray | None:
        """Per block, when it was complete on the race clock (inf: not yet, or it failed
        its check); None before the manifest is known and accepted."""
        s = self._poll()
        if s is None:
            return None
        assert self._manifest is not None and self._decoder is not None  # _poll found it
        arrival = s.complete_at - self._t0  # inf while a block is not complete
        arrival[self._decoder.failed] = np.inf
        return arrival

    def link(self) -> LinkView:
        self._poll()
        if self.refused:
            return self._dead
        if self._view is not None:
            return self._view
        return self._announced if self._announced is not None else self._hello

    def received(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        d, s = self._decoder, self._session
        assert d is not None and s is not None  # ready_at reported these ranges
        with self._decoding:
            got = d.take(s.payload_buffer, lo, hi)
        if got is None:
            log.warning(
                "%d received blocks failed (CRC-32 or decoding): recomputed", d.failed.sum()
            )
        return got

    def received_layer(self, layer: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        d, s = self._decoder, self._session
        assert d is not None and s is not None  # block_ready_at reported these blocks
        with self._decoding:
            got = d.take_layer(s.payload_buffer, layer, lo, hi)
        if got is None:
            log.warning(
                "%d received blocks failed (CRC-32 or decoding): recomputed", d.failed.sum()
            )
        return got

    def run(self, fn: Callable[[], None]) -> tuple[float, float]:
        t0 = self.now()
        fn()
        return t0, self.now()

    def wait(self, r: int, until: float, layer: int | None = None) -> None:
        known = self._manifest is not None
        while (now := self.now()) < until:
            ready = self.ready_at() if layer is None else self.block_ready_at()[layer]
            if ready[r] <= now or (self._manifest is not None) != known:
                return  # the range came, or the plan became known: look again
            time.sleep(min(WAIT_POLL_S, until - now))

    # ------------------------------------------------------------------ the transfer

    def _poll(self) -> Any:
        """The session once its blocks manifest is known and accepted (else None)."""
        if self._manifest is not None or self.refused:
            return self._session if not self.refused else None
        if self._session is None:
            self._session = self._source()
            if self._session is None:
                return None
            # its manifest is first on the wire: due now, so the race waits for it (silent
            # after hello_s) rather than computing what the hello guess allows
            now = self.now()
            self._announced = LinkView(np.full(self.ranges, now), np.ones(self.ranges), np.inf,
                                       self._hello_s, start_s=now, settled=False)  # fmt: skip
        s = self._session
        tm = s.manifest
        nb = (len(tm.blocks),) if tm is not None else None
        if nb is None or s.complete.shape != nb or s.complete_at.shape != nb:
            return None  # not yet (or being set up by the receiving thread)
        try:
            m = blocks.Manifest.from_bytes(tm.app_metadata)
        except blocks.ManifestError as exc:
            return self._refuse(f"not a KV cache transfer ({exc})")
        why = self._mismatch(m)
        if why:
            return self._refuse(why)
        self._accept(m, tm, s)
        return s

    def _mismatch(self, m: blocks.Manifest) -> str:
        g = m.geometry
        n = len(self.token_ids)
        if g.num_tokens != n or g.block_tokens != self.block_tokens:
            return (f"the transfer holds {g.num_tokens} tokens in ranges of {g.block_tokens}, "
                    f"the race builds {n} in ranges of {self.block_tokens}")  # fmt: skip
        if not blocks.is_cache_of(m, self.token_ids):
            return "the transfer is the cache of other token ids"
        if self.model_id is not None and m.model_id != self.model_id:
            return f"the transfer is a cache of {m.model_id}, not of {self.model_id}"
        return ""

    def _refuse(self, why: str) -> None:
        self.refused = why
        log.warning("race: the transfer is not loaded, everything is computed: %s", why)

    def _accept(self, m: blocks.Manifest, tm: Any, s: Any) -> None:
        """The plan as the transfer shows it: which ranges come, their bytes, when."""
        g = m.geometry
        self._decoder = blocks.RangeDecoder(m)
        range_bytes = np.bincount(m.token_block.astype(np.int64), weights=m.length,
                                  minlength=self.ranges)  # fmt: skip
        sent = np.zeros(self.ranges, dtype=bool)
        sent[m.token_block.astype(np.int64)] = True
        sent &= np.array([np.unique(m.layer[b]).size == g.num_layers
                          for b in self._decoder.range_blocks])  # fmt: skip
        start = s.timings.get("first_packet", s.created) - self._t0
        deadline = start + tm.deadline_s if tm.deadline_s > 0 else np.inf
        rank = stream_rank(m)  # a range is in with its last block in the stream's order
        cum = np.cumsum(m.length.astype(np.float64))[np.maximum(rank, 0)]
        if self.rate_bps is not None:  # loss-free at the rate, as the plan's link time
            sz, rate = tm.symbol_size, self.rate_bps
            expect = start + np.array([full_send_time(int(c), rate, sz, True) for c in cum])
        elif np.isfinite(deadline) and range_bytes.sum() > 0:
            expect = start + (deadline - start) * cum / range_bytes.sum()
        else:
            expect = np.full(self.ranges, start + self._hello.expect_at[0])
        expect = np.where(sent, expect, np.inf)
        self._view = LinkView(expect, np.where(sent, range_bytes, 0), float(deadline),
                              self.hole_wait_s, start, rank=rank,
                              layered_from=layered_tail(m))  # fmt: skip
        self._manifest = m
        self._decoder_thread = threading.Thread(
            target=self._decode_as_they_come, args=(s,), name="race-decode", daemon=True
        )
        self._decoder_thread.start()

    def _decode_as_they_come(self, s: Any) -> None:
        """The decoding thread (on the receiver's other core: the dequantizing kernel
        releases the GIL): each token range checked and decoded as soon as it is complete,
        so that the race's load of it is a copy. Runs until :meth:`close`."""
        d, m = self._decoder, self._manifest
        assert d is not None and m is not None  # started by _accept
        done = np.zeros(self.ranges, dtype=bool)
        while not self._stop.wait(WAIT_POLL_S):
            for r in np.flatnonzero(np.isfinite(range_ready_at(m, s.complete_at)) & ~done):
                if self._stop.is_set():
                    return
                with self._decoding:  # a range that fails its check is never ready
                    d.take_range(s.payload_buffer, int(r))
                done[r] = True

    def close(self) -> None:
        """Stop the decoding thread (the race is over)."""
        self._stop.set()
        if self._decoder_thread is not None:
            self._decoder_thread.join()


def live_race(
    session: Callable[[], Any],
    model: Any,
    token_ids: Sequence[int],
    *,
    split: int | None = None,
    speed: ComputeSpeed | None = None,
    rate_mbps: float | None = None,
    block_tokens: int = blocks.DEFAULT_BLOCK_TOKENS,
    hello_ms: float = DEFAULT_HELLO_S * 1e3,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    question_ids: Sequence[int] | None = None,
) -> RaceResult:
    """Race the transfer whose receiver session ``session`` returns once there is one
    (:class:`LiveArrivals`; see the module docstring); the race clock starts now. What
    :meth:`kvtransport.embed.inprocess.Receiver.race` and :func:`race_daemon` run.
    question_ids: the race ends with its first answer token, run through the model while
    the stream's layer-major tail arrives where the sender planned one
    (kvtransport.model.race.race)."""
    from kvtransport.errors import UserError
    from kvtransport.model.loader import model_id_of
    from kvtransport.model.model_cache import check_model

    ids = [int(t) for t in token_ids]
    if not ids:
        raise UserError("the race needs the context's token ids (none given)")
    if question_ids is not None and len(question_ids) == 0:
        raise UserError("question_ids is empty: give the question's token ids, or None")
    if block_tokens < 1 or not hello_ms > 0 or max_chunk < 1:
        raise UserError("block_tokens, hello_ms and max_chunk must be positive")
    if rate_mbps is not None and not rate_mbps > 0:
        raise UserError("rate_mbps must be a positive number")
    if split is not None and not (
        0 <= split <= len(ids) and (split % block_tokens == 0 or split == len(ids))
    ):
        raise UserError(f"split must be a multiple of {block_tokens} in 0..{len(ids)}, "
                        f"not {split}")  # fmt: skip
    check_model(model)  # refused before anything is measured or received
    if speed is None:
        speed = _speed_of(model, ids)
    src = LiveArrivals(session, ids, block_tokens=block_tokens, model_id=model_id_of(model),
                       rate_bps=None if rate_mbps is None else rate_mbps * 1e6,
                       hello_s=hello_ms * 1e-3)  # fmt: skip
    try:
        res = race(model, ids, src, split=split or 0, speed=speed, block_tokens=block_tokens,
                   max_chunk=max_chunk, question_ids=question_ids)  # fmt: skip
    finally:
        src.close()
    if src._session is not None:
        tid = getattr(src._session, "transfer_id", None)
        res.transfer = f"{tid:016x}" if isinstance(tid, int) else str(tid or "")
        res.refused = src.refused
    return res


def _speed_of(model: Any, ids: list[int]) -> ComputeSpeed:
    """The model's compute speed, measured once per model (on ``ids``)."""
    speed = _speeds.get(model)
    if speed is None:
        speed = _speeds[model] = ComputeSpeed.measure(model, ids)
    return speed


def race_daemon(
    model: Any,
    token_ids: Sequence[int],
    race_dir: str,
    *,
    wait_s: float = DEFAULT_WAIT_S,
    speed: ComputeSpeed | None = None,
    note: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> RaceResult:
    """Race the transfer of ``token_ids``'s cache that a receiver daemon on this host is
    receiving or has received: the daemon runs with ``--race-dir race_dir`` and mirrors
    each transfer into it while it arrives (kvtransport.daemons.race_share); the race takes
    the newest mirror of this context's cache, arriving or complete.

    In the order a user starts things: the call claims the context's transfer first (the
    daemon keeps its mirror until the race is done, within its bounds), maps a mirror that
    is already there, measures the model's speed when ``speed`` is not given (once per
    model), then waits for the mirror to appear until ``wait_s`` after the call, and races.
    With no transfer by then the race computes the context (loading what a transfer that
    starts later still brings in time); the result's ``transfer`` is None when none came.
    ``note`` hears one line when the call, ready to race, starts waiting for a transfer
    that has not appeared. ``kwargs``: :func:`live_race`'s options. The daemon still
    publishes the transfer's result when it ends."""
    from kvtransport.daemons.race_share import SharedTransfers
    from kvtransport.errors import UserError

    if not wait_s >= 0:
        raise UserError(f"wait_s must be 0 or more seconds, not {wait_s}")
    t_end = clock() + wait_s
    ids = [int(t) for t in token_ids]
    source = SharedTransfers(race_dir, ids)
    with source.claim():
        source()  # look first: a mirror there now is mapped, and stays readable
        if speed is None and ids:
            speed = _speed_of(model, ids)
        if note is not None and source() is None and clock() < t_end:
            note(f"waiting up to {t_end - clock():.1f} s for a transfer of this context "
                 f"in {race_dir}")  # fmt: skip
        while source() is None and clock() < t_end:
            time.sleep(LOOK_POLL_S)
        return live_race(source, model, ids, speed=speed, **kwargs)
