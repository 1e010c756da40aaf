"""Per-packet loss/delay traces: the CSV format, its reader and writer, and trace replay.

Format (documented for users in docs/traces.md)::

    # comment lines start with '#'
    seq,lost,owd_us
    0,0,5012.5
    1,1,
    2,0,5100

* ``seq``: packet sequence number, non-negative integer, strictly increasing. A gap in
  the sequence means the missing packets were lost (a capture only sees what arrived).
* ``lost``: 1 if the packet was lost, 0 if it arrived.
* ``owd_us``: one-way delay of an arrived packet in microseconds (>= 0); empty or ignored
  for lost packets.

Files ending in ``.gz`` (or starting with the gzip magic bytes) are read through gzip.

Replay (``TraceReplay``) plays the trace packet by packet from an offset, wrapping around
at the end; the loss of packet i and its one-way delay come from the same row, so a
channel built from a trace reproduces both the loss bursts and the delay variation.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kvtransport.netem.loss import LossSampler, LossSpec, MarkovLossStats

from kvtransport.errors import UserError

__all__ = [
    "Trace",
    "TraceError",
    "TraceReplay",
    "read_trace",
    "write_trace",
    "trace_from_irtt",
]

HEADER = ("seq", "lost", "owd_us")


class TraceError(UserError, ValueError):
    """A trace file is missing, unreadable or malformed (message names file and line)."""


@dataclass(frozen=True, eq=False)
class Trace:
    """A trace in memory: one entry per packet, gaps already filled in as losses."""

    lost: np.ndarray
    """bool, True = lost."""
    owd_s: np.ndarray
    """float64 seconds; NaN for lost packets."""
    first_seq: int = 0

    def __len__(self) -> int:
        return int(self.lost.shape[0])

    @property
    def loss_rate(self) -> float:
        return float(self.lost.mean()) if len(self) else 0.0

    def mean_burst_length(self) -> float:
        """Mean length of runs of consecutive losses (0 if there are none)."""
        lost = self.lost.astype(np.int8)
        onsets = int(np.count_nonzero(np.diff(lost, prepend=0) == 1))
        return float(lost.sum()) / onsets if onsets else 0.0


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115


def _parse(path: Path) -> Trace:
    where = str(path)
    seqs: list[int] = []
    lost: list[bool] = []
    owd: list[float] = []
    header_seen = False
    try:
        fh = _open_text(path)
    except FileNotFoundError:
        raise TraceError(f"{where}: no such trace file") from None
    except OSError as exc:
        raise TraceError(f"{where}: cannot read trace ({exc.strerror})") from None
    try:
        with fh:
            for lineno, raw in enumerate(fh, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                fields = [f.strip() for f in line.split(",")]
                if not header_seen:
                    if tuple(f.lower() for f in fields) != HEADER:
                        raise TraceError(
                            f"{where}:{lineno}: expected the header 'seq,lost,owd_us', "
                            f"got {line[:60]!r}"
                        )
                    header_seen = True
                    continue
                if len(fields) != 3:
                    raise TraceError(
                        f"{where}:{lineno}: expected 3 fields seq,lost,owd_us, got {len(fields)}"
                    )
                s, l, d = fields
                try:
                    seq = int(s)
                except ValueError:
                    raise TraceError(f"{where}:{lineno}: seq {s!r} is not an integer") from None
                if seq < 0:
                    raise TraceError(f"{where}:{lineno}: seq {seq} is negative")
                if seqs and seq <= seqs[-1]:
                    raise TraceError(
                        f"{where}:{lineno}: seq {seq} does not increase (previous {seqs[-1]})"
                    )
                if l not in ("0", "1"):
                    raise TraceError(f"{where}:{lineno}: lost must be 0 or 1, got {l!r}")
                is_lost = l == "1"
                if is_lost:
                    delay = math.nan
                else:
                    try:
                        delay = float(d)
                    except ValueError:
                        raise TraceError(
                            f"{where}:{lineno}: owd_us {d!r} is not a number "
                            "(it is required for a packet that arrived)"
                        ) from None
                    if not (delay >= 0.0) or math.isinf(delay):
                        raise TraceError(f"{where}:{lineno}: owd_us {d!r} must be >= 0")
                seqs.append(seq)
                lost.append(is_lost)
                owd.append(delay * 1e-6)
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as exc:
        raise TraceError(f"{where}: cannot read trace ({exc})") from None
    if not header_seen:
        raise TraceError(f"{where}: empty trace (no 'seq,lost,owd_us' header)")
    if not seqs:
        raise TraceError(f"{where}: trace has a header but no packets")
    seq_arr = np.asarray(seqs, dtype=np.int64)
    n = int(seq_arr[-1] - seq_arr[0] + 1)
    if n > 50_000_000:
        raise TraceError(f"{where}: sequence numbers span {n} packets; too large to replay")
    idx = seq_arr - seq_arr[0]
    lost_arr = np.ones(n, dtype=np.bool_)
    owd_arr = np.full(n, np.nan)
    lost_arr[idx] = np.asarray(lost, dtype=np.bool_)
    owd_arr[idx] = np.asarray(owd, dtype=np.float64)
    if lost_arr.all():
        raise TraceError(f"{where}: every packet in the trace is lost")
    return Trace(lost_arr, owd_arr, int(seq_arr[0]))


@functools.lru_cache(maxsize=16)
def _read_cached(path: str, mtime_ns: int, size: int) -> Trace:
    return _parse(Path(path))


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file (cached by path and modification time)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace file") from None
    if not p.is_file():
        raise TraceError(f"{p}: not a regular file")
    return _read_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


def write_trace(
    path: str | os.PathLike[str],
    lost: np.ndarray,
    owd_us: np.ndarray,
    seq: np.ndarray | None = None,
    comment: str | None = None,
) -> None:
    """Write a trace (gzip if the name ends in .gz). Lost rows get an empty owd_us."""
    lost = np.asarray(lost, dtype=np.bool_)
    owd_us = np.asarray(owd_us, dtype=np.float64)
    if seq is None:
        seq = np.arange(lost.shape[0], dtype=np.int64)
    if not (lost.shape == owd_us.shape == np.shape(seq)):
        raise ValueError("seq, lost and owd_us must have the same length")
    lines: list[str] = []
    if comment:
        lines.extend(f"# {c}" for c in comment.splitlines())
    lines.append(",".join(HEADER))
    for s, l, d in zip(np.asarray(seq).tolist(), lost.tolist(), owd_us.tolist(), strict=True):
        lines.append(f"{s},1," if l else f"{s},0,{d:.1f}")
    data = ("\n".join(lines) + "\n").encode()
    p = Path(path)
    if p.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    p.write_bytes(data)


def trace_from_irtt(
    path: str | os.PathLike[str], owd: str = "send", base_owd_ms: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Convert an irtt client JSON result (``irtt client -o out.json``) to (seq, lost, owd_us).

    The trace describes the client -> server direction: a round trip whose request was
    lost (``lost`` "true" or "true_up") is lost; "true_down" (only the reply was lost)
    counts as arrived. ``owd="send"`` takes irtt's one-way send delay, which needs
    synchronized clocks; ``owd="rtt/2"`` uses half the round-trip time instead.
    ``base_owd_ms`` shifts the delays so that the smallest equals it (use it when the
    clocks have an unknown offset).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw)
        trips = doc["round_trips"]
    except FileNotFoundError:
        raise TraceError(f"{p}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{p}: not an irtt JSON result ({exc.__class__.__name__})") from None
    if owd not in ("send", "rtt/2"):
        raise ValueError("owd must be 'send' or 'rtt/2'")
    seq, lost, delay = [], [], []
    for trip in trips:
        state = str(trip.get("lost", "false"))
        d = trip.get("delay") or {}
        is_lost = state in ("true", "true_up")
        value = math.nan
        if not is_lost:
            if owd == "send" and "send" in d:
                value = d["send"] / 1e3
            elif "rtt" in d:
                value = d["rtt"] / 2e3
        seq.append(int(trip["seqno"]))
        lost.append(is_lost)
        delay.append(value)
    seq_a = np.asarray(seq, dtype=np.int64)
    lost_a = np.asarray(lost, dtype=np.bool_)
    owd_a = np.asarray(delay, dtype=np.float64)
    known = ~lost_a & ~np.isnan(owd_a)
    if not known.any():
        raise TraceError(f"{p}: no arrived packet has a usable delay (try owd='rtt/2')")
    # arrived packets without a delay (e.g. only the reply was lost under rtt/2): median
    owd_a[~lost_a & np.isnan(owd_a)] = float(np.median(owd_a[known]))
    if base_owd_ms is not None:
        owd_a[~lost_a] += base_owd_ms * 1e3 - float(np.min(owd_a[~lost_a]))
    if (owd_a[~lost_a] < 0).any():
        raise TraceError(
            f"{p}: negative one-way delays (clocks not synchronized); pass base_owd_ms"
        )
    order = np.argsort(seq_a, kind="stable")
    return seq_a[order], lost_a[order], owd_a[order]


# ---------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------


class _TraceCursorSampler(LossSampler):
    """Hands out consecutive slices of a per-packet array, wrapping at the end."""

    def __init__(self, values: np.ndarray, offset: int) -> None:
        self.values = values
        self.pos = offset % values.shape[0]

    def draw(self, n: int) -> np.ndarray:
        v = self.values
        m = v.shape[0]
        idx = (self.pos + np.arange(n)) % m
        self.pos = (self.pos + n) % m
        return v[idx]


@dataclass(frozen=True)
class TraceReplay(LossSpec):
    """Replay of a trace file: loss AND one-way delay per packet come from the trace.

    ``offset`` is the first packet (row index after gap filling) to replay; None lets
    the channel's seed pick a uniformly random window start, so different seeds replay
    different stretches of a long trace.
    """

    path: str
    offset: int | None = None
    kind = "trace"

    def trace(self) -> Trace:
        return read_trace(self.path)

    def start(self, rng: np.random.Generator) -> int:
        n = len(self.trace())
        if self.offset is None:
            return int(rng.integers(0, n))
        if self.offset < 0:
            raise ValueError(f"trace offset must be >= 0, got {self.offset}")
        return self.offset % n

    def sampler(self, rng: np.random.Generator) -> LossSampler:
        return self.samplers(rng)[0]

    def samplers(self, rng: np.random.Generator) -> tuple[LossSampler, LossSampler]:
        """(loss sampler, one-way-delay sampler in seconds), aligned on the same rows."""
        tr = self.trace()
        start = self.start(rng)
        owd = np.where(tr.lost, 0.0, tr.owd_s)
        return _TraceCursorSampler(tr.lost, start), _TraceCursorSampler(owd, start)

    def netem_args(self) -> list[str]:
        raise ValueError(
            f"trace {self.path}: a trace cannot be replayed by kernel netem (use the relay)"
        )

    def describe(self) -> str:
        start = "random start" if self.offset is None else f"from row {self.offset}"
        return f"trace {self.path} ({start})"

    def stats(self) -> MarkovLossStats:
        tr = self.trace()
        return MarkovLossStats(tr.loss_rate, tr.mean_burst_length(), math.nan)
