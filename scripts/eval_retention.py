"""Partial retention (the seed paper's Figure 2c): which blocks should arrive first?

For held-out prompts (RULER-style needle tasks and worlddatax facts QA, seeds disjoint
from the sensitivity calibration's and from the seeds kvtransport.model.utility was tuned on),
prefill the context, take the full cache's greedy answer (up to its stop token) as the
reference, then keep only the first 25 / 50 / 75 % of the block stream in
each order and measure teacher-forced top-1 agreement with the reference (missing blocks
masked per layer, as the receiver injects them):

- utility: kvtransport.model.utility's order (sink blocks first, then SnapKV attention mass x
  layer weight);
- random: a seeded random permutation (averaged over several seeds per prompt);
- position: token range first, then layer (what a sequential sender would send).

Writes ``retention.json`` (every measurement plus the summary) and ``retention.png``
(mean agreement with 95 % t-intervals over prompts) into --out, and prints a table.

    .venv/bin/python scripts/eval_retention.py --prompts 24 --out results/retention
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from kvtransport.eval.handoffs import layer_weights_for, reference_answer, weights_label
from kvtransport.eval.reports import run_prompts, save_report

FRACTIONS = (0.25, 0.5, 0.75)
ORDERS = ("utility", "random", "position")
HELD_OUT_SEED = 10_000  # calibration (kvtransport profile) uses small seeds


def measure_prompt(
    model,
    tokenizer,
    sample,
    *,
    fractions=FRACTIONS,
    orders=ORDERS,
    random_seeds: int = 3,
    ref_tokens: int = 32,
    block_tokens: int = 16,
    layer_weights=None,
) -> dict:
    """Top-1 agreement of every (order, fraction) for one prompt."""
    from kvtransport.model import hf, utility

    ctx, question = sample.prompt(tokenizer)
    kv = hf.prefill(model, tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    ref = reference_answer(model, tokenizer, kv, question, ref_tokens)
    u = utility.cache_utility(kv, block_tokens, layer_weights)
    out = {"task": sample.task, "seed": sample.seed, "tokens": kv.num_tokens, "results": {}}
    for order in orders:
        seeds = range(random_seeds) if order == "random" else [0]
        for frac in fractions:
            scores = []
            for s in seeds:
                idx = utility.stream_order(u, block_tokens, order, seed=s)
                keep = utility.kept_mask(idx, u.shape, frac)
                present = np.repeat(keep, block_tokens, axis=1)[:, : kv.num_tokens]
                scores.append(hf.top1_agreement(model, kv, question, ref, present=present))
            out["results"][f"{order}@{frac}"] = float(np.mean(scores))
    return out


def summarize(records: list[dict], fractions=FRACTIONS, orders=ORDERS) -> dict:
    """Mean and 95 % t-interval over prompts per (order, fraction); paired differences."""
    from scipy import stats

    def ci(x: np.ndarray) -> tuple[float, float, float]:
        m = float(np.mean(x))
        if len(x) < 2:
            return m, m, m
        half = float(stats.t.ppf(0.975, len(x) - 1) * np.std(x, ddof=1) / np.sqrt(len(x)))
        return m, m - half, m + half

    table: dict = {}
    for order in orders:
        for frac in fractions:
            x = np.array([r["results"][f"{order}@{frac}"] for r in records])
            m, lo, hi = ci(x)
            table[f"{order}@{frac}"] = {"mean": m, "ci95": [lo, hi], "n": len(x)}
    for other in orders:
        if other == "utility":
            continue
        for frac in fractions:
            d = np.array(
                [r["results"][f"utility@{frac}"] - r["results"][f"{other}@{frac}"] for r in records]
            )
            m, lo, hi = ci(d)
            table[f"utility-{other}@{frac}"] = {"mean": m, "ci95": [lo, hi], "n": len(d)}
    return table


def plot(summary: dict, path: Path, fractions=FRACTIONS, orders=ORDERS, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.array(fractions) * 100
    for order, marker in zip(orders, "osd", strict=False):
        m = np.array([summary[f"{order}@{f}"]["mean"] for f in fractions])
        lo = np.array([summary[f"{order}@{f}"]["ci95"][0] for f in fractions])
        hi = np.array([summary[f"{order}@{f}"]["ci95"][1] for f in fractions])
        ax.errorbar(x, m, yerr=[m - lo, hi - m], marker=marker, capsize=4, label=order)
    ax.set_xlabel("blocks kept (%)")
    ax.set_ylabel("teacher-forced top-1 agreement")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend(title="stream order")
    ax.set_title(title or "Partial KV retention (95% CI over prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(summary: dict, fractions=FRACTIONS, orders=ORDERS) -> str:
    lines = ["order      " + "".join(f"{int(f * 100):>3d}% kept [95% CI]      " for f in fractions)]
    for order in orders:
        cells = []
        for f in fractions:
            s = summary[f"{order}@{f}"]
            cells.append(f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]   ")
        lines.append(f"{order:10s} " + "".join(cells))
    for other in orders[1:]:
        cells = []
        for f in fractions:
            s = summary[f"utility-{other}@{f}"]
            cells.append(f"{s['mean']:+.3f} [{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}] ")
        lines.append(f"util-{other[:4]:5s} " + "".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts (default 24)")
    p.add_argument("--target-tokens", type=int, default=500, help="context length (tokens)")
    p.add_argument("--ref-tokens", type=int, default=32, help="reference answer length cap")
    p.add_argument(
        "--profile",
        default=None,
        help="sensitivity profile JSON, or 'uniform' (default: the model's packaged profile)",
    )
    p.add_argument("--random-seeds", type=int, default=3, help="random orders per prompt")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/retention", help="output directory")
    args = p.parse_args(argv)

    from kvtransport.model import tasks
    from kvtransport.model.loader import load_model

    lm = load_model(args.model, threads=args.threads)
    weights = layer_weights_for(lm.model_id, lm.num_layers, args.profile)
    samples = tasks.suite(
        lm.tokenizer, n=args.prompts, target_tokens=args.target_tokens, seed=HELD_OUT_SEED
    )
    t0 = time.perf_counter()
    records = run_prompts(
        samples,
        lambda s: measure_prompt(
            lm.model,
            lm.tokenizer,
            s,
            random_seeds=args.random_seeds,
            ref_tokens=args.ref_tokens,
            block_tokens=args.block_tokens,
            layer_weights=weights,
        ),
    )
    summary = summarize(records)
    meta = {
        "model_id": lm.model_id,
        "prompts": args.prompts,
        "target_tokens": args.target_tokens,
        "ref_tokens": args.ref_tokens,
        "random_seeds": args.random_seeds,
        "block_tokens": args.block_tokens,
        "layer_weights": weights_label(args.profile, weights),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    title = f"{lm.model_id}\npartial retention, {args.prompts} held-out prompts, 95% CI"
    save_report(
        args.out,
        "retention",
        meta,
        summary,
        records,
        lambda path: plot(summary, path, title=title),
        format_table(summary),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
