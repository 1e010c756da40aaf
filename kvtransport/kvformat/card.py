"""Cache cards: a KV cache in one self-contained safetensors file.

A card holds exactly what the transport would ship, so one code path serves both:

- tensor ``stream`` (uint8): the block stream, every block's bytes back to back in
  stream (utility) order, each block fp32/fp16 or int8/int4 with its scales and zero
  points (layout: kvtransport.kvformat.blocks). One tensor rather than thousands keeps the
  safetensors header small and the load a single zero-copy read;
- metadata ``kvtransport.card``: JSON with the format version, the creation info and the
  manifest in readable form (model, dtype, geometry, block size, quantization groups, and
  a columnar block table: layer, token range, precision, byte offset and length, CRC-32,
  utility; plus the token ids).

Writes are atomic (kvtransport.atomic): the file is written to a temporary sibling,
fsynced, renamed over the target, and the directory is fsynced, so a reader sees the old
card or the new one, never half of one. Reading validates everything (safetensors
framing, metadata, block table against the geometry, stream length, every block's CRC-32)
and turns any problem into a one-line :class:`CardError`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.atomic import atomic_write
from kvtransport.errors import UserError
from kvtransport.kvformat import blocks

CARD_FORMAT = "kvtransport-card"
CARD_VERSIONS = blocks.MANIFEST_VERSIONS
"""The card versions this module reads. A card is written with its manifest's version
(kvtransport.kvformat.blocks.Manifest.version): the lowest whose readers size every block
right, so older readers take what they can read."""
METADATA_KEY = "kvtransport.card"
TENSOR_NAME = "stream"


class CardError(UserError):
    """A card that cannot be read: missing, truncated, corrupted or not a card."""


@dataclass(frozen=True)
class CacheCard:
    """A card in memory: its manifest and block stream."""

    manifest: blocks.Manifest
    payload: np.ndarray  # uint8
    created: dict[str, Any]

    def utility_grid(self) -> np.ndarray:
        """``[layers, token_blocks]`` utilities (0 for blocks the card does not hold)."""
        return self.manifest.utility_grid()

    def reassemble(self, *, allow_corrupt: bool = False) -> blocks.Reassembled:
        """The cache, with the presence mask; corrupted blocks raise unless allowed."""
        out = blocks.decode_stream(self.manifest, self.payload)
        if out.corrupted.size and not allow_corrupt:
            first = out.corrupted[:5].tolist()
            raise CardError(
                f"card has {out.corrupted.size} corrupted block(s) (stream index {first}"
                f"{'...' if out.corrupted.size > 5 else ''}): checksum mismatch"
            )
        return out


def creation_info(**extra: Any) -> dict[str, Any]:
    """Who made a card and when (kept out of the manifest's deterministic core)."""
    from kvtransport import __version__

    info = {"tool": f"kvtransport {__version__}", "unix_time": round(time.time(), 3)}
    info.update(extra)
    return info


def write_card(path: str | os.PathLike, stream: blocks.EncodedStream) -> Path:
    """Write ``stream`` as a card at ``path`` atomically; returns the path.

    A directory that is missing or not writable raises
    :class:`~kvtransport.atomic.AtomicWriteError` (a UserError and an OSError).
    """
    from safetensors.numpy import save

    data = save({TENSOR_NAME: stream.payload}, metadata=card_metadata(stream.manifest))
    return atomic_write(Path(path), data)


def card_metadata(manifest: blocks.Manifest) -> dict[str, str]:
    """The safetensors metadata of a card holding ``manifest``'s stream: the format tag,
    the card version (:data:`CARD_VERSIONS`) and the manifest in readable form."""
    meta = {"format": CARD_FORMAT, "version": manifest.version, "manifest": manifest.to_json()}
    return {METADATA_KEY: json.dumps(meta, sort_keys=True, separators=(",", ":"))}


def _read_header(raw: memoryview, name: str) -> tuple[dict[str, Any], int]:
    """Parse the safetensors framing by hand: one-line errors, no library tracebacks."""
    if len(raw) < 8:
        raise CardError(f"{name} is not a cache card: {len(raw)} bytes, truncated")
    hlen = int.from_bytes(raw[:8], "little")
    if hlen > len(raw) - 8 or hlen > 100 * 2**20:
        raise CardError(f"{name} is truncated or not a cache card (header of {hlen} bytes)")
    try:
        header = json.loads(bytes(raw[8 : 8 + hlen]))
    except ValueError as exc:
        raise CardError(f"{name} has a corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CardError(f"{name} has a corrupt safetensors header")
    return header, 8 + hlen


def read_card(path: str | os.PathLike) -> CacheCard:
    """Read and validate a card; any problem raises :class:`CardError` (one line)."""
    path = Path(path)
    name = str(path)
    try:
        # Mapped, not read: the blocks are copied once, straight into the rebuilt cache.
        # Safe against concurrent writers, whose atomic rename leaves this inode intact.
        if path.is_dir():
            raise IsADirectoryError(name)
        size = path.stat().st_size
        data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except FileNotFoundError:
        raise CardError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise CardError(f"{name} is a directory, not a cache card") from None
    except OSError as exc:
        raise CardError(f"cannot read {name}: {exc.strerror or exc}") from None
    header, start = _read_header(memoryview(data), name)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or METADATA_KEY not in meta:
        raise CardError(f"{name} is a safetensors file but not a kvtransport cache card")
    try:
        card_meta = json.loads(meta[METADATA_KEY])
        if card_meta.get("format") != CARD_FORMAT:
            raise ValueError("wrong format tag")
        version = card_meta.get("version")
        manifest_json = card_meta["manifest"]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CardError(f"{name} has corrupt card metadata: {exc}") from None
    if version not in CARD_VERSIONS:
        raise CardError(f"{name} is card version {version}; this kvtransport reads "
                        f"{' and '.join(map(str, CARD_VERSIONS))}")  # fmt: skip
    info: Any = header.get(TENSOR_NAME)  # untrusted JSON: any shape fails below
    try:
        if info["dtype"] != "U8" or len(info["shape"]) != 1:
            raise ValueError("not a uint8 vector")
        lo, hi = (int(x) for x in info["data_offsets"])
        if not 0 <= lo <= hi or hi - lo != int(info["shape"][0]):
            raise ValueError("inconsistent offsets")
    except (TypeError, KeyError, ValueError) as exc:
        raise CardError(f"{name} has a corrupt tensor table: {exc}") from None
    if start + hi > data.size:
        raise CardError(
            f"{name} is truncated: {data.size} bytes, its header announces {start + hi}"
        )
    try:
        manifest = blocks.Manifest.from_json(manifest_json)
    except blocks.ManifestError as exc:
        raise CardError(f"{name}: {exc}") from None
    payload = data[start + lo : start + hi]
    if payload.size != manifest.payload_nbytes:
        raise CardError(
            f"{name}: stream of {payload.size} bytes, block table needs {manifest.payload_nbytes}"
        )
    created = manifest.created
    return CacheCard(manifest=manifest, payload=payload, created=created)


def load_cache(path: str | os.PathLike) -> blocks.Reassembled:
    """Read a card and rebuild its cache; corrupted blocks raise :class:`CardError`."""
    return read_card(path).reassemble()


def summary(card: CacheCard, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """What `kvtransport card inspect` prints, as a dict."""
    m, g = card.manifest, card.manifest.geometry
    names, counts = np.unique(m.precision, return_counts=True)
    by_precision = {blocks.PRECISIONS[int(p)]: int(c) for p, c in zip(names, counts, strict=True)}
    corrupted = blocks.corrupted_blocks(m, card.payload)
    full = 2 * g.num_layers * g.num_kv_heads * g.num_tokens * g.head_dim
    full_bytes = full * np.dtype(g.dtype).itemsize
    return {
        "path": None if path is None else str(path),
        "model_id": m.model_id,
        "dtype": g.dtype,
        "layers": g.num_layers,
        "kv_heads": g.num_kv_heads,
        "tokens": g.num_tokens,
        "head_dim": g.head_dim,
        "block_tokens": g.block_tokens,
        "group_size": g.group_size,
        "int8_group_size": g.group_of("int8"),
        "int4_keys": g.int4_keys,
        "blocks": m.num_blocks,
        "blocks_in_geometry": g.num_blocks,
        "precisions": by_precision,
        "stream_bytes": int(card.payload.size),
        "compression": round(full_bytes / max(int(card.payload.size), 1), 3),
        "manifest_bytes": len(m.to_bytes()),
        "utility_held": round(float(m.utility.sum(dtype=np.float64)), 6),
        "corrupted_blocks": corrupted.tolist(),
        "token_ids": "included" if m.token_ids is not None else "hash only",
        "created": card.created,
    }
