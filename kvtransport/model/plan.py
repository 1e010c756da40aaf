"""The handoff planner: what the receiver computes, what crosses the link, at which precision.

Before the first datagram the sender decides, from the TTFT budget, the link estimate and
the receiver's measured compute speed (kvtransport.model.cache_builder.ComputeSpeed):

- the **split**: the context's first ``split`` tokens, which the receiver computes itself
  while the rest streams in (compute while loading); their blocks are not sent;
- each sent block's **precision** (fp16, int8 or int4 by default; k8v4 too where the caller
  lists it, ALL_LEVELS; the plan uses the given levels on the upper convex hull of bytes
  and fidelity: :func:`menu`): every block
  starts at the cheapest level, and blocks are raised one level at a time, the raise that
  buys the most expected fidelity per byte first (utility times the level's fidelity gain
  over its extra bytes: among whole blocks, utility order), first until the plan's
  expected fidelity reaches a floor (``min_fidelity``: int4 only where it costs little
  utility), then while the bytes still cross within the budget;
- the **stream order** (``order``, one of ORDERS): whole token ranges, every layer of a
  range together, so that what the deadline cuts off or the channel destroys sits in few
  token ranges, which the receiver recomputes cheaply (kvtransport.model.race). ``position``
  sends them front first (the range after the split first); ``back`` sends the last range
  first, so the receiver computing from the front and the link delivering from the back
  meet wherever the real speeds put them: the split is the planned meeting point, a link
  slower than planned moves it back (the receiver computes on past the split) and no link
  time goes to ranges the receiver computes (those are the last the sender would send);
- the **hedge**: the prefix's last token ranges (``hedge`` tokens, ``hedge_share`` of
  the split and at most one race chunk) are sent too, after the planned ranges and last
  first, so the link carries on past the planned finish (:attr:`HandoffPlan.send_s`; the
  sender's deadline should cover it). The receiver's first call then computes only
  ``split - hedge`` tokens (:attr:`HandoffPlan.first_call`) and races for the rest
  (kvtransport.model.race): on time, it computes them itself and pays one more call at
  most (the link's first hedge ranges arrive as it gets there); slower than its measured
  speed, or with a link faster than planned, it loads what the otherwise idle link
  brought instead of computing it. The planned part (split, precisions, finish) does not
  depend on the hedge;
- the **tail**: with the question's forward time given (``answer_s``, the receiver's
  :meth:`ComputeSpeed.answer_seconds`) and the ``position`` order, the context's last
  token ranges, those that take the link about that long, are sent layer by layer (all
  their layer-0 blocks, then layer 1, ...) before the hedge: the receiver runs the
  question through the model while they arrive, each layer as soon as its part is in
  (kvtransport.model.race), so the first token is out about one layer's time after the
  last block rather than a whole forward pass after it. The plan then prices a split by
  when the first token is out (:attr:`HandoffPlan.answer_at_s`): the receiver's prefix
  and the question's pass, against the link and one layer of the pass;
- the planned arrival of every token range, in stream order, which the receiver uses to
  decide between waiting for a range and computing it.

Two objectives (``objective``), both over the expected answer fidelity: the
utility-weighted share of the cache that the receiver holds exactly (computed) or at a
precision's fidelity (kvtransport.kvformat.blocks.DEFAULT_FIDELITY):

- ``fidelity`` spends the budget: the highest fidelity with everything in place by the
  budget, among equal plans the one that finishes first;
- ``ttft`` answers as soon as it can: the split whose first token is out first
  (:attr:`HandoffPlan.answer_at_s`; without ``answer_s``, the one that finishes first)
  with every sent block at the cheapest precision, then upgrades only with the link time
  that the receiver's own compute leaves idle (so that time does not move). The budget
  is then a cap, not a target: a plan never answers later than the ``fidelity`` plan for
  the same budget.

A speed whose measured rounds disagreed (not ComputeSpeed.trusted) plans so that being
wrong costs little, whatever ``order`` says:

- the prefix is priced at the slowest speed the rounds showed (:func:`robust_speed`): a
  prefix planned too short costs the link time of what it left out, one planned too long
  the receiver's compute time of what it added (several times more per token);
- the stream goes in the ``back`` order, so the split stays open: the receiver computes
  from the front at its real speed (the race learns it from its first computed chunk,
  kvtransport.model.race) until it meets the link filling the cache from the back, and
  no link time goes to what it computes. There is then no layer-by-layer tail (the
  question's pass runs once the cache is in place);
- the ``ttft`` objective sends every block at its fidelity floor's level
  (:meth:`_Task.floored`), without the upgrades for the link time the receiver's compute
  is predicted to leave idle (a guess of the same speed): the precision depends on the
  link and the floor alone.

The link time of ``b`` payload bytes is the loss-free wire time inflated by the expected
loss and a repair margin, plus one one-way delay. When nothing fits the budget (even all
at the cheapest precision), both objectives give the split that finishes soonest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, cast

import numpy as np

from kvtransport.core.wire import full_send_time
from kvtransport.kvformat.blocks import (
    DEFAULT_FIDELITY,
    PRECISIONS,
    EncodedStream,
    Geometry,
    decode_stream,
    encode_stream,
    estimate_coded,
)
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model.cache_builder import ComputeSpeed
from kvtransport.model.race import DEFAULT_MAX_CHUNK
from kvtransport.model.utility import range_rank, stream_order

ALL_LEVELS = ("fp16", "int8", "k8v4", "int4")
"""Every level the planner can choose among, best first."""
DEFAULT_LEVELS = ("fp16", "int8", "int4")
"""The levels a plan uses unless the caller names others: k8v4 (keys int8, values int4)
stays opt-in (``--levels fp16,int8,k8v4,int4``) until answers on held-out prompts confirm
its calibrated fidelity (docs/results.md)."""
DEFAULT_MIN_FIDELITY = 0.999
"""The expected fidelity every plan keeps (when its levels can reach it). With the
calibrated per-precision fidelities (kvtransport.kvformat.blocks.DEFAULT_FIDELITY: int8
0.999, int4 0.988) the least useful sent blocks go as int4 (then, where k8v4 is listed, the
next as k8v4) and the rest at int8 or better.
The int4 share this gives, and what lower floors cost in answers, are measured in
docs/results.md (section 0)."""
DEFAULT_REPAIR_MARGIN = 0.05
"""Link time allowed beyond the loss-inflated wire time, for repair the loss estimate does
not cover. Chosen by comparing planned with realized range arrivals on the emulated
ge-heavy link (docs/results.md, section 0): a larger margin plans a longer prefix for the
receiver while the link idles at the end."""
DEFAULT_HEDGE_SHARE = 0.25
"""The share of the receiver's planned prefix the sender also sends as a hedge (see the
module docstring): a receiver up to this much slower than its measured speed still finds
its last prefix ranges brought by the link. Capped at one race chunk (kvtransport.model.race
DEFAULT_MAX_CHUNK) so that a receiver on time computes the hedge in one call."""
HEDGE_MIN_CALLS = 2.0
"""A hedge is planned only where computing it costs at least this many calls' fixed cost
(ComputeSpeed.per_call_s): a receiver on time pays up to one more call for it."""
OBJECTIVES = ("fidelity", "ttft")
ORDERS = ("position", "back")
"""The stream orders a plan may send in (kvtransport.model.utility.stream_order modes)."""
NO_RECEIVER_COMPUTE = ComputeSpeed(per_call_s=float("inf"), per_token_s=float("inf"))
"""A receiver that computes nothing itself: every plan with it has split 0."""


@dataclass(frozen=True)
class LinkEstimate:
    """What the sender assumes of the link: rate, loss share, one-way delay; whether
    datagrams carry an authentication tag (sealed, the default)."""

    rate_bps: float
    loss: float
    one_way_s: float
    symbol_size: int
    sealed: bool = True

    def seconds(self, payload_bytes: float, repair_margin: float = DEFAULT_REPAIR_MARGIN) -> float:
        """Expected time until ``payload_bytes`` are at the receiver (0 bytes: 0 s)."""
        if payload_bytes <= 0:
            return 0.0
        wire = full_send_time(int(payload_bytes), self.rate_bps, self.symbol_size, self.sealed)
        return self._after(wire, repair_margin)

    def seconds_each(
        self, payload_bytes: np.ndarray, repair_margin: float = DEFAULT_REPAIR_MARGIN
    ) -> np.ndarray:
        """:meth:`seconds` of each of an array of byte counts (the planner prices every
        token range's arrival at once)."""
        n = np.asarray(payload_bytes, dtype=np.float64).astype(np.int64)
        some = n > 0
        wire = full_send_time(cast(Any, np.where(some, n, 0)), self.rate_bps,
                              self.symbol_size, self.sealed)  # fmt: skip
        return np.where(some, self._after(wire, repair_margin), 0.0)

    def _after(self, wire_s: Any, repair_margin: float) -> Any:
        """When what takes ``wire_s`` loss-free on the wire is at the receiver."""
        return self.one_way_s + wire_s * (1.0 + repair_margin) / max(1.0 - self.loss, 0.05)

    def max_bytes(self, seconds: float, repair_margin: float = DEFAULT_REPAIR_MARGIN) -> int:
        """The most payload bytes expected at the receiver within ``seconds``."""
        lo, hi = 0, 1
        while self.seconds(hi, repair_margin) <= seconds:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.seconds(mid, repair_margin) <= seconds else (lo, mid)
        return lo


@dataclass(frozen=True)
class HandoffPlan:
    """A plan (see the module docstring).

    precision: codes ``[layers, token_blocks]`` (index into kvtransport.kvformat.blocks.PRECISIONS;
        -1 for the receiver's prefix, except its hedge). expect_at: per token range, the
        planned arrival in seconds from the start (inf for the prefix, except its hedge,
        due after every planned range). fidelity: the objective's value (the prefix counted
        computed). range_bytes: per token range, the payload bytes sent for it (the hedge
        included); payload_bytes / link_s: the planned ranges' bytes and when they are in
        place (the hedge comes after).
    hedge / hedge_bytes: the prefix's last tokens also sent, after the planned ranges,
        last first (0: none), and their bytes; the receiver's first call computes
        :attr:`first_call` tokens.
    answer_s / tail: the question's forward time the plan assumed, and the context's last
        tokens sent layer by layer (0: none; see the module docstring).
    """

    split: int
    precision: np.ndarray
    expect_at: np.ndarray
    range_bytes: np.ndarray  # per token range, the payload bytes sent for it
    payload_bytes: int
    compute_s: float
    link_s: float
    fidelity: float
    fits: bool  # everything is planned in place by the budget
    prefix_utility: float  # the share of the cache's utility the receiver computes
    order: str = "position"  # the stream order (ORDERS)
    hedge: int = 0
    hedge_bytes: int = 0
    answer_s: float = 0.0
    tail: int = 0

    @property
    def finish_s(self) -> float:
        return max(self.compute_s, self.link_s)

    @property
    def answer_at_s(self) -> float:
        """When the question's first token is planned out: after the prefix and the pass,
        and, with a tail, one layer's share of the pass after the link (the pass runs
        while the tail arrives); without one, a whole pass after everything is in place."""
        if self.tail:
            layer_s = self.answer_s / self.precision.shape[0]
            return max(self.compute_s + self.answer_s, self.link_s + layer_s)
        return self.finish_s + self.answer_s

    @property
    def link_by_s(self) -> float:
        """When the link must be done for the first token to be out at :attr:`answer_at_s`."""
        layer_s = self.answer_s / self.precision.shape[0] if self.tail else self.answer_s
        return self.answer_at_s - layer_s

    @property
    def first_call(self) -> int:
        """The tokens the receiver computes before it looks at the link (the race's
        ``split``): the planned prefix less its hedge."""
        return self.split - self.hedge

    @property
    def send_s(self) -> float:
        """When the last range the stream carries is planned in place (the hedge's, if
        any): the sender's deadline should not come before."""
        sent = np.isfinite(self.expect_at)
        return max(self.link_s, float(self.expect_at[sent].max()) if sent.any() else 0.0)

    def describe(self) -> str:
        names, counts = np.unique(self.precision[self.precision >= 0], return_counts=True)
        mix = ", ".join(f"{c} {PRECISIONS[int(p)]}" for p, c in zip(names, counts, strict=True))
        front = f"tokens 0-{self.split}" if self.split else "nothing"
        front = f"receiver computes {front}"
        hedge = (f"; then the prefix's last {self.hedge} tokens as a hedge (in place at "
                 f"{self.send_s * 1e3:.0f} ms)" if self.hedge else "")  # fmt: skip
        if self.tail:
            front += f"; its last {self.tail} tokens cross layer by layer"
        if self.order == "back":
            front += " (or more: the link sends the last tokens first)"
        return (
            f"{front}, the link carries {mix or 'nothing'} "
            f"blocks ({(self.payload_bytes + self.hedge_bytes) / 2**20:.1f} MiB); planned "
            f"in place at {self.finish_s * 1e3:.0f} ms{hedge}"
        )


def plan_handoff(
    geometry: Geometry,
    utilities: np.ndarray,
    *,
    link: LinkEstimate,
    speed: ComputeSpeed,
    budget_s: float,
    levels: tuple[str, ...] = DEFAULT_LEVELS,
    repair_margin: float = DEFAULT_REPAIR_MARGIN,
    fidelity: dict[str, float] | None = None,
    objective: str = "fidelity",
    min_fidelity: float = DEFAULT_MIN_FIDELITY,
    order: str = "position",
    hedge_share: float = DEFAULT_HEDGE_SHARE,
    answer_s: float = 0.0,
) -> HandoffPlan:
    """The best plan for ``budget_s`` seconds under ``objective`` (see the module
    docstring).

    utilities: ``[layers, token_blocks]`` block utilities (normalized here); levels: the
    precisions the link may carry, best first (the last is where every sent block starts;
    the plan chooses among :func:`menu`'s);
    min_fidelity: the expected fidelity below which no plan goes while its levels can
    reach it (sent blocks are raised, most fidelity per byte first, until they do; 0: no
    floor);
    order: the stream order (ORDERS), which only sets the expected arrivals (an untrusted
    speed plans ``back``: :attr:`HandoffPlan.order`);
    hedge_share: the share of the prefix also sent as a hedge (0: none); answer_s: the
    question's forward time on the receiver (0: no tail, the plan ends at the cache);
    speed: the receiver's; an untrusted one plans as the module docstring says (the
    prefix priced by :func:`robust_speed`, the ``back`` order, the floor's levels).
    Raises ValueError for an unknown objective, order or level, a floor or hedge share
    outside [0, 1], or a negative answer_s.
    """
    g = geometry
    u = np.asarray(utilities, dtype=np.float64)
    if u.shape != (g.num_layers, g.token_blocks):
        raise ValueError(f"utilities {u.shape} != ({g.num_layers}, {g.token_blocks})")
    if not levels or any(p not in PRECISIONS for p in levels):
        raise ValueError(f"levels must be names from {PRECISIONS}, not {levels}")
    if not budget_s > 0:
        raise ValueError(f"budget must be positive, not {budget_s}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    if not 0.0 <= min_fidelity <= 1.0:
        raise ValueError(f"min_fidelity must be in [0, 1], not {min_fidelity}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    if not 0.0 <= hedge_share <= 1.0:
        raise ValueError(f"hedge_share must be in [0, 1], not {hedge_share}")
    if not answer_s >= 0.0:
        raise ValueError(f"answer_s must be >= 0, not {answer_s}")
    u = u / u.sum()
    speed = robust_speed(speed)
    if not speed.trusted:  # the receiver and the link meet wherever their real speeds put them
        order = "back"
    levels = menu(g, levels, fidelity)
    fid = np.array([(fidelity or DEFAULT_FIDELITY)[p] for p in levels])
    cost = g.cost_table(levels).reshape(g.num_layers, g.token_blocks, len(levels))
    task = _Task(g, u, cost, fid, link, repair_margin, budget_s, levels, min_fidelity, order,
                 answer_s if order == "position" else 0.0)  # fmt: skip
    best: tuple[tuple[float, float], HandoffPlan] | None = None
    fastest: tuple[float, int, HandoffPlan] | None = None
    for k in range(g.token_blocks + 1):
        split = min(k * g.block_tokens, g.num_tokens)
        compute_s = float(speed.seconds(split))
        if compute_s > budget_s and best is not None:
            break  # a longer prefix only computes longer
        if objective == "ttft" and fastest is not None and compute_s + task.answer_s >= fastest[0]:
            break  # nor can it answer sooner
        level = task.floored(k)
        plan = task.plan(k, level, compute_s)
        if plan.fits and objective == "fidelity":
            plan = task.upgraded(k, level, compute_s, budget_s)
            key = (round(plan.fidelity, 9), -plan.answer_at_s)
            if best is None or key > best[0]:
                best = (key, plan)
        if fastest is None or plan.answer_at_s < fastest[0]:
            fastest = (plan.answer_at_s, k, plan)
    assert fastest is not None
    if best is not None:
        return task.hedged(best[1], hedge_share, speed)
    _, k, quick = fastest
    if not quick.fits or not speed.trusted:  # an untrusted speed's idle link is a guess
        return task.hedged(quick, hedge_share, speed)
    # ttft: the link time that the receiver's own compute leaves idle buys upgrades
    return task.hedged(task.upgraded(k, task.floored(k), quick.compute_s, quick.link_by_s),
                       hedge_share, speed)  # fmt: skip


def robust_speed(speed: ComputeSpeed) -> ComputeSpeed:
    """The speed a plan prices the receiver's compute at: ``speed`` when it is trusted;
    otherwise (its measured rounds disagreed: ComputeSpeed.trusted) every cost times ``1 +
    speed.spread``, about the slowest round the measurement saw. A prefix planned too
    short costs the link time of the tokens it left out, one planned too long the
    receiver's compute time of the tokens it added, several times more per token on the
    links the planner is for: so an untrusted speed errs short."""
    return speed if speed.trusted else speed.scaled(1.0 + speed.spread)


def menu(
    geometry: Geometry, levels: tuple[str, ...], fidelity: dict[str, float] | None = None
) -> tuple[str, ...]:
    """The levels a plan chooses among, best first: those of ``levels`` that ``fidelity``
    (default DEFAULT_FIDELITY) rates, less any that lies on or below the chord between
    its neighbours in (full block's bytes, fidelity): mixing those neighbours gives as much
    fidelity for its bytes, and the planner, which raises blocks one level at a time,
    would pay for the detour. The first and the last rated level always stay. Raises
    ValueError when ``fidelity`` rates none of ``levels``."""
    fid = fidelity or DEFAULT_FIDELITY
    rated = [p for p in levels if p in fid]
    if not rated:
        raise ValueError(f"fidelity rates none of the levels {levels}")
    cost = [geometry.block_nbytes(p) for p in rated]
    keep = [len(rated) - 1]  # from the cheapest (the last), up the upper hull
    for i in range(len(rated) - 2, -1, -1):
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]  # b above the chord from a to i: keep b
            if (fid[rated[b]] - fid[rated[a]]) * (cost[i] - cost[a]) > (
                fid[rated[i]] - fid[rated[a]]
            ) * (cost[b] - cost[a]):
                break
            keep.pop()
        keep.append(i)
    return tuple(rated[i] for i in sorted(keep))


@dataclass(frozen=True)
class _Task:
    """One planning problem: the cache, its utilities, the cost and fidelity per level,
    the link and the budget; :meth:`plan` prices a split and a level per block."""

    g: Geometry
    u: np.ndarray
    cost: np.ndarray  # [layers, token_blocks, levels] bytes
    fid: np.ndarray  # per level
    link: LinkEstimate
    margin: float
    budget_s: float
    levels: tuple[str, ...]
    min_fidelity: float
    order: str
    answer_s: float

    @cached_property
    def codes(self) -> np.ndarray:
        """Per level, its code (index into kvtransport.kvformat.blocks.PRECISIONS)."""
        return np.array([PRECISIONS.index(p) for p in self.levels])

    @cached_property
    def range_sequence(self) -> np.ndarray:
        """The token ranges in the order the stream completes them."""
        flat = stream_order(self.u, self.g.block_tokens, self.order)
        return np.argsort(range_rank(flat, self.g.token_blocks), kind="stable")

    def upgrades(self, level: np.ndarray) -> tuple[np.ndarray, ...]:
        """Every one-level raise of a sent block, in the order that buys the most fidelity
        per byte first: (layer, token block, target level, fidelity gained, extra bytes)
        arrays. A block's raises keep their own order (each is ranked no higher than the
        one before it, which matters only where short blocks bend the menu's hull); ties
        go to the more useful block, then to a block's earlier raise."""
        u, fid, cost = self.u, self.fid, self.cost
        rows: list[tuple[np.ndarray, ...]] = []
        blocks = np.argwhere(level > 0)
        i, j = blocks[:, 0], blocks[:, 1]
        best = np.full(len(blocks), np.inf)
        for nth in range(len(self.levels) - 1):  # the nth raise of each block
            target = level[i, j] - 1 - nth
            ok = target >= 0
            ti, tj, t = i[ok], j[ok], target[ok]
            gain = u[ti, tj] * (fid[t] - fid[t + 1])
            extra = cost[ti, tj, t] - cost[ti, tj, t + 1]
            best[ok] = np.minimum(best[ok], gain / np.maximum(extra, 1))
            rows.append((ti, tj, t, gain, extra, best[ok].copy(), np.full(t.size, nth)))
        ti, tj, t, gain, extra, rank, step = (np.concatenate(c) for c in zip(*rows, strict=True))
        order = np.lexsort((step, -u[ti, tj], -rank))
        return ti[order], tj[order], t[order], gain[order], extra[order]

    @cached_property
    def cheapest_upgrades(self) -> tuple[np.ndarray, ...]:
        """:meth:`upgrades` from every block at the cheapest level: (layer, token block,
        target level, fidelity gained). A block's raises and their rank depend on that
        block alone, so the order for any prefix is this one less the prefix's blocks
        (computed once, not once per split)."""
        level = np.full((self.g.num_layers, self.g.token_blocks), len(self.levels) - 1)
        return self.upgrades(level)[:4]

    def floored(self, k: int) -> np.ndarray:
        """The levels with the first ``k`` token ranges computed (-1) and the rest at the
        cheapest level, raised in :meth:`upgrades`' order (the most fidelity per byte
        first) until the expected fidelity reaches ``min_fidelity`` (as far as the levels
        allow)."""
        g, u, fid = self.g, self.u, self.fid
        level = np.full((g.num_layers, g.token_blocks), len(self.levels) - 1)
        level[:, :k] = -1
        need = self.min_fidelity - float(u[:, :k].sum() + u[:, k:].sum() * fid[-1])
        if need <= 0 or len(self.levels) == 1:
            return level
        i, j, target, gain = self.cheapest_upgrades
        sent = j >= k  # a block's raises rank by the block alone: the order from all
        i, j, target, gain = i[sent], j[sent], target[sent], gain[sent]  # blocks holds
        take = min(int(np.searchsorted(np.cumsum(gain), need, side="left")) + 1, len(gain))
        np.minimum.at(level, (i[:take], j[:take]), target[:take])
        return level

    def upgraded(self, k: int, level: np.ndarray, compute_s: float, by_s: float) -> HandoffPlan:
        """Raise sent blocks in :meth:`upgrades`' order while the bytes still cross by
        ``by_s`` (the longest prefix of that order whose extra bytes fit)."""
        level = level.copy()
        cost = self.cost
        sent = level >= 0
        now = np.take_along_axis(cost, np.maximum(level, 0)[..., None], 2)[..., 0][sent].sum()
        room = self.link.max_bytes(by_s, self.margin) - int(now)
        if len(self.levels) > 1 and np.any(level > 0):
            i, j, target, _, extra = self.upgrades(level)
            take = int(np.searchsorted(np.cumsum(extra), room, side="right"))
            np.minimum.at(level, (i[:take], j[:take]), target[:take])
        return self.plan(k, level, compute_s)

    def hedged(self, plan: HandoffPlan, share: float, speed: ComputeSpeed) -> HandoffPlan:
        """``plan`` with its hedge (see the module docstring): the prefix's last token
        ranges, ``share`` of the prefix's ranges (rounded down) and at most one race
        chunk, at the cheapest level that keeps the fidelity floor (the best level if none
        does); due after the planned ranges, the last first. No hedge where computing it
        costs less than HEDGE_MIN_CALLS calls (``speed``): the extra call a receiver on
        time pays would then outweigh what a slow one saves."""
        link, bt = self.link, self.g.block_tokens
        k = -(-plan.split // bt)  # the prefix's token ranges (the last may be short)
        h = min(int(share * k), DEFAULT_MAX_CHUNK // bt)
        if h == 0 or h * bt * speed.per_token_s < HEDGE_MIN_CALLS * speed.per_call_s:
            return plan
        floor_ok = [i for i, f in enumerate(self.fid) if f >= self.min_fidelity]
        lv = floor_ok[-1] if floor_ok else 0
        per_range = self.cost[:, :, lv].sum(axis=0)
        cum = plan.payload_bytes + np.cumsum(per_range[k - h : k][::-1])  # last first
        lo = k - h
        precision = plan.precision.copy()
        precision[:, lo:k] = self.codes[lv]
        range_bytes = plan.range_bytes.copy()
        range_bytes[lo:k] = per_range[lo:k]
        expect = plan.expect_at.copy()
        expect[lo:k] = link.seconds_each(cum[::-1], self.margin)
        return replace(plan, precision=precision, range_bytes=range_bytes, expect_at=expect,
                       hedge=plan.split - lo * bt,
                       hedge_bytes=int(cum[-1]) - plan.payload_bytes)  # fmt: skip

    def plan(self, k: int, level: np.ndarray, compute_s: float) -> HandoffPlan:
        """The plan with the first ``k`` token ranges computed and ``level`` per block."""
        g, link = self.g, self.link
        sent = level >= 0
        lv = np.maximum(level, 0)
        block_bytes = np.where(sent, np.take_along_axis(self.cost, lv[..., None], 2)[..., 0], 0)
        per_range = block_bytes.sum(axis=0)  # a range's layers go back to back
        # each range is in place once the bytes sent up to it (stream order) crossed
        seq = self.range_sequence
        cum = np.empty(g.token_blocks)
        cum[seq] = np.cumsum(per_range[seq])
        t = self._tail_from(k, per_range)
        if t < g.token_blocks:  # the tail's ranges complete with their last layer's blocks
            before = cum[t] - per_range[t]
            cum[t:] = before + block_bytes[:-1, t:].sum() + np.cumsum(block_bytes[-1, t:])
        expect = link.seconds_each(cum, self.margin)
        expect[:k] = np.inf
        nbytes = int(per_range.sum())
        link_s = link.seconds(nbytes, self.margin)
        precision = np.where(sent, self.codes[lv], -1)
        u = self.u
        fidelity = float(u[~sent].sum() + (u * np.where(sent, self.fid[lv], 0.0)).sum())
        return HandoffPlan(
            split=min(k * g.block_tokens, g.num_tokens),
            precision=precision.astype(np.int64),
            expect_at=expect,
            range_bytes=per_range.astype(np.int64),
            payload_bytes=nbytes,
            compute_s=compute_s,
            link_s=link_s,
            fidelity=fidelity,
            fits=compute_s <= self.budget_s and link_s <= self.budget_s,
            prefix_utility=float(u[:, :k].sum()),
            order=self.order,
            answer_s=self.answer_s,
            tail=max(g.num_tokens - t * g.block_tokens, 0) if t < g.token_blocks else 0,
        )

    def _tail_from(self, k: int, per_range: np.ndarray) -> int:
        """The first token range of the layer-major tail (token_blocks: none): the fewest
        last ranges, at least two, whose bytes take the link ``answer_s`` (all the sent
        ranges if they take less). Only for the position order, after the prefix's ``k``
        ranges."""
        nb = self.g.token_blocks
        if self.answer_s <= 0 or self.order != "position" or nb - k < 2:
            return nb
        wire = np.cumsum(per_range[k:][::-1])  # bytes of the last 1, 2, ... ranges
        times = self.link.seconds_each(wire, self.margin)
        enough = np.flatnonzero(times - self.link.one_way_s >= self.answer_s)
        count = max(int(enough[0]) + 1 if enough.size else nb - k, 2)
        return nb - count


def parse_levels(spec: str | tuple[str, ...]) -> tuple[str, ...]:
    """``auto`` (DEFAULT_LEVELS) or precision names best first ("fp16,int8", "fp32", ...).

    Raises ValueError naming the choices otherwise."""
    if isinstance(spec, str):
        if spec.strip() == "auto":
            return DEFAULT_LEVELS
        spec = tuple(p.strip() for p in spec.split(",") if p.strip())
    levels = tuple(spec)
    if not levels or any(p not in PRECISIONS for p in levels):
        raise ValueError(
            f"precision must be auto or names from {', '.join(PRECISIONS)}, best first, "
            f"not {','.join(levels) or 'nothing'!r}"
        )
    return levels


def sending_order(plan: HandoffPlan, utilities: np.ndarray, block_tokens: int) -> np.ndarray:
    """Flat block indices in the order ``plan`` sends them: the ranges after its prefix in
    the plan's order, its tail layer by layer (layer 0 of every tail range, then layer 1,
    ...), then the hedge's ranges last first, then the rest of the prefix (which the plan
    does not send: encode_stream leaves out blocks of precision -1)."""
    nb = np.asarray(utilities).shape[1]
    base = stream_order(utilities, block_tokens, plan.order)
    layer, tblock = np.divmod(base, nb)
    first, split = plan.first_call // block_tokens, -(-plan.split // block_tokens)
    tail_from = nb - -(-plan.tail // block_tokens)
    group = np.where(tblock >= split, np.where(tblock >= tail_from, 1, 0),
                     np.where(tblock >= first, 2, 3))  # fmt: skip
    within = np.where(group == 1, layer * nb + tblock, np.where(group == 2, -tblock, 0))
    return base[np.lexsort((np.arange(base.size), within, group))]


def planned_stream(
    stream: EncodedStream,
    *,
    link: LinkEstimate,
    budget_s: float,
    speed: ComputeSpeed | None = None,
    levels: tuple[str, ...] = DEFAULT_LEVELS,
    token_ids: np.ndarray | None = None,
    objective: str = "fidelity",
    min_fidelity: float = DEFAULT_MIN_FIDELITY,
    order: str = "position",
    hedge_share: float = DEFAULT_HEDGE_SHARE,
    answer_s: float = 0.0,
    int8_group_size: int | None = None,
    int4_keys: str = "channel",
    fidelity: dict[str, float] | None = None,
) -> tuple[HandoffPlan, EncodedStream]:
    """Plan a card's stream for ``budget_s`` and re-encode it the way the plan sends it.

    The stream is decoded (numpy only: no model), planned, and encoded again in the
    plan's stream order (``order``, one of ORDERS; the hedge last, :func:`sending_order`)
    at the planned precisions, without the receiver's first call. ``speed`` is the
    receiver's compute speed; None plans nothing for the receiver to compute (split 0).
    token_ids: needed when the stream's manifest carries only their hash; answer_s: the
    question's forward time on the receiver (its tail, :func:`plan_handoff`).
    int8_group_size / int4_keys: the int8 quantization group and int4's key layout planned
    and sent, whatever the card's own (:meth:`Geometry.of`'s defaults: cards written
    before them hold 32-value groups and int4 keys per token; int4's group is Geometry.of's
    for the key layout). fidelity: per precision, as :func:`plan_handoff` takes it.
    """
    m = stream.manifest
    full = decode_stream(m, stream.payload, token_ids=token_ids)
    if full.missing.size:
        raise ValueError("the stream to plan is incomplete")
    g = Geometry.of(full.cache, m.geometry.block_tokens, None, int8_group_size, int4_keys)
    if "int8r" in levels:  # int8r blocks planned at the card's coded size (kvformat.blocks)
        g = estimate_coded(g, full.cache, m)
    u = m.utility_grid()
    if not u.sum() > 0:
        u[:] = 1.0
    plan = plan_handoff(g, u, link=link, speed=speed or NO_RECEIVER_COMPUTE,
                        budget_s=budget_s, levels=levels, objective=objective,
                        fidelity=fidelity, min_fidelity=min_fidelity, order=order,
                        hedge_share=hedge_share, answer_s=answer_s)  # fmt: skip
    note = f"split {plan.split}, budget {budget_s * 1e3:.0f} ms"
    note += f", hedge {plan.hedge}" if plan.hedge else ""
    note += f", tail {plan.tail}" if plan.tail else ""
    created = dict(
        m.created, plan=note if plan.order == "position" else f"{note}, order {plan.order}"
    )
    return plan, encode_planned(full.cache, u, plan, g, created)


def encode_planned(
    cache: KVCache,
    utilities: np.ndarray,
    plan: HandoffPlan,
    geometry: Geometry,
    created: dict[str, Any] | None = None,
) -> EncodedStream:
    """``cache`` encoded the way ``plan`` (made for ``geometry``) sends it: each block at its
    planned precision, in the plan's sending order (:func:`sending_order`: the receiver's
    first call is not sent). ``utilities``: the grid the plan was made with."""
    sending = sending_order(plan, utilities, geometry.block_tokens)
    return encode_stream(cache, utilities, sending, plan.precision,
                         block_tokens=geometry.block_tokens, group_size=geometry.group_size,
                         int8_group_size=geometry.int8_group_size, int4_keys=geometry.int4_keys,
                         created=created)  # fmt: skip
