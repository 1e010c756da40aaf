"""Cut a KV cache into blocks, serialize them as a stream in utility order, and rebuild it.

A *block* is one layer's K and V for one token range of ``block_tokens`` tokens (the last
range of a layer may be shorter). The sender side (:func:`encode_stream`) turns a
:class:`~kvtransport.kvformat.kvcache.KVCache`, the blocks' utilities, a stream order and a
precision per block into

- a compact binary **manifest** (sent first by the transport, heavily protected),
- a uint8 **payload**: the blocks' bytes back to back in stream order,
- per-block offsets, lengths and utilities (the transport's block table).

The receiver side (:func:`decode_stream`) takes the manifest bytes, the payload and which
blocks arrived complete, verifies every block's CRC-32 (a block that fails counts as
missing and is reported as corrupted) and rebuilds a KVCache with zeros where blocks are
missing, plus the per-layer presence mask ``[layers, tokens]`` that injection needs.

Block byte layout (all little-endian; ``H`` kv heads, ``T`` tokens, ``D`` head_dim):

- ``fp32`` / ``fp16``: K ``[H, T, D]`` then V ``[H, T, D]``;
- ``int8`` / ``int4``: codes of ``[2, H, T, D]`` (K then V; int4 packed two per byte), then
  float16 scales, K's then V's, then float16 zeros, the same (kvtransport.codecs.quant.
  quantize_kv): per token ``[H, T, D / G]``, ``G`` the precision's group (the header's
  ``int8_group_size`` for int8, absent in manifests written before it and then
  ``group_size``; ``group_size`` for int4), except int4's keys when the header's
  ``int4_keys`` is ``channel``: ``[H, D]``, one per channel over the block's tokens (absent
  in manifests written before it, and then ``token``);
- ``k8v4``: the same layout with K's codes and groups as int8's and V's as int4's: K codes
  ``[H, T, D]``, V codes ``[H, T, D / 2]``, float16 scales K's ``[H, T, D / int8 group]``
  then V's ``[H, T, D / G]``, then the zeros the same;
- ``int8r``: the int8 block entropy-coded without loss (kvtransport.codecs.kvcodec's int8
  layout: the codes through per-channel anchors and rANS, the scales and zeros as they
  are); each block decodes on its own into exactly the int8 block's bytes. Its length
  varies: the manifest carries it.

Manifest format, version 1 to 5 (all integers little-endian)::

    0   4  magic b"KVMF"
    4   2  version (5 when the stream holds int8r blocks, 4 when it holds k8v4 blocks,
           either of which an older reader does not know; else 3 when the stream holds
           int4 blocks with keys per channel, 2 when it holds int8 blocks quantized in
           groups other than ``group_size``, either of which an older reader would
           mis-size; 1 otherwise)
    6   2  flags (bit 0: token ids included)
    8   4  header length J
    12  4  body length B
    16  J  header: UTF-8 JSON, sorted keys, no spaces (model id, dtype, geometry,
           block size, group sizes, block count, token-id SHA-256, creation info)
    ..  B  body: zlib of the columns, in stream order: layer u16[n], token block u32[n],
           precision u8[n], crc32 u32[n], utility f32[n], (version 5) length u32[n],
           then token ids u32[tokens]
    ..  4  CRC-32 of everything before

Token counts, byte lengths and offsets are not stored (but for version 5's lengths, which a
reader checks against the geometry for every block not int8r): they follow from the geometry,
each block's precision and the stream order. Serialization is deterministic: the same
inputs give the same bytes (creation info is whatever the caller passes; nothing is
time-stamped implicitly).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from kvtransport.codecs import kvcodec, quant
from kvtransport.core.transfer import BlockTable, Transfer
from kvtransport.kvformat.kvcache import KVCache

PRECISIONS = ("fp32", "fp16", "int8", "int4", "k8v4", "int8r")
"""Precision names; a block's precision code is its index here. ``k8v4``: keys as int8's,
values as int4's (keys weigh more in the answer: between int8 and int4 in bytes and in
fidelity, DEFAULT_FIDELITY). ``int8r``: int8's block entropy-coded without loss
(kvtransport.codecs.kvcodec.encode_int8_rows): the same values as int8 in fewer bytes,
its length per block in the manifest (version 5)."""
CODED = ("int8r",)
"""Precisions whose blocks vary in length: the manifest carries each one's."""
CODED_AS = {"int8r": "int8"}
"""Each coded precision's values: the fixed-length precision it codes without loss."""
INT8R_RATIO = 0.98
"""An int8r block's bytes as a share of int8's, where the cache's own is not measured
(:func:`estimate_coded`): what the plan sizes int8r blocks by."""

DEFAULT_BLOCK_TOKENS = 16
MANIFEST_MAGIC = b"KVMF"
MANIFEST_VERSIONS = (1, 2, 3, 4, 5)
"""The manifest versions this module reads; it writes the lowest that holds the stream
(:attr:`Manifest.version`)."""
_FIXED = struct.Struct("<4sHHII")
_FLAG_TOKEN_IDS = 1
_BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4), "int8r": (8, 8)}
"""Quantized precisions: (key bits, value bits)."""
INT4_KEYS = ("token", "channel")
"""How int4 blocks quantize their keys (:attr:`Geometry.int4_keys`)."""
_FLOAT = {"fp32": "<f4", "fp16": "<f2"}
_CODED_CODES = [PRECISIONS.index(p) for p in CODED]
_DTYPES = {"float32": np.float32, "float16": np.float16}
_MAX_TOKEN_ID = 2**32 - 1


class ManifestError(ValueError):
    """A manifest that cannot be trusted: truncated, corrupted, or inconsistent."""


@dataclass(frozen=True)
class Geometry:
    """Shape of a cache and how it is cut into blocks."""

    num_layers: int
    num_kv_heads: int
    num_tokens: int
    head_dim: int
    dtype: str = "float32"
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    group_size: int = quant.DEFAULT_GROUP_SIZE
    int8_group_size: int = 0
    """int8's quantization group; 0 (normalized to ``group_size``): what manifests written
    before the field hold. :meth:`of` gives one group per head vector (``head_dim``
    values): int8's error stays far below int4's either way, and on SmolLM2 (head_dim 64)
    that halves the scales and zeros, from 4 of every 36 bytes of an int8 block to 2 of
    34 (docs/results.md, section 0)."""
    int4_keys: str = "token"
    """int4's keys: ``token`` (groups of ``group_size`` per token, like the values: what
    manifests written before the field hold) or ``channel`` (one scale and zero per channel
    over the block's tokens, what :meth:`of` gives; kvtransport.codecs.quant says why)."""
    int8r_ratio: float = field(default=INT8R_RATIO, compare=False)
    """The share of int8's bytes an int8r block is planned at (:meth:`block_nbytes`); not
    part of the manifest: a stream carries each int8r block's real length."""

    def __post_init__(self) -> None:
        if not self.int8_group_size:
            object.__setattr__(self, "int8_group_size", self.group_size)
        if self.int4_keys not in INT4_KEYS:
            raise ValueError(f"int4_keys {self.int4_keys!r} is not one of {INT4_KEYS}")

    @classmethod
    def of(
        cls,
        cache: KVCache,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        group_size: int | None = None,
        int8_group_size: int | None = None,
        int4_keys: str = "channel",
    ) -> Geometry:
        """``cache``'s geometry; ``group_size`` capped at head_dim, None: one group per head
        vector with int4's keys per channel (only the values then use it: their error is
        the same in 32-value groups, at 4 more bytes per 64 values), else
        ``quant.DEFAULT_GROUP_SIZE``; ``int8_group_size`` None: one group per head vector.
        A group that is not an even divisor of head_dim raises ValueError."""
        dtype = np.dtype(cache.keys.dtype).name
        if dtype not in _DTYPES:
            raise ValueError(f"cache dtype {dtype} is not float32 or float16")
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, not {block_tokens}")
        if group_size is None:
            group_size = cache.head_dim if int4_keys == "channel" else quant.DEFAULT_GROUP_SIZE
        group = min(group_size, cache.head_dim)
        group8 = cache.head_dim if int8_group_size is None else int8_group_size
        quant.check_group(cache.head_dim, group)
        quant.check_group(cache.head_dim, group8, "int8_group_size")
        return cls(
            cache.num_layers,
            cache.num_kv_heads,
            cache.num_tokens,
            cache.head_dim,
            dtype,
            block_tokens,
            group,
            group8,
            int4_keys,
        )

    def group_of(self, precision: str) -> int:
        """The quantization group of a quantized precision (int8 or int4)."""
        return self.int8_group_size if precision in ("int8", "int8r") else self.group_size

    def channel_keys(self, precision: str) -> bool:
        """Does a block at this precision quantize its keys per channel?"""
        return precision == "int4" and self.int4_keys == "channel"

    def quant_spec(self, precision: str) -> tuple[int, int, bool, int, int]:
        """A quantized precision's (key bits, key group, keys per channel, value bits,
        value group): each half as at its bits' uniform precision (8 bits: int8's group,
        4 bits: int4's group and key layout)."""
        kb, vb = _BITS[precision]
        k_name, v_name = ("int8" if kb == 8 else "int4"), ("int8" if vb == 8 else "int4")
        return kb, self.group_of(k_name), self.channel_keys(k_name), vb, self.group_of(v_name)

    @property
    def token_blocks(self) -> int:
        """Token ranges per layer (the last may be shorter than block_tokens)."""
        return -(-self.num_tokens // self.block_tokens)

    @property
    def num_blocks(self) -> int:
        return self.num_layers * self.token_blocks

    def block_token_count(self, token_block: np.ndarray) -> np.ndarray:
        start = token_block.astype(np.int64) * self.block_tokens
        return np.minimum(self.block_tokens, self.num_tokens - start)

    def block_nbytes(self, precision: str, tokens: int | None = None) -> int:
        """Bytes of one block of ``tokens`` tokens (default: a full block) at a precision;
        for a coded precision (CODED), its planned size: ``int8r_ratio`` of int8's."""
        t = self.block_tokens if tokens is None else tokens
        if precision in CODED:
            return max(1, round(self.int8r_ratio * self.block_nbytes(CODED_AS[precision], t)))
        if precision in _FLOAT:
            elements = 2 * self.num_kv_heads * t * self.head_dim
            return elements * np.dtype(_FLOAT[precision]).itemsize
        return quant.kv_nbytes_mixed(self.num_kv_heads, t, self.head_dim,
                                     *self.quant_spec(precision))  # fmt: skip

    def cost_table(self, precisions: tuple[str, ...]) -> np.ndarray:
        """``[num_blocks, len(precisions)]`` bytes per block (flat index) per precision."""
        counts = self.block_token_count(np.arange(self.token_blocks))
        per_tb = np.array([[self.block_nbytes(p, int(c)) for p in precisions] for c in counts])
        return np.tile(per_tb, (self.num_layers, 1)).astype(np.int64)


@dataclass(frozen=True)
class Manifest:
    """What the receiver must know to rebuild the cache; arrays are in stream order."""

    model_id: str
    geometry: Geometry
    layer: np.ndarray  # uint16 [n]
    token_block: np.ndarray  # uint32 [n]
    precision: np.ndarray  # uint8 [n], index into PRECISIONS
    checksum: np.ndarray  # uint32 [n], CRC-32 of the block's bytes
    utility: np.ndarray  # float32 [n], share of the whole cache's utility
    token_ids_sha256: str
    token_ids: np.ndarray | None = None  # int64 [tokens] when carried
    created: dict[str, Any] = field(default_factory=dict)
    coded_length: np.ndarray | None = None
    """int64 ``[n]``: each block's byte length where its precision is CODED (other
    blocks' entries are not read); None when the stream holds none."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the stream (blocks dropped by a byte budget are not listed)."""
        return int(self.layer.shape[0])

    @cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _layout(self.geometry, self.precision, self.token_block, self.coded_length)

    @property
    def token_start(self) -> np.ndarray:
        return self.token_block.astype(np.int64) * self.geometry.block_tokens

    @property
    def token_count(self) -> np.ndarray:
        """Tokens in each block (the last range of a layer may be short)."""
        return self._layout[0]

    @property
    def length(self) -> np.ndarray:
        """Bytes of each block in the payload."""
        return self._layout[1]

    @property
    def offset(self) -> np.ndarray:
        """Byte offset of each block in the payload (blocks are back to back)."""
        return self._layout[2]

    @property
    def payload_nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def whole_ranges(self) -> bool:
        """Whether the stream sends each token range's blocks one after another (the
        handoff plan's position or back order, hedge included, and the vLLM connector's
        prefix order): a racing receiver loads a range once every block of it arrived, so
        such a stream is worth whole ranges. False for a utility-ordered card, whose
        ranges are interleaved."""
        tb = self.token_block
        runs = 1 + int(np.count_nonzero(tb[1:] != tb[:-1])) if tb.size else 0
        return runs == np.unique(tb).size

    def flat_index(self) -> np.ndarray:
        """Each stream block's index in the ``[layers, token_blocks]`` grid, flattened."""
        return self.layer.astype(np.int64) * self.geometry.token_blocks + self.token_block

    def utility_grid(self) -> np.ndarray:
        """``[layers, token_blocks]`` utilities (0 for blocks the stream does not hold)."""
        g = self.geometry
        grid = np.zeros(g.num_layers * g.token_blocks)
        grid[self.flat_index()] = self.utility
        return grid.reshape(g.num_layers, g.token_blocks)

    # -- encodings -------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The manifest version written: the lowest whose readers size every block right
        (5: int8r blocks, whose lengths the manifest carries; 4: k8v4 blocks; 3: int4
        blocks with keys per channel; 2: int8 blocks in groups other than ``group_size``;
        else 1), so older readers take what they can read and refuse, by version, what
        they would mis-size."""
        g = self.geometry
        if self.has_coded:
            return 5
        if np.any(self.precision == PRECISIONS.index("k8v4")):
            return 4
        if g.int4_keys == "channel" and np.any(self.precision == PRECISIONS.index("int4")):
            return 3
        has_int8 = bool(np.any(self.precision == PRECISIONS.index("int8")))
        return 2 if has_int8 and g.int8_group_size != g.group_size else 1

    @property
    def has_coded(self) -> bool:
        """Whether the stream holds blocks of a coded precision (CODED)."""
        return bool(np.isin(self.precision, _CODED_CODES).any())

    def header(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "format": "kvtransport-manifest",
            "version": self.version,
            "model_id": self.model_id,
            "dtype": g.dtype,
            "layers": g.num_layers,
            "kv_heads": g.num_kv_heads,
            "tokens": g.num_tokens,
            "head_dim": g.head_dim,
            "block_tokens": g.block_tokens,
            "group_size": g.group_size,
            "int8_group_size": g.group_of("int8"),
            "int4_keys": g.int4_keys,
            "num_blocks": self.num_blocks,
            "token_ids_sha256": self.token_ids_sha256,
            "created": self.created,
        }

    def to_bytes(self) -> bytes:
        """The compact binary form (see the module docstring)."""
        head = json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode()
        cols = [
            self.layer.astype("<u2").tobytes(),
            self.token_block.astype("<u4").tobytes(),
            self.precision.astype("u1").tobytes(),
            self.checksum.astype("<u4").tobytes(),
            self.utility.astype("<f4").tobytes(),
        ]
        if self.version >= 5:
            cols.append(self.length.astype("<u4").tobytes())
        flags = 0
        if self.token_ids is not None:
            flags |= _FLAG_TOKEN_IDS
            cols.append(self.token_ids.astype("<u4").tobytes())
        body = zlib.compress(b"".join(cols), 6)
        out = _FIXED.pack(MANIFEST_MAGIC, self.version, flags, len(head), len(body))
        out += head + body
        return out + struct.pack("<I", zlib.crc32(out))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | np.ndarray) -> Manifest:
        """Parse and validate; any inconsistency raises :class:`ManifestError`."""
        buf = bytes(data) if not isinstance(data, np.ndarray) else data.tobytes()
        if len(buf) < _FIXED.size + 4:
            raise ManifestError(f"manifest truncated: {len(buf)} bytes")
        magic, version, flags, jlen, blen = _FIXED.unpack_from(buf)
        if magic != MANIFEST_MAGIC:
            raise ManifestError(f"not a kvtransport manifest (magic {magic!r})")
        if version not in MANIFEST_VERSIONS:
            raise ManifestError(f"manifest version {version} is not supported")
        if len(buf) != _FIXED.size + jlen + blen + 4:
            raise ManifestError(
                f"manifest length {len(buf)} != {_FIXED.size + jlen + blen + 4} announced"
            )
        (crc,) = struct.unpack_from("<I", buf, len(buf) - 4)
        if zlib.crc32(buf[:-4]) != crc:
            raise ManifestError("manifest checksum mismatch (corrupted)")
        try:
            head = json.loads(buf[_FIXED.size : _FIXED.size + jlen])
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"manifest undecodable: {exc}") from exc
        geometry, n, model_id, sha, created = _parse_header(head)
        tokens = geometry.num_tokens if flags & _FLAG_TOKEN_IDS else 0
        lengths = 4 * n if version >= 5 else 0
        sizes = [2 * n, 4 * n, n, 4 * n, 4 * n, lengths, 4 * tokens]
        try:  # at most the size the header announces (no decompression bomb)
            z = zlib.decompressobj()
            body = z.decompress(buf[_FIXED.size + jlen : -4], sum(sizes) + 1)
        except zlib.error as exc:
            raise ManifestError(f"manifest undecodable: {exc}") from exc
        if len(body) != sum(sizes):
            raise ManifestError(f"manifest body holds {len(body)} bytes, expected {sum(sizes)}")
        cuts = np.cumsum([0, *sizes])
        col = [body[cuts[i] : cuts[i + 1]] for i in range(len(sizes))]
        arrays: dict[str, np.ndarray] = dict(
            layer=np.frombuffer(col[0], "<u2").astype(np.uint16),
            token_block=np.frombuffer(col[1], "<u4").astype(np.uint32),
            precision=np.frombuffer(col[2], "u1").astype(np.uint8),
            checksum=np.frombuffer(col[3], "<u4").astype(np.uint32),
            utility=np.frombuffer(col[4], "<f4").astype(np.float32),
        )
        token_ids = np.frombuffer(col[6], "<u4").astype(np.int64) if tokens else None
        coded = np.frombuffer(col[5], "<u4").astype(np.int64) if lengths else None
        return _validated(cls, model_id, geometry, arrays, sha, token_ids, created, coded)

    def to_json(self) -> dict[str, Any]:
        """A readable form (cards keep it as metadata): header plus a columnar block table."""
        out = self.header()
        out["blocks"] = {
            "layer": self.layer.tolist(),
            "token_start": self.token_start.tolist(),
            "token_count": self.token_count.tolist(),
            "precision": [PRECISIONS[p] for p in self.precision.tolist()],
            "offset": self.offset.tolist(),
            "length": self.length.tolist(),
            "crc32": self.checksum.tolist(),
            "utility": [float(u) for u in self.utility.tolist()],
        }
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids.tolist()
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        """Inverse of :meth:`to_json`; the derived columns are checked, not trusted."""
        if not isinstance(obj, dict) or not isinstance(obj.get("blocks"), dict):
            raise ManifestError("manifest JSON lacks a block table")
        geometry, n, model_id, sha, created = _parse_header(obj)
        b = obj["blocks"]
        try:
            names = [PRECISIONS.index(p) for p in b["precision"]]
            token_start = np.asarray(b["token_start"], dtype=np.int64)
            arrays = dict(
                layer=np.asarray(b["layer"], dtype=np.int64),
                token_block=token_start // geometry.block_tokens,
                precision=np.asarray(names, dtype=np.int64),
                checksum=np.asarray(b["crc32"], dtype=np.int64),
                utility=np.asarray(b["utility"], dtype=np.float64),
            )
            ids = obj.get("token_ids")
            token_ids = None if ids is None else np.asarray(ids, dtype=np.int64)
            coded = np.asarray(b.get("length", []), dtype=np.int64)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(f"manifest block table malformed: {exc}") from exc
        if any(a.shape != (n,) for a in arrays.values()):
            raise ManifestError(f"manifest block table does not hold {n} blocks")
        if np.any(token_start % geometry.block_tokens):
            raise ManifestError("manifest token_start not on a block boundary")
        for name, lo, hi in (("layer", 0, 2**16 - 1), ("checksum", 0, 2**32 - 1)):
            if n and (arrays[name].min() < lo or arrays[name].max() > hi):
                raise ManifestError(f"manifest {name} out of range")
        arrays["layer"] = arrays["layer"].astype(np.uint16)
        arrays["token_block"] = np.clip(arrays["token_block"], 0, 2**32 - 1).astype(np.uint32)
        arrays["precision"] = arrays["precision"].astype(np.uint8)
        arrays["checksum"] = arrays["checksum"].astype(np.uint32)
        arrays["utility"] = arrays["utility"].astype(np.float32)
        has_coded = bool(np.isin(arrays["precision"], _CODED_CODES).any())
        if has_coded and coded.shape != (n,):
            raise ManifestError(f"manifest length column does not hold {n} blocks")
        m = _validated(cls, model_id, geometry, arrays, sha, token_ids, created,
                       coded if has_coded else None)  # fmt: skip
        for name in ("token_count", "offset", "length"):
            if list(b.get(name, [])) != getattr(m, name).tolist():
                raise ManifestError(f"manifest {name} column disagrees with the geometry")
        return m


MAX_GEOMETRY = 1 << 24
"""Largest value a manifest's geometry field (layers, heads, tokens, ...) may have: a
manifest may come from the network, and its fields size what is read next."""


def _parse_header(head: Any) -> tuple[Geometry, int, str, str, dict[str, Any]]:
    if not isinstance(head, dict):
        raise ManifestError("manifest header is not a JSON object")
    try:
        ints = {k: head[k] for k in ("layers", "kv_heads", "tokens", "head_dim", "block_tokens")}
        ints["group_size"] = head["group_size"]
        ints["int8_group_size"] = head.get("int8_group_size", head["group_size"])
        ints["num_blocks"] = head["num_blocks"]
        model_id, dtype, sha = head["model_id"], head["dtype"], head["token_ids_sha256"]
        created = head.get("created", {})
        int4_keys = head.get("int4_keys", "token")
    except KeyError as exc:
        raise ManifestError(f"manifest header lacks {exc}") from exc
    if not all(type(v) is int and 0 <= v <= MAX_GEOMETRY for v in ints.values()):
        raise ManifestError(
            f"manifest geometry fields must be non-negative integers <= {MAX_GEOMETRY}"
        )
    if min(ints["layers"], ints["kv_heads"], ints["head_dim"], ints["block_tokens"]) < 1:
        raise ManifestError("manifest geometry has an empty dimension")
    for name in ("group_size", "int8_group_size"):
        try:
            quant.check_group(ints["head_dim"], ints[name])
        except ValueError:
            raise ManifestError(f"manifest {name} {ints[name]} invalid") from None
    if dtype not in _DTYPES or not isinstance(model_id, str) or not isinstance(sha, str):
        raise ManifestError("manifest dtype, model_id or token hash malformed")
    if not isinstance(created, dict):
        raise ManifestError("manifest creation info malformed")
    if int4_keys not in INT4_KEYS:
        raise ManifestError(f"manifest int4_keys must be one of {INT4_KEYS}")
    g = Geometry(
        ints["layers"],
        ints["kv_heads"],
        ints["tokens"],
        ints["head_dim"],
        dtype,
        ints["block_tokens"],
        ints["group_size"],
        ints["int8_group_size"],
        int4_keys,
    )
    if ints["num_blocks"] > g.num_blocks:
        raise ManifestError(f"manifest lists {ints['num_blocks']} blocks, geometry has fewer")
    return g, ints["num_blocks"], model_id, sha, created


def _validated(
    cls: type[Manifest],
    model_id: str,
    g: Geometry,
    arrays: dict[str, np.ndarray],
    sha: str,
    token_ids: np.ndarray | None,
    created: dict[str, Any],
    coded: np.ndarray | None = None,
) -> Manifest:
    if np.any(arrays["layer"] >= g.num_layers) or np.any(arrays["token_block"] >= g.token_blocks):
        raise ManifestError("manifest lists a block outside the geometry")
    if np.any(arrays["precision"] >= len(PRECISIONS)):
        raise ManifestError("manifest lists an unknown precision code")
    u = arrays["utility"]
    if not np.all(np.isfinite(u)) or np.any(u < 0) or u.sum(dtype=np.float64) > 1 + 1e-4:
        raise ManifestError("manifest utilities must be finite, >= 0 and sum to <= 1")
    flat = arrays["layer"].astype(np.int64) * g.token_blocks + arrays["token_block"]
    if np.unique(flat).size != flat.size:
        raise ManifestError("manifest lists a block twice")
    if token_ids is not None and _token_hash(token_ids) != sha:
        raise ManifestError("manifest token ids do not match their hash")
    if token_ids is not None and token_ids.shape != (g.num_tokens,):
        raise ManifestError("manifest token ids have the wrong length")
    if coded is not None:
        _check_lengths(g, arrays["precision"], arrays["token_block"], coded)
    return cls(model_id=model_id, geometry=g, token_ids_sha256=sha, token_ids=token_ids,
               created=created, coded_length=coded, **arrays)  # fmt: skip


def max_coded_nbytes(g: Geometry, tokens: int) -> int:
    """The most bytes a coded (int8r) block of ``tokens`` tokens may take: every symbol at
    its most (a 16-bit rANS word and a 2-byte escape), the frequency table, the lengths and
    the scales (kvtransport.codecs.kvcodec's layout). A manifest announcing more is forged."""
    symbols = 2 * g.num_kv_heads * (tokens + 1) * g.head_dim
    scales = g.block_nbytes("int8", tokens) - kvcodec.int8_codes_nbytes(
        g.num_kv_heads, tokens, g.head_dim
    )
    return 4 * symbols + scales + 2 * 256 + 64


def _check_lengths(
    g: Geometry, precision: np.ndarray, token_block: np.ndarray, length: np.ndarray
) -> None:
    """A manifest's length column: each fixed-precision block's as the geometry gives it,
    each coded block's between 1 and :func:`max_coded_nbytes`; ManifestError otherwise."""
    counts = g.block_token_count(token_block)
    coded = np.isin(precision, _CODED_CODES)
    expected = _layout(g, precision[~coded], token_block[~coded], None)[1]
    if np.any(length[~coded] != expected):
        raise ManifestError("manifest length column disagrees with the geometry")
    for c in np.unique(counts[coded]).tolist():
        sel = coded & (counts == c)
        if np.any(length[sel] < 1) or np.any(length[sel] > max_coded_nbytes(g, c)):
            raise ManifestError("manifest lists a coded block length out of range")


def _layout(
    g: Geometry, precision: np.ndarray, token_block: np.ndarray, coded: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token count, byte length and offset of each block of a stream; ``coded``: the
    lengths of its coded blocks (CODED precisions; None: there are none)."""
    counts = g.block_token_count(token_block)
    table = {
        (p, c): g.block_nbytes(PRECISIONS[p], c)
        for p, c in set(zip(precision.tolist(), counts.tolist(), strict=True))
    }
    pairs = zip(precision.tolist(), counts.tolist(), strict=True)
    length = np.fromiter((table[pc] for pc in pairs), dtype=np.int64, count=counts.size)
    if coded is not None:
        length = np.where(np.isin(precision, _CODED_CODES), coded, length)
    offset = np.zeros_like(length)
    np.cumsum(length[:-1], out=offset[1:])
    return counts, length, offset


def _token_hash(token_ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(token_ids, dtype="<i8").tobytes()).hexdigest()


def is_cache_of(manifest: Manifest, token_ids: np.ndarray | Sequence[int]) -> bool:
    """Whether the stream is the cache of exactly ``token_ids`` (the ids the manifest
    carries, else their SHA-256)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.shape != (manifest.geometry.num_tokens,):
        return False
    if manifest.token_ids is not None:
        return bool(np.array_equal(manifest.token_ids, ids))
    return _token_hash(ids) == manifest.token_ids_sha256


# ---------------------------------------------------------------------------------------
# Encoding


@dataclass(frozen=True)
class EncodedStream:
    """What the sender hands to the transport (see the module docstring)."""

    manifest: Manifest
    manifest_bytes: bytes
    payload: np.ndarray  # uint8 [payload bytes], blocks back to back in stream order

    @property
    def offsets(self) -> np.ndarray:
        return self.manifest.offset

    @property
    def lengths(self) -> np.ndarray:
        return self.manifest.length

    @property
    def utilities(self) -> np.ndarray:
        """float64 utilities of the stream's blocks (share of the whole cache; sum <= 1).

        The manifest stores float32; should their float64 sum round above 1 it is scaled
        back, so transports may rely on ``sum <= 1`` exactly.
        """
        u = self.manifest.utility.astype(np.float64)
        total = u.sum()
        return u / total if total > 1.0 else u

    def to_transfer(self) -> Transfer:
        """The stream as the transport's transfer: the blocks, their utilities, the
        manifest as opaque app metadata, and the stream's kind declared for the transport
        (``whole_ranges``: :attr:`Manifest.whole_ranges`), which never parses the manifest."""
        return Transfer(
            payload=self.payload,
            blocks=BlockTable(self.offsets, self.lengths, self.utilities),
            app_metadata=self.manifest_bytes,
            whole_ranges=self.manifest.whole_ranges,
        )


def parse_precision(spec: str) -> tuple[str, int | None]:
    """``fp32|fp16|int8|int4`` -> (name, None); ``mixed:BYTES`` -> ("mixed", BYTES).

    BYTES takes an optional K/M/G suffix (powers of 1024). Raises ValueError otherwise.
    """
    spec = spec.strip().lower()
    if spec in PRECISIONS:
        return spec, None
    if spec.startswith("mixed:"):
        raw = spec[6:].strip()
        mult = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(raw[-1:], 1)
        digits = raw[:-1] if mult > 1 else raw
        try:
            value = float(digits) * mult
        except ValueError:
            value = -1.0
        if value > 0:
            return "mixed", int(value)
        raise ValueError(f"mixed:BYTES needs a positive byte count, not {raw!r}")
    raise ValueError(f"precision {spec!r} is not one of {', '.join(PRECISIONS)} or mixed:BYTES")


MIXED_LEVELS = ("fp16", "int8", "k8v4", "int4")
DEFAULT_FIDELITY = {"fp32": 1.0, "fp16": 1.0, "int8": 0.999, "int4": 0.988, "k8v4": 0.994,
                    "int8r": 0.999}  # fmt: skip
"""Share of a block's utility that survives at each precision, used by the mixed
allocator and the handoff plan. Calibrated with scripts/eval_quant.py's uniform-precision
runs on SmolLM2 (16 prompts, task seeds 30000+): teacher-forced top-1 agreement with the
fp32 answer was 1.000 for fp16, 0.996 for int8 and 0.988 [0.975, 1.002] for int4 with keys
per channel (0.978 with int4 keys per token, which the value before was set from). int8
is set just below 1 so that fp16 still wins a block when bytes are plentiful; the
agreement saturates there. k8v4's top-1 cannot be told from int4's on those prompts
(their intervals overlap), so it is placed between int4's and int8's values by the same
run's teacher-forced KL to the fp32 answer, which tells them apart: as far from int4
toward int8 as its KL lies, rounded down (kvtransport.model.plan.menu keeps a level only
where it is worth its bytes against its neighbours). int8r holds exactly int8's values:
int8's fidelity."""


def plan_precision(
    geometry: Geometry,
    utilities: np.ndarray,
    spec: str,
    fidelity: dict[str, float] | None = None,
) -> np.ndarray:
    """Precision code per block ``[layers, token_blocks]`` (-1: dropped) for a spec.

    Uniform specs give every block the same code; ``mixed:BYTES`` runs
    :func:`kvtransport.codecs.quant.allocate_precision` over MIXED_LEVELS and dropped with
    the payload byte budget BYTES (the manifest is not counted).
    """
    name, budget = parse_precision(spec)
    shape = (geometry.num_layers, geometry.token_blocks)
    if name != "mixed":
        return np.full(shape, PRECISIONS.index(name), dtype=np.int64)
    assert budget is not None  # parse_precision gives "mixed" its byte budget
    fid = fidelity or DEFAULT_FIDELITY
    cost = geometry.cost_table(MIXED_LEVELS)
    alloc = quant.allocate_precision(
        np.asarray(utilities, dtype=np.float64).reshape(-1),
        cost,
        np.array([fid[p] for p in MIXED_LEVELS]),
        int(budget),
    )
    codes = np.array([PRECISIONS.index(p) for p in MIXED_LEVELS], dtype=np.int64)
    out = np.where(alloc.level >= 0, codes[np.maximum(alloc.level, 0)], -1)
    return out.reshape(shape)


def estimate_coded(
    g: Geometry, cache: KVCache, manifest: Manifest | None = None, sample: int = 64
) -> Geometry:
    """``g`` with ``int8r_ratio`` (what the plan sizes int8r blocks by) from ``cache``'s
    statistics: where ``manifest`` (the card's stream of this cache) holds int8r blocks,
    their lengths against int8's; else up to ``sample`` full blocks spread evenly over
    the cache, int8-quantized and coded (a sample, not the whole cache)."""
    if manifest is not None and manifest.has_coded:
        m = manifest
        sel = np.isin(m.precision, _CODED_CODES)
        int8 = sum(g.block_nbytes("int8", int(c)) for c in m.token_count[sel].tolist())
        return replace(g, int8r_ratio=float(m.length[sel].sum()) / int8)
    full = g.num_tokens // g.block_tokens
    if full == 0:
        return g
    flat = np.unique(np.linspace(0, g.num_layers * full - 1, min(sample, g.num_layers * full))
                     .astype(np.int64))  # fmt: skip
    layer, tb = np.divmod(flat, full)
    lo = tb[:, None] * g.block_tokens + np.arange(g.block_tokens)
    kv = np.stack([cache.keys[layer[:, None], :, lo], cache.values[layer[:, None], :, lo]], 1)
    kv = kv.transpose(0, 1, 3, 2, 4)  # [n, 2, H, T, D]
    rows = _encode_rows(np.ascontiguousarray(kv, dtype=np.float32), "int8", g)
    _, lengths = kvcodec.encode_int8_rows(rows, g.num_kv_heads, g.block_tokens, g.head_dim)
    return replace(g, int8r_ratio=float(lengths.sum()) / rows.size)


def _padded_blocks(x: np.ndarray, g: Geometry) -> np.ndarray:
    """``[L, H, N, D]`` -> ``[L, H, token_blocks, block_tokens, D]`` (zero-padded tail)."""
    pad = g.token_blocks * g.block_tokens - g.num_tokens
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:2], pad, x.shape[3]), x.dtype)], axis=2)
    return x.reshape(g.num_layers, g.num_kv_heads, g.token_blocks, g.block_tokens, g.head_dim)


def _encode_rows(kv: np.ndarray, precision: str, g: Geometry) -> np.ndarray:
    """``[n, 2, H, T, D]`` float blocks -> ``[n, bytes]`` uint8 rows in block layout."""
    n = kv.shape[0]
    if precision in _FLOAT:
        with np.errstate(over="ignore"):  # overflow is checked just below
            arr = kv.astype(_FLOAT[precision])
        if precision == "fp16" and not np.all(np.isfinite(arr)):
            raise ValueError("cache values exceed the float16 range")
        return np.ascontiguousarray(arr).view(np.uint8).reshape(n, -1)
    return quant.quantize_kv_mixed(kv, *g.quant_spec(precision))


def _decode_rows(rows: np.ndarray, precision: str, g: Geometry, tokens: int) -> np.ndarray:
    """Inverse of :func:`_encode_rows`: ``[n, bytes]`` -> ``[n, 2, H, tokens, D]``."""
    n = rows.shape[0]
    shape = (n, 2, g.num_kv_heads, tokens, g.head_dim)
    if precision in _FLOAT:
        return np.ascontiguousarray(rows).view(_FLOAT[precision]).reshape(shape)
    return quant.dequantize_kv_mixed(rows, shape, *g.quant_spec(precision),
                                     _DTYPES[g.dtype])  # fmt: skip


def encode_stream(
    cache: KVCache,
    utilities: np.ndarray,
    order: np.ndarray,
    precision: np.ndarray | str | None = None,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    group_size: int | None = None,
    int8_group_size: int | None = None,
    int4_keys: str = "channel",
    include_token_ids: bool = True,
    created: dict[str, Any] | None = None,
) -> EncodedStream:
    """Serialize ``cache`` as blocks in ``order``.

    utilities: ``[layers, token_blocks]``, normalized here to sum to 1 over the cache.
    order: flat block indices (``layer * token_blocks + token_block``) in stream order;
        usually :func:`kvtransport.model.utility.stream_order`. Blocks whose precision is -1
        (dropped by a byte budget) are left out of the stream.
    precision: a precision name for every block, or ``[layers, token_blocks]`` codes
        (index into PRECISIONS, -1 = dropped); default: the cache's own dtype (lossless).
    group_size / int8_group_size / int4_keys: the quantization groups and int4's key
        layout (:meth:`Geometry.of`).
    include_token_ids: carry the token ids in the manifest (4 bytes per token before
        compression); otherwise only their SHA-256 and the receiver supplies them.
    """
    g = Geometry.of(cache, block_tokens, group_size, int8_group_size, int4_keys)
    shape = (g.num_layers, g.token_blocks)
    u = np.asarray(utilities, dtype=np.float64)
    if u.shape != shape:
        raise ValueError(f"utilities {u.shape} != {shape}")
    if not np.all(np.isfinite(u)) or np.any(u < 0) or u.sum() <= 0:
        raise ValueError("utilities must be finite, non-negative and not all zero")
    u = u / u.sum()
    if precision is None:
        precision = "fp32" if g.dtype == "float32" else "fp16"
    if isinstance(precision, str):
        codes = np.full(shape, PRECISIONS.index(precision), dtype=np.int64)
    else:
        codes = np.asarray(precision, dtype=np.int64)
        if codes.shape != shape or np.any(codes >= len(PRECISIONS)) or np.any(codes < -1):
            raise ValueError(f"precision codes must be {shape} in -1..{len(PRECISIONS) - 1}")
    order = np.asarray(order, dtype=np.int64)
    if np.sort(order).tolist() != list(range(g.num_blocks)):
        raise ValueError("order must be a permutation of all flat block indices")
    order = order[codes.reshape(-1)[order] >= 0]
    if np.any(cache.token_ids < 0) or np.any(cache.token_ids > _MAX_TOKEN_ID):
        raise ValueError("token ids must fit in 32 bits unsigned")

    layer = (order // g.token_blocks).astype(np.uint16)
    tblock = (order % g.token_blocks).astype(np.uint32)
    prec = codes.reshape(-1)[order].astype(np.uint8)
    counts = g.block_token_count(tblock)
    # [L, token_blocks, H, T, D] views: one block is then one (layer, token block) row.
    k5 = _padded_blocks(cache.keys, g).transpose(0, 2, 1, 3, 4)
    v5 = _padded_blocks(cache.values, g).transpose(0, 2, 1, 3, 4)
    # One vectorized encode per (precision, token count) group, one concatenation at the end.
    pieces: list[np.ndarray] = [np.empty(0, np.uint8)] * order.size
    for p, c in sorted(set(zip(prec.tolist(), counts.tolist(), strict=True))):
        idx = np.flatnonzero((prec == p) & (counts == c))
        ls, ts = layer[idx].astype(np.int64), tblock[idx].astype(np.int64)
        kv = np.stack([k5[ls, ts, :, :c], v5[ls, ts, :, :c]], axis=1)  # [n, 2, H, c, D]
        if PRECISIONS[p] in CODED:
            coded, lens = kvcodec.encode_int8_rows(_encode_rows(kv, "int8", g), g.num_kv_heads,
                                                   c, g.head_dim)  # fmt: skip
            ends = np.cumsum(lens)
            for r, i in enumerate(idx.tolist()):
                pieces[i] = coded[ends[r] - lens[r] : ends[r]]
            continue
        rows = _encode_rows(kv, PRECISIONS[p], g)
        for r, i in enumerate(idx.tolist()):
            pieces[i] = rows[r]
    payload = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
    length = np.array([piece.size for piece in pieces], dtype=np.int64)
    offset = np.zeros_like(length)
    np.cumsum(length[:-1], out=offset[1:])
    checksum = np.array(
        [zlib.crc32(payload[o : o + n]) for o, n in zip(offset, length, strict=True)],
        dtype=np.uint32,
    )
    manifest = Manifest(
        model_id=cache.model_id,
        geometry=g,
        layer=layer,
        token_block=tblock,
        precision=prec,
        checksum=checksum,
        utility=u.reshape(-1)[order].astype(np.float32),
        token_ids_sha256=_token_hash(cache.token_ids),
        token_ids=cache.token_ids.astype(np.int64) if include_token_ids else None,
        created=dict(created or {}),
        coded_length=length if np.isin(prec, _CODED_CODES).any() else None,
    )
    return EncodedStream(manifest=manifest, manifest_bytes=manifest.to_bytes(), payload=payload)


# ---------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True)
class Reassembled:
    """What the receiver injects.

    cache: keys/values with zeros where blocks are missing (never NaN).
    present: ``[layers, tokens]`` bool, True where the layer's K/V for the token arrived
        intact (the per-layer mask for injection).
    missing: stream indices of listed blocks that did not arrive or failed their checksum.
    corrupted: the subset of ``missing`` that arrived "complete" but failed the CRC-32 or,
        coded (CODED), did not decode.
    """

    cache: KVCache
    present: np.ndarray
    missing: np.ndarray
    corrupted: np.ndarray
    manifest: Manifest

    @property
    def mask(self) -> np.ndarray | None:
        """``present`` for injection, or None when every slot arrived (the model then runs
        its stock attention: kvtransport.model.hf's ``present=None``)."""
        return None if self.present.all() else self.present

    @property
    def utility_recovered(self) -> float:
        """Share of the whole cache's utility that arrived intact."""
        ok = np.ones(self.manifest.num_blocks, dtype=bool)
        ok[self.missing] = False
        return float(self.manifest.utility[ok].sum(dtype=np.float64))


def _as_u8(payload: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    if isinstance(payload, bytes | bytearray | memoryview):
        return np.frombuffer(payload, dtype=np.uint8)
    return np.asarray(payload).reshape(-1).view(np.uint8)


def corrupted_blocks(
    manifest: Manifest,
    payload: np.ndarray | bytes | bytearray | memoryview,
    complete: np.ndarray | None = None,
) -> np.ndarray:
    """Stream indices of complete blocks whose bytes fail their CRC-32 (sorted).

    Raises ValueError when the payload is too short for a block marked complete.
    """
    m = manifest
    buf = _as_u8(payload)
    ok = np.ones(m.num_blocks, bool) if complete is None else np.asarray(complete, bool)
    end = m.offset + m.length
    if np.any(ok & (end > buf.size)):
        raise ValueError(f"payload of {buf.size} bytes is shorter than its complete blocks")
    candidates = np.flatnonzero(ok)
    crc_ok = np.fromiter(
        (zlib.crc32(buf[m.offset[i] : end[i]]) == m.checksum[i] for i in candidates.tolist()),
        dtype=bool,
        count=candidates.size,
    )
    return candidates[~crc_ok]


def decode_stream(
    manifest: Manifest | bytes | bytearray | memoryview,
    payload: np.ndarray | bytes | bytearray | memoryview,
    complete: np.ndarray | None = None,
    *,
    token_ids: np.ndarray | Sequence[int] | None = None,
) -> Reassembled:
    """Rebuild a cache from a (possibly partial) payload.

    complete: ``[blocks]`` bool in stream order, True where the transport holds all of a
        block's bytes (default: all). Bytes of incomplete blocks are never read.
    token_ids: needed only when the manifest carries just their hash; checked against it.
        Without either, token ids are -1 (unknown).
    Raises ManifestError for a bad manifest and ValueError for a payload too short for a
    block marked complete.
    """
    m = manifest if isinstance(manifest, Manifest) else Manifest.from_bytes(manifest)
    g = m.geometry
    buf = _as_u8(payload)
    ok = np.ones(m.num_blocks, bool) if complete is None else np.asarray(complete, bool).copy()
    if ok.shape != (m.num_blocks,):
        raise ValueError(f"complete mask {ok.shape} != ({m.num_blocks},)")
    corrupted = corrupted_blocks(m, buf, ok)
    ok[corrupted] = False

    dtype = _DTYPES[g.dtype]
    n, tb, bt = g.num_tokens, g.token_blocks, g.block_tokens
    shape = (g.num_layers, g.num_kv_heads, n, g.head_dim)
    keys, values = np.zeros(shape, dtype), np.zeros(shape, dtype)  # lazily zeroed pages
    present_blocks = np.zeros((g.num_layers, tb), dtype=bool)
    undecodable = decode_blocks_into(m, buf, np.flatnonzero(ok), keys, values)
    ok[undecodable] = False
    corrupted = np.union1d(corrupted, undecodable).astype(np.int64)
    good = np.flatnonzero(ok)
    present_blocks[m.layer[good], m.token_block[good]] = True
    present = np.repeat(present_blocks, bt, axis=1)[:, :n]
    if m.token_ids is not None:
        ids = m.token_ids
    elif token_ids is not None:
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.shape != (n,) or _token_hash(ids) != m.token_ids_sha256:
            raise ValueError("token ids supplied do not match the manifest's hash")
    else:
        ids = np.full(n, -1, dtype=np.int64)
    cache = KVCache(keys=keys, values=values, token_ids=ids, model_id=m.model_id)
    missing = np.flatnonzero(~ok)
    return Reassembled(cache, present, missing, corrupted, m)


def decode_blocks_into(
    manifest: Manifest, payload: np.ndarray, blocks: np.ndarray, keys: np.ndarray,
    values: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Decode the stream blocks ``blocks`` (indices; their bytes in ``payload`` at their
    offsets, checked by the caller) into place in ``keys`` / ``values``, each
    ``[layers, kv_heads, tokens, head_dim]`` of the geometry's dtype. Other slots are left
    as they are, so a receiver can decode a few token ranges at a time into one cache.
    Returns the indices of coded blocks (CODED) that do not decode although their bytes
    passed the CRC-32 (forged or corrupted), whose slots are left as they are too."""
    m, g, buf = manifest, manifest.geometry, _as_u8(payload)
    good = np.asarray(blocks, dtype=np.int64)
    offset, end = m.offset, m.offset + m.length
    counts, starts, layers = m.token_count, m.token_start, m.layer
    undecodable: list[np.ndarray] = [np.empty(0, np.int64)]
    # Each block is copied straight into place (one slice assignment per K and V); only
    # quantized blocks go through an intermediate, dequantized in one vectorized step per
    # (precision, token count) group.
    for p, c in sorted(set(zip(m.precision[good].tolist(), counts[good].tolist(), strict=True))):
        idx = good[(m.precision[good] == p) & (counts[good] == c)]
        name = PRECISIONS[p]
        src, src_offset = buf, offset[idx]
        if name in CODED:
            idx, src, bad = _uncoded_rows(m, buf, idx, c)
            undecodable.append(bad)
            name = CODED_AS[name]
            src_offset = np.arange(idx.size, dtype=np.int64) * (src.size // max(idx.size, 1))
        # one numba pass, in place; one compiled kernel for every quantized precision (what
        # warms int8 and int4 warms k8v4)
        if name not in _FLOAT and keys.dtype == np.float32:
            quant.dequantize_mixed_blocks_into(
                src, src_offset, layers[idx].astype(np.int64), starts[idx], c,
                *g.quant_spec(name), keys, values,
            )  # fmt: skip
            continue
        kv: list[np.ndarray] | np.ndarray
        if name in _FLOAT:
            kv = [buf[offset[i] : end[i]].view(_FLOAT[name]).reshape(2, -1, c, g.head_dim)
                  for i in idx]  # fmt: skip
        else:
            n = g.block_nbytes(name, c)
            kv = _decode_rows(np.stack([src[o : o + n] for o in src_offset]), name, g, c)
        for j, i in enumerate(idx.tolist()):
            t0 = int(starts[i])
            keys[layers[i], :, t0 : t0 + c] = kv[j][0]
            values[layers[i], :, t0 : t0 + c] = kv[j][1]
    return np.sort(np.concatenate(undecodable))


def _uncoded_rows(
    m: Manifest, buf: np.ndarray, idx: np.ndarray, tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coded blocks ``idx`` of ``tokens`` tokens back to their fixed-length layout: (the
    blocks that decode, their rows back to back (uint8), the blocks that do not)."""
    g = m.geometry
    name = CODED_AS[PRECISIONS[int(m.precision[idx[0]])]] if idx.size else "int8"
    rows = np.empty((idx.size, g.block_nbytes(name, tokens)), np.uint8)
    status = kvcodec.decode_int8_rows(buf, m.offset[idx], m.length[idx], g.num_kv_heads,
                                      tokens, g.head_dim, rows)  # fmt: skip
    ok = status == 0
    return idx[ok], np.ascontiguousarray(rows[ok]).reshape(-1), idx[~ok]


class RangeDecoder:
    """One stream's blocks checked and decoded token range by token range, each block
    once, into one cache of the whole context: what a receiver racing the link does with
    a range when it loads it, instead of decoding the whole stream first.

    keys / values: ``[layers, kv_heads, tokens, head_dim]`` of the geometry's dtype,
    zeros where nothing was decoded; failed: per block, it failed its CRC-32 or, coded
    (CODED), did not decode (so its range is never loaded).
    """

    def __init__(self, manifest: Manifest) -> None:
        g = manifest.geometry
        self.manifest = manifest
        self.range_blocks = [np.flatnonzero(manifest.token_block == r)
                             for r in range(g.token_blocks)]  # fmt: skip
        self.failed = np.zeros(manifest.num_blocks, dtype=bool)
        self._decoded = np.zeros(manifest.num_blocks, dtype=bool)
        shape = (g.num_layers, g.num_kv_heads, g.num_tokens, g.head_dim)
        dtype = np.float32 if g.dtype == "float32" else np.float16
        self.keys, self.values = np.zeros(shape, dtype), np.zeros(shape, dtype)

    def take_range(
        self, payload: np.ndarray | bytes | bytearray | memoryview, r: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`take` of token range ``r`` (the last one may be short)."""
        g = self.manifest.geometry
        return self.take(payload, r * g.block_tokens, min((r + 1) * g.block_tokens, g.num_tokens))

    def take(
        self, payload: np.ndarray | bytes | bytearray | memoryview, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The K/V of tokens ``[lo, hi)`` (whole token ranges whose blocks are complete in
        ``payload``), decoding what was not yet; None when one of those blocks fails its
        CRC-32 or does not decode (then marked in ``failed``)."""
        bt = self.manifest.geometry.block_tokens
        if not self._decode(payload, np.concatenate(self.range_blocks[lo // bt : -(-hi // bt)])):
            return None
        return self.keys[:, :, lo:hi], self.values[:, :, lo:hi]

    def take_layer(
        self, payload: np.ndarray | bytes | bytearray | memoryview, layer: int, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The K/V ``[kv_heads, hi - lo, head_dim]`` of one layer's tokens ``[lo, hi)``
        (whole token ranges whose blocks of that layer are complete in ``payload``), as
        :meth:`take` does for every layer: a receiver loading a stream's tail layer by
        layer (kvtransport.model.race)."""
        m = self.manifest
        bt = m.geometry.block_tokens
        tb = m.token_block
        idx = np.flatnonzero((m.layer == layer) & (tb >= lo // bt) & (tb < -(-hi // bt)))
        if not self._decode(payload, idx):
            return None
        return self.keys[layer, :, lo:hi], self.values[layer, :, lo:hi]

    def _decode(
        self, payload: np.ndarray | bytes | bytearray | memoryview, idx: np.ndarray
    ) -> bool:
        """Check and decode the blocks ``idx`` not decoded yet; False (and marked in
        ``failed``) when one fails its CRC-32 or does not decode."""
        todo = idx[~self._decoded[idx]]
        if todo.size:
            m = self.manifest
            check = np.zeros(m.num_blocks, dtype=bool)
            check[todo] = True
            bad = corrupted_blocks(m, payload, check)
            if bad.size:
                self.failed[bad] = True
                return False
            bad = decode_blocks_into(m, _as_u8(payload), todo, self.keys, self.values)
            self._decoded[todo] = True
            self._decoded[bad] = False
            if bad.size:
                self.failed[bad] = True
                return False
        return True
