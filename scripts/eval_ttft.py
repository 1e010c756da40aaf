"""Time to first token: load a cache card vs re-prefill the context, on this CPU.

For contexts of about 512, 1K, 2K and 4K tokens (RULER-style needle haystacks), the
downstream agent (model already loaded) must produce the first answer token after the
question. Compared side by side in one run, interleaved, median of --repeats:

- re-prefill: one forward pass over context + question (the fastest re-prefill there is);
- card fp32: read the card, verify and rebuild the cache (CRC-32 of every block), build
  the model cache, feed the question;
- card int8: the same with an int8 card (4x smaller read, dequantization on load).

The cards are written beforehand (the upstream agent's work, not timed) and read from the
page cache; dropping the OS cache needs root and would disturb other work on the machine,
so a cold disk read is not measured. Writes ttft.json and ttft.png into --out.

    .venv/bin/python scripts/eval_ttft.py --out results/ttft
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtransport.eval.handoffs import ttft_prefill

SIZES = (512, 1024, 2048, 4096)
METHODS = ("prefill", "card_fp32", "card_int8")


def ttft_card(model, path: Path, question: list[int]) -> tuple[float, int, dict]:
    from kvtransport.kvformat import card
    from kvtransport.model import hf

    t0 = time.perf_counter()
    got = card.load_cache(path)
    t_load = time.perf_counter() - t0
    gen = hf.greedy_generate(model, got.cache, question, max_new_tokens=1, stop_ids=())
    total = t_load + gen.first_token_seconds
    stages = {"load_card": t_load, "inject": gen.inject_seconds, "total": total}
    return total, gen.tokens[0], stages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="context sizes (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method and size")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/ttft", help="output directory")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    from tqdm import tqdm

    from kvtransport.kvformat import card
    from kvtransport.model import encoding, hf, tasks
    from kvtransport.model.loader import load_model

    lm = load_model(args.model, threads=args.threads)
    model, tok = lm.model, lm.tokenizer
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvt-ttft-") as tmp:
        for size in tqdm(sizes, desc="context sizes", file=sys.stderr):
            sample = tasks.generate("niah_single", tok, target_tokens=size, seed=size)
            ctx, question = sample.prompt(tok)
            kv = hf.prefill(model, tok, ctx)
            paths = {}
            for prec in ("fp32", "int8"):
                paths[prec] = Path(tmp) / f"ctx{size}-{prec}.card"
                card.write_card(paths[prec], encoding.encode_cache(kv, precision=prec))
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            stages: dict[str, list[dict]] = {m: [] for m in METHODS[1:]}
            first: dict[str, int] = {}
            ttft_prefill(model, ctx[:64] + question)  # warm-up
            for _ in range(args.repeats):  # interleaved, so drift hits all methods alike
                t, first["prefill"] = ttft_prefill(model, ctx + question)
                times["prefill"].append(t)
                for prec in ("fp32", "int8"):
                    t, first[f"card_{prec}"], st = ttft_card(model, paths[prec], question)
                    times[f"card_{prec}"].append(t)
                    stages[f"card_{prec}"].append(st)
            med = {m: statistics.median(v) for m, v in times.items()}
            rows.append(
                {
                    "target_tokens": size,
                    "context_tokens": len(ctx),
                    "question_tokens": len(question),
                    "card_bytes": {k: v.stat().st_size for k, v in paths.items()},
                    "ttft_s": med,
                    "all_s": times,
                    "card_stages_median_s": {
                        m: {k: statistics.median(s[k] for s in v) for k in v[0]}
                        for m, v in stages.items()
                    },
                    "speedup": {m: med["prefill"] / med[m] for m in METHODS[1:]},
                    "same_first_token": first["prefill"] == first["card_fp32"],
                    "first_token": first,
                }
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model_id": lm.model_id, "threads": args.threads, "repeats": args.repeats}
    (out / "ttft.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, out / "ttft.png", lm.model_id, args.threads)
    print(f"{'tokens':>7} {'re-prefill':>11} {'card fp32':>10} {'card int8':>10} "
          f"{'x fp32':>7} {'x int8':>7}  same 1st token")  # fmt: skip
    for r in rows:
        t = r["ttft_s"]
        print(
            f"{r['context_tokens']:7d} {t['prefill'] * 1e3:9.0f}ms {t['card_fp32'] * 1e3:8.0f}ms "
            f"{t['card_int8'] * 1e3:8.0f}ms {r['speedup']['card_fp32']:6.1f}x "
            f"{r['speedup']['card_int8']:6.1f}x  {r['same_first_token']}"
        )
    print(f"wrote {out / 'ttft.json'} and {out / 'ttft.png'}")
    return 0


def _plot(rows, path: Path, model_id: str, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.array([r["context_tokens"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"prefill": "re-prefill", "card_fp32": "card (fp32)", "card_int8": "card (int8)"}
    for m, marker in zip(METHODS, "osd", strict=True):
        ax.plot(x, [r["ttft_s"][m] * 1e3 for r in rows], marker=marker, label=labels[m])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{model_id}, CPU, {threads} thread(s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
