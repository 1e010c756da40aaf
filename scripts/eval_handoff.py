"""The handoff against re-prefill, over seeds and link rates (issue: TTFT speed-up).

Runs the main job (kvtransport.demo.run.run_demo) on the emulated link for each configuration
and seed, with the model loaded once, and summarizes per scheme: the TTFT speed-up
against re-prefilling measured in the same run (median, min, max over seeds), the answers
equal to the full cache's (worst seed, mean), and the receiver's computed tokens. The
"link down" row is the receiver alone (100 % loss): its TTFT against re-prefill is the
fallback's cost. A second table measures how concentrated what goes missing is: the share
of context tokens the receiver must recompute when the last 10 % of a stream's blocks is
lost, in utility order (today's scatter) against prefix order.

With ``--orders position,back`` every seed runs once per stream order of the plan
(kvtransport.model.plan.ORDERS), one after the other, and the table adds the paired ratio of
each order's speed-up to the first order's (per seed, then the median); ``--hedges
0.25,0`` does the same for the plan's hedge share (kvtransport.model.plan), and ``--tails
1,0`` for the plan's layer-by-layer tail (with it, without), every order with every hedge
and tail. A configuration
``TOKENS@RATE>LINK`` plans for RATE Mbit/s while the link carries LINK Mbit/s (a link
worse than planned), e.g. ``512@100>60``.

Writes handoff.json and handoff.md into --out (default results/eval_handoff).

    .venv/bin/python scripts/eval_handoff.py                      # the three configurations
    .venv/bin/python scripts/eval_handoff.py --configs 512@100 --seeds 1-2   # a quick look
    .venv/bin/python scripts/eval_handoff.py --configs 512@100,512@100>60 --orders position,back
    .venv/bin/python scripts/eval_handoff.py --configs 2048@100 --hedges 0.25,0 --schemes adaptive
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvtransport.eval.args import parse_seeds
from kvtransport.model.plan import DEFAULT_HEDGE_SHARE

CONFIGS = {"512@100": (512, 100.0), "2048@100": (2048, 100.0), "2048@1000": (2048, 1000.0)}
SCHEMES = ("no FEC", "RLC 4/32", "adaptive", "DDQN")


def parse_config(name: str) -> tuple[int, float, float | None]:
    """(tokens, planned rate, the link's rate or None) of ``TOKENS@RATE[>LINK]``: a named
    configuration of CONFIGS or any such spec. Raises ValueError otherwise."""
    head, _, link = name.partition(">")
    if head in CONFIGS and not link:
        return (*CONFIGS[head], None)
    tokens, _, rate = head.partition("@")
    return int(tokens), float(rate), float(link) if link else None


def run(
    configs: list[str],
    seeds: list[int],
    budget: float,
    objective: str,
    loaded: object,
    repeats: int = 1,
    orders: tuple[str, ...] = ("position",),
    schemes: tuple[str, ...] = SCHEMES,
    hedges: tuple[float, ...] = (DEFAULT_HEDGE_SHARE,),
    speed_error: float = 1.0,
    tails: tuple[bool, ...] = (True,),
) -> dict:
    """Run every configuration, seed and plan variant (each order with each hedge share
    and each tail choice);
    the variants of a seed share one measured receiver speed. speed_error: the receiver
    believes its compute takes this share of what it measured (1: as measured; 0.8: 20 %
    optimistic, as when it is busier than when it measured)."""
    from kvtransport.demo.run import DemoConfig, run_demo

    variants = [(o, h, t) for o in orders for h in hedges for t in tails]
    names = [variant_name(*v, hedges, tails) for v in variants]
    out: dict = {"budget": budget, "objective": objective, "seeds": seeds,
                 "repeats": repeats, "orders": list(orders), "hedges": list(hedges),
                 "tails": list(tails), "variants": names, "speed_error": speed_error,
                 "configs": {}}  # fmt: skip
    for name in configs:
        tokens, rate, link_rate = parse_config(name)
        runs = []
        for seed, (order, hedge, tail) in ((s, v) for s in seeds for v in variants):
            t0 = time.perf_counter()
            if (order, hedge, tail) == variants[0]:  # one measured speed for the seed's variants
                speed = None
                if len(variants) > 1 or speed_error != 1.0:
                    speed = tuple(x * speed_error for x in _speed(loaded, tokens, seed))
            cfg = DemoConfig(tokens=tokens, rate_mbps=rate, seed=seed, budget=budget,
                             objective=objective, link="emulated", progress=False,
                             schemes=schemes, repeats=repeats, order=order, hedge=hedge,
                             tail=tail, link_rate_mbps=link_rate,
                             compute_speed=speed)  # fmt: skip
            rep = run_demo(cfg, loaded=loaded)
            rows = [*rep.schemes, rep.link_down]
            runs.append({
                "seed": seed,
                "order": order,
                "hedge": hedge,
                "tail": tail,
                "variant": variant_name(order, hedge, tail, hedges, tails),
                "context_tokens": rep.cache["context_tokens"],
                "reprefill_ttft_s": rep.reprefill["ttft_s"],
                "budget_s": rep.budget_s,
                "plan": {k: v for k, v in rep.plan.items() if k != "text"},
                "rows": {r.label: {"ttft_s": r.ttft_s, "speedup": r.speedup,
                                   "matches": r.matches, "questions": len(r.answers),
                                   "computed": r.computed_tokens, "utility": r.utility,
                                   "race_s": r.race_s, "waited_s": r.waited_s,
                                   "first_token_s": r.first_token_s,
                                   "transfer_s": r.transfer_s}
                         for r in rows if r.ttft_s is not None},
            })  # fmt: skip
            print(f"{name} seed {seed} {runs[-1]['variant']}: " + ", ".join(
                f"{k} {v['speedup']:.2f}x {v['matches']}/{v['questions']}"
                for k, v in runs[-1]["rows"].items()) + f" ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr, flush=True)  # fmt: skip
        out["configs"][name] = {"tokens": tokens, "rate_mbps": rate,
                                "link_rate_mbps": link_rate, "runs": runs}  # fmt: skip
    return out


def variant_name(
    order: str, hedge: float, tail: bool, hedges: tuple[float, ...], tails: tuple[bool, ...]
) -> str:
    """A plan variant's label in the tables: the order, and the hedge share and the tail
    choice when several are compared."""
    name = order if len(hedges) == 1 else f"{order}, hedge {hedge:g}"
    return name if len(tails) == 1 else f"{name}, {'tail' if tail else 'no tail'}"


def _speed(loaded: object, tokens: int, seed: int) -> tuple[float, float, float]:
    """The receiver's compute speed on the seed's context, measured once, so that the
    orders compared on a seed plan with the same speed (a measurement on a shared
    machine varies enough to move the split)."""
    from kvtransport.demo.demo_report import DemoConfig
    from kvtransport.model import tasks
    from kvtransport.model.cache_builder import ComputeSpeed

    tok = loaded.tokenizer  # type: ignore[attr-defined]
    sample = tasks.generate(DemoConfig.task, tok, target_tokens=tokens, seed=seed)
    ctx, _ = sample.prompt(tok)
    s = ComputeSpeed.measure(loaded.model, ctx)  # type: ignore[attr-defined]
    return s.per_call_s, s.per_token_s, s.per_pair_s


def concentration(loaded: object, tokens: int = 512, seed: int = 1) -> dict:
    """Share of tokens to recompute when the stream's last 10 % of blocks is lost."""
    from kvtransport.demo.demo_model import prepare_card
    from kvtransport.kvformat import blocks
    from kvtransport.model import tasks, utility

    tok = loaded.tokenizer  # type: ignore[attr-defined]
    sample = tasks.generate("facts_qa", tok, target_tokens=tokens, seed=seed)
    ctx, _ = sample.prompt(tok)
    stream, _, _ = prepare_card(loaded, sample, ctx, None)
    m = stream.manifest
    g = m.geometry
    u = m.utility_grid()
    res = {}
    for order in ("utility", "position"):
        idx = utility.stream_order(u, g.block_tokens, order)
        lost = idx[int(round(0.9 * idx.size)) :]
        ranges = np.unique(lost % g.token_blocks)
        touched = int(blocks.Geometry.block_token_count(g, ranges).sum())
        res[order] = {"token_ranges": int(ranges.size), "tokens": touched,
                      "share": touched / g.num_tokens}  # fmt: skip
    return res


def fallback(loaded: object, tokens: int, repeats: int, seed: int = 1) -> dict:
    """The dead link against re-prefill, interleaved ``repeats`` times on one context
    (each side: the context's cache, then the first answer token): the receiver's race
    with nothing arriving computes the planned prefix, finds the link silent and computes
    the rest in one call."""
    from kvtransport.demo.demo_links import LinkOutcome
    from kvtransport.demo.run import (
        DemoConfig,
        prepare,
        race_ttft_once,
        reprefill_ttft_once,
    )

    cfg = DemoConfig(tokens=tokens, seed=seed, link="emulated", progress=False)
    prep = prepare(cfg, loaded)
    nothing = LinkOutcome(0.0, "", np.zeros(0, bool), np.zeros(0, np.uint8), None, 0.0)
    re_s, dead_s = [], []
    for _ in range(repeats):
        re_s.append(reprefill_ttft_once(prep))
        dead_s.append(race_ttft_once(prep, nothing))
    ratios = [d / r for d, r in zip(dead_s, re_s, strict=True)]
    return {"tokens": len(prep.context_ids), "reprefill_s": re_s, "link_down_s": dead_s,
            "ratio_median": statistics.median(ratios), "ratio_max": max(ratios)}  # fmt: skip


def render_fallback(rows: list[dict]) -> str:
    lines = [
        "| context | re-prefill TTFT (median s) | link down TTFT (median s) | "
        "link down / re-prefill: median, worst of the pairs |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} tok | {statistics.median(r['reprefill_s']):.2f} | "
            f"{statistics.median(r['link_down_s']):.2f} | {r['ratio_median']:.3f}, "
            f"{r['ratio_max']:.3f} ({len(r['reprefill_s'])} interleaved pairs) |"
        )
    return "\n".join(lines) + "\n"


def render(doc: dict) -> str:
    variants = doc.get("variants", doc.get("orders", ["position"]))
    lines = [
        f"TTFT budget {doc['budget']:g} of the receiver's re-prefill estimate, plan objective "
        f"{doc.get('objective', 'fidelity')}; emulated "
        f"ge-heavy link; seeds {doc['seeds'][0]}-{doc['seeds'][-1]}; speed-up = re-prefill "
        "TTFT / handoff TTFT, both measured in the same run"
        + (
            f" (per seed the median of {doc['repeats']} interleaved rounds)"
            if doc.get("repeats", 1) > 1
            else ""
        )
        + (
            f"; the receiver believes its compute takes {doc['speed_error']:g} of what it measured"
            if doc.get("speed_error", 1.0) != 1.0
            else ""
        ),
        "",
        "| context | link | plan | scheme | speed-up median [min, max] | "
        f"vs {variants[0]}: paired ratio median [min, max] | answers = full cache: "
        "worst seed, mean | tokens computed (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _name, c in doc["configs"].items():
        labels = list(c["runs"][0]["rows"])
        link = f"{c['rate_mbps']:g} Mbit/s"
        if c.get("link_rate_mbps"):
            link = f"planned {link}, carries {c['link_rate_mbps']:g}"
        by_variant = {v: [r for r in c["runs"] if r.get("variant", r.get("order", "position")) == v]
                      for v in variants}  # fmt: skip
        first = {r["seed"]: r for r in by_variant[variants[0]]}
        for variant, runs in by_variant.items():
            for label in labels:
                sp = [r["rows"][label]["speedup"] for r in runs]
                mt = [r["rows"][label]["matches"] for r in runs]
                q = runs[0]["rows"][label]["questions"]
                comp = statistics.mean(r["rows"][label]["computed"] for r in runs)
                ntok = statistics.mean(r["context_tokens"] for r in runs)
                pair = [r["rows"][label]["speedup"] / first[r["seed"]]["rows"][label]["speedup"]
                        for r in runs if r["seed"] in first]  # fmt: skip
                paired = (f"{statistics.median(pair):.3f} [{min(pair):.3f}, {max(pair):.3f}]"
                          if pair and variant != variants[0] else "-")  # fmt: skip
                lines.append(
                    f"| {ntok:.0f} tok | {link} | {variant} | {label} | "
                    f"{statistics.median(sp):.2f}x [{min(sp):.2f}, {max(sp):.2f}] | {paired} | "
                    f"{min(mt)}/{q}, {statistics.mean(mt):.1f} | {comp:.0f} |"
                )
    conc = doc.get("concentration")
    if conc:
        lines += [
            "",
            "| stream order | token ranges hit by losing the last 10 % of blocks | "
            "tokens to recompute |",
            "|---|---|---|",
        ]
        for order, v in conc.items():
            lines.append(f"| {order} | {v['token_ranges']} | {v['tokens']} ({v['share']:.0%}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="of " + ", ".join(CONFIGS) + ", or TOKENS@RATE[>LINK]")  # fmt: skip
    p.add_argument(
        "--orders",
        default="position",
        help="the plan's stream orders, each run per seed (e.g. position,back)",
    )
    p.add_argument(
        "--hedges",
        default=None,
        help="the plan's hedge shares, each run per seed and order (e.g. 0.25,0; default: "
        "the plan's)",
    )
    p.add_argument(
        "--tails",
        default="1",
        help="the plan's layer-by-layer tail, with (1) and/or without (0), each run per seed "
        "(e.g. 1,0; default 1)",
    )
    p.add_argument(
        "--speed-error",
        type=float,
        default=1.0,
        metavar="F",
        help="the receiver plans and races believing its compute takes F of what it "
        "measured (default 1; 0.8: a measurement 20%% optimistic)",
    )
    p.add_argument("--schemes", default=",".join(SCHEMES), help="of " + ", ".join(SCHEMES))
    p.add_argument("--seeds", default="1-8", help="e.g. 1-8 or 1,3")
    p.add_argument("--budget", type=float, default=None, help="TTFT budget share (demo default)")
    from kvtransport.model.plan import OBJECTIVES

    p.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help="the plan's objective (demo default)")  # fmt: skip
    p.add_argument("--out", default="results/eval_handoff")
    p.add_argument(
        "--fallback",
        default="",
        metavar="TOKENS",
        help="only the dead-link measurement, at these context sizes (e.g. 512,2048)",
    )
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved TTFT rounds per seed (default 3), or pairs for "
                   "--fallback (default 5)")  # fmt: skip
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        try:
            parse_config(c)
        except ValueError:
            p.error(f"unknown configuration {c!r}; one of {', '.join(CONFIGS)} or TOKENS@RATE")
    from kvtransport.model.plan import ORDERS

    orders = tuple(o.strip() for o in args.orders.split(",") if o.strip())
    if not orders or set(orders) - set(ORDERS):
        p.error(f"--orders must list names from {', '.join(ORDERS)}, not {args.orders!r}")
    try:
        hedges = (tuple(float(h) for h in args.hedges.split(",") if h.strip())
                  if args.hedges else (DEFAULT_HEDGE_SHARE,))  # fmt: skip
    except ValueError:
        hedges = ()
    if not hedges or any(not 0 <= h <= 1 for h in hedges):
        p.error(f"--hedges must list shares in [0, 1], e.g. 0.25,0, not {args.hedges!r}")
    tails = tuple(t.strip() == "1" for t in args.tails.split(",") if t.strip())
    if not tails or any(t.strip() not in ("0", "1") for t in args.tails.split(",")):
        p.error(f"--tails must list 1 (with) and/or 0 (without), not {args.tails!r}")
    if not 0.1 <= args.speed_error <= 10:
        p.error(f"--speed-error must be in [0.1, 10], not {args.speed_error:g}")
    schemes = tuple(x.strip() for x in args.schemes.split(",") if x.strip())
    if not schemes or set(schemes) - set(SCHEMES):
        p.error(f"--schemes must list labels from {', '.join(SCHEMES)}, not {args.schemes!r}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds must be like 1-8 or 1,3, not {args.seeds!r}")
    from kvtransport.demo.demo_report import DEFAULT_BUDGET, DEFAULT_OBJECTIVE
    from kvtransport.model.loader import load_model

    loaded = load_model(threads=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.fallback:
        rows = [fallback(loaded, int(t), args.repeats or 5) for t in args.fallback.split(",")]
        (out / "fallback.json").write_text(json.dumps(rows, indent=1))
        (out / "fallback.md").write_text(render_fallback(rows))
        print(render_fallback(rows))
        return 0
    doc = run(configs, seeds, args.budget or DEFAULT_BUDGET,
              args.objective or DEFAULT_OBJECTIVE, loaded, args.repeats or 3,
              orders, schemes, hedges, args.speed_error, tails)  # fmt: skip
    doc["concentration"] = concentration(loaded)
    (out / "handoff.json").write_text(json.dumps(doc, indent=1))
    (out / "handoff.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
