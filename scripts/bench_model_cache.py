#!/usr/bin/env python3
"""Building a receiver's cache range by range: transformers' concatenating cache against
kvtransport's growing one, side by side in one process.

For a facts_qa context of about ``--tokens`` tokens (SmolLM2-135M-Instruct, one torch
thread), per round, interleaved:

    concat   the context's K/V appended ``--range`` tokens at a time to a transformers
             ``DynamicCache`` (every update concatenates: it copies the whole layer);
    growing  the same appends to kvtransport.model.model_cache.new_model_cache (layers
             preallocated, each range written where it goes);

then the first token of the sample's question answered (a) from the numpy cache injected
into a new model cache, as the demo did before, and (b) from the growing cache as built.
Figures: medians of ``--rounds`` and their ratios. Writes ``--out`` (JSON) and prints a table.

    .venv/bin/python scripts/bench_model_cache.py --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="context size (default 2048)")
    ap.add_argument("--range", type=int, default=16, help="tokens per append (default 16)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--out", default="results/bench_model_cache.json")
    args = ap.parse_args()
    if args.tokens < 16 or args.range < 1 or args.rounds < 1:
        ap.error("--tokens must be >= 16, --range and --rounds >= 1")

    import torch
    from transformers import DynamicCache

    from kvtransport.model import hf, tasks
    from kvtransport.model.loader import load_model
    from kvtransport.model.model_cache import new_model_cache

    lm = load_model(threads=1)
    sample = tasks.generate("facts_qa", lm.tokenizer, target_tokens=args.tokens, seed=1)
    ctx, question = sample.prompt(lm.tokenizer)
    kv = hf.prefill(lm.model, lm.tokenizer, ctx, attention=False)
    n, step = kv.num_tokens, args.range

    def build(cache: object) -> float:
        t0 = time.perf_counter()
        for a in range(0, n, step):
            for layer in range(kv.num_layers):
                k = torch.from_numpy(kv.keys[layer, :, a : a + step])[None]
                v = torch.from_numpy(kv.values[layer, :, a : a + step])[None]
                cache.update(k, v, layer)  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    def first_token_s(cache: object) -> float:
        return hf.greedy_generate(lm.model, cache, question, max_new_tokens=1).first_token_seconds

    times: dict[str, list[float]] = {"concat": [], "growing": [], "inject": [], "built": []}
    for _ in range(args.rounds):
        times["concat"].append(build(DynamicCache(config=lm.model.config)))
        grown = new_model_cache(lm.model, n + 256)
        times["growing"].append(build(grown))
        times["inject"].append(first_token_s(kv))
        times["built"].append(first_token_s(grown))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "tokens": n,
        "range": step,
        "rounds": args.rounds,
        "host": platform.node(),
        "seconds": times,
        "median_s": med,
        "append_ratio": med["concat"] / med["growing"],
        "first_token_ratio": med["inject"] / med["built"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{n} tokens appended {step} at a time, median of {args.rounds} rounds:")
    print(f"  concatenating DynamicCache  {med['concat']:.3f} s")
    print(f"  growing cache               {med['growing']:.3f} s  ({out['append_ratio']:.1f}x)")
    print(f"first token, numpy injected   {med['inject']:.3f} s")
    print(f"first token, cache as built   {med['built']:.3f} s  ({out['first_token_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
