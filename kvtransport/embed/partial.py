"""From what a receiver got to the partial KV cache a transformers model takes: one call.

:func:`partial_cache` turns a received result (a :class:`~kvtransport.daemons.api.DeliveredResult`
from ``kvtransport.receive`` or a daemon's subscriber, a receiver session's
:class:`~kvtransport.core.transfer.TransferResult`, the demo's link outcome), a result file, or
a cache card into a :class:`~kvtransport.kvformat.blocks.Reassembled`: the numpy ``KVCache`` with
zeros where blocks are missing and the per-layer presence mask. Hand both to the model
with :func:`kvtransport.model.hf.greedy_generate` (``present=got.mask``) or
:func:`kvtransport.model.hf.to_model_cache` plus :func:`kvtransport.model.hf.layer_visibility`,
which hide each missing block from its own layer only.

numpy only: torch is imported by kvtransport.model.hf when the cache goes into a model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.errors import UserError
from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache


def partial_cache(
    source: Any,
    *,
    token_ids: np.ndarray | list[int] | None = None,
    expected: blocks.Manifest | None = None,
) -> blocks.Reassembled:
    """The (possibly partial) cache and its presence mask from what arrived.

    source: anything with ``app_metadata`` (the blocks manifest, None if it never arrived),
        ``payload`` (complete blocks' bytes at their offsets) and ``complete`` (per block);
        a :class:`~kvtransport.kvformat.card.CacheCard`; or the path of a result file
        (``recv --out``, ``receiver-daemon --out-dir``) or of a cache card.
    token_ids: the context's token ids, needed only when the manifest carries just their
        hash (checked against it).
    expected: the manifest the receiver expected; used only when the transfer's manifest
        never arrived, to return an all-masked cache of the right shape (the model then
        answers from the question alone). Without it that case raises a UserError.

    Blocks marked complete that fail their CRC-32 count as missing. A cache card must be
    intact (a corrupted block raises :class:`~kvtransport.kvformat.card.CardError`).
    """
    if isinstance(source, str | os.PathLike):
        return _from_file(Path(source), token_ids, expected)
    from kvtransport.kvformat.card import CacheCard

    if isinstance(source, CacheCard):
        return source.reassemble()
    meta = source.app_metadata
    if meta is None:
        if expected is None:
            raise UserError(
                "the transfer's manifest never arrived: nothing is known about the cache "
                "(pass expected= to get an all-masked cache of that shape)"
            )
        return _all_missing(expected, token_ids)
    try:
        return blocks.decode_stream(meta, source.payload, source.complete, token_ids=token_ids)
    except ValueError as exc:  # ManifestError is one too
        raise UserError(f"cannot rebuild the cache: {exc}") from None


def _from_file(path: Path, token_ids: Any, expected: blocks.Manifest | None) -> blocks.Reassembled:
    from kvtransport.daemons.api import RESULT_KEY, read_result_file
    from kvtransport.kvformat.card import read_card

    if RESULT_KEY in _metadata(path):
        return partial_cache(read_result_file(path), token_ids=token_ids, expected=expected)
    return read_card(path).reassemble()  # one-line CardError for anything but a card


def _metadata(path: Path) -> dict[str, Any]:
    """A safetensors file's ``__metadata__`` ({} if the file is not one: read_card says why)."""
    import json

    try:
        with open(path, "rb") as fh:
            hlen = int.from_bytes(fh.read(8), "little")
            if hlen > 100 << 20:
                return {}
            meta = json.loads(fh.read(hlen)).get("__metadata__")
    except (OSError, ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _all_missing(m: blocks.Manifest, token_ids: Any) -> blocks.Reassembled:
    g = m.geometry
    shape = (g.num_layers, g.num_kv_heads, g.num_tokens, g.head_dim)
    zeros = np.zeros(shape, dtype=np.float32)
    if m.token_ids is not None:
        ids = m.token_ids
    elif token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64)
    else:
        ids = np.full(g.num_tokens, -1, dtype=np.int64)
    kv = KVCache(zeros, zeros.copy(), ids, m.model_id)
    present = np.zeros((g.num_layers, g.num_tokens), dtype=bool)
    missing = np.arange(m.num_blocks, dtype=np.int64)
    return blocks.Reassembled(kv, present, missing, np.zeros(0, np.int64), m)
