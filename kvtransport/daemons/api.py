"""The daemons' local API: ZeroMQ message layouts, default endpoints, result files.

Control (both daemons): a ROUTER socket, by default on an ``ipc://`` path (a file, so a
client in another network namespace reaches it too) in a private runtime directory
(:func:`runtime_dir`, mode 0700), or on ``tcp://`` loopback only (control is not
authenticated: :func:`check_endpoint` refuses other hosts, and ipc:// directories that are
not the user's own, on both the daemon's and the client's side), or on any ``tcp://``
address with ZeroMQ CURVE (kvtransport.daemons.curve: ``--curve-secret`` on the daemon,
``curve_server_key`` on the client). A request is a
multipart message ``[header, *frames]`` (REQ framing); the header is one JSON object with
an ``op``; the reply is ``[json]`` with ``ok`` and either the answer or ``error`` (one line).

Sender daemon ops::

    submit  {"op": "submit", "to": "HOST:PORT", "deadline_ms": D | "rho": R,
             "policy": "adaptive", "weight": 1.0, "label": "...",
             "utility": {"a":..,"b":..,"c":..,"d":..}  (or "model" + "context_tokens"),
             "transfer_id": "hex" (optional), "initial_rtt_ms": 20 (optional: else
             the shortest round trip the receiver's last transfer measured, else the
             config's)}
            + frames  payload (uint8 stream in utility order), offsets (<u8), lengths
                      (<u8), utilities (<f8), app_metadata (bytes, may be empty)
            -> {"ok": true, "transfer_id": "0123...", "deadline_s": .., "n_source": ..}
    status  {"op": "status"} or {"op": "status", "transfer_id": "hex"}
            -> {"ok": true, "transfers": [ {...}, ... ]}   (each transfer's state, counters,
               pacing rate and link share)
    cancel  {"op": "cancel", "transfer_id": "hex"} -> {"ok": true, "cancelled": bool}
    stats   / ping

Receiver daemon ops: ``status``, ``abort`` (deliver a transfer's partial result now),
``stats``, ``ping``. Results go out on a PUB socket as ``[b"result", header, payload,
offsets, lengths, utilities, complete, app_metadata]``: the header (JSON) has the transfer
id, utility recovered, reason, the missing block indices and the per-transfer stats; the
frames are the reassembled stream (complete blocks' bytes at their offsets), the block
table, a uint8 completeness mask and the application metadata.

Frames travel zero-copy (``copy=False`` both ways): the sender daemon paces straight out
of the submitted payload frame, and a subscriber's arrays are views of the received frames.

Result files (``--out-dir``): ``<transfer id>.result.safetensors`` with tensors
``stream``, ``complete`` and ``app_metadata`` plus metadata ``kvtransport.result`` (JSON:
the result header and the block table). When the application metadata is a
kvtransport.kvformat.blocks manifest (the transfer came from a cache card) the file also carries
the card metadata, so
:func:`kvtransport.kvformat.card.read_card` opens it as a cache card; its missing blocks are the
``complete == 0`` ones (they fail their checksums, as they should).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.atomic import atomic_write
from kvtransport.core.transfer import BlockTable, Transfer, TransferResult
from kvtransport.errors import UserError


def runtime_dir() -> Path:
    """Where the default ipc:// sockets live: ``$KVT_RUN_DIR``, else
    ``$XDG_RUNTIME_DIR/kvtransport``, else ``/tmp/kvtransport-<uid>``; made 0700 when a
    daemon or client first uses it (:func:`check_endpoint`)."""
    env = os.environ.get("KVT_RUN_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvtransport"
    return Path(tempfile.gettempdir()) / f"kvtransport-{os.getuid()}"


def _is_loopback(host: str) -> bool:
    """``host`` (of a tcp:// endpoint) is a loopback address: ``localhost``, 127.0.0.0/8
    or ``[::1]``; a name merely starting so (``127.example.net``) is not."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, what: str = "endpoint", *, curve: bool = False) -> str:
    """``endpoint`` if a daemon may bind it or a client may trust it, else a one-line
    UserError naming it as ``what``. Daemons check before any slow start-up work.
    ``tcp://`` (any address, loopback included: every local user can connect there)
    needs ``curve``: the socket uses ZeroMQ CURVE with a client allowlist
    (kvtransport.daemons.curve); ``ipc://`` must name a socket file (not a
    directory) whose directory is made (mode 0700) when missing and must then be owned by
    this user and closed to others' writes, so nobody else can squat the socket path;
    ``inproc://`` is process-local."""
    if endpoint.startswith("inproc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        _check_tcp_port(endpoint, what)
        if not curve:
            raise UserError(
                f"{what} {endpoint}: tcp:// is open to every local user, so it needs CURVE "
                "with a client allowlist (daemon --curve-secret FILE and the clients' public "
                "keys in FILE.clients; clients --curve-server-key FILE.pub "
                "--curve-client-key KEY); or use ipc://"
            )
        from kvtransport.daemons.curve import available

        if not available():
            raise UserError(f"{what} {endpoint}: this pyzmq's libzmq has no CURVE support")
        return endpoint
    if not endpoint.startswith("ipc://"):
        raise UserError(f"{what} {endpoint!r}: use ipc://PATH or tcp://127.0.0.1:PORT")
    path = Path(endpoint[len("ipc://") :])
    if endpoint.endswith("/") or path.is_dir():
        raise UserError(f"{what} {endpoint!r} is a directory, not a socket file")
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as exc:
        raise UserError(f"cannot use {what} {endpoint}: {directory}: {exc.strerror}") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UserError(
            f"{endpoint}: directory {directory} is not private (owner uid {st.st_uid}, mode "
            f"{st.st_mode & 0o7777:04o}); use a directory only you can write (chmod 700)"
        )
    return endpoint


def _check_tcp_port(endpoint: str, what: str) -> None:
    """A one-line UserError unless ``endpoint`` (tcp://) ends in a port 1..65535: ZeroMQ
    would bind a port outside it modulo 65536 without a word."""
    port = endpoint.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise UserError(f"{what} {endpoint}: the port must be a number in 1..65535")


_RUN_DIR = runtime_dir()
DEFAULT_SENDER_CONTROL = f"ipc://{_RUN_DIR / 'kvtransport-sender.ipc'}"
DEFAULT_RECEIVER_CONTROL = f"ipc://{_RUN_DIR / 'kvtransport-receiver.ipc'}"
DEFAULT_RESULTS = f"ipc://{_RUN_DIR / 'kvtransport-results.ipc'}"
RESULT_TOPIC = b"result"
RESULT_KEY = "kvtransport.result"
TRANSFER_FRAMES = ("payload", "offsets", "lengths", "utilities", "app_metadata")


class ApiError(UserError):
    """A request the daemon refused, or a reply a client could not use (one line)."""


def format_tid(tid: int) -> str:
    """Transfer ids travel as 16 hex digits in JSON (a u64 does not fit a JSON double)."""
    return f"{tid:016x}"


def parse_tid(value: object) -> int:
    """A transfer id from JSON: hex string (as :func:`format_tid` writes, at most 16
    digits) or a JSON integer; a float (``1.5``), a bool or anything else is refused."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | str)
        or (isinstance(value, str) and not 1 <= len(value) <= 16)
    ):
        raise ApiError(f"transfer_id {_short(value)} is not a hex u64")
    try:
        tid = int(value, 16) if isinstance(value, str) else value
    except ValueError:
        raise ApiError(f"transfer_id {_short(value)} is not a hex u64") from None
    if not 0 <= tid < 1 << 64:
        raise ApiError(f"transfer_id {_short(value)} does not fit 64 bits")
    return tid


def _short(value: object) -> str:
    s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."


MAX_HEADER_BYTES = 64 * 1024
"""The largest JSON header a request may have (a request holds a few fields)."""

MAX_HEADER_DEPTH = 8
"""The deepest nesting of objects and arrays a header may have (``utility`` is depth 2)."""


def load_json_header(frame: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """The JSON object of a request or reply header frame (ApiError otherwise). With
    ``max_bytes`` (a daemon reading a request) it is also refused when larger than that or
    nested deeper than ``MAX_HEADER_DEPTH``."""
    raw = frame.bytes if hasattr(frame, "bytes") else bytes(frame)
    if max_bytes is not None:
        if len(raw) > max_bytes:
            raise ApiError(f"header of {len(raw)} bytes is larger than {max_bytes}")
        opens = raw.count(b"[") + raw.count(b"{")
        if opens > MAX_HEADER_DEPTH and _nesting(raw) > MAX_HEADER_DEPTH:
            raise ApiError(f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ApiError(f"header is not JSON: {text}") from None
    if not isinstance(head, dict):
        raise ApiError("header must be a JSON object")
    return head


def _nesting(raw: bytes) -> int:
    """The deepest bracket nesting in JSON text, brackets inside strings not counted (an
    upper bound is enough: it only has to stop a nesting bomb before the parser recurses)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in raw:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D):
            depth -= 1
    return deepest


def dump_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=_json_default).encode()


def _json_default(obj: object) -> object:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


# --------------------------------------------------------------------- transfers


def _as_bytes_view(obj: Any) -> memoryview:
    """A flat byte view of any buffer (numpy array, bytes, torch CPU tensor via numpy)."""
    if hasattr(obj, "detach") and hasattr(obj, "numpy"):  # torch tensor: no torch import
        obj = obj.detach().contiguous().numpy()
    if isinstance(obj, np.ndarray):
        obj = np.ascontiguousarray(obj)
    mv = memoryview(obj)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def transfer_frames(transfer: Transfer) -> list[memoryview]:
    """The five frames of a submit request (views: nothing is copied)."""
    b = transfer.blocks
    return [
        _as_bytes_view(transfer.payload),
        _as_bytes_view(b.offsets.astype("<u8", copy=False)),
        _as_bytes_view(b.lengths.astype("<u8", copy=False)),
        _as_bytes_view(b.utilities.astype("<f8", copy=False)),
        memoryview(transfer.app_metadata),
    ]


def _frame_buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def transfer_from_frames(frames: list, whole_ranges: object = False) -> Transfer:
    """Rebuild a submitted transfer; the payload stays a view of its frame (zero-copy).
    ``whole_ranges``: the request's declaration of the stream's kind (a bool)."""
    if not isinstance(whole_ranges, bool):
        raise ApiError("whole_ranges must be true or false")
    if len(frames) not in (4, 5):
        raise ApiError(
            f"submit needs frames {', '.join(TRANSFER_FRAMES)} (app_metadata optional); "
            f"got {len(frames)}"
        )
    bufs = [_frame_buffer(f) for f in frames]
    for name, buf, size in zip(TRANSFER_FRAMES[1:4], bufs[1:4], (8, 8, 8), strict=True):
        if len(buf) % size:
            raise ApiError(f"frame {name} has {len(buf)} bytes, not a multiple of {size}")
    payload = np.frombuffer(bufs[0], dtype=np.uint8)
    offsets = np.frombuffer(bufs[1], dtype="<u8")
    lengths = np.frombuffer(bufs[2], dtype="<u8")
    utilities = np.frombuffer(bufs[3], dtype="<f8")
    meta = bytes(bufs[4]) if len(bufs) == 5 else b""
    if payload.size == 0:
        raise ApiError("the payload frame is empty")
    try:
        return Transfer(payload, BlockTable(offsets, lengths, utilities), meta, whole_ranges)
    except ValueError as exc:
        raise ApiError(f"bad block table: {exc}") from None


def transfer_from_card(path: str | os.PathLike) -> Transfer:
    """A cache card file as a transfer (its blocks manifest travels as app metadata)."""
    from kvtransport.kvformat.blocks import EncodedStream
    from kvtransport.kvformat.card import read_card

    card = read_card(path)
    stream = EncodedStream(card.manifest, card.manifest.to_bytes(), card.payload)
    return stream.to_transfer()


# --------------------------------------------------------------------- results


@dataclass
class DeliveredResult:
    """A receiver daemon's result as a subscriber (or a result file reader) sees it.

    ``payload`` holds every complete block's bytes at its offset; ``complete`` is the
    per-block mask and ``missing`` the indices of blocks that did not arrive in full.
    """

    transfer_id: int
    utility_recovered: float
    reason: str
    blocks: BlockTable | None
    complete: np.ndarray
    missing: np.ndarray
    payload: np.ndarray
    app_metadata: bytes | None
    stats: dict[str, Any] = field(default_factory=dict)
    # per block: seconds from its completion to the result (inf: never complete)
    complete_age_s: np.ndarray | None = None

    def block_bytes(self, index: int) -> np.ndarray:
        """The bytes of block ``index`` (meaningful only if it is complete)."""
        if self.blocks is None:
            raise ValueError("no manifest arrived: no block is complete")
        o = int(self.blocks.offsets[index])
        return self.payload[o : o + int(self.blocks.lengths[index])]

    @property
    def is_complete(self) -> bool:
        """Every block arrived (False when the manifest, and so the block list, did not)."""
        return self.blocks is not None and bool(self.complete.all())

    @classmethod
    def from_result(cls, result: TransferResult, stats: dict[str, Any]) -> DeliveredResult:
        """A receiver session's result as a subscriber sees it (no copy of the payload)."""
        m = result.manifest
        return cls(
            transfer_id=result.transfer_id,
            utility_recovered=float(result.utility_recovered),
            reason=result.reason,
            blocks=m.blocks if m is not None else None,
            complete=np.asarray(result.complete, dtype=bool),
            missing=np.asarray(result.missing, dtype=np.int64),
            payload=result.payload,
            app_metadata=m.app_metadata if m is not None else None,
            stats=stats,
        )


def result_header(result: TransferResult, stats: dict[str, Any]) -> dict[str, Any]:
    """The JSON part of a published result (and of a result file's metadata)."""
    return {
        "transfer_id": format_tid(result.transfer_id),
        "utility_recovered": float(result.utility_recovered),
        "reason": result.reason,
        "manifest": result.manifest is not None,
        "blocks": int(result.complete.size),
        "blocks_complete": int(result.complete.sum()),
        "missing": result.missing.tolist(),
        # seconds from each block's completion to the result; -1: never complete
        "complete_age_s": np.where(
            np.isfinite(age := result.complete_age_s), np.round(age, 6), -1.0
        ).tolist(),
        "payload_bytes": int(result.payload.size),
        "stats": stats,
    }


def result_frames(result: TransferResult, stats: dict[str, Any]) -> list:
    """``[topic, header, payload, offsets, lengths, utilities, complete, app_metadata]``."""
    m = result.manifest
    if m is not None:
        b = m.blocks
        table = [b.offsets.astype("<u8"), b.lengths.astype("<u8"), b.utilities.astype("<f8")]
        meta = m.app_metadata
    else:
        table = [np.zeros(0, "<u8"), np.zeros(0, "<u8"), np.zeros(0, "<f8")]
        meta = b""
    return [
        RESULT_TOPIC,
        dump_json(result_header(result, stats)),
        _as_bytes_view(result.payload),
        *(_as_bytes_view(t) for t in table),
        _as_bytes_view(result.complete.astype(np.uint8)),
        meta,
    ]


def result_from_frames(frames: list) -> DeliveredResult:
    """Parse a published result (arrays are views of the frames)."""
    if len(frames) != 8:
        raise ApiError(f"a result has 8 frames, got {len(frames)}")
    head = load_json_header(frames[1])
    bufs = [_frame_buffer(f) for f in frames[2:]]
    payload = np.frombuffer(bufs[0], dtype=np.uint8)
    offsets = np.frombuffer(bufs[1], dtype="<u8")
    lengths = np.frombuffer(bufs[2], dtype="<u8")
    utilities = np.frombuffer(bufs[3], dtype="<f8")
    complete = np.frombuffer(bufs[4], dtype=np.uint8).astype(bool)
    blocks = BlockTable(offsets, lengths, utilities) if head.get("manifest") else None
    return DeliveredResult(
        transfer_id=parse_tid(head["transfer_id"]),
        utility_recovered=float(head["utility_recovered"]),
        reason=str(head["reason"]),
        blocks=blocks,
        complete=complete,
        missing=np.asarray(head["missing"], dtype=np.int64),
        payload=payload,
        app_metadata=bytes(bufs[5]) if head.get("manifest") else None,
        stats=head.get("stats", {}),
        complete_age_s=_complete_age(head, complete.size),
    )


def write_result_file(directory: str | os.PathLike, result: TransferResult, stats: dict) -> Path:
    """Write a result as ``<tid>.result.safetensors`` atomically (see the module doc).

    A directory that is missing or not writable raises
    :class:`~kvtransport.atomic.AtomicWriteError` (a UserError and an OSError).
    """
    from safetensors.numpy import save

    directory = Path(directory)
    head = result_header(result, stats)
    m = result.manifest
    tensors = {
        "stream": np.ascontiguousarray(result.payload, dtype=np.uint8),
        "complete": result.complete.astype(np.uint8),
    }
    meta = {RESULT_KEY: ""}  # first in order; its value is set last (below)
    if m is not None:
        b = m.blocks
        head["block_table"] = {
            "offsets": b.offsets.tolist(),
            "lengths": b.lengths.tolist(),
            "utilities": b.utilities.tolist(),
        }
        tensors["app_metadata"] = np.frombuffer(m.app_metadata, dtype=np.uint8).copy()
        card_meta = _card_metadata(m.app_metadata)
        if card_meta is not None:
            meta.update(card_meta)
    meta[RESULT_KEY] = json.dumps(head, separators=(",", ":"))
    data = save(tensors, metadata=meta)
    name = f"{format_tid(result.transfer_id)}.result.safetensors"
    return atomic_write(directory / name, data, mode=0o600)  # the cache: its owner's only


PROBE_BYTES = 1 << 20
"""Space a result directory must have free at start (:func:`probe_result_dir`)."""


def kept_results_dir() -> Path:
    """Where a result goes when its directory cannot take it (:func:`keep_result`):
    ``results`` in the state directory (kvtransport.core.replay.default_state_dir)."""
    from kvtransport.core.replay import default_state_dir

    return default_state_dir() / "results"


def probe_result_dir(directory: str | os.PathLike, what: str) -> Path:
    """``directory`` if results can be written there: a directory, writable by this
    process, with PROBE_BYTES free (a file of that size is allocated and removed). A
    one-line UserError naming ``what`` otherwise, before anything is received."""
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{what} {d} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvtransport-probe.", dir=d)
    except OSError as exc:
        raise UserError(f"{what} {d} is not writable: {exc.strerror}") from None
    try:
        os.posix_fallocate(fd, 0, PROBE_BYTES)
    except OSError as exc:
        raise UserError(f"{what} {d} has no room for results: {exc.strerror}") from None
    finally:
        os.close(fd)
        os.unlink(tmp)
    return d


def keep_result(
    directory: str | os.PathLike, result: TransferResult, stats: dict
) -> tuple[Path, str | None]:
    """Write a result into ``directory`` (:func:`write_result_file`); when that fails
    (disk full, read-only, removed), into :func:`kept_results_dir` instead, so what
    arrived is not lost. Returns the file and, after a fallback, the one-line reason
    the directory refused it. Raises AtomicWriteError only when both writes fail."""
    try:
        return write_result_file(directory, result, stats), None
    except OSError as exc:
        why = str(exc)
    fallback = kept_results_dir()
    try:
        fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{why}; and cannot make {fallback}: {exc.strerror}") from None
    return write_result_file(fallback, result, stats), why


def _card_metadata(app_metadata: bytes) -> dict[str, str] | None:
    """Card metadata when the app metadata is a kvtransport.kvformat.blocks manifest, else None."""
    if not app_metadata:
        return None
    from kvtransport.kvformat import blocks, card

    try:
        manifest = blocks.Manifest.from_bytes(app_metadata)
    except Exception:  # bytes from the network: whatever they are, not a card's manifest
        return None
    return card.card_metadata(manifest)


def read_result_file(path: str | os.PathLike) -> DeliveredResult:
    """Read a file written by :func:`write_result_file`."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as fh:
            hlen = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(hlen))
        head = json.loads(header["__metadata__"][RESULT_KEY])
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise ApiError(f"{path} is not a kvtransport result file: {exc}") from None
    table = head.get("block_table")
    blocks = (
        BlockTable(
            np.asarray(table["offsets"], np.uint64),
            np.asarray(table["lengths"], np.uint64),
            np.asarray(table["utilities"], np.float64),
        )
        if table
        else None
    )
    return DeliveredResult(
        transfer_id=parse_tid(head["transfer_id"]),
        utility_recovered=float(head["utility_recovered"]),
        reason=str(head["reason"]),
        blocks=blocks,
        complete=tensors["complete"].astype(bool),
        missing=np.asarray(head["missing"], dtype=np.int64),
        payload=tensors["stream"],
        app_metadata=tensors["app_metadata"].tobytes() if table else None,
        stats=head.get("stats", {}),
        complete_age_s=_complete_age(head, tensors["complete"].size),
    )


def _complete_age(head: dict[str, Any], blocks: int) -> np.ndarray | None:
    """The header's per-block completion ages (inf: never), None if absent or malformed."""
    raw = head.get("complete_age_s")
    if not isinstance(raw, list) or len(raw) != blocks:
        return None
    try:
        age = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return np.where(age >= 0, age, np.inf)
