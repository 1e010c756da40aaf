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
- :func:`encode_request`: the cache as a prefix-ordered, lossless block stream whose
  manifest names the request (``created["request"]``);
- :func:`load_plan`: from a received result, the usable prefix and the vLLM block ids
  that failed (:class:`LoadPlan`);
- :class:`Pusher` sends caches in background threads through :func:`kvtransport.send`
  with a deadline; :class:`Inbox` receives many transfers on one UDP port (the receiver
  daemon's engine) and hands each result out by its request tag.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransport.daemons.api import DeliveredResult
from kvtransport.errors import UserError
from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model.utility import stream_order

REQUEST_TAG = "request"
"""Key in the blocks manifest's ``created`` dict that names the vLLM request."""


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


def encode_request(cache: KVCache, tag: str, block_tokens: int) -> blocks.EncodedStream:
    """The cache as a lossless block stream in prefix order, its manifest tagged ``tag``.

    block_tokens: tokens per range; vLLM's block size, or a divisor of it (a smaller range
    is lost alone, but vLLM still recomputes its whole block).
    """
    g = blocks.Geometry.of(cache, block_tokens)
    # A range's utility for a prefix-only consumer is its token count: every token of a
    # usable prefix counts alike.
    counts = g.block_token_count(np.arange(g.token_blocks)).astype(np.float64)
    u = np.tile(counts, (g.num_layers, 1))
    order = stream_order(u, block_tokens, "position")
    return blocks.encode_stream(cache, u, order, block_tokens=block_tokens,
                                created={REQUEST_TAG: str(tag)})  # fmt: skip


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
        loaded ("" when it did).
    """

    prefix: int
    failed_block_ids: list[int]
    cache: KVCache | None
    why: str = ""

    @property
    def complete(self) -> bool:
        return not self.failed_block_ids


def usable_prefix(present: np.ndarray) -> int:
    """Leading tokens present in every layer (``present``: ``[layers, tokens]`` bool)."""
    every = np.asarray(present, dtype=bool).all(axis=0)
    missing = np.flatnonzero(~every)
    return int(missing[0]) if missing.size else int(every.size)


def load_plan(
    result: DeliveredResult | None,
    *,
    block_ids: Sequence[int],
    block_size: int,
    start: int,
    stop: int,
    token_ids: Sequence[int],
) -> LoadPlan:
    """Decide what of ``result`` the consumer loads into tokens ``[start, stop)``.

    result: the transfer (None: nothing arrived by the deadline). block_ids: the request's
    vLLM blocks in token order. token_ids: the request's prompt; a transfer of another
    prompt (other tokens, other length) loads nothing. The usable prefix is the longest
    run of token ranges complete in every layer, rounded down to whole vLLM blocks
    (unless it reaches ``stop``); every block from there to ``stop`` fails.
    """
    last_block = -(-stop // block_size)

    def failed(prefix: int, why: str, cache: KVCache | None = None) -> LoadPlan:
        cut = max(prefix, start)
        ids = [int(b) for b in block_ids[cut // block_size : last_block]] if cut < stop else []
        return LoadPlan(prefix, ids, cache, why if ids else "")

    if start % block_size:
        raise ValueError(f"a load must start on a block boundary, not at token {start}")
    if result is None:
        return failed(start, "nothing arrived")
    from kvtransport.embed.partial import partial_cache

    try:
        got = partial_cache(result)
    except UserError as exc:
        return failed(start, str(exc))
    ids = np.asarray(token_ids, dtype=np.int64)
    if got.cache.num_tokens < stop or not np.array_equal(got.cache.token_ids[:stop], ids[:stop]):
        return failed(start, "the transfer is of another prompt")
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
    """Send caches to receivers in background threads (the producer's side).

    ``send_options`` go to :func:`kvtransport.send` (``key``, ``insecure``,
    ``rate_mbps``, ...). :meth:`push` returns at once; :meth:`poll` returns the tags whose
    transfer ended, with the sender's final status (or the exception as ``error``).
    ``on_done(tag, status)``, if given, is called with the same in the sending thread as
    each transfer ends (when nobody polls: an idle engine).
    """

    def __init__(self, max_parallel: int = 2, on_done: Any = None, **send_options: Any) -> None:
        from kvtransport.core.protocol import DEFAULT_INITIAL_RTT
        from kvtransport.embed.inprocess import api_key, warm_kernels
        from kvtransport.hosts.policy_choice import default_policy_for

        # Load (or compile) the sender's kernels now: done by the first push instead, it
        # took seconds on a busy host and the consumer gave up waiting for that transfer.
        # The pushes are prefix-ordered whole ranges, so send picks the policy for those.
        key = api_key(send_options.get("key"), bool(send_options.get("insecure", False)))
        rtt_s = float(send_options.get("initial_rtt_ms", DEFAULT_INITIAL_RTT * 1e3)) * 1e-3
        rate = send_options.get("rate_mbps")
        rate_bps = None if rate is None else float(rate) * 1e6
        policy = send_options.get("policy") or default_policy_for(rtt_s / 2, True, rate_bps)
        warm_kernels(key, policy)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_parallel, "kvt-push")
        self._options = send_options
        self._on_done = on_done
        self._sent: list[_Sent] = []

    def push(self, stream: blocks.EncodedStream, tag: str, to: str, deadline_ms: float) -> None:
        """Start sending ``stream`` to ``to`` with a deadline ``deadline_ms`` from now."""
        from kvtransport.embed.inprocess import send

        opts = dict(self._options, deadline_ms=deadline_ms, precision="keep")
        future = self._pool.submit(send, stream, to, **opts)
        if self._on_done is not None:
            future.add_done_callback(lambda f: self._on_done(tag, _status(f)))
        self._sent.append(_Sent(tag, future))

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


@dataclass
class Inbox:
    """Receive transfers on one UDP port in a thread; results by request tag.

    The receiver daemon's engine (kvtransport.daemons.daemon_receiver.ReceiverEngine) on its loop
    (kvtransport.daemons.daemon.serve). A transfer without a tagged manifest is counted in
    ``untagged`` and dropped. :meth:`take` hands a result out once; at most
    ``max_results`` results wait to be taken (the oldest beyond are dropped and counted in
    ``expired``: a request that never reached this engine).
    """

    listen: str = "0.0.0.0:9400"
    key: bytes | str | None = None
    insecure: bool = False
    max_transfers: int = 64
    max_mb: float = 1024.0
    max_results: int = 256
    untagged: int = 0
    expired: int = 0
    results: OrderedDict[str, DeliveredResult] = field(default_factory=OrderedDict)

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
        host = ReceiverHost(key=raw_key, max_transfers=self.max_transfers,
                            max_bytes=int(self.max_mb * 1e6))  # fmt: skip
        self.engine = ReceiverEngine(self.sock, host, on_result=self._on_result)
        self._thread = threading.Thread(target=self._run, name="kvt-inbox", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self.sock.address
        return f"{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    def _run(self) -> None:
        from kvtransport.daemons.daemon import serve

        serve(self.engine, [], self._stop)

    def _on_result(self, incoming: Any) -> None:
        from kvtransport.embed.inprocess import delivered

        result = delivered(incoming, self.engine)
        tag = request_tag(result)
        with self._lock:
            if tag is None:
                self.untagged += 1
            else:
                self.results[tag] = result
                while len(self.results) > self.max_results:
                    self.results.popitem(last=False)
                    self.expired += 1

    def take(self, tag: str) -> DeliveredResult | None:
        """The result of request ``tag`` if it has ended (once; None otherwise)."""
        with self._lock:
            return self.results.pop(tag, None)

    def close(self) -> None:
        self._stop.request("closed")
        self._thread.join()
        self.sock.close()
        self._stop.close()
