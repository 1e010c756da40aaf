"""vLLM's paged KV cache as kvtransport token ranges, and back: the connector without vLLM.

vLLM keeps a request's KV in fixed-size *blocks* of ``block_size`` tokens, every layer's
K and V of a token range in the block of the same id (``block_ids[i]`` holds tokens
``[i * block_size, (i + 1) * block_size)``). It takes a partial load only as a prefix:
it recomputes from the first block with a load error. So the connector
(kvtransport.embed.vllm_connector, the only part that imports vLLM) ships a request's cache in
prefix order, token ranges front first with every layer of a range together
(kvtransport.model.utility's ``position`` order), and loads the longest prefix of token ranges
that arrived complete in *every* layer; the blocks after it are reported failed.

This module is numpy and the embeddable API only:

- :func:`gather` / :func:`scatter`: a request's tokens between per-layer paged arrays
  (logical K and V views ``[num_blocks, kv_heads, block_size, head_dim]``, strided as the
  engine stores them: kvtransport.embed.vllm_connector.paged_views) and a
  :class:`~kvtransport.kvformat.kvcache.KVCache`;
- :func:`plan_push`: the producer's decision for one push, by the product's handoff
  planner (kvtransport.model.plan): a precision per block and the planned time, or a
  decline where the consumer's own prefill (:class:`StepSpeed` measures one) is sooner;
- :func:`encode_request`: the cache as a prefix-ordered block stream (lossless, or at a
  plan's precisions) whose manifest names the request (``created["request"]``) and
  carries the producer's :class:`Compat` header (``created["vllm"]``);
- :func:`load_plan`: from a received result, the usable prefix and the vLLM block ids
  that failed (:class:`LoadPlan`); a result whose header does not match the consumer's
  :class:`Compat`, or whose manifest is not the cache of the request's prompt, loads
  nothing;
- :func:`race_cut`: the consumer's race against its own push: whether computing what
  has not arrived is now sooner than waiting for it (then the load is cut and what
  arrived loads);
- :class:`Pusher` encodes and sends caches in background threads through
  :func:`kvtransport.send` with a deadline; :class:`Inbox` receives many transfers on one
  UDP port (the receiver daemon's engine), hands each result out by its request tag,
  cuts a transfer short on request (:meth:`Inbox.cut`: what arrived is delivered at
  once), says how much of a transfer still arriving would load now
  (:meth:`Inbox.progress`) and drops results nobody took within a lease or beyond a byte
  bound.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from kvtransport.daemons.api import DeliveredResult
from kvtransport.embed.inprocess import NOT_SENT, SendOptions
from kvtransport.errors import UserError
from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model.cache_builder import ComputeSpeed
from kvtransport.model.plan import (
    NO_RECEIVER_COMPUTE,
    HandoffPlan,
    LinkEstimate,
    encode_planned,
    plan_handoff,
)
from kvtransport.model.utility import stream_order

REQUEST_TAG = "request"
"""Key in the blocks manifest's ``created`` dict that names the vLLM request."""
COMPAT_TAG = "vllm"
"""Key in the blocks manifest's ``created`` dict that holds the producer's :class:`Compat`."""
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
"""Model config entries that differ between two copies of one model (a path, the library
version that wrote it): left out of :func:`config_digest`."""


# ---------------------------------------------------------------------- compatibility


@dataclass(frozen=True)
class Compat:
    """What a consumer's paged cache must share with the producer's for its KV to load.

    model_id: the served model's name (the same on both engines, or set in both
    connectors' ``model_id``); num_layers / num_kv_heads / head_dim: the paged cache's
    geometry; dtype: its element type (``float32`` / ``float16``); block_size: vLLM's block
    size; config_hash: :func:`config_digest` of the model's config (a different checkpoint
    of the same shape has another).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    config_hash: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_created(cls, created: dict[str, Any]) -> Compat | None:
        """The header a manifest's ``created`` carries (None: absent or malformed)."""
        raw = created.get(COMPAT_TAG)
        if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(cls)}:
            return None
        try:
            return cls(str(raw["model_id"]), int(raw["num_layers"]), int(raw["num_kv_heads"]),
                       int(raw["head_dim"]), str(raw["dtype"]), int(raw["block_size"]),
                       str(raw["config_hash"]))  # fmt: skip
        except (TypeError, ValueError):
            return None

    def mismatch(self, other: Compat) -> str:
        """The first field where ``other`` differs, as one line ("" when they match)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"{f.name} {theirs!r} is not this engine's {mine!r}"
        return ""


def config_digest(config: dict[str, Any]) -> str:
    """SHA-256 (hex) of a model config dict, sorted, without :data:`VOLATILE_CONFIG_KEYS`
    (non-JSON values by their ``str``)."""
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------- layout


def _check_views(keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> tuple[int, ...]:
    if not keys or len(keys) != len(values):
        raise ValueError(f"need one K and one V view per layer, got {len(keys)} and {len(values)}")
    shape = keys[0].shape
    if len(shape) != 4 or any(a.shape != shape for a in (*keys, *values)):
        raise ValueError(f"paged views must share one [blocks, heads, block_size, dim] shape, "
                         f"not {[a.shape for a in keys[:2]]}")  # fmt: skip
    return shape


def _token_slots(block_ids: Sequence[int], block_size: int, start: int, stop: int,
                 num_blocks: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(block id, offset in block) of each token in ``[start, stop)``."""
    tokens = np.arange(start, stop, dtype=np.int64)
    index = tokens // block_size
    ids = np.asarray(block_ids, dtype=np.int64)
    if index.size and index[-1] >= ids.size:
        raise ValueError(f"{ids.size} blocks of {block_size} tokens cannot hold {stop} tokens")
    slot_blocks = ids[index]
    if slot_blocks.size and (slot_blocks.min() < 0 or slot_blocks.max() >= num_blocks):
        raise ValueError(f"block ids outside the paged cache's {num_blocks} blocks")
    return slot_blocks, tokens % block_size


def gather(
    keys: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    block_ids: Sequence[int],
    token_ids: Sequence[int],
    model_id: str,
) -> KVCache:
    """The request's KV out of the paged cache, as one contiguous KVCache (a copy).

    keys, values: per layer, ``[num_blocks, kv_heads, block_size, head_dim]`` views of
        the paged cache (float32 or float16). block_ids: the request's blocks in token
        order. token_ids: the tokens whose KV is taken (tokens ``0..len-1``).
    """
    nb, heads, block_size, dim = _check_views(keys, values)
    n = len(token_ids)
    blk, off = _token_slots(block_ids, block_size, 0, n, nb)
    # [n, heads, dim] per layer (advanced indices first), then [heads, n, dim]
    k = np.stack([np.asarray(x)[blk, :, off].transpose(1, 0, 2) for x in keys])
    v = np.stack([np.asarray(x)[blk, :, off].transpose(1, 0, 2) for x in values])
    return KVCache(k, v, np.asarray(token_ids, dtype=np.int64), model_id)


def scatter(
    cache: KVCache,
    keys: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    block_ids: Sequence[int],
    start: int,
    stop: int,
) -> None:
    """Write tokens ``[start, stop)`` of ``cache`` into the paged views (in place)."""
    nb, heads, block_size, dim = _check_views(keys, values)
    if cache.keys.shape[:2] != (len(keys), heads) or cache.head_dim != dim:
        raise ValueError(
            f"cache {cache.keys.shape} does not fit {len(keys)} layers of {heads} heads x {dim}"
        )
    if not 0 <= start <= stop <= cache.num_tokens:
        raise ValueError(f"tokens [{start}, {stop}) are not in the cache's {cache.num_tokens}")
    blk, off = _token_slots(block_ids, block_size, start, stop, nb)
    for layer, (kd, vd) in enumerate(zip(keys, values, strict=True)):
        kd[blk, :, off] = cache.keys[layer, :, start:stop].transpose(1, 0, 2)
        vd[blk, :, off] = cache.values[layer, :, start:stop].transpose(1, 0, 2)


# ---------------------------------------------------------------------- the stream


def prefix_utilities(g: blocks.Geometry) -> np.ndarray:
    """``[layers, token_blocks]`` block utilities for a prefix-only consumer: a range's
    token count (every token of a usable prefix counts alike)."""
    counts = g.block_token_count(np.arange(g.token_blocks)).astype(np.float64)
    return np.tile(counts, (g.num_layers, 1))


def geometry_for(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, num_tokens: int,
    block_tokens: int,
) -> blocks.Geometry:  # fmt: skip
    """The geometry :func:`encode_request` gives a request's cache of this shape (the
    block format's defaults, :meth:`Geometry.of`), known before the cache is (the
    scheduler plans a push before the worker copies it out). ValueError for a dtype the
    block format does not hold (only float32 and float16)."""
    shape = (num_layers, num_kv_heads, num_tokens, head_dim)
    kv = np.broadcast_to(np.zeros((), dtype=dtype), shape)
    return blocks.Geometry.of(KVCache(kv, kv, np.zeros(num_tokens, np.int64), ""), block_tokens)


@dataclass(frozen=True)
class PushPlan:
    """What the producer decided for one push (:func:`plan_push`).

    plan: the handoff plan (kvtransport.model.plan.HandoffPlan: a precision per block, the
    stream order, ``link_s``: when the whole cache is planned in place at the consumer);
    recompute_s: the consumer's own prefill of the prompt at its compute speed (None:
    unknown); declined: the push cannot pay off (``link_s`` beyond ``threshold`` times
    ``recompute_s``), the consumer recomputes instead; why: one line saying so.
    """

    plan: HandoffPlan
    recompute_s: float | None
    declined: bool
    why: str = ""

    def describe(self) -> str:
        own = "?" if self.recompute_s is None else f"{self.recompute_s * 1e3:.0f}"
        return (f"{self.plan.describe()}; the consumer's own prefill {own} ms"
                + (f"; declined: {self.why}" if self.declined else ""))  # fmt: skip


def plan_push(
    g: blocks.Geometry,
    *,
    link: LinkEstimate,
    budget_s: float,
    levels: tuple[str, ...],
    speed: ComputeSpeed | None = None,
    threshold: float = 1.0,
    objective: str = "ttft",
) -> PushPlan:
    """Plan a push of a cache of geometry ``g`` with the product's handoff planner
    (kvtransport.model.plan.plan_handoff) for a consumer that loads a prefix and
    recomputes the rest (vLLM): precisions from ``levels`` over ``link`` within
    ``budget_s`` under ``objective``, token ranges front first, nothing left for the
    consumer to compute first (its engine takes loaded KV only as a prefix), no hedge and
    no layer-by-layer tail.

    speed: the consumer's prefill speed (None: unknown, never declined); the push is
    declined when its planned time in place exceeds ``threshold`` times the consumer's
    own prefill of the prompt (``threshold`` 0: never declined).
    """
    plan = plan_handoff(g, prefix_utilities(g), link=link, speed=NO_RECEIVER_COMPUTE,
                        budget_s=budget_s, levels=levels, objective=objective,
                        hedge_share=0.0)  # fmt: skip
    recompute_s = None if speed is None else float(speed.seconds(g.num_tokens))
    if recompute_s is None or threshold <= 0 or plan.link_s <= threshold * recompute_s:
        return PushPlan(plan, recompute_s, False)
    why = (f"planned {plan.link_s * 1e3:.0f} ms to move {plan.payload_bytes} bytes > "
           f"{threshold:g} x the consumer's own prefill ({recompute_s * 1e3:.0f} ms)")  # fmt: skip
    return PushPlan(plan, recompute_s, True, why)


PACE_AFTER = 0.25
"""The consumer trusts the pace a push keeps once it has been arriving for this share of
its planned time (before, a burst of loss at its start, repaired later, looks like a
link that stopped)."""


def race_cut(
    *,
    waited_s: float,
    arrived: int,
    total: int,
    recompute_s: float | None,
    planned_s: float | None,
    wait_s: float,
    arriving_s: float = 0.0,
    received: float = 0.0,
) -> bool:
    """Whether a consumer waiting for its push should stop now, load the ``arrived``
    prefix (tokens complete in every layer) and compute the rest itself.

    waited_s: since the load began; arriving_s: since the push's first block arrived
    (0: none yet); received: the share of the push's bytes in complete blocks (0 to 1;
    a lost block holds the prefix back until its repair while later ones arrive, so the
    pace counts these, not the prefix); total: the prompt's tokens; recompute_s: the
    consumer's own prefill of the whole prompt (the producer's estimate; None: unknown);
    planned_s: the push's planned link time (None: unplanned); wait_s: the configured
    bound, always kept. Computing the rest is taken as ``recompute_s`` per token,
    evenly. The rest is expected at the pace the push has kept since its first block
    (once it has been arriving for :data:`PACE_AFTER` of ``planned_s``); before, in
    ``planned_s`` or, once later than that, in as long again as it has been waited for
    (the producer's copy-out and encoding come before the link and are not in its
    plan). Cut when computing the rest is sooner than its expected arrival. Without
    ``recompute_s`` or ``planned_s`` there is no race: only ``wait_s`` cuts.
    """
    if arrived >= total:
        return False
    if waited_s >= wait_s:
        return True
    if recompute_s is None or planned_s is None:
        return False
    rest_compute = recompute_s * (total - arrived) / total
    if received > 0 and arriving_s >= PACE_AFTER * planned_s:
        rest_arrive = arriving_s * (1.0 - received) / received
    else:
        rest_arrive = max(planned_s, waited_s)
    return rest_compute < rest_arrive


def arrived_prefix(manifest: blocks.Manifest, complete: np.ndarray) -> int:
    """Leading tokens of a stream whose blocks are complete in every layer (``complete``:
    per block, in stream order, as the receiving session marks them)."""
    g = manifest.geometry
    done = np.zeros((g.num_layers, g.token_blocks), dtype=bool)
    got = np.asarray(complete, dtype=bool)
    done[manifest.layer.astype(np.int64), manifest.token_block.astype(np.int64)] = got
    ranges = usable_prefix(done)
    return int(min(ranges * g.block_tokens, g.num_tokens))


@dataclass
class StepSpeed:
    """An engine's prefill speed measured on its own steps (the consumer's, when the
    producer runs the same model on the same kind of host and nobody configured it).

    :meth:`scheduled` when a step is scheduled with its token count, :meth:`finished` when
    its output is back, in order. A step runs from when it was scheduled or the step before
    it finished, whichever is later (so steps scheduled ahead are not counted twice), to
    when it finished; steps of at least ``min_tokens`` tokens give a time per token, and
    :meth:`speed` is the median of the last ``window`` (None before the first).
    """

    min_tokens: int = 128
    window: int = 8
    _queue: list[tuple[float, int]] = field(default_factory=list)
    _last_end: float = float("-inf")
    _samples: list[float] = field(default_factory=list)

    def scheduled(self, now: float, tokens: int) -> None:
        self._queue.append((now, int(tokens)))

    def finished(self, now: float) -> None:
        if not self._queue:
            return
        at, tokens = self._queue.pop(0)
        began, self._last_end = max(at, self._last_end), now
        if tokens >= self.min_tokens and now > began:
            self._samples = [*self._samples[-(self.window - 1) :], (now - began) / tokens]

    def speed(self) -> ComputeSpeed | None:
        if not self._samples:
            return None
        return ComputeSpeed(per_call_s=0.0, per_token_s=float(np.median(self._samples)))


def encode_request(
    cache: KVCache,
    tag: str,
    block_tokens: int,
    compat: Compat | None = None,
    plan: HandoffPlan | None = None,
) -> blocks.EncodedStream:
    """The cache as a block stream in prefix order, its manifest tagged ``tag`` and
    carrying ``compat`` (a consumer that checks headers loads nothing without one) and
    the prompt's token ids (what binds the stream to one prompt).

    block_tokens: tokens per range; vLLM's block size, or a divisor of it (a smaller range
    is lost alone, but vLLM still recomputes its whole block). plan: None sends every block
    lossless (the cache's dtype); a :class:`PushPlan`'s plan (made for this geometry)
    sends each block at its planned precision in its planned order
    (kvtransport.model.plan.encode_planned). ValueError when the plan is another shape's.
    """
    g = blocks.Geometry.of(cache, block_tokens)
    u = prefix_utilities(g)
    created: dict[str, Any] = {REQUEST_TAG: str(tag)}
    if compat is not None:
        created[COMPAT_TAG] = compat.to_dict()
    if plan is None:
        order = stream_order(u, block_tokens, "position")
        return blocks.encode_stream(cache, u, order, block_tokens=block_tokens, created=created)
    if plan.precision.shape != u.shape or plan.split:
        raise ValueError(f"a plan of {plan.precision.shape} blocks (split {plan.split}) is not "
                         f"a push plan for {u.shape} blocks")  # fmt: skip
    return encode_planned(cache, u, plan, g, created)


def request_tag(result: DeliveredResult) -> str | None:
    """The request a received transfer belongs to (None: no manifest, or not tagged)."""
    if result.app_metadata is None:
        return None
    try:
        m = blocks.Manifest.from_bytes(result.app_metadata)
    except ValueError:
        return None
    tag = m.created.get(REQUEST_TAG)
    return str(tag) if tag is not None else None


@dataclass(frozen=True)
class LoadPlan:
    """What a consumer loads from a received result.

    prefix: tokens loaded, from token 0, a multiple of ``block_size`` unless it is the
        whole request. failed_block_ids: the request's vLLM blocks among ``[start, stop)``
        that were not loaded (vLLM recomputes from the first). cache: the reassembled
        cache (None when nothing usable arrived). why: a short reason when not everything
        loaded ("" when it did). refused: the result was refused whole (no or another
        compatibility header, another prompt, an unreadable manifest), not merely cut.
    """

    prefix: int
    failed_block_ids: list[int]
    cache: KVCache | None
    why: str = ""
    refused: bool = False

    @property
    def complete(self) -> bool:
        return not self.failed_block_ids


def usable_prefix(present: np.ndarray) -> int:
    """Leading tokens present in every layer (``present``: ``[layers, tokens]`` bool)."""
    every = np.asarray(present, dtype=bool).all(axis=0)
    missing = np.flatnonzero(~every)
    return int(missing[0]) if missing.size else int(every.size)


def _covers(manifest: blocks.Manifest, ids: np.ndarray) -> bool:
    """Whether the stream is the cache of a prompt that starts with ``ids`` (exactly
    ``ids`` unless the manifest carries its token ids)."""
    if manifest.geometry.num_tokens == ids.size:
        return blocks.is_cache_of(manifest, ids)
    if manifest.token_ids is None or manifest.geometry.num_tokens < ids.size:
        return False
    return bool(np.array_equal(manifest.token_ids[: ids.size], ids))


def refusal(result: DeliveredResult, expect: Compat | None, token_ids: np.ndarray) -> str:
    """Why ``result`` must not be written into the consumer's cache ("" when it may).

    The manifest must parse, be the cache of ``token_ids`` (its token ids or their
    SHA-256), and, with ``expect``, carry a :class:`Compat` header equal to it whose
    geometry is the manifest's own.
    """
    if result.app_metadata is None:
        return "no manifest arrived"
    try:
        m = blocks.Manifest.from_bytes(result.app_metadata)
    except ValueError as exc:
        return f"unreadable manifest ({exc})"
    if not _covers(m, token_ids):
        return "the transfer is of another prompt"
    if expect is None:
        return ""
    got = Compat.from_created(m.created)
    if got is None:
        return "the transfer has no compatibility header"
    why = expect.mismatch(got)
    if why:
        return f"incompatible KV: {why}"
    g = m.geometry
    if (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) != (
        got.num_layers, got.num_kv_heads, got.head_dim, got.dtype):  # fmt: skip
        return "incompatible KV: the payload's geometry is not its header's"
    return ""


def load_plan(
    result: DeliveredResult | None,
    *,
    block_ids: Sequence[int],
    block_size: int,
    start: int,
    stop: int,
    token_ids: Sequence[int],
    expect: Compat | None = None,
) -> LoadPlan:
    """Decide what of ``result`` the consumer loads into tokens ``[start, stop)``.

    result: the transfer (None: nothing arrived by the deadline). block_ids: the request's
    vLLM blocks in token order. token_ids: the request's prompt. A result :func:`refusal`
    turns down (another prompt; with ``expect``, a missing or different compatibility
    header) loads nothing and is ``refused``. Otherwise the usable prefix is the longest
    run of token ranges complete in every layer, rounded down to whole vLLM blocks
    (unless it reaches ``stop``); every block from there to ``stop`` fails.
    """
    last_block = -(-stop // block_size)

    def failed(prefix: int, why: str, cache: KVCache | None = None, refused: bool = False):
        cut = max(prefix, start)
        ids = [int(b) for b in block_ids[cut // block_size : last_block]] if cut < stop else []
        return LoadPlan(prefix, ids, cache, why if ids else "", refused and bool(ids))

    if start % block_size:
        raise ValueError(f"a load must start on a block boundary, not at token {start}")
    if result is None:
        return failed(start, "nothing arrived")
    from kvtransport.embed.partial import partial_cache

    ids = np.asarray(token_ids, dtype=np.int64)[:stop]
    why = refusal(result, expect, ids)
    if why:
        return failed(start, why, refused=result.app_metadata is not None)
    try:
        got = partial_cache(result)
    except (UserError, ValueError) as exc:
        return failed(start, str(exc), refused=True)
    prefix = min(usable_prefix(got.present[:, :stop]), stop)
    if prefix < stop:
        prefix -= prefix % block_size
    why = "" if prefix >= stop else f"token {prefix} of {stop} missing at the deadline"
    return failed(prefix, why, got.cache if prefix > start else None)


# ---------------------------------------------------------------------- transport


def _status(future: concurrent.futures.Future) -> dict[str, Any]:
    exc = future.exception()
    return {"error": f"{type(exc).__name__}: {exc}"} if exc else future.result()


@dataclass
class _Sent:
    tag: str
    future: concurrent.futures.Future


class Pusher:
    """Encode and send caches to receivers in background threads (the producer's side).

    ``send_options`` are :class:`kvtransport.SendOptions`' fields (``key``, ``insecure``,
    ``rate_mbps``, ...; the deadline and precision are each push's). :meth:`push` returns
    at once: the stream is encoded (when given as a function) and sent in a pool thread.
    :meth:`poll` returns the tags whose transfer ended, with the sender's final status
    (:meth:`kvtransport.SentResult.to_dict`, or the exception as ``error``).
    ``on_done(tag, status)``, if given, is called with the same in the sending thread as
    each transfer ends (when nobody polls: an idle engine).
    """

    def __init__(self, max_parallel: int = 2, on_done: Any = None, **send_options: Any) -> None:
        from kvtransport.embed.inprocess import api_key, warm_kernels
        from kvtransport.hosts.policy_choice import default_policy_for

        # Load (or compile) the sender's kernels now: done by the first push instead, it
        # took seconds on a busy host and the consumer gave up waiting for that transfer.
        # The pushes are prefix-ordered whole ranges, so send picks the policy for those.
        try:
            options = SendOptions(**send_options)
        except TypeError as exc:
            raise UserError(f"Pusher: {exc}") from None
        key = api_key(options.key, options.insecure)
        rtt_s = options.initial_rtt_ms * 1e-3
        rate_bps = float(options.rate_mbps) * 1e6
        policy = options.policy or default_policy_for(rtt_s / 2, True, rate_bps)
        warm_kernels(key, policy)
        # and the encoder's (its first call imports and allocates for a while)
        tiny = np.zeros((1, 1, 1, 8), np.float32)
        encode_request(KVCache(tiny, tiny, np.zeros(1, np.int64), "warm-up"), "warm-up", 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_parallel, "kvt-push")
        self._options = options
        self._on_done = on_done
        self._sent: list[_Sent] = []

    def push(
        self,
        stream: blocks.EncodedStream | Callable[[], blocks.EncodedStream],
        tag: str,
        to: str,
        deadline_ms: float,
    ) -> None:
        """Start sending ``stream`` (or what the function ``stream`` returns, called in the
        sending thread) to ``to`` with a deadline ``deadline_ms`` from now."""
        future = self._pool.submit(self._send, stream, to, deadline_ms, time.monotonic())
        if self._on_done is not None:
            future.add_done_callback(lambda f: self._on_done(tag, _status(f)))
        self._sent.append(_Sent(tag, future))

    def _send(self, stream: Any, to: str, deadline_ms: float, asked: float) -> dict[str, Any]:
        """Encode (when asked to) and send; the deadline counts from :meth:`push`."""
        from kvtransport.embed.inprocess import send

        encoded = stream() if callable(stream) else stream
        left_ms = deadline_ms - 1e3 * (time.monotonic() - asked)
        status: dict[str, Any]
        if left_ms <= 0:  # the queue or the encoding took the whole deadline
            note = f"no time left of the {deadline_ms:.0f} ms deadline to send"
            status = {"finish_reason": NOT_SENT, "delivered": "nothing", "to": to, "note": note}
        else:
            options = replace(self._options, deadline_ms=left_ms, precision="keep")
            status = send(encoded, to, options=options).to_dict()
        status["bytes_encoded"] = int(encoded.payload.nbytes)
        return status

    def poll(self) -> dict[str, dict[str, Any]]:
        """Transfers that ended since the last poll: tag -> status."""
        done: dict[str, dict[str, Any]] = {}
        keep = []
        for s in self._sent:
            if not s.future.done():
                keep.append(s)
                continue
            done[s.tag] = _status(s.future)
        self._sent = keep
        return done

    @property
    def pending(self) -> int:
        return len(self._sent)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Waker:
    """A socket pair the daemon loop watches (it takes anything with ``fileno``, ``drain``
    and ``pending``, as it takes a control server): :meth:`wake` from any thread makes the
    loop run ``on_drain`` in its own thread at once."""

    def __init__(self, on_drain: Callable[[], None]) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._on_drain = on_drain

    def fileno(self) -> int:
        return self._r.fileno()

    def pending(self) -> bool:
        """Never: a socket pair is level-triggered, so the loop's wait wakes for it."""
        return False

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except OSError:  # full: a wake-up is already pending
            pass

    def drain(self) -> None:
        try:
            while self._r.recv(4096):
                pass
        except OSError:
            pass
        self._on_drain()

    def close(self) -> None:
        self._r.close()
        self._w.close()


@dataclass
class _Held:
    result: DeliveredResult
    at: float
    nbytes: int


@dataclass
class Inbox:
    """Receive transfers on one UDP port in a thread; results by request tag.

    The receiver daemon's engine (kvtransport.daemons.daemon_receiver.ReceiverEngine) on its loop
    (kvtransport.daemons.daemon.serve). A transfer without a tagged manifest is counted in
    ``untagged`` and dropped. :meth:`take` hands a result out once. A result waits to be
    taken at most ``lease_s`` seconds from its arrival; beyond ``max_results`` results or
    ``max_held_mb`` of payload held, the oldest go first (both counted in ``expired``, with
    ``expired_bytes``: a request that never reached this engine, or came too late).
    :meth:`cut` ends a transfer still receiving: what arrived becomes its result.
    """

    listen: str = "0.0.0.0:9400"
    key: bytes | str | None = None
    insecure: bool = False
    max_transfers: int = 64
    max_mb: float = 1024.0
    max_results: int = 256
    lease_s: float = 30.0
    max_held_mb: float = 512.0
    untagged: int = 0
    expired: int = 0
    expired_bytes: int = 0
    results: OrderedDict[str, _Held] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        from kvtransport.daemons.daemon import StopSignal
        from kvtransport.daemons.daemon_receiver import ReceiverEngine, ReceiverHost
        from kvtransport.daemons.udp import DatagramSocket, parse_address
        from kvtransport.embed.inprocess import api_key, warm_kernels

        raw_key = api_key(self.key, self.insecure)
        warm_kernels(raw_key, "fixed:1/4")
        self.sock = DatagramSocket(parse_address(self.listen, what="listen"))
        self._lock = threading.Lock()
        self._stop = StopSignal()
        self._cuts: set[str] = set()  # tags to cut, for the loop thread
        self._cut_done: set[str] = set()  # tags whose cut the loop has handled
        self._tags: dict[int, str | None] = {}  # transfer id -> its tag, once known
        self._manifests: dict[int, blocks.Manifest | None] = {}  # progress's, by transfer id
        self._waker = _Waker(self._on_wake)
        host = ReceiverHost(key=raw_key, max_transfers=self.max_transfers,
                            max_bytes=int(self.max_mb * 1e6))  # fmt: skip
        self.engine = ReceiverEngine(self.sock, host, on_result=self._on_result)
        self._thread = threading.Thread(target=self._run, name="kvt-inbox", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self.sock.address
        return f"{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    @property
    def held_bytes(self) -> int:
        """Payload bytes of the results waiting to be taken."""
        with self._lock:
            return sum(h.nbytes for h in self.results.values())

    def _run(self) -> None:
        from kvtransport.daemons.daemon import serve

        serve(self.engine, [self._waker], self._stop)  # type: ignore[list-item]

    def _on_result(self, incoming: Any) -> None:
        from kvtransport.embed.inprocess import delivered

        result = delivered(incoming, self.engine)
        self._tags.pop(incoming.transfer_id, None)
        tag = request_tag(result)
        with self._lock:
            if tag is None:
                self.untagged += 1
                return
            self.results.pop(tag, None)
            self.results[tag] = _Held(result, time.monotonic(), int(result.payload.nbytes))
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        """Drop results past their lease, then the oldest beyond the bounds (lock held)."""
        budget = int(self.max_held_mb * 1e6)
        held = sum(h.nbytes for h in self.results.values())
        while self.results:
            tag, oldest = next(iter(self.results.items()))
            over = len(self.results) > self.max_results or held > budget
            if not over and now - oldest.at < self.lease_s:
                break
            del self.results[tag]
            held -= oldest.nbytes
            self.expired += 1
            self.expired_bytes += oldest.nbytes

    def _tag_of(self, transfer_id: int, incoming: Any) -> str | None:
        """A receiving transfer's tag (None until its manifest arrived; cached after)."""
        if self._tags.get(transfer_id) is None:
            tm = incoming.session.manifest
            if tm is None or not tm.app_metadata:
                return None
            try:
                m = blocks.Manifest.from_bytes(tm.app_metadata)
            except ValueError:
                self._tags[transfer_id] = ""
                return None
            self._tags[transfer_id] = str(m.created.get(REQUEST_TAG, ""))
        return self._tags[transfer_id] or None

    def _on_wake(self) -> None:
        """In the loop thread: cut the transfers asked for; expire results."""
        from kvtransport.daemons.udp import clock

        with self._lock:
            cuts, self._cuts = self._cuts, set()
        for tag in cuts:
            for tid, inc in list(self.engine.host.active.items()):
                if self._tag_of(tid, inc) == tag:
                    self.engine.abort(tid, clock(), "cut")  # its result: _on_result, now
        with self._lock:
            self._cut_done |= cuts
            self._expire(time.monotonic())

    def cut(self, tag: str) -> None:
        """Ask for transfer ``tag`` to end now if it is still receiving (what arrived
        becomes its result); :meth:`cut_done` says when the loop has done so."""
        with self._lock:
            self._cuts.add(tag)
        self._waker.wake()

    def cut_done(self, tag: str) -> bool:
        """Whether the cut of ``tag`` was handled (once): its result, if a transfer was
        receiving, is then in :meth:`take`."""
        with self._lock:
            if tag in self._cut_done:
                self._cut_done.discard(tag)
                return True
            return False

    def progress(self, tag: str) -> tuple[int, int, float, float] | None:
        """Of transfer ``tag`` while it is still receiving: (the prefix of tokens complete
        in every layer so far, the tokens it carries, seconds since its first block was
        complete: 0 before, the share of its bytes in complete blocks); None when no such
        transfer is
        receiving (not begun, its manifest not in yet, or ended: see :meth:`take`). Read
        from any thread: blocks only become complete, so a reading is at most behind."""
        from kvtransport.daemons.udp import clock  # the sessions' clock

        for _ in range(3):  # the loop thread may add or end a transfer meanwhile
            try:
                active = list(self.engine.host.active.values())
                break
            except RuntimeError:
                continue
        else:
            return None
        for inc in active:
            s = inc.session
            tm = s.manifest
            m = self._manifest_of(inc.transfer_id, tm)
            if tm is None or m is None or str(m.created.get(REQUEST_TAG, "")) != tag:
                continue
            complete = np.array(s.complete, dtype=bool)
            at = np.array(s.complete_at, dtype=np.float64)
            if complete.shape != (len(tm.blocks),) or at.shape != complete.shape:
                return None  # being set up by the loop thread
            since = float(clock() - at[complete].min()) if complete.any() else 0.0
            sizes = np.asarray(m.length, dtype=np.float64)
            share = float(sizes[complete].sum() / sizes.sum()) if sizes.sum() > 0 else 0.0
            return arrived_prefix(m, complete), m.geometry.num_tokens, max(since, 0.0), share
        return None

    def _manifest_of(self, transfer_id: int, tm: Any) -> blocks.Manifest | None:
        """A receiving transfer's blocks manifest, parsed once (for :meth:`progress`)."""
        if tm is None or not tm.app_metadata:
            return None
        if transfer_id not in self._manifests:
            if len(self._manifests) >= 4 * self.max_transfers:
                self._manifests.clear()
            try:
                self._manifests[transfer_id] = blocks.Manifest.from_bytes(tm.app_metadata)
            except ValueError:
                self._manifests[transfer_id] = None
        return self._manifests[transfer_id]

    def take(self, tag: str) -> DeliveredResult | None:
        """The result of request ``tag`` if it has ended (once; None otherwise)."""
        with self._lock:
            held = self.results.pop(tag, None)
            return held.result if held is not None else None

    def close(self) -> None:
        self._stop.request("closed")
        self._thread.join()
        self.sock.close()
        self._waker.close()
        self._stop.close()
