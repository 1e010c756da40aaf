"""KV quantization quality: fp16 / int8 / int4 and utility-driven mixed precision.

For held-out prompts (needle tasks and facts QA), prefill the context, take the full fp32
cache's greedy answer as the reference, then pass the cache through the real block codec
(kvtransport.model.encoding.degrade: encode at a precision, decode) and measure

- teacher-forced top-1 agreement with the reference answer,
- the greedy answer's token F1 (and contains) against the task's gold answer.

Configurations, with their payload size relative to the fp32 cache:

- uniform fp16 (50 %), int8 (26.6 % with head_dim 64: one group per head vector), int4
  (15.6 %);
- mixed:B at B = 28.1 % (int8's size in 32-value groups, as first calibrated), int4's size
  and below (10 %, 5 %): each block gets fp16,
  int8, int4 or is dropped so the kept utility is maximal (kvtransport.codecs.quant);
- int4+drop at the same small budgets: every kept block int4, the lowest-utility blocks
  dropped to fit (utility-aware, precision-blind), to show what mixing precisions adds.

Writes quant.json and quant.png into --out and prints the table.

    .venv/bin/python scripts/eval_quant.py --prompts 16 --out results/quant
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HELD_OUT_SEED = 30_000
MIXED_FRACTIONS = (0.28125, 0.15625, 0.10, 0.05)
DROP_FRACTIONS = (0.10, 0.05)


def configs(fp32_bytes: int) -> list[tuple[str, str | None, float]]:
    """(label, precision spec, drop fraction) for one cache of ``fp32_bytes``."""
    out = [("fp32", None, 0.0), ("fp16", "fp16", 0.0), ("int8", "int8", 0.0), ("int4", "int4", 0.0)]
    for f in MIXED_FRACTIONS:
        out.append((f"mixed@{f:.3g}", f"mixed:{int(f * fp32_bytes)}", 0.0))
    for f in DROP_FRACTIONS:  # int4 is 15.625 % of fp32: keep f / 0.15625 of the stream
        out.append((f"int4+drop@{f:.3g}", "int4", 1.0 - f / 0.15625))
    return out


def measure_prompt(model, tokenizer, sample, *, max_tokens: int = 32, layer_weights=None) -> dict:
    from kvtransport.model import encoding, hf, metrics, utility

    ctx, question = sample.prompt(tokenizer)
    kv = hf.prefill(model, tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    u = utility.cache_utility(kv, 16, layer_weights)
    full = hf.greedy_generate(model, kv, question, max_new_tokens=max_tokens)
    stops = hf.stop_ids_of(model)
    ref = full.tokens + ([stops[0]] if full.stopped and len(stops) == 1 else [])
    rec = {"task": sample.task, "seed": sample.seed, "tokens": kv.num_tokens, "results": {}}
    for label, spec, drop in configs(kv.nbytes):
        got = encoding.degrade(kv, u, drop=drop, precision=spec)
        present = None if got.present.all() else got.present
        top1 = hf.top1_agreement(model, got.cache, question, ref, present=present)
        gen = hf.greedy_generate(
            model, got.cache, question, present=present, max_new_tokens=max_tokens
        )
        answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
        ok = np.ones(got.manifest.num_blocks, bool)
        ok[got.missing] = False
        rec["results"][label] = {
            "bytes_fraction": float(got.manifest.length[ok].sum() / kv.nbytes),
            "top1": top1,
            "f1": metrics.token_f1(answer, sample.answers),
            "contains": metrics.contains(answer, sample.answers),
            "utility_kept": got.utility_recovered,
            "answer": answer,
        }
    return rec


def summarize(records: list[dict]) -> dict:
    from scipy import stats

    labels = list(records[0]["results"])
    out = {}
    for label in labels:
        row = {}
        for key in ("bytes_fraction", "top1", "f1", "contains", "utility_kept"):
            x = np.array([r["results"][label][key] for r in records], dtype=float)
            m = float(x.mean())
            half = (
                float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
                if len(x) > 1
                else 0.0
            )
            row[key] = {"mean": m, "ci95": [m - half, m + half]}
        out[label] = row
    return out


def format_table(summary: dict) -> str:
    lines = [f"{'config':16s} {'bytes':>6s} {'top-1 [95% CI]':>22s} {'F1':>6s} {'contains':>8s}"]
    for label, row in summary.items():
        t = row["top1"]
        lines.append(
            f"{label:16s} {row['bytes_fraction']['mean'] * 100:5.1f}% "
            f"{t['mean']:.3f} [{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}] "
            f"{row['f1']['mean']:6.3f} {row['contains']['mean']:8.3f}"
        )
    return "\n".join(lines)


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups = {
        "uniform": [k for k in summary if k in ("fp32", "fp16", "int8", "int4")],
        "mixed (utility)": [k for k in summary if k.startswith("mixed")],
        "int4 + drop": [k for k in summary if k.startswith("int4+drop")],
    }
    for (name, keys), marker in zip(groups.items(), "osd", strict=True):
        keys = sorted(keys, key=lambda k: summary[k]["bytes_fraction"]["mean"])
        x = [summary[k]["bytes_fraction"]["mean"] * 100 for k in keys]
        y = [summary[k]["top1"]["mean"] for k in keys]
        lo = [summary[k]["top1"]["mean"] - summary[k]["top1"]["ci95"][0] for k in keys]
        ax.errorbar(x, y, yerr=lo, marker=marker, capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("payload (% of the fp32 cache)")
    ax.set_ylabel("teacher-forced top-1 agreement")
    low = min(row["top1"]["ci95"][0] for row in summary.values())
    ax.set_ylim(max(0.0, min(0.5, low - 0.1)), 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    p.add_argument("--target-tokens", type=int, default=500, help="context length (tokens)")
    p.add_argument(
        "--seed",
        type=int,
        default=HELD_OUT_SEED,
        help=f"first task seed (default {HELD_OUT_SEED}; the int8/int4 fidelities in "
        "kvtransport.kvformat.blocks were calibrated on these, use another to evaluate held-out)",
    )
    p.add_argument(
        "--profile", default=None, help="sensitivity profile JSON, or 'uniform' (default: packaged)"
    )
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/quant", help="output directory")
    args = p.parse_args(argv)

    from eval_retention import layer_weights_for, run_prompts, save_report, weights_label

    from kvtransport.kvformat import blocks
    from kvtransport.model import tasks
    from kvtransport.model.loader import load_model

    lm = load_model(args.model, threads=args.threads)
    weights = layer_weights_for(lm.model_id, lm.num_layers, args.profile)
    samples = tasks.suite(
        lm.tokenizer, n=args.prompts, target_tokens=args.target_tokens, seed=args.seed
    )
    t0 = time.perf_counter()
    records = run_prompts(
        samples, lambda s: measure_prompt(lm.model, lm.tokenizer, s, layer_weights=weights)
    )
    summary = summarize(records)
    meta = {
        "model_id": lm.model_id,
        "prompts": args.prompts,
        "target_tokens": args.target_tokens,
        "seed": args.seed,
        "fidelity": blocks.DEFAULT_FIDELITY,
        "layer_weights": weights_label(args.profile, weights),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    title = f"{lm.model_id}: KV quantization, {args.prompts} prompts"
    save_report(
        args.out,
        "quant",
        meta,
        summary,
        records,
        lambda path: plot(summary, path, title),
        format_table(summary),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
