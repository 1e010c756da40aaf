"""Cache -> block stream on the model side: utilities from attention, order and precision
(kvtransport.kvformat.blocks does the encoding; kvtransport.kvformat.card stores the result).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import utility


def encode_cache(
    cache: KVCache,
    *,
    utilities: np.ndarray | None = None,
    layer_weights: np.ndarray | None = None,
    block_tokens: int = blocks.DEFAULT_BLOCK_TOKENS,
    precision: str | None = None,
    order: str = "utility",
    seed: int = 0,
    window: int | None = utility.OBSERVATION_WINDOW,
    created: dict[str, Any] | None = None,
) -> blocks.EncodedStream:
    """Cache -> block stream: utilities (from attention or given), order, precision.

    utilities: ``[layers, token_blocks]``; default: :func:`kvtransport.model.utility.cache_utility`
        with ``layer_weights`` and the observation ``window`` the attention came from.
    precision: None (the cache's own dtype, lossless), a precision name, or ``mixed:BYTES``.
    """
    g = blocks.Geometry.of(cache, block_tokens)
    if utilities is None:
        utilities = utility.cache_utility(cache, block_tokens, layer_weights, window=window)
    spec = precision or ("fp32" if g.dtype == "float32" else "fp16")
    codes = blocks.plan_precision(g, utilities, spec)
    order_idx = utility.stream_order(utilities, block_tokens, order, seed=seed)
    return blocks.encode_stream(
        cache, utilities, order_idx, codes, block_tokens=block_tokens, created=created
    )


def degrade(
    cache: KVCache,
    utilities: np.ndarray,
    *,
    drop: float = 0.0,
    order: str = "utility",
    precision: str | None = None,
    block_tokens: int = blocks.DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
) -> blocks.Reassembled:
    """What a receiver would hold after the stream lost its last ``drop`` share of blocks.

    The cache goes through the real sender and receiver code (encode at ``precision`` in
    ``order``, mark the tail of the stream missing, decode), so the result carries the
    quantization error and the per-layer presence mask exactly as a transfer would.
    """
    if not 0.0 <= drop <= 1.0:
        raise ValueError(f"drop fraction {drop} is not in [0, 1]")
    stream = encode_cache(
        cache,
        utilities=utilities,
        block_tokens=block_tokens,
        precision=precision,
        order=order,
        seed=seed,
    )
    n = stream.manifest.num_blocks
    complete = np.arange(n) < n - int(round(drop * n))
    return blocks.decode_stream(
        stream.manifest, stream.payload, complete, token_ids=cache.token_ids
    )
