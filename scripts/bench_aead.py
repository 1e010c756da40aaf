#!/usr/bin/env python3
"""What authenticated encryption costs per datagram in the run kernels (kvtransport.codecs.aesgcm).

Rows, each per datagram of --payload bytes, best of --rounds rounds of --count datagrams in
one process (CPU-bound, single thread):

  seal_run keyed / unkeyed   the sender's run kernel with the key and without (a copy)
  open_run keyed / unkeyed   the receiver's run kernel the same way
  evp: ...                   the EVP calls seal_run makes for one datagram, added one at a
                             time (nonce, header as associated data, payload, finish, tag):
                             each row minus the one above is that call's cost

keyed minus unkeyed is the cipher's cost on the data path; the libcrypto the kernels load
(its OpenSSL version is printed) decides it: the system's, or the file KVTRANSPORT_LIBCRYPTO
names. docs/results.md quotes these figures (issue 15).

    .venv/bin/python scripts/bench_aead.py            # about 10 s
    .venv/bin/python scripts/bench_aead.py --quick    # smoke run

Writes results/bench_aead.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kvtransport.codecs import aesgcm as A
from numba import njit

from kvtransport.eval.statistics import best_seconds

EVP_STEPS = ("nonce", "+ header (AAD)", "+ payload", "+ finish", "+ tag")


@njit(cache=True)
def _evp_steps(ctx: int, steps: int, buf: np.ndarray, size: int, n: int) -> int:
    """The first ``steps`` of seal_run's EVP calls for ``n`` datagrams (EVP_STEPS)."""
    nonce = np.zeros(A.NONCE_BYTES, np.uint8)
    outl = np.zeros(1, np.int32)
    c, null, o = A._ptr(ctx), A._ptr(0), A._ptr(outl.ctypes.data)
    body = A.HEADER_BYTES
    bad = 0
    for k in range(n):
        A._put_nonce(nonce, 0, k)
        bad += A._encrypt_init(c, null, null, null, A._ptr(nonce.ctypes.data)) != 1
        if steps >= 2:
            bad += A._encrypt_update(c, null, o, A._ptr(buf.ctypes.data), A.HEADER_BYTES) != 1
        if steps >= 3:
            dst = A._ptr(buf.ctypes.data + body)
            bad += A._encrypt_update(c, dst, o, A._ptr(buf.ctypes.data + body), size) != 1
        if steps >= 4:
            bad += A._encrypt_final(c, null, o) != 1
        if steps >= 5:
            tag = A._ptr(buf.ctypes.data + body + size)
            bad += A._ctx_ctrl(c, A._GCM_GET_TAG, A.TAG_BYTES, tag) != 1
    return bad


def _ns_per_datagram(fn: Callable[[], object], count: int, rounds: int) -> float:
    """Best of ``rounds`` calls of ``fn`` (``count`` datagrams each), CPU ns per datagram."""
    return best_seconds(fn, rounds, time.process_time) / count * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--payload", type=int, default=1280, help="symbol bytes (default 1280)")
    p.add_argument("--count", type=int, default=20_000, help="datagrams a round")
    p.add_argument("--rounds", type=int, default=15, help="rounds (best kept)")
    p.add_argument("--quick", action="store_true", help="smoke run")
    p.add_argument("--out", default="results/bench_aead.json", help="JSON file to write")
    args = p.parse_args(argv)
    if args.quick:
        args.count, args.rounds = 2000, 2
    if not A.AVAILABLE:
        p.error("no libcrypto with AES-256-GCM loads here (or KVTRANSPORT_AEAD=python)")
    if not 16 <= args.payload <= 8192 or args.count < 1 or args.rounds < 1:
        p.error("--payload must be 16..8192, --count and --rounds at least 1")
    size, n = args.payload, args.count
    key = A.GcmKey(bytes(range(32)))
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, size * n, dtype=np.uint8)
    header = rng.integers(0, 256, A.HEADER_BYTES, dtype=np.uint8)
    whole = A.HEADER_BYTES + size + A.TAG_BYTES
    sealed = {ctx: np.zeros(whole * n, np.uint8) for ctx in (key.seal_ctx, 0)}
    last = np.zeros(size, np.uint8)
    check = np.ones(A.HEADER_BYTES, np.uint8)
    out, scratch = np.zeros(size * n, np.uint8), np.zeros(size, np.uint8)

    def seal(ctx: int) -> int:
        got = A.seal_run(ctx, header, 8, 12, 0, 0, 0, n, payload, size, -1, last, sealed[ctx])
        return int(got)

    def opened(ctx: int, o_ctx: int) -> int:
        step = A.HEADER_BYTES + size + (A.TAG_BYTES if ctx else 0)
        starts = np.arange(n, dtype=np.int64) * step
        return int(
            A.open_run(o_ctx, sealed[ctx], starts, starts + step, 0, n, header, check, 8, 12,
                       0, 0, 0, size, out, scratch)
        )  # fmt: skip

    for ctx, o_ctx in ((key.seal_ctx, key.open_ctx), (0, 0)):
        if seal(ctx) <= 0 or opened(ctx, o_ctx) != n:
            print("the kernels refused the run: libcrypto failed", file=sys.stderr)
            return 1
    rows = {
        "seal_run keyed": _ns_per_datagram(lambda: seal(key.seal_ctx), n, args.rounds),
        "seal_run unkeyed": _ns_per_datagram(lambda: seal(0), n, args.rounds),
        "open_run keyed": _ns_per_datagram(
            lambda: opened(key.seal_ctx, key.open_ctx), n, args.rounds
        ),
        "open_run unkeyed": _ns_per_datagram(lambda: opened(0, 0), n, args.rounds),
    }
    buf = np.zeros(whole, np.uint8)
    for steps, name in enumerate(EVP_STEPS, start=1):
        rows[f"evp: {name}"] = _ns_per_datagram(
            lambda steps=steps: _evp_steps(key.seal_ctx, steps, buf, size, n), n, args.rounds
        )
    ver = A.libcrypto_version()
    print(f"AES-256-GCM per {size}-byte datagram, ns (best of {args.rounds}; {ver})")
    for name, ns in rows.items():
        print(f"  {name:22s} {ns:7.0f}")
    gbps = size / (rows["evp: + payload"] - rows["evp: + header (AAD)"])
    print(f"  payload encryption alone: {gbps:.2f} GB/s")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "openssl": ver, "payload": size, "ns": rows}
    out_path.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
