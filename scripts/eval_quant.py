"""KV quantization quality: fp16 / int8 / int4 and utility-driven mixed precision.

For held-out prompts (needle tasks and facts QA), prefill the context, take the full fp32
cache's greedy answer as the reference, then pass the cache through the real block codec
(kvtransport.model.encoding.degrade: encode at a precision, decode) and measure

- teacher-forced top-1 agreement with the reference answer,
- the greedy answer's token F1 (and contains) against the task's gold answer.

Configurations, with their payload size relative to the fp32 cache:

- uniform fp16 (50 %), int8 (26.6 % with head_dim 64: one group per head vector), k8v4
  (keys int8, values int4: 20.3 %), int4 (15.6 %);
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


UNIFORM = ("fp16", "int8", "k8v4", "int4")
CODEC_STEPS = ((0.03, 0.03), (0.05, 0.05), (0.05, 0.1), (0.1, 0.1))
"""The entropy codec's (K, V) quantization steps relative to each head's RMS
(kvtransport.codecs.kvcodec), measured as configurations ``ans:K,V``."""


def configs(fp32_bytes: int, only: tuple[str, ...] = ()) -> list[tuple[str, str | None, float]]:
    """(label, precision spec, drop fraction) for one cache of ``fp32_bytes``; ``only``:
    just the reference (fp32) and these uniform precisions (a calibration run)."""
    out: list[tuple[str, str | None, float]] = [("fp32", None, 0.0)]
    out += [(p, p, 0.0) for p in UNIFORM if not only or p in only]
    out += [(f"ans:{k:g},{v:g}", f"ans:{k:g},{v:g}", 0.0) for k, v in CODEC_STEPS
            if not only or "ans" in only]  # fmt: skip
    if only:
        return out
    for f in MIXED_FRACTIONS:
        out.append((f"mixed@{f:.3g}", f"mixed:{int(f * fp32_bytes)}", 0.0))
    for f in DROP_FRACTIONS:  # int4 is 15.625 % of fp32: keep f / 0.15625 of the stream
        out.append((f"int4+drop@{f:.3g}", "int4", 1.0 - f / 0.15625))
    return out


def through_codec(kv, spec: str):
    """``kv`` through the entropy codec at ``ans:K,V`` steps, as the receiver decodes it:
    (cache, coded bytes)."""
    from kvtransport.codecs import kvcodec

    from kvtransport.kvformat.kvcache import KVCache

    k_step, v_step = (float(x) for x in spec.split(":", 1)[1].split(","))
    keys, values, sizes = kvcodec.code_cache(kv.keys, kv.values, 16, (k_step, v_step))
    return KVCache(keys, values, kv.token_ids, kv.model_id), int(sizes.sum())


def measure_prompt(
    model, tokenizer, sample, *, max_tokens: int = 32, layer_weights=None, only=()
) -> dict:
    from kvtransport.model import encoding, hf, metrics, sensitivity, utility

    ctx, question = sample.prompt(tokenizer)
    kv = hf.prefill(model, tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    u = utility.cache_utility(kv, 16, layer_weights)
    full = hf.greedy_generate(model, kv, question, max_new_tokens=max_tokens)
    stops = hf.stop_ids_of(model)
    ref = full.tokens + ([stops[0]] if full.stopped and len(stops) == 1 else [])
    rec = {"task": sample.task, "seed": sample.seed, "tokens": kv.num_tokens, "results": {}}
    feed = list(question) + list(ref[:-1])
    ref_logits, _ = hf.cache_forward(model, kv, feed, last=len(ref))
    for label, spec, drop in configs(kv.nbytes, only):
        if spec is not None and spec.startswith("ans:"):
            cache, nbytes = through_codec(kv, spec)
            present, kept = None, 1.0
        else:
            got = encoding.degrade(kv, u, drop=drop, precision=spec)
            present = None if got.present.all() else got.present
            ok = np.ones(got.manifest.num_blocks, bool)
            ok[got.missing] = False
            cache, nbytes = got.cache, int(got.manifest.length[ok].sum())
            kept = got.utility_recovered
        logits, _ = hf.cache_forward(model, cache, feed, present=present, last=len(ref))
        top1 = float((logits.argmax(dim=-1).numpy() == np.asarray(ref)).mean())
        gen = hf.greedy_generate(model, cache, question, present=present, max_new_tokens=max_tokens)
        answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
        rec["results"][label] = {
            "bytes_fraction": float(nbytes / kv.nbytes),
            "top1": top1,
            "kl": sensitivity.kl_divergence(ref_logits, logits),
            "f1": metrics.token_f1(answer, sample.answers),
            "contains": metrics.contains(answer, sample.answers),
            "utility_kept": kept,
            "answer": answer,
        }
    return rec


def summarize(records: list[dict]) -> dict:
    from scipy import stats

    labels = list(records[0]["results"])
    out = {}
    for label in labels:
        row = {}
        for key in ("bytes_fraction", "top1", "kl", "f1", "contains", "utility_kept"):
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
    lines = [
        f"{'config':16s} {'bytes':>6s} {'top-1 [95% CI]':>22s} {'KL':>8s} {'F1':>6s} "
        f"{'contains':>8s}"
    ]
    for label, row in summary.items():
        t = row["top1"]
        lines.append(
            f"{label:16s} {row['bytes_fraction']['mean'] * 100:5.1f}% "
            f"{t['mean']:.3f} [{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}] "
            f"{row['kl']['mean']:8.5f} "
            f"{row['f1']['mean']:6.3f} {row['contains']['mean']:8.3f}"
        )
    return "\n".join(lines)


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups = {
        "uniform": [k for k in summary if k == "fp32" or k in UNIFORM],
        "mixed (utility)": [k for k in summary if k.startswith("mixed")],
        "int4 + drop": [k for k in summary if k.startswith("int4+drop")],
        "entropy codec": [k for k in summary if k.startswith("ans:")],
    }
    for (name, keys), marker in zip(groups.items(), "osd^", strict=True):
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
    p.add_argument(
        "--only",
        default="",
        help="comma-separated uniform precisions to measure alone (a calibration run: "
        f"e.g. int8,k8v4; from {','.join(UNIFORM)}, or ans: the entropy codec's steps); "
        "default: every configuration",
    )
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/quant", help="output directory")
    args = p.parse_args(argv)
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    if any(x not in (*UNIFORM, "ans") for x in only):
        p.error(f"--only takes names from {','.join(UNIFORM)}, not {args.only!r}")

    from kvtransport.eval.handoffs import layer_weights_for, weights_label
    from kvtransport.eval.reports import run_prompts, save_report
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
        samples,
        lambda s: measure_prompt(lm.model, lm.tokenizer, s, layer_weights=weights, only=only),
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
