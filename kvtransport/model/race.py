"""The receiver's race: compute the context's front while the rest loads, then complete.

From the moment a handoff is announced the receiver builds the cache front to back
(kvtransport.model.cache_builder.CacheBuilder): first the ``split`` tokens the plan gave it
(kvtransport.model.plan; the sender does not send them), then, token range by token range, it
*loads* a range whose K/V have arrived in every layer, *waits* a little for a range that
is due any moment, or *computes* a run of ranges that have not arrived. The result is
always the whole cache, exact up to the quantization of what was loaded:

- compute while loading: the prefix is computed while the link carries the rest;
- completion: a range that never arrived (lost beyond repair, or never sent by the
  deadline) is recomputed at its own positions over the ranges before it;
- fallback: with a dead link nothing ever arrives, every range is computed, and the
  time is one chunked prefill (plus nothing: the receiver never idles on a range that is
  overdue).

The wait-or-compute rule for a range that has not arrived compares computing it with
waiting for it (:meth:`LinkView.expected`, from what arrived so far): at the link's
frontier the range is due when the bytes still owed before it (in the stream's order)
cross at the delivery rate seen so far, a silence longer than the usual gap between
arrivals counting against that rate (before the first arrival, when the plan says; a
link silent well past that is dead); a hole behind the frontier is due ``hole_wait_s``
after the first range sent after it arrived (repair fills a loss within about a round
trip); after the sender's deadline
nothing more is due. The receiver waits when computing would take longer, otherwise it
computes a run of ranges, extended while computing through the next range still beats
waiting for it, capped at ``max_chunk`` tokens, a cap that doubles with every compute in a
row (a dead link costs a handful of calls, not one per range) and that never splits the
ranges the transfer's plan does not send (a live receiver that learns the plan from the
manifest computes the sender's split in one call). Once nothing more can
arrive (the sender's deadline has passed, or a link that never delivered anything is long
overdue) the receiver finishes the cheaper way by its cost model: the rest of the context
in one call, or each run of missing ranges in one call each, loading what arrived between.

The stream may come in any order of whole token ranges (kvtransport.model.plan.ORDERS); the
cache is still built front to back, so a range that arrives ahead of the receiver's
frontier stays where it arrived until the frontier reaches it (loading needs only the
range's own K/V). With the ``back`` order the link fills the cache from the end while the
receiver computes from the front: a link slower than planned makes the receiver compute
more ranges, the ones the sender would send last, and nothing it computed is ever waited
for.

One decision loop, :func:`race`, reads the link and the time through an
:class:`Arrivals` source. :func:`run_race` replays the race against a transfer's measured
arrival timeline (:class:`ReplayArrivals`; ``ready_at``: when each token range was
complete at the receiver, counted from the transfer's start): computing and loading run
for real on the model and advance the race clock by their measured wall time (a load
includes fetching the range's K/V: waiting for the receiver's decoding thread, which
checks and decodes each range as it arrives, to have it done); a wait advances it to the
arrival (or to the end of the wait). The decisions only use arrivals up
to the race clock, so they are the ones a live receiver would take; what the replay leaves
out is any CPU contention between the receiving daemon (and the decoding thread) and the
model (on a receiver host they run on different cores). The live race
(kvtransport.embed.live_race) runs the same loop on the wall clock while the in-process
receiver receives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any, Protocol

import numpy as np

from kvtransport.kvformat.blocks import RangeDecoder
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model.cache_builder import CacheBuilder, ComputeSpeed
from kvtransport.model.utility import range_rank

DEFAULT_MAX_CHUNK = 128
DEFAULT_HOLE_WAIT_S = 0.05
POLL_S = 0.002


def range_ready_at(manifest: Any, arrival_s: np.ndarray | None) -> np.ndarray:
    """Per token range: when its last layer's block was complete (inf: some never was).

    manifest: the blocks manifest (kvtransport.kvformat.blocks.Manifest) of the stream; arrival_s:
    per block in stream order, seconds from the transfer's start (inf: never). A range
    with a layer not in the stream (the receiver's own prefix) is never ready.
    """
    return layer_ready_at(manifest, arrival_s).max(axis=0)


def layer_ready_at(manifest: Any, arrival_s: np.ndarray | None) -> np.ndarray:
    """``[layers, token ranges]``: when each block was complete (inf: never, or not in the
    stream); arrival_s as :func:`range_ready_at` takes it."""
    g = manifest.geometry
    ready = np.full((g.num_layers, g.token_blocks), np.inf)
    if arrival_s is not None and len(arrival_s):
        ready[manifest.layer.astype(np.int64), manifest.token_block.astype(np.int64)] = arrival_s
    return ready


def layered_tail(manifest: Any) -> int | None:
    """The first token range of the stream's layer-major tail (kvtransport.model.plan: the
    context's last ranges sent layer by layer, so that the question's forward pass can run
    while they arrive), or None when the stream has none.

    The tail is recognised from the order alone: the context's last ranges, at least two,
    each with every layer in the stream, whose blocks interleave with each other's, in
    layer then range order; every other range's blocks are back to back."""
    tb = manifest.token_block.astype(np.int64)
    ranges = manifest.geometry.token_blocks
    pos = np.arange(tb.size)
    first = np.full(ranges, tb.size)
    last = np.full(ranges, -1)
    np.minimum.at(first, tb, pos)
    np.maximum.at(last, tb, pos)
    count = np.bincount(tb, minlength=ranges)
    interleaved = (count == manifest.geometry.num_layers) & (last - first + 1 > count)
    if not interleaved.any():
        return None
    t = int(np.flatnonzero(interleaved)[0])
    if not interleaved[t:].all() or ranges - t < 2:
        return None
    tail = tb >= t
    key = manifest.layer.astype(np.int64)[tail] * ranges + tb[tail]
    return t if bool(np.all(np.diff(key) > 0)) else None


def stream_rank(manifest: Any) -> np.ndarray:
    """Per token range, its place in the stream's sending order (the stream index of its
    last block; -1 for a range not in the stream), as :class:`LinkView` takes it."""
    return range_rank(manifest.flat_index(), manifest.geometry.token_blocks)


@dataclass
class RaceStep:
    """One step of the race: what was done to which tokens, and when on the race clock."""

    action: str  # "compute", "load", "wait", "answer" (the question's first token) or
    # "abandoned" (a pass over a layer-major tail that stopped arriving, given up)
    start: int  # first token
    tokens: int
    t0: float
    t1: float


@dataclass
class RaceResult:
    """The whole cache and how it was made.

    builder: what built the cache (kvtransport.model.cache_builder.CacheBuilder);
    :attr:`model_cache` is its model cache, to answer from as it is
    (kvtransport.model.hf.greedy_generate; asking leaves it as it was), :attr:`kv` a numpy
    copy made when first asked for (not on the way to the first answer).
    seconds: race clock when the last token was in place (from the transfer's start).
    computed / loaded: tokens computed by the receiver / loaded from the link.
    first_token / answer_s: with a question, its first answer token and the race clock
    when it was out (the time to first token); None without one.
    transfer / refused (a live race, kvtransport.embed.live_race): the id of the transfer
    the race found ("" when its session has none; None: no transfer came), and why it was
    not loaded ("" when it was, or none came).
    speed: the compute speed the race's decisions ended on (the given one, or the one it
    learned from its first computed chunk: :func:`race`'s ``learn``).
    """

    builder: CacheBuilder
    seconds: float
    computed: int
    loaded: int
    waited_s: float
    steps: list[RaceStep] = field(default_factory=list)
    first_token: int | None = None
    answer_s: float | None = None
    transfer: str | None = None
    refused: str = ""
    speed: ComputeSpeed | None = None

    @property
    def model_cache(self) -> Any:
        """The model cache the race built (a transformers ``DynamicCache``)."""
        return self.builder.model_cache

    @cached_property
    def kv(self) -> KVCache:
        """The whole cache as numpy (a copy of the model cache as the race left it)."""
        return self.builder.kv()

    @property
    def recomputed(self) -> int:
        """Tokens computed after the first call: what the link did not deliver in time
        (a plan's hedge included, kvtransport.model.plan)."""
        first = self.steps[0] if self.steps else None
        prefix = first.tokens if first is not None and first.action == "compute" else 0
        return self.computed - prefix


@dataclass(frozen=True)
class LinkView:
    """What the receiver knows of the link before anything arrives: the plan.

    expect_at / range_bytes: per token range, the planned arrival (inf: not sent) and the
    bytes the link carries for it; deadline_s: when the sender stops (from the start);
    hole_wait_s: how long a range may stay missing once a later range has arrived (a
    loss that repair fills within about a round trip) before it is computed; start_s: when
    the transfer started on the race clock (the delivery rate is counted from there);
    settled: the view is the transfer's own (its plan), so once it is silent nothing more
    comes; False for a guess made before the plan is known (a live receiver before the
    manifest): silence then stops the waiting, but the receiver computes in chunks that
    double, so a late transfer still counts. rank: per token range, its place in the
    stream's order (:func:`stream_rank`; ranges complete in increasing rank); None: front
    first (position order). layered_from: the first token range of the stream's
    layer-major tail (:func:`layered_tail`; None: none).
    """

    expect_at: np.ndarray
    range_bytes: np.ndarray
    deadline_s: float
    hole_wait_s: float = DEFAULT_HOLE_WAIT_S
    start_s: float = 0.0
    settled: bool = True
    rank: np.ndarray | None = None
    layered_from: int | None = None

    def silent(self, ready_at: np.ndarray, clock: float) -> bool:
        """Nothing more will arrive: the sender has stopped, or the link never delivered
        anything and its first arrival is long overdue (a dead link)."""
        if clock > self.deadline_s + self.hole_wait_s:
            return True
        if np.any(ready_at <= clock):
            return False
        sent = np.isfinite(self.expect_at)
        first = float(self.expect_at[sent].min()) if sent.any() else -np.inf
        return clock > self.start_s + 2 * (first - self.start_s) + self.hole_wait_s

    def expected(self, ready_at: np.ndarray, r: int, clock: float) -> float:
        """When range ``r`` should arrive, from what arrived by ``clock`` (inf: it will
        not, as far as the receiver can tell)."""
        arrived = ready_at <= clock
        if clock > self.deadline_s + self.hole_wait_s or not np.isfinite(self.expect_at[r]):
            return np.inf  # the sender has stopped, or never sends it
        rank = self.rank if self.rank is not None else np.arange(ready_at.size)
        after = rank > rank[r]  # sent after r
        later = arrived & after
        if later.any():  # a hole behind the link's frontier: repair comes soon or never
            due = float(ready_at[later].min()) + self.hole_wait_s
            return due if due > clock else np.inf
        if not arrived.any():  # nothing yet: the plan, until its first arrival is overdue
            return np.inf if self.silent(ready_at, clock) else float(self.expect_at[r])
        # the delivery rate so far; a silence longer than the usual gap between arrivals
        # counts against it (a loss burst or a stalled link), so what is owed is expected
        # later the longer nothing comes, and the receiver turns to computing it
        last = float(ready_at[arrived].max())
        elapsed = max(last - self.start_s, 1e-6)
        gap = elapsed / int(arrived.sum())
        rate = float(self.range_bytes[arrived].sum()) / max(elapsed, clock - self.start_s - gap)
        owed = float(self.range_bytes[~after & ~arrived].sum())
        return clock + owed / rate


class Arrivals(Protocol):
    """Where the race reads the link and the time: what arrived by when, and its K/V.

    Times are seconds on the race clock, from the transfer's start (the replay) or the
    race's start (live). The race only ever compares arrival times with :meth:`now`, so a
    source may report arrivals still in the future (the replay's timeline): the race does
    not see them before their time.
    """

    def now(self) -> float:
        """The race clock."""
        ...

    def ready_at(self) -> np.ndarray:
        """Per token range, when it was complete at the receiver in every layer it is sent
        in (inf: not yet, or never)."""
        ...

    def link(self) -> LinkView:
        """What the receiver expects of the link now (it may sharpen as the transfer
        reveals its plan)."""
        ...

    def block_ready_at(self) -> np.ndarray:
        """``[layers, token ranges]``: when each block was complete (inf: not yet, or
        never)."""
        ...

    def received(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The received K/V ``[layers, heads, hi - lo, dim]`` of tokens ``[lo, hi)``, whole
        token ranges that :meth:`ready_at` reports in place; None when one of them failed
        its check after all (it is then never ready)."""
        ...

    def received_layer(self, layer: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`received` of one layer (``[heads, hi - lo, dim]``), whole token ranges
        whose blocks of that layer :meth:`block_ready_at` reports in place."""
        ...

    def run(self, fn: Callable[[], None]) -> tuple[float, float]:
        """Do ``fn`` (compute or load); the clock moves on by its time. Returns
        ``(start, end)`` on the race clock."""
        ...

    def wait(self, r: int, until: float, layer: int | None = None) -> None:
        """Let the clock run until range ``r`` is ready (its block of ``layer``, if given)
        or ``until``, whichever is first. It may be called during :meth:`run`'s work."""
        ...


Received = KVCache | tuple[RangeDecoder, np.ndarray]
"""What arrived, for the replay: a decoded cache (nothing left to decode), or the received
stream's decoder and its payload (each range checked and decoded as a live receiver does:
by its decoding thread, :class:`ReplayArrivals`)."""


class ReplayArrivals:
    """A transfer's measured arrival timeline on a virtual clock: work advances it by its
    measured wall time, a wait jumps it to the arrival (or to the end of the wait), also a
    wait during work (the layer-by-layer answer, :func:`race`).

    With a received stream to decode, the live receiver's decoding thread (on the
    receiver's other core: kvtransport.embed.live_race) is modelled as a queue: each range
    (but those of the link's layer-major tail, which the answer decodes a layer at a time
    as it loads them) is checked and decoded once complete, in arrival order, one after the
    other, each taking its measured wall time (decoded here, up front). Loading a range
    whose decoding is not done by then waits for it (the clock moves to when it is).

    layer_ready: ``[layers, ranges]`` per block (:func:`layer_ready_at`); None: every layer
    of a range at its ``ready_at`` (as many layers as ``received`` has).
    """

    def __init__(
        self,
        ready_at: np.ndarray,
        received: Received | None,
        link: LinkView,
        layer_ready: np.ndarray | None = None,
    ) -> None:
        self._ready = ready_at.copy() if received is not None else np.full_like(ready_at, np.inf)
        if layer_ready is None:
            layers = 1
            if isinstance(received, KVCache):
                layers = received.num_layers
            elif isinstance(received, tuple):
                layers = received[0].manifest.geometry.num_layers
            layer_ready = np.broadcast_to(ready_at, (layers, ready_at.size))
        # nothing is ever ready without what arrived
        self._layers = layer_ready.copy() if received is not None else np.full_like(
            layer_ready, np.inf)  # fmt: skip
        self._received = received
        self._link = link
        self._not_before = 0.0  # the work under way cannot end before this (a decode)
        self._decoded_at = np.zeros_like(self._ready)
        if isinstance(received, tuple):
            self._decoded_at = self._decode_in_arrival_order(*received)
        self._clock = 0.0  # the race clock at the wall-clock mark, while work runs
        self._mark: float | None = None

    def _decode_in_arrival_order(self, decoder: RangeDecoder, payload: np.ndarray) -> np.ndarray:
        """Per token range, when the decoding thread has it decoded (inf: never arrived, or
        in the layer-major tail)."""
        done = np.full_like(self._ready, np.inf)
        busy_until = 0.0
        tail = self._link.layered_from
        for r in np.argsort(self._ready, kind="stable"):
            if not np.isfinite(self._ready[r]):
                break
            if tail is not None and r >= tail:
                continue
            w0 = time.perf_counter()
            decoder.take_range(payload, int(r))
            busy_until = max(busy_until, float(self._ready[r])) + time.perf_counter() - w0
            done[r] = busy_until
        return done

    def now(self) -> float:
        if self._mark is None:
            return self._clock
        return self._clock + time.perf_counter() - self._mark

    def ready_at(self) -> np.ndarray:
        return self._ready

    def block_ready_at(self) -> np.ndarray:
        return self._layers

    def link(self) -> LinkView:
        return self._link

    def received(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        got = self._received
        assert got is not None  # nothing is ever ready without it
        if isinstance(got, KVCache):
            return got.keys[:, :, lo:hi], got.values[:, :, lo:hi]
        decoder, payload = got
        bt = decoder.manifest.geometry.block_tokens
        done = self._decoded_at[lo // bt : -(-hi // bt)]
        done = done[np.isfinite(done)]  # the tail's are not the thread's: decoded here
        self._not_before = float(done.max()) if done.size else 0.0
        kv = decoder.take(payload, lo, hi)
        if kv is None:
            self._fail(decoder)
        return kv

    def received_layer(self, layer: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        got = self._received
        assert got is not None  # nothing is ever ready without it
        if isinstance(got, KVCache):
            return got.keys[layer, :, lo:hi], got.values[layer, :, lo:hi]
        decoder, payload = got
        kv = decoder.take_layer(payload, layer, lo, hi)
        if kv is None:
            self._fail(decoder)
        return kv

    def _fail(self, decoder: RangeDecoder) -> None:
        """A range with a corrupt block is never ready."""
        bad = np.unique(decoder.manifest.token_block[decoder.failed].astype(np.int64))
        self._ready[bad] = np.inf
        self._layers[:, bad] = np.inf

    def run(self, fn: Callable[[], None]) -> tuple[float, float]:
        t0 = self._clock
        self._mark = time.perf_counter()
        try:
            fn()
        finally:
            self._clock = max(self.now(), self._not_before)
            self._mark = None
            self._not_before = 0.0
        return t0, self._clock

    def wait(self, r: int, until: float, layer: int | None = None) -> None:
        ready = self._ready if layer is None else self._layers[layer]
        self._clock = max(self.now(), min(float(ready[r]), until))
        if self._mark is not None:
            self._mark = time.perf_counter()


def run_race(
    model: Any,
    token_ids: list[int],
    *,
    split: int,
    received: Received | None,
    ready_at: np.ndarray,
    link: LinkView,
    speed: ComputeSpeed,
    block_tokens: int,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    layer_ready: np.ndarray | None = None,
    question_ids: Sequence[int] | None = None,
    learn: bool = True,
) -> RaceResult:
    """Replay the race (see the module docstring) and return the cache it built.

    received: the K/V that arrived (zeros elsewhere), ``[layers, heads, tokens, dim]``,
        or the received stream to decode range by range as the race loads it
        (:data:`Received`), or None when nothing arrived; ready_at: per token range of
        ``block_tokens``, when it was complete at the receiver (inf: never); link: the
        plan's view of the link; layer_ready: per block (:class:`ReplayArrivals`);
        question_ids, learn: as :func:`race` takes them.
    """
    n = len(token_ids)
    ranges = -(-n // block_tokens)
    shapes = [ready_at.shape, link.expect_at.shape]
    shapes += [] if link.rank is None else [link.rank.shape]
    if any(s != (ranges,) for s in shapes):
        raise ValueError(f"ready_at and the link's expect_at (and rank) must have {ranges} "
                         "token ranges")  # fmt: skip
    src = ReplayArrivals(ready_at, received, link, layer_ready)
    return race(model, token_ids, src, split=split, speed=speed, block_tokens=block_tokens,
                max_chunk=max_chunk, question_ids=question_ids, learn=learn)  # fmt: skip


def race(
    model: Any,
    token_ids: list[int],
    src: Arrivals,
    *,
    split: int,
    speed: ComputeSpeed,
    block_tokens: int,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    builder: CacheBuilder | None = None,
    question_ids: Sequence[int] | None = None,
    learn: bool = True,
) -> RaceResult:
    """The race's decision loop (see the module docstring) against ``src``: the replay
    (:func:`run_race`) and the live receiver (kvtransport.embed.live_race) both run it.

    split: tokens computed first in one call (a token range boundary); speed: the
    receiver's compute speed, which sizes waits against computes; builder: what builds the
    cache (default: a new CacheBuilder of ``model`` and ``token_ids``). Returns the whole
    cache of ``token_ids`` with the race clock when its last token was in place.

    learn: the race times its first computed chunk (the planned prefix, or the first
    run of ranges it computes) and, where that call took a time the speed does not
    predict (:meth:`ComputeSpeed.learned`), takes every later wait-or-compute decision,
    the question's cost included, on the speed it measured
    (:attr:`RaceResult.speed`): a plan made on a mismeasured speed is corrected from
    the first real chunk. A speed that is not trusted (its measured rounds disagreed:
    ComputeSpeed.trusted) and no prefix to time: the first range not in place is computed
    before anything is waited for (one range's time, at most, buys the speed every later
    decision weighs). False: the given speed throughout (a replay that studies the
    decision rule under a fixed speed).

    question_ids: the race ends with the question's first answer token
    (:attr:`RaceResult.first_token`, out at :attr:`RaceResult.answer_s`). Where the stream
    ends in a layer-major tail (:attr:`LinkView.layered_from`) and waiting for it beats
    computing it and then running the question (``speed.answer_seconds``), the race builds
    the cache up to the tail and then runs the question through the model while the tail
    arrives, each layer's part loaded just before that layer runs
    (kvtransport.model.cache_builder.CacheBuilder.answer), so that the first token is out
    about one layer's time after the last block. Should a block of the tail not come in
    time (:func:`tail_block_due`: the link stalled, or the sender's deadline passed) or
    fail its check, the pass is abandoned (the cache as it was) and the race finishes as
    after the sender's deadline: it loads the ranges in place and computes the rest, each
    run of missing ranges in one call or the rest in one, whichever is cheaper.
    """
    n = len(token_ids)
    ranges = -(-n // block_tokens)
    if question_ids is not None and len(question_ids) == 0:
        raise ValueError("the question has no tokens")
    if split < 0 or split > n or (split % block_tokens and split != n):
        raise ValueError(f"split {split} is not a token range boundary of {n} tokens")
    b = builder if builder is not None else CacheBuilder(model, token_ids)
    steps: list[RaceStep] = []
    learning = learn  # the first computed chunk is still to be timed
    range_cost = float(speed.seconds(block_tokens))

    def timed(action: str, tokens: int, fn: Any, *args: Any) -> None:
        nonlocal speed, range_cost, learning
        start = b.filled
        t0, t1 = src.run(lambda: fn(*args))
        steps.append(RaceStep(action, start, tokens, t0, t1))
        if action == "compute" and learning:
            learning = False
            speed = speed.learned(tokens, t1 - t0)
            range_cost = float(speed.seconds(block_tokens))

    if split:
        timed("compute", split, b.compute, split)
    computes_in_a_row = 0
    first_token: list[int] = []
    tail_in: list[float] = []  # when the layer-major tail's last layer was in place
    tail_tried = False
    gave_up = False  # the tail stopped arriving: nothing more is waited for
    while b.filled < n:
        clock = src.now()
        ready_at = src.ready_at()
        link = src.link()
        if gave_up:  # as if the sender had stopped
            link = replace(link, deadline_s=-np.inf)
        r = b.filled // block_tokens
        if question_ids is not None and not tail_tried and link.layered_from == r:
            due = link.expected(ready_at, ranges - 1, clock)  # the tail's last range
            pass_s = speed.answer_seconds(len(question_ids), n)
            computing = clock + speed.seconds(n - b.filled) + pass_s  # then the pass
            if np.isfinite(due) and computing >= due + pass_s / b.num_layers:
                tail_tried = True  # answer while the tail arrives; once
                lo = b.filled
                try:
                    t0, t1 = src.run(partial(_answer_over_tail, src, b, question_ids, r,
                                             range_cost, first_token, tail_in))  # fmt: skip
                except TailLost:
                    gave_up = True
                    tail_in.clear()  # its layers were cropped back
                    steps.append(RaceStep("abandoned", lo, 0, clock, src.now()))
                    continue
                steps.append(RaceStep("answer", lo, n - lo, t0, t1))
                break
        if ready_at[r] <= clock:  # load every range in place by now, in one go
            end = r
            while end < ranges and ready_at[end] <= clock:
                end += 1
            lo, hi = b.filled, min(end * block_tokens, n)
            passed: list[bool] = []  # fetching the K/V (checking, decoding) is on the clock
            t0, t1 = src.run(partial(_fetch_and_load, src, b, lo, hi, passed))
            if not passed[0]:  # failed its check: no longer ready, look again
                continue
            steps.append(RaceStep("load", lo, hi - lo, t0, t1))
            computes_in_a_row = 0
            continue
        if learning and not speed.trusted:  # time one range before weighing any wait
            timed("compute", min(block_tokens, n - b.filled), b.compute,
                  min(block_tokens, n - b.filled))  # fmt: skip
            computes_in_a_row += 1
            continue
        due = link.expected(ready_at, r, clock)
        if clock + range_cost >= due:  # waiting beats computing: wait, then look again
            src.wait(r, clock + max(POLL_S, min(due - clock, range_cost)))
            steps.append(RaceStep("wait", b.filled, 0, clock, src.now()))
            continue
        if link.settled and link.silent(ready_at, clock):  # nothing more comes: the
            # cheaper way to the end
            holes = ready_at[r:] > clock
            runs = int(holes[0]) + int(np.count_nonzero(holes[1:] & ~holes[:-1]))
            piecewise = runs * speed.per_call_s + holes.sum() * block_tokens * speed.per_token_s
            if speed.seconds(n - b.filled) <= piecewise:
                timed("compute", n - b.filled, b.compute, n - b.filled)
                continue
            cap = n  # each run of holes in one call
        else:
            # compute the ranges not in place while computing through each beats waiting
            # for it, up to a cap that doubles with every compute in a row; the ranges the
            # link never sends (the transfer's own plan says so) from here on in one call
            cap = max_chunk << min(computes_in_a_row, 8)
            if link.settled:
                sent = np.flatnonzero(np.isfinite(link.expect_at[r:]))
                cap = max(cap, int(sent[0] if sent.size else ranges - r) * block_tokens)
        end = r + 1
        while (
            end < ranges
            and (end + 1 - r) * block_tokens <= cap
            and ready_at[end] > clock
            and clock + speed.seconds((end + 1 - r) * block_tokens)
            < link.expected(ready_at, end, clock)
        ):
            end += 1
        hi = min(end * block_tokens, n)
        timed("compute", hi - b.filled, b.compute, hi - b.filled)
        computes_in_a_row += 1
    computed = sum(s.tokens for s in steps if s.action == "compute")
    waited = sum(s.t1 - s.t0 for s in steps if s.action == "wait")
    seconds = tail_in[-1] if tail_in else src.now()  # the last token is in place
    if question_ids is not None and not first_token:
        t0, t1 = src.run(lambda: first_token.append(b.answer(question_ids)))
        steps.append(RaceStep("answer", n, 0, t0, t1))
    answer_s = src.now() if question_ids is not None else None
    return RaceResult(b, seconds, computed, n - computed, waited, steps,
                      first_token[0] if first_token else None, answer_s,
                      speed=speed)  # fmt: skip


class TailLost(Exception):
    """The layer-major tail stopped arriving during the answer (:func:`race`)."""


def _answer_over_tail(
    src: Arrivals,
    b: CacheBuilder,
    question_ids: Sequence[int],
    tail_from: int,
    range_cost: float,
    out: list[int],
    tail_in: list[float],
) -> None:
    """Run the question through the model while the context's tail (its token ranges from
    ``tail_from`` on) arrives layer by layer; appends the first answer token to ``out``
    and the race clock when each layer's part was in place to ``tail_in``.
    Raises :class:`TailLost` when a block is no longer expected (:func:`tail_block_due`);
    the builder is then as it was."""
    lo, n = b.filled, b.num_tokens

    def tail_layer(layer: int) -> tuple[np.ndarray, np.ndarray]:
        while True:
            clock = src.now()
            arrived_at = src.block_ready_at()
            late = np.flatnonzero(arrived_at[layer, tail_from:] > clock)
            if not late.size:
                break
            r = tail_from + int(late[0])
            due = tail_block_due(src.link(), arrived_at, clock)
            if not due > clock:
                raise TailLost(f"layer {layer} of token range {r} is no longer expected")
            src.wait(r, min(due, clock + max(POLL_S, range_cost)), layer=layer)
        got = src.received_layer(layer, lo, n)
        if got is None:
            raise TailLost(f"a block of layer {layer} failed its check")
        tail_in.append(src.now())
        return got

    out.append(b.answer(question_ids, tail_layer))


def tail_block_due(link: LinkView, arrived_at: np.ndarray, clock: float) -> float:
    """Until when the race waits for a block of the layer-major tail that is not in by
    ``clock``, from ``arrived_at``, when each block was complete
    (``Arrivals.block_ready_at``). While the rest of the tail keeps coming a block missing
    is a loss that repair may still fill, and the pass cannot finish before the tail's last
    block anyway, so the race waits as long as the link delivers: until it stalls (nothing
    came for four usual gaps between the transfer's block arrivals, at least
    ``hole_wait_s``, after the last one; before any, ``hole_wait_s`` after the transfer's
    start: the first datagram for a live receiver, the sender's start in a replay), and
    never past the sender's deadline (plus ``hole_wait_s``)."""
    if clock > link.deadline_s + link.hole_wait_s:
        return -np.inf
    times = arrived_at[arrived_at <= clock]
    if not times.size:
        return link.start_s + link.hole_wait_s
    last = float(times.max())
    gap = (last - float(times.min())) / max(times.size - 1, 1)
    return last + max(link.hole_wait_s, 4 * gap)


def _fetch_and_load(src: Arrivals, b: CacheBuilder, lo: int, hi: int, passed: list[bool]) -> None:
    """Load tokens ``[lo, hi)`` from ``src`` into ``b``; appends to ``passed`` whether they
    passed their check (they are not loaded otherwise)."""
    got = src.received(lo, hi)
    if got is not None:
        b.load(*got)
    passed.append(got is not None)


def complete_missing(
    model: Any, token_ids: list[int], received: KVCache, present: np.ndarray, block_tokens: int
) -> RaceResult:
    """The whole cache from a partial one after the fact (nothing more will arrive):
    every token range present in all layers is loaded, every other one recomputed exactly.

    present: ``[layers, tokens]`` as kvtransport.kvformat.blocks.Reassembled gives it.
    """
    n = len(token_ids)
    if present.shape != (received.num_layers, n):
        raise ValueError(f"present {present.shape} != ({received.num_layers}, {n})")
    ranges = -(-n // block_tokens)
    pad = ranges * block_tokens - n
    whole = np.pad(present.all(axis=0), (0, pad), constant_values=True)
    ready_at = np.where(whole.reshape(ranges, block_tokens).all(axis=1), 0.0, np.inf)
    link = LinkView(np.where(np.isfinite(ready_at), 0.0, np.inf), np.zeros(ranges), -1.0)
    speed = ComputeSpeed(0.0, 1e-3)  # nothing is due: the speed only sizes waits
    return run_race(model, token_ids, split=0, received=received, ready_at=ready_at,
                    link=link, speed=speed, block_tokens=block_tokens)  # fmt: skip
