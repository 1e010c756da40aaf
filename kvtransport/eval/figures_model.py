"""scripts/evaluate.py's real-model figures: 2 (F1 vs rho), 3 (ablation), 5 (TTFT).

Every handoff here is a real one: the real model's cache, as a block stream, through the
simulator's real sessions, rebuilt and injected (see kvtransport.eval.handoffs). Figures 2
and 3 share their prompts, channel seeds and (memoized) handoffs; figure 5 times the
receiver's side against re-prefilling (kvtransport.eval.handoffs.ttft_prefill).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvtransport.eval.figures import md_table, pyplot
from kvtransport.eval.handoffs import (
    BLOCK_TOKENS,
    CASE_SEED,
    Case,
    deliver,
    layer_weights,
    ttft_prefill,
)
from kvtransport.eval.harness import Run
from kvtransport.eval.provenance import machine
from kvtransport.eval.registries import FAMILIES, LABELS
from kvtransport.eval.statistics import ci_cell, summary

METRICS = ("f1", "top1", "utility")
FIG2_METRICS = ("f1", "f1_minus_full", "utility")
ABLATION = (("utility", "ddqn"), ("utility", "none"), ("position", "ddqn"), ("position", "none"))
"""Figure 3's conditions: (stream order, repair scheme)."""
FAMILY_TITLES = {"qa": "facts QA (worlddatax)", "ruler": "RULER-style needles"}


def _cells(
    run: Run, order: str, schemes: tuple[str, ...]
) -> list[tuple[int, str, str, float, int]]:
    s = run.settings
    return [
        (i, order, name, rho, k)
        for i in range(len(run.cases()))
        for rho in s.rhos
        for name in schemes
        for k in range(s.channel_seeds)
    ]


def _seeds(run: Run) -> str:
    s = run.settings
    return (
        f"prompts {CASE_SEED}..{CASE_SEED + s.prompts - 1} per family ({s.tokens} "
        f"context tokens); channel seeds {run.seed} + 1000 x prompt index + "
        f"0..{s.channel_seeds - 1}, the same for every scheme and order"
    )


def _stats(rows: list[dict[str, Any]], metrics: tuple[str, ...] = METRICS) -> dict[str, Any]:
    return {m: summary([r[m] for r in rows]) for m in metrics}


# ---------------------------------------------------------------------------- figure 2


def figure2(run: Run) -> dict[str, Any]:
    from kvtransport.model import metrics

    s = run.settings
    cases = run.cases()
    t0, before = time.perf_counter(), machine()
    cells = _cells(run, "utility", s.fig2_schemes)
    rows = [run.measure(*c) for c in run.bar(cells, desc="fig 2: handoffs", unit="handoff")]
    full_f1 = [metrics.token_f1(c.full_answer, c.golds) for c in cases]
    for r in rows:  # paired with the same prompt's clean full-cache answer
        r["f1_minus_full"] = r["f1"] - full_f1[r["case"]]
    summ: dict[str, dict[str, Any]] = {}
    for fam in FAMILIES:
        mine = [c for c in cases if c.family == fam]
        summ[fam] = {
            "full_cache": {
                "f1": summary([f for c, f in zip(cases, full_f1, strict=True) if c.family == fam]),
                "utility": summary([1.0] * len(mine)),
            }
        }
        for rho in s.rhos:
            for n in s.fig2_schemes:
                sel = [
                    r
                    for r in rows
                    if cases[r["case"]].family == fam and r["rho"] == rho and r["scheme"] == n
                ]
                summ[fam][f"{n}@{rho:g}"] = _stats(sel, FIG2_METRICS)
    header = ["family", "rho", *(LABELS[n] for n in s.fig2_schemes)]
    table = ""
    for metric, title in (
        ("f1", "Token F1 against the gold answer"),
        ("f1_minus_full", "F1 minus the same prompt's clean full-cache F1 (paired; 0: no loss)"),
        ("utility", "Utility recovered before the deadline"),
    ):
        trows = [
            [
                fam,
                f"{rho:g}",
                *(ci_cell(summ[fam][f"{n}@{rho:g}"][metric]) for n in s.fig2_schemes),
            ]
            for fam in FAMILIES
            for rho in s.rhos
        ]
        if metric == "f1":
            trows += [
                [fam, "full cache", ci_cell(summ[fam]["full_cache"]["f1"])]
                + [""] * (len(s.fig2_schemes) - 1)
                for fam in FAMILIES
            ]
        table += (
            f"{'' if not table else chr(10)}{title} (mean ± 95% CI over prompts x "
            f"channel seeds):\n\n{md_table(header, trows)}"
        )
    record = {
        "channel": s.channel,
        "tokens": s.tokens,
        "precision": "fp16",
        "cases": [
            {
                "family": c.family,
                "task": c.sample.task,
                "seed": c.sample.seed,
                "context_tokens": len(c.context_ids),
                "gold": c.golds,
                "full_answer": c.full_answer,
            }
            for c in cases
        ],
        "summary": summ,
        "rows": rows,
    }
    plt = pyplot()
    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(10, 4.8), sharey=True)
    for ax, fam in zip(axes, FAMILIES, strict=True):
        for n in s.fig2_schemes:
            st = [summ[fam][f"{n}@{rho:g}"]["f1"] for rho in s.rhos]
            ax.errorbar(
                s.rhos,
                [c["mean"] for c in st],
                yerr=np.nan_to_num([c["ci95"] for c in st]),
                marker="o",
                ms=3,
                capsize=2,
                lw=2.2 if n == "ddqn" else 1.0,
                label=LABELS[n],
            )
        fc = summ[fam]["full_cache"]["f1"]
        ax.axhline(fc["mean"], color="k", ls=":", lw=1.2, label="full cache, clean")
        if fc["ci95"] == fc["ci95"]:
            ax.axhspan(fc["mean"] - fc["ci95"], fc["mean"] + fc["ci95"], color="k", alpha=0.07)
        n_prompts = sum(c.family == fam for c in cases)
        ax.set_title(
            f"{FAMILY_TITLES[fam]}: {n_prompts} prompts x {s.channel_seeds} seeds", fontsize=9
        )
        ax.set_xlabel("rho (deadline / loss-free send time)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("token F1 against the gold answer")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"Fig. 6 reproduced: end-to-end F1, {run.lm.model_id}, {s.channel}, 95% CI", fontsize=10
    )
    fig.subplots_adjust(bottom=0.25, top=0.86)
    return run.finish(2, record, table, fig, _seeds(run), before, t0)


# ---------------------------------------------------------------------------- figure 3


def _label(order: str, scheme: str) -> str:
    return f"{order} order, " + ("adaptive FEC (DDQN)" if scheme == "ddqn" else "no FEC")


def figure3(run: Run) -> dict[str, Any]:
    s = run.settings
    run.cases()
    t0, before = time.perf_counter(), machine()
    cells = [c for o, n in ABLATION for c in _cells(run, o, (n,))]
    rows = [
        run.measure(i, o, n, rho, k, top1=True)
        for i, o, n, rho, k in run.bar(cells, desc="fig 3: ablation", unit="handoff")
    ]

    def pick(rho: float, order: str, scheme: str) -> list[dict[str, Any]]:
        sel = [r for r in rows if r["rho"] == rho and r["order"] == order and r["scheme"] == scheme]
        return sorted(sel, key=lambda r: (r["case"], r["channel_seed"]))

    summ = {f"{o}/{n}@{rho:g}": _stats(pick(rho, o, n)) for rho in s.rhos for o, n in ABLATION}
    paired = {}
    for n in ("none", "ddqn"):
        for rho in s.rhos:
            pairs = list(zip(pick(rho, "utility", n), pick(rho, "position", n), strict=True))
            paired[f"{n}@{rho:g}"] = {m: summary([a[m] - b[m] for a, b in pairs]) for m in METRICS}
    allrho = {}
    for o, n in ABLATION:
        sel = [r for r in rows if r["order"] == o and r["scheme"] == n]
        allrho[f"{o}/{n}"] = _stats(sel)
    header = ["rho", *(_label(o, n) for o, n in ABLATION)]
    table = ""
    for metric, title in (
        ("top1", "Top-1 agreement with the full cache's answer"),
        ("f1", "Token F1 against the gold answer"),
        ("utility", "Utility recovered (the same block utilities in both orders)"),
    ):
        trows = [
            [f"{rho:g}", *(ci_cell(summ[f"{o}/{n}@{rho:g}"][metric]) for o, n in ABLATION)]
            for rho in s.rhos
        ]
        trows.append(["all", *(ci_cell(allrho[f"{o}/{n}"][metric]) for o, n in ABLATION)])
        table += (
            f"{'' if not table else chr(10)}{title} (mean ± 95% CI over prompts x "
            f"channel seeds):\n\n{md_table(header, trows)}"
        )
    table += "\nPaired (same prompt and channel seed): utility order minus position order:\n\n"
    table += md_table(
        ["scheme @ rho", "top-1", "F1", "utility"],
        [[k, *(ci_cell(v[m]) for m in ("top1", "f1", "utility"))] for k, v in paired.items()],
    )
    record = {
        "channel": s.channel,
        "summary": summ,
        "all_rhos": allrho,
        "paired": paired,
        "rows": rows,
    }
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    width = 0.8 / len(ABLATION)
    x = np.arange(len(s.rhos))
    for ax, metric, ylabel in (
        (axes[0], "top1", "top-1 agreement with the full cache"),
        (axes[1], "f1", "token F1 against the gold answer"),
    ):
        for j, (o, n) in enumerate(ABLATION):
            st = [summ[f"{o}/{n}@{rho:g}"][metric] for rho in s.rhos]
            ax.bar(
                x + (j - 1.5) * width,
                [c["mean"] for c in st],
                width,
                capsize=2,
                yerr=np.nan_to_num([c["ci95"] for c in st]),
                label=_label(o, n),
                color="C0" if n == "ddqn" else "C1",
                hatch="" if o == "utility" else "//",
                alpha=1.0 if o == "utility" else 0.5,
            )
        ax.set_xticks(x, [f"rho {r:g}" for r in s.rhos])
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"Fig. 7 reproduced: ablation on {s.channel}, {len(run.cases())} prompts x "
        f"{s.channel_seeds} channel seeds, 95% CI",
        fontsize=10,
    )
    fig.subplots_adjust(bottom=0.25, top=0.88)
    return run.finish(3, record, table, fig, _seeds(run), before, t0)


# ---------------------------------------------------------------------------- figure 5


def _ttft_size(run: Run, size: int, policy: str) -> dict[str, Any]:
    """Re-prefill vs handoff TTFT for one context size, interleaved repeats."""
    from kvtransport.demo.demo_model import answer
    from kvtransport.model import hf, tasks, utility
    from kvtransport.sim.oracle import make_sim_policy

    s, lm = run.settings, run.lm
    sample = tasks.generate("niah_single", lm.tokenizer, target_tokens=size, seed=size)
    ctx, question = sample.prompt(lm.tokenizer)
    kv = hf.prefill(lm.model, lm.tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    u = utility.cache_utility(kv, BLOCK_TOKENS, layer_weights(lm))
    cases = {p: Case("ruler", sample, ctx, question, kv, u, [], "", p) for p in s.ttft_precisions}
    ttft_prefill(lm.model, ctx[:64] + question)  # warm-up
    row: dict[str, Any] = {
        "target_tokens": size,
        "context_tokens": len(ctx),
        "reprefill_s": [],
        "handoff": {},
    }
    for k in range(s.ttft_repeats):  # interleaved, so drift hits every method alike
        row["reprefill_s"].append(ttft_prefill(lm.model, ctx + question)[0])
        for prec in s.ttft_precisions:
            for rho in s.ttft_rhos:
                d = deliver(
                    cases[prec],
                    "utility",
                    make_sim_policy(policy),
                    channel=s.channel,
                    rho=rho,
                    seed=run.seed + k,
                )
                _, first = answer(lm, d.kv, d.present, question, 1)
                h = row["handoff"].setdefault(
                    f"{prec}@{rho:g}",
                    {
                        "precision": prec,
                        "rho": rho,
                        "bytes": int(cases[prec].stream()[1].nbytes),
                        "ttft_s": [],
                        "transfer_s": [],
                        "rebuild_s": [],
                        "first_token_s": [],
                        "utility": [],
                    },
                )
                h["ttft_s"].append(d.transfer_s + d.rebuild_s + first)
                h["transfer_s"].append(d.transfer_s)
                h["rebuild_s"].append(d.rebuild_s)
                h["first_token_s"].append(first)
                h["utility"].append(d.utility)
    row["reprefill"] = summary(row["reprefill_s"])
    for h in row["handoff"].values():
        for key in ("ttft_s", "transfer_s", "rebuild_s", "first_token_s", "utility"):
            h[key.removesuffix("_s")] = summary(h[key])
        h["speedup"] = row["reprefill"]["mean"] / h["ttft"]["mean"]
    return row


def figure5(run: Run) -> dict[str, Any]:
    from kvtransport.policies.registry import default_policy

    s, policy = run.settings, default_policy()
    _ = run.lm  # loaded before the clock starts
    t0, before = time.perf_counter(), machine()
    results = [
        _ttft_size(run, size, policy)
        for size in run.bar(s.ttft_sizes, desc="fig 5: context sizes", unit="size")
    ]
    variants = list(results[0]["handoff"]) if results else []
    record = {"channel": s.channel, "policy": policy, "threads": run.threads, "rows": results}
    ms = 1e3
    header = ["context tokens", "re-prefill (ms)"]
    header += [f"handoff {v.replace('@', ', rho ')} (ms; utility; speed-up)" for v in variants]
    trows = []
    for r in results:
        cells = [str(r["context_tokens"]), ci_cell(r["reprefill"], 0, ms)]
        for v in variants:
            h = r["handoff"][v]
            cells.append(
                f"{ci_cell(h['ttft'], 0, ms)}; {h['utility']['mean']:.3f}; {h['speedup']:.1f}x"
            )
        trows.append(cells)
    table = "Time to first token (mean ± 95% CI over repeats):\n\n" + md_table(header, trows)
    table += (
        "\nHandoff TTFT split (ms, means): link time + rebuild + injection and first token:\n\n"
    )
    table += md_table(
        ["context tokens", *variants],
        [
            [
                str(r["context_tokens"]),
                *(
                    " + ".join(
                        f"{ms * r['handoff'][v][k]['mean']:.0f}"
                        for k in ("transfer", "rebuild", "first_token")
                    )
                    for v in variants
                ),
            ]
            for r in results
        ],
    )
    seeds = (
        f"needle prompts seeded by their size; channel seeds {run.seed}.."
        f"{run.seed + s.ttft_repeats - 1} (one per repeat, interleaved with the re-prefill "
        f"repeats); torch threads {run.threads}"
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    x = [r["context_tokens"] for r in results]
    ax.errorbar(
        x,
        [ms * r["reprefill"]["mean"] for r in results],
        marker="o",
        color="k",
        yerr=np.nan_to_num([ms * r["reprefill"]["ci95"] for r in results]),
        capsize=3,
        label="re-prefill (prefill + first token)",
    )
    for j, v in enumerate(variants):
        hs = [r["handoff"][v]["ttft"] for r in results]
        prec, rho = v.split("@")
        ax.errorbar(
            x,
            [ms * h["mean"] for h in hs],
            yerr=np.nan_to_num([ms * h["ci95"] for h in hs]),
            marker="sd^v"[j % 4],
            capsize=3,
            ls="-" if prec == "fp16" else "--",
            label=f"handoff, {prec} blocks, rho {rho}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(
        f"TTFT: KV handoff over {s.channel} (100 Mbit/s, {policy}) vs re-prefill, "
        f"{run.lm.model_id}, CPU, {run.threads} thread(s)",
        fontsize=8.5,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.subplots_adjust(bottom=0.22)
    return run.finish(5, record, table, fig, seeds, before, t0)
