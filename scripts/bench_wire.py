"""Per-datagram cost of the wire layer: AES-256-GCM sealing (kvtransport.core.wire today) against
the keyed BLAKE2b tag it replaced, and against no protection (--insecure), side by side.

Each row is one datagram of --payload bytes (default 1280, the default symbol size) built by
a sender and parsed by a receiver:

  frame   pack the header into the preallocated buffer, protect, return ``bytes``
  parse   check the header, verify (and with AES-GCM decrypt), return a Datagram

``blake2b-tag`` is the previous mechanism written out exactly as the old Framer/Parser ran
it (header pack, copy of the precomputed keyed state, update over header and payload,
16-byte digest, ``hmac.compare_digest`` on parse): the baseline. ``aes-gcm`` and
``insecure`` are the real :class:`kvtransport.core.wire.Framer` and
:class:`~kvtransport.core.wire.Parser`. The three run interleaved round by round in one process, so
a shared machine's noise hits them alike; the ratios against the baseline are the figures to read.
Times are CPU time of this process per datagram (median and best over the rounds). Target: aes-gcm
below blake2b-tag (frame + parse).

    .venv/bin/python scripts/bench_wire.py            # about 20 s
    .venv/bin/python scripts/bench_wire.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import struct
import time
from collections.abc import Callable
from pathlib import Path

from kvtransport.core import wire
from kvtransport.core.wire import HEADER, HEADER_SIZE, MAGIC, TAG_SIZE, DatagramType

KEY = bytes(range(32))
TID = 0x0123456789ABCDEF
_FAST = struct.Struct("!IHHQIHHI")
_OLD_PREFIX = MAGIC << 16 | 1 << 8
_compare_digest = hmac.compare_digest
_tuple_new = tuple.__new__


class Blake2bBaseline:
    """The replaced mechanism, its Framer.finish and Parser.parse hot paths as they were
    (commit e1773d7): header + payload + BLAKE2b(key=psk, 16 bytes) over both."""

    def __init__(self, payload: int) -> None:
        self.hash = hashlib.blake2b(key=KEY, digest_size=TAG_SIZE)
        self.buf = bytearray(HEADER_SIZE + payload + TAG_SIZE)
        self.mv = memoryview(self.buf)
        self.plain = os.urandom(payload)
        self.mv[HEADER_SIZE : HEADER_SIZE + payload] = self.plain
        self.n = payload

    def frame(self, seq: int) -> bytes:
        n = self.n
        HEADER.pack_into(self.buf, 0, MAGIC, 1, 1, 1, 0, n, TID, seq, 0, 0, seq)
        end = HEADER_SIZE + n
        h = self.hash
        if h is not None:
            hh = h.copy()
            hh.update(self.mv[:end])
            self.mv[end : end + TAG_SIZE] = hh.digest()
            end += TAG_SIZE
        return bytes(self.mv[:end])

    def parse(self, data: bytes) -> memoryview:
        n = len(data)
        if n < HEADER_SIZE:
            raise wire.Truncated("short")
        mvt, fr, plen, tid, seq, key, dt_nss, esi = _FAST.unpack_from(data, 0)
        dtype = mvt & 0xFF
        end = HEADER_SIZE + plen
        h = self.hash
        if (
            mvt & 0xFFFFFF00 != _OLD_PREFIX
            or fr & 0xFC00
            or not 0 < dtype <= 7
            or n != (end + TAG_SIZE if h is not None else end)
            or n > wire.MAX_DATAGRAM
            or (fr & 0x100) != (0x100 if h is not None else 0)
        ):
            raise wire.WireError("malformed")
        mv = memoryview(data)
        if h is not None:
            hh = h.copy()
            hh.update(mv[:end])
            if not _compare_digest(hh.digest(), mv[end:n]):
                raise wire.BadTag("tag mismatch")
        if fr & 0x200 and dtype != 1:
            raise wire.BadType("RETRANSMIT flag on a non-source datagram")
        return _tuple_new(
            wire.Datagram, (dtype, fr >> 8, tid, seq, key, dt_nss, esi, mv[HEADER_SIZE:end])
        ).payload


class Real:
    """kvtransport.core.wire's Framer and Parser, with a key (AES-256-GCM) or without."""

    def __init__(self, payload: int, key: bytes | None) -> None:
        self.framer = wire.Framer(TID, key, max_payload=max(payload, 2048))
        self.parser = wire.Parser(key)
        self.plain = os.urandom(payload)
        self.framer.payload_view(payload)[:] = self.plain
        self.n = payload

    def frame(self, seq: int) -> bytes:
        return self.framer.finish(DatagramType.SOURCE, seq, self.n, seq)

    def parse(self, data: bytes) -> memoryview:
        return self.parser.parse(data).payload


def _time_per_call(fn: Callable[[int], object], args: list, n: int) -> float:
    """CPU seconds of this process per call (time other processes held the core left out:
    the machine is shared)."""
    t0 = time.process_time()
    for a in args[:n]:
        fn(a)
    return (time.process_time() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--payload", type=int, default=1280, help="payload bytes (1280)")
    ap.add_argument("--n", type=int, default=20000, help="datagrams per round (20000)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (15)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2000 x 3")
    ap.add_argument("--out", type=Path, default=Path("results/bench_wire.json"))
    args = ap.parse_args()
    if args.quick:
        args.n, args.rounds = 2000, 3
    mechanisms = {
        "blake2b-tag": Blake2bBaseline(args.payload),
        "aes-gcm": Real(args.payload, KEY),
        "insecure": Real(args.payload, None),
    }
    samples: dict[str, dict[str, list[float]]] = {m: {"frame": [], "parse": []} for m in mechanisms}
    seq0 = 0
    for _ in range(args.rounds):
        for name, m in mechanisms.items():
            seqs = list(range(seq0, seq0 + args.n))
            samples[name]["frame"].append(_time_per_call(m.frame, seqs, args.n))
            datagrams = [m.frame(s) for s in range(seq0 + args.n, seq0 + 2 * args.n)]
            samples[name]["parse"].append(_time_per_call(m.parse, datagrams, args.n))
        seq0 += 2 * args.n
    for m in mechanisms.values():  # sanity: each parse returns the payload its frame sent
        assert bytes(m.parse(m.frame(seq0))) == m.plain
    rows = {}
    base = {op: statistics.median(samples["blake2b-tag"][op]) for op in ("frame", "parse")}
    base_total = base["frame"] + base["parse"]
    print(f"per datagram, {args.payload}-byte payload, median of {args.rounds} rounds:")
    print(f"  {'mechanism':12s} {'frame us':>9s} {'parse us':>9s} {'total us':>9s} {'vs tag':>7s}")
    for name in mechanisms:
        med = {op: statistics.median(samples[name][op]) for op in ("frame", "parse")}
        best = {op: min(samples[name][op]) for op in ("frame", "parse")}
        total = med["frame"] + med["parse"]
        rows[name] = {
            "frame_us_median": med["frame"] * 1e6,
            "parse_us_median": med["parse"] * 1e6,
            "frame_us_best": best["frame"] * 1e6,
            "parse_us_best": best["parse"] * 1e6,
            "total_us_median": total * 1e6,
            "ratio_to_blake2b_tag": total / base_total,
        }
        print(
            f"  {name:12s} {med['frame'] * 1e6:9.3f} {med['parse'] * 1e6:9.3f} "
            f"{total * 1e6:9.3f} {total / base_total:7.2f}"
        )
    ok = rows["aes-gcm"]["ratio_to_blake2b_tag"] < 1.0
    print(f"target aes-gcm below blake2b-tag: {'met' if ok else 'NOT met'}")
    report = {
        "payload_bytes": args.payload,
        "datagrams_per_round": args.n,
        "rounds": args.rounds,
        "rows": rows,
        "target_aes_gcm_below_tag": ok,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
