"""The receiver's race: compute the context's front while the rest loads, then complete.

From the moment a handoff is announced the receiver builds the cache front to back
(kvtransport.cache_builder.CacheBuilder): first the ``split`` tokens the plan gave it
(kvtransport.plan; the sender does not send them), then, token range by token range, it
*loads* a range whose K/V have arrived in every layer, *waits* a little for a range that
is due any moment, or *computes* a run of ranges that have not arrived. The result is
always the whole cache, exact up to the quantization of what was loaded:

- compute while loading: the prefix is computed while the link carries the rest;
- completion: a range that never arrived (lost beyond repair, or never sent by the
  deadline) is recomputed at its own positions over the ranges before it;
- fallback: with a dead link nothing ever arrives, every range is computed, and the
  time is one chunked prefill (plus nothing: the receiver never idles on a range that is
  overdue).

The wait-or-compute rule for a range that has not arrived: wait if its planned arrival
(``expect_at``) is no more than ``slack_s`` in the past and no later than the time
computing the range would take; otherwise compute a run of consecutive ranges that have
not arrived, up to a cap of ``max_chunk`` tokens that doubles with every compute in a row
(so a dead link costs a handful of calls, not one per range), taking in an arrived gap
when computing it costs less than the extra call it saves.

:func:`run_race` replays the race against a transfer's measured arrival timeline
(``ready_at``: when each token range was complete at the receiver, counted from the
transfer's start): computing and loading run for real on the model and advance the race
clock by their measured wall time; a wait advances it to the arrival (or to the end of the
wait). The decisions only use arrivals up to the race clock, so they are the ones a live
receiver would take; what the replay leaves out is any CPU contention between the
receiving daemon and the model (on a receiver host they run on different cores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransport.cache_builder import CacheBuilder, ComputeSpeed
from kvtransport.kvcache import KVCache

DEFAULT_MAX_CHUNK = 128
DEFAULT_SLACK_S = 0.02


def range_ready_at(manifest: Any, arrival_s: np.ndarray | None) -> np.ndarray:
    """Per token range: when its last layer's block was complete (inf: some never was).

    manifest: the blocks manifest (kvtransport.blocks.Manifest) of the stream; arrival_s:
    per block in stream order, seconds from the transfer's start (inf: never). A range
    with a layer not in the stream (the receiver's own prefix) is never ready.
    """
    g = manifest.geometry
    ready = np.full((g.num_layers, g.token_blocks), np.inf)
    if arrival_s is not None and len(arrival_s):
        ready[manifest.layer.astype(np.int64), manifest.token_block.astype(np.int64)] = arrival_s
    return ready.max(axis=0)


@dataclass
class RaceStep:
    """One step of the race: what was done to which tokens, and when on the race clock."""

    action: str  # "compute", "load" or "wait"
    start: int  # first token
    tokens: int
    t0: float
    t1: float


@dataclass
class RaceResult:
    """The whole cache and how it was made.

    seconds: race clock when the last token was in place (from the transfer's start).
    computed / loaded: tokens computed by the receiver / loaded from the link.
    """

    kv: KVCache
    seconds: float
    computed: int
    loaded: int
    waited_s: float
    steps: list[RaceStep] = field(default_factory=list)

    @property
    def recomputed(self) -> int:
        """Tokens computed after the planned prefix (the link did not deliver them)."""
        first = self.steps[0] if self.steps else None
        prefix = first.tokens if first is not None and first.action == "compute" else 0
        return self.computed - prefix


def run_race(
    model: Any,
    token_ids: list[int],
    *,
    split: int,
    received: KVCache | None,
    ready_at: np.ndarray,
    expect_at: np.ndarray,
    speed: ComputeSpeed,
    block_tokens: int,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    slack_s: float = DEFAULT_SLACK_S,
) -> RaceResult:
    """Replay the race (see the module docstring) and return the cache it built.

    received: the K/V that arrived (zeros elsewhere), ``[layers, heads, tokens, dim]``,
        or None when nothing did; ready_at / expect_at: per token range of
        ``block_tokens``, the measured and the planned arrival (inf: never / not sent).
    """
    n = len(token_ids)
    ranges = -(-n // block_tokens)
    if ready_at.shape != (ranges,) or expect_at.shape != (ranges,):
        raise ValueError(f"ready_at and expect_at must have {ranges} token ranges")
    if split < 0 or split > n or (split % block_tokens and split != n):
        raise ValueError(f"split {split} is not a token range boundary of {n} tokens")
    if received is None:
        ready_at = np.full(ranges, np.inf)
    b = CacheBuilder(model, token_ids)
    steps: list[RaceStep] = []
    clock = 0.0

    def timed(action: str, tokens: int, fn: Any, *args: Any) -> None:
        nonlocal clock
        start = b.filled
        w0 = time.perf_counter()
        fn(*args)
        t1 = clock + time.perf_counter() - w0
        steps.append(RaceStep(action, start, tokens, clock, t1))
        clock = t1

    if split:
        timed("compute", split, b.compute, split)
    range_cost = speed.seconds(block_tokens)
    merge_tokens = speed.per_call_s / speed.per_token_s
    computes_in_a_row = 0
    while b.filled < n:
        r = b.filled // block_tokens
        if ready_at[r] <= clock:  # load every range in place by now, in one go
            end = r
            while end < ranges and ready_at[end] <= clock:
                end += 1
            lo, hi = b.filled, min(end * block_tokens, n)
            assert received is not None
            timed("load", hi - lo, b.load, received.keys[:, :, lo:hi], received.values[:, :, lo:hi])
            computes_in_a_row = 0
            continue
        due = expect_at[r]
        if clock - slack_s <= due <= clock + range_cost:
            wake = min(max(due, clock) + slack_s, clock + range_cost)
            t1 = min(ready_at[r], wake)
            steps.append(RaceStep("wait", b.filled, 0, clock, t1))
            clock = t1
            if ready_at[r] <= clock:
                continue
        # compute the ranges that have not arrived: up to the chunk cap, which doubles
        # with every compute in a row (a dead link costs few calls), and over an arrived
        # gap shorter than what one more call would cost
        cap = max_chunk << min(computes_in_a_row, 8)
        end = r + 1
        while end < ranges and (end + 1 - r) * block_tokens <= cap:
            if ready_at[end] > clock:
                end += 1
                continue
            gap = end
            while gap < ranges and ready_at[gap] <= clock:
                gap += 1
            if gap >= ranges or (gap - end) * block_tokens > merge_tokens:
                break
            end = gap
        hi = min(end * block_tokens, n)
        timed("compute", hi - b.filled, b.compute, hi - b.filled)
        computes_in_a_row += 1
    computed = sum(s.tokens for s in steps if s.action == "compute")
    waited = sum(s.t1 - s.t0 for s in steps if s.action == "wait")
    return RaceResult(b.kv(), clock, computed, n - computed, waited, steps)
