#!/usr/bin/env python3
"""Quantized KV blocks: bytes, encode and decode time per layout, side by side.

A random cache of SmolLM2-135M's geometry (30 layers, 3 kv heads, head_dim 64, float32;
``--tokens`` tokens, blocks of 16) is encoded as a whole stream (kvtransport.kvformat.blocks.
encode_stream) and decoded in place (``decode_blocks_into``, the receiver's compiled pass)
at each layout, in interleaved rounds:

    int8                one group per head vector (the product's int8)
    int4 keys/token     keys and values in 32-value groups per token (int4 until 2026-12-06)
    int4 keys/channel   keys per channel over each block's 16 tokens, values one group per
                        head vector (the product's int4: kvtransport.codecs.quant)

Figures: payload bytes, medians of the rounds in ms, and each layout's ratio to int4
keys/token. Writes results/bench_quant.json.

    .venv/bin/python scripts/bench_quant.py --tokens 2048 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

LAYOUTS = {  # label: (precision, int4_keys, group_size)
    "int8": ("int8", "channel", None),
    "int4 keys/token": ("int4", "token", 32),
    "int4 keys/channel": ("int4", "channel", None),
}
BASE = "int4 keys/token"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="context size (default 2048)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--out", default="results/bench_quant.json")
    args = ap.parse_args(argv)
    if args.tokens < 16 or args.rounds < 1:
        ap.error("--tokens must be at least 16 and --rounds at least 1")

    from kvtransport.kvformat import blocks
    from kvtransport.kvformat.kvcache import KVCache
    from kvtransport.model import utility

    rng = np.random.default_rng(0)
    shape = (30, 3, args.tokens, 64)
    cache = KVCache(
        rng.standard_normal(shape).astype(np.float32),
        rng.standard_normal(shape).astype(np.float32),
        rng.integers(0, 49152, args.tokens),
        "bench",
    )
    u = np.ones((30, -(-args.tokens // 16)))
    order = utility.stream_order(u, 16, "position")

    def encode(label: str) -> blocks.EncodedStream:
        precision, keys, group = LAYOUTS[label]
        return blocks.encode_stream(
            cache, u, order, precision, int4_keys=keys, group_size=group, include_token_ids=False
        )

    streams = {label: encode(label) for label in LAYOUTS}  # also compiles the kernels
    keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    times: dict[str, dict[str, list[float]]] = {x: {"encode": [], "decode": []} for x in LAYOUTS}
    for _ in range(args.rounds):
        for label, s in streams.items():
            t0 = time.perf_counter()
            encode(label)
            t1 = time.perf_counter()
            every = np.arange(s.manifest.num_blocks)
            blocks.decode_blocks_into(s.manifest, s.payload, every, keys, values)
            t2 = time.perf_counter()
            times[label]["encode"].append(t1 - t0)
            times[label]["decode"].append(t2 - t1)
    rows = {}
    base = {k: statistics.median(v) for k, v in times[BASE].items()}
    print(f"{args.tokens} tokens, {args.rounds} rounds (medians; ratio to {BASE})")
    for label, s in streams.items():
        med = {k: statistics.median(v) for k, v in times[label].items()}
        rows[label] = {
            "payload_bytes": int(s.payload.size),
            "bytes_ratio": s.payload.size / streams[BASE].payload.size,
            **{f"{k}_ms": v * 1e3 for k, v in med.items()},
            **{f"{k}_ratio": v / base[k] for k, v in med.items()},
        }
        r = rows[label]
        print(
            f"  {label:18s} {r['payload_bytes']:>11,} B ({r['bytes_ratio']:.3f}x)  "
            f"encode {r['encode_ms']:7.1f} ms ({r['encode_ratio']:.2f}x)  "
            f"decode {r['decode_ms']:6.1f} ms ({r['decode_ratio']:.2f}x)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokens": args.tokens, "rounds": args.rounds, "host": platform.node()}
    out.write_text(json.dumps({"meta": meta, "layouts": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
