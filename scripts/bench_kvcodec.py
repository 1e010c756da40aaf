"""Speed and size of the entropy-coded KV codec (kvtransport.codecs.kvcodec), beside int8's
quantization, on one core: the lossy codec at relative steps, and int8r (int8's blocks coded
without loss, the sendable precision).

The cache is a real model's (SmolLM2 prefilled on a held-out prompt, ``--model``) or, with
``--synthetic``, Gaussian blocks with per-channel key offsets. Every block of the cache is
coded; one decode call then decodes all of them into a cache (what a receiver does with a
token range), against int8's in-place dequantization of the same blocks. Rounds interleave
the two; each figure is the median over rounds of coded (input) bits per second, by the
process's CPU time (one thread: CPU time is one core's, also on a shared host) and by the
wall clock, printed with the load average. Encoding is timed the same way, in coded
(output) bits per second: the sender encodes at submit. int8r's line gives its bytes per
token against int8's, its encode speed (from int8's rows, the quantization excluded) and
its decode speed (into int8's rows, then int8's dequantization), beside int8's
dequantization. Run with an older checkout's interpreter, the script measures what that
checkout has (int8r only where it exists).

    .venv/bin/python scripts/bench_kvcodec.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def blocks_of(keys: np.ndarray, values: np.ndarray, block_tokens: int) -> np.ndarray:
    """``[L, H, N, D]`` K and V -> ``[L * (N // block_tokens), 2, H, T, D]`` whole blocks."""
    layers, heads, n, dim = keys.shape
    nb = n // block_tokens
    kv = np.stack([keys, values], axis=1)[:, :, :, : nb * block_tokens]
    kv = kv.reshape(layers, 2, heads, nb, block_tokens, dim).transpose(0, 3, 1, 2, 4, 5)
    return np.ascontiguousarray(kv.reshape(-1, 2, heads, block_tokens, dim), dtype=np.float32)


def synthetic(n_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((n_blocks, 2, 3, 16, 64)).astype(np.float32)
    kv[:, 0] += (rng.standard_normal((1, 3, 1, 64)) * 2).astype(np.float32)
    return kv


def real(model: str | None, tokens: int, seed: int) -> np.ndarray:
    from kvtransport.model import hf, tasks
    from kvtransport.model.loader import load_model

    lm = load_model(model, threads=1)
    sample = tasks.suite(lm.tokenizer, n=1, target_tokens=tokens, seed=seed)[0]
    ctx, _ = sample.prompt(lm.tokenizer)
    kv = hf.prefill(lm.model, lm.tokenizer, ctx)
    return blocks_of(kv.keys, kv.values, 16)


def measure(kv: np.ndarray, rel_step: tuple[float, float], rounds: int) -> dict:
    """Sizes and decode speeds of ``kv``'s blocks, codec and int8 interleaved."""
    from kvtransport.codecs import kvcodec, quant

    n, _, heads, t, dim = kv.shape
    coded = kvcodec.encode_blocks(kv, rel_step)
    lengths = np.array([c.size for c in coded])
    buf = np.concatenate(coded)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = quant.quantize_kv(kv, 8, dim, False)
    i8 = rows.reshape(-1)
    i8_offsets = np.arange(n) * rows.shape[1]
    keys = np.zeros((1, heads, n * t, dim), np.float32)
    values = np.zeros_like(keys)
    layers, starts = np.zeros(n, np.int64), np.arange(n) * t

    def codec() -> None:
        kvcodec.decode_blocks_into(buf, offsets, lengths, layers, starts, t, keys, values)

    def int8() -> None:
        quant.dequantize_blocks_into(i8, i8_offsets, layers, starts, t, 8, dim, False, keys,
                                     values)  # fmt: skip

    def encode() -> None:
        kvcodec.encode_blocks(kv, rel_step)

    times = _rounds({"codec": codec, "int8": int8, "encode": encode}, rounds)
    values_n = kv.size
    out = {
        "blocks": n,
        "rel_step": list(rel_step),
        "codec_bytes_per_block": float(lengths.mean()),
        "int8_bytes_per_block": int(rows.shape[1]),
        "size_vs_int8": float(lengths.sum() / i8.size),
        "codec_bits_per_value": float(buf.size * 8 / values_n),
    }
    for name, size in (("codec", buf.size), ("int8", i8.size)):
        cpu = float(np.median([c for c, _ in times[name]]))
        wall = float(np.median([w for _, w in times[name]]))
        out[f"{name}_gbit_s_cpu"] = size * 8 / cpu / 1e9
        out[f"{name}_gbit_s_wall"] = size * 8 / wall / 1e9
        out[f"{name}_mvalues_s_cpu"] = values_n / cpu / 1e6
    out["encode_gbit_s_cpu"] = buf.size * 8 / _median_cpu(times["encode"]) / 1e9
    out["encode_mvalues_s_cpu"] = values_n / _median_cpu(times["encode"]) / 1e6
    return out


def _rounds(fns: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Each function once to compile or load its kernels, then ``rounds`` interleaved
    rounds: (CPU, wall) seconds per call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            times[name].append((time.process_time() - c0, time.perf_counter() - w0))
    return times


def _median_cpu(times: list[tuple[float, float]]) -> float:
    return float(np.median([c for c, _ in times]))


def measure_int8r(kv: np.ndarray, rounds: int) -> dict:
    """int8r against int8 on ``kv``'s blocks: sizes, encode and decode speeds."""
    from kvtransport.codecs import kvcodec, quant

    n, _, heads, t, dim = kv.shape
    rows = quant.quantize_kv(kv, 8, dim, False)  # one group per head vector, as sent
    buf, lengths = kvcodec.encode_int8_rows(rows, heads, t, dim)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    back = np.empty_like(rows)
    keys = np.zeros((1, heads, n * t, dim), np.float32)
    values = np.zeros_like(keys)
    layers, starts = np.zeros(n, np.int64), np.arange(n) * t
    row_offsets = np.arange(n) * rows.shape[1]

    def dequantize(src: np.ndarray) -> None:
        quant.dequantize_blocks_into(src.reshape(-1), row_offsets, layers, starts, t, 8, dim,
                                     False, keys, values)  # fmt: skip

    def decode() -> None:
        status = kvcodec.decode_int8_rows(buf, offsets, lengths, heads, t, dim, back)
        assert not status.any()
        dequantize(back)

    times = _rounds({
        "encode": lambda: kvcodec.encode_int8_rows(rows, heads, t, dim),
        "decode": decode,
        "int8": lambda: dequantize(rows),
    }, rounds)  # fmt: skip
    assert np.array_equal(back, rows)
    tokens = n * t  # block-tokens: times the layers, bytes per context token
    return {
        "kind": "int8r",
        "blocks": n,
        "size_vs_int8": float(buf.size / rows.size),
        "int8r_bytes_per_block": float(lengths.mean()),
        "int8_bytes_per_block": int(rows.shape[1]),
        "int8r_bytes_per_layer_token": float(buf.size / tokens),
        "int8_bytes_per_layer_token": float(rows.size / tokens),
        "encode_gbit_s_cpu": buf.size * 8 / _median_cpu(times["encode"]) / 1e9,
        "encode_int8_gbit_s_cpu": rows.size * 8 / _median_cpu(times["encode"]) / 1e9,
        "decode_gbit_s_cpu": buf.size * 8 / _median_cpu(times["decode"]) / 1e9,
        "int8_dequant_gbit_s_cpu": rows.size * 8 / _median_cpu(times["int8"]) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", default="0.05,0.05;0.1,0.1;0.1,0.2",
                   help="(K,V) relative steps, ';'-separated")  # fmt: skip
    p.add_argument("--synthetic", type=int, default=0, help="N Gaussian blocks instead")
    p.add_argument("--tokens", type=int, default=2000, help="real cache: context length")
    p.add_argument("--seed", type=int, default=40_000, help="real cache: task seed")
    p.add_argument("--model", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON line per step")
    args = p.parse_args(argv)
    import os

    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    kv = synthetic(args.synthetic) if args.synthetic else real(args.model, args.tokens, args.seed)
    for spec in args.steps.split(";"):
        k, v = (float(x) for x in spec.split(","))
        r = measure(kv, (k, v), args.rounds)
        r["loadavg"] = open("/proc/loadavg").read().split()[:3]
        if args.json:
            print(json.dumps(r))
            continue
        print(
            f"steps K {k:g} V {v:g}: {r['codec_bytes_per_block']:.0f} B/block "
            f"({r['size_vs_int8']:.3f} of int8, {r['codec_bits_per_value']:.2f} bit/value); "
            f"decode {r['codec_gbit_s_cpu']:.2f} Gbit/s coded by CPU time "
            f"({r['codec_gbit_s_wall']:.2f} wall, {r['codec_mvalues_s_cpu']:.0f} Mvalues/s); "
            f"int8 {r['int8_gbit_s_cpu']:.2f} Gbit/s ({r['int8_mvalues_s_cpu']:.0f} Mvalues/s); "
            f"encode {r['encode_gbit_s_cpu']:.3f} Gbit/s coded by CPU time "
            f"({r['encode_mvalues_s_cpu']:.0f} Mvalues/s); loadavg {' '.join(r['loadavg'])}"
        )
    from kvtransport.codecs import kvcodec

    if hasattr(kvcodec, "encode_int8_rows"):  # int8r: not in checkouts before it
        r = measure_int8r(kv, args.rounds)
        r["loadavg"] = open("/proc/loadavg").read().split()[:3]
        if args.json:
            print(json.dumps(r))
            return 0
        print(
            f"int8r: {r['size_vs_int8']:.3f} of int8 ({r['int8r_bytes_per_block']:.0f} B/block "
            f"vs {r['int8_bytes_per_block']}); encode {r['encode_gbit_s_cpu']:.2f} Gbit/s "
            f"coded ({r['encode_int8_gbit_s_cpu']:.2f} of int8 in) by CPU time; decode + "
            f"dequantize {r['decode_gbit_s_cpu']:.2f} Gbit/s coded; int8 dequantize "
            f"{r['int8_dequant_gbit_s_cpu']:.2f} Gbit/s; loadavg {' '.join(r['loadavg'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
