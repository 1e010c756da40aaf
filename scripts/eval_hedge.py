"""The plan's hedge on a modelled clock: what it saves a receiver slower than it measured,
and what it costs one on time (issue: TTFT speed-up, robustness to a wrong speed).

For each seed's real context card (the demo's task at --tokens, SmolLM2's block
utilities), the demo's plan (kvtransport.demo.demo_model.plan_stream: objective ttft,
budget 0.3 of the re-prefill estimate, the ge-heavy link at --rate-mbps) is made with the
hedge and without it, for a receiver that believes it computes at --compute-speed. Then
the real race loop (kvtransport.model.race.race) runs on a modelled clock: the link puts
every token range in place at its planned arrival times LINK (1: as planned; 0.9: a link
10 % faster than planned, as when the loss and repair margin the plan allows do not
materialize), the receiver's compute takes SLOW times what it believes (1.25: a receiver
25 % slower than it measured, as when it is busier than when it measured), a load costs
nothing. What is left out, on purpose: the model itself (no cache is built, so no
machine noise), losses beyond the plan's (every range arrives), and the question's
forward pass after the race (the same with and without the hedge).

Writes hedge.json and hedge.md into --out (default results/eval_hedge).

    .venv/bin/python scripts/eval_hedge.py
    .venv/bin/python scripts/eval_hedge.py --tokens 1024 --seeds 1-2 --slow 1,1.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.model.cache_builder import CacheBuilder, ComputeSpeed
from kvtransport.model.race import LinkView, RaceResult, ReplayArrivals, race, stream_rank


class ModelledBuilder(CacheBuilder):
    """A cache builder that builds nothing: it counts the tokens in place and records
    what each call would cost a receiver ``slow`` times slower than ``speed``."""

    def __init__(self, token_ids: list[int], speed: ComputeSpeed, slow: float) -> None:
        self.token_ids = list(token_ids)
        self.filled = 0
        self.speed, self.slow = speed, slow
        self.costs: list[float] = []

    def compute(self, n: int) -> None:
        self.filled += self._check(n)
        self.costs.append(float(self.speed.seconds(n)) * self.slow)

    def load(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.filled += self._check(int(keys.shape[2]))
        self.costs.append(0.0)


class ModelledArrivals(ReplayArrivals):
    """The replay's arrivals with work costing what the builder says of it."""

    def __init__(self, ready_at: np.ndarray, link: LinkView, builder: ModelledBuilder) -> None:
        super().__init__(ready_at, np.zeros(0), link)  # type: ignore[arg-type]
        self._builder = builder

    def received(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros((1, 1, hi - lo, 1), dtype=np.float32)
        return empty, empty

    def run(self, fn: Any) -> tuple[float, float]:
        t0 = self._clock
        fn()
        self._clock = t0 + self._builder.costs.pop()
        return t0, self._clock


def modelled_race(prep: dict, hedged: bool, slow: float, link_factor: float) -> RaceResult:
    """One race of a prepared plan (see :func:`prepare`) on the modelled clock."""
    plan, manifest = prep["plans"][hedged]
    speed: ComputeSpeed = prep["speed"]
    ids = prep["context_ids"]
    b = ModelledBuilder(ids, speed, slow)
    view = LinkView(plan.expect_at, plan.range_bytes, prep["deadlines"][hedged],
                    rank=stream_rank(manifest))  # fmt: skip
    src = ModelledArrivals(plan.expect_at * link_factor, view, b)
    return race(None, ids, src, split=plan.first_call, speed=speed,
                block_tokens=manifest.geometry.block_tokens, builder=b)  # fmt: skip


def prepare(loaded: Any, tokens: int, seed: int, rate_mbps: float, speed: ComputeSpeed) -> dict:
    """The seed's context card and the demo's plans for it, with and without the hedge."""
    from kvtransport.demo.demo_model import link_profile, plan_stream, prepare_card
    from kvtransport.demo.demo_report import DEFAULT_BUDGET, DEFAULT_OBJECTIVE, DemoConfig
    from kvtransport.model import tasks
    from kvtransport.model.plan import DEFAULT_HEDGE_SHARE, DEFAULT_LEVELS

    sample = tasks.generate(DemoConfig.task, loaded.tokenizer, target_tokens=tokens, seed=seed)
    ctx, question = sample.prompt(loaded.tokenizer)
    stream, _, _ = prepare_card(loaded, sample, ctx, None)
    budget_s = DEFAULT_BUDGET * (speed.seconds(len(ctx)) + speed.seconds(len(question)))
    plans, deadlines = {}, {}
    for hedged in (True, False):
        plan, planned, link_budget = plan_stream(
            stream, ctx, link_profile(rate_mbps), speed, budget_s, len(question),
            DEFAULT_LEVELS, DEFAULT_OBJECTIVE, hedge=DEFAULT_HEDGE_SHARE if hedged else 0.0,
        )  # fmt: skip
        plans[hedged] = (plan, planned.manifest)
        deadlines[hedged] = max(link_budget, plan.finish_s, plan.send_s)  # as the demo's
    return {"context_ids": ctx, "speed": speed, "plans": plans, "deadlines": deadlines}


def run(preps: list[dict], slows: list[float], links: list[float]) -> dict:
    cells = []
    for link_factor in links:
        for slow in slows:
            rows = []
            for prep in preps:
                on, off = (modelled_race(prep, h, slow, link_factor) for h in (True, False))
                p = prep["plans"][True][0]
                rows.append({"split": p.split, "hedge": p.hedge,
                             "hedged_s": on.seconds, "bare_s": off.seconds,
                             "hedged_calls": sum(s.action == "compute" for s in on.steps),
                             "hedge_loaded": _loaded_in(on, p.first_call, p.split)})  # fmt: skip
            cells.append({"link": link_factor, "slow": slow, "seeds": rows})
    return {"cells": cells}


def _loaded_in(res: RaceResult, lo: int, hi: int) -> int:
    """Tokens of ``[lo, hi)`` that the race loaded rather than computed."""
    return sum(max(0, min(s.start + s.tokens, hi) - max(s.start, lo))
               for s in res.steps if s.action == "load")  # fmt: skip


def render(doc: dict) -> str:
    p = doc["params"]
    lines = [
        f"{p['tokens']} tokens, {p['rate_mbps']:g} Mbit/s ge-heavy as planned, receiver "
        f"believes {p['per_call_ms']:g} ms per call + {p['per_token_ms']:g} ms per token; seeds "
        f"{p['seeds'][0]}-{p['seeds'][-1]}; modelled clock (the real race loop, no model); "
        "race time = the cache complete, from the transfer's start",
        "",
        "| link's time / planned | receiver's compute time / what it believes | "
        "race with hedge (s, median) | "
        "without (s) | hedged / bare, per seed: median [min, max] | hedge tokens loaded "
        "(mean of the hedge) |",
        "|---|---|---|---|---|---|",
    ]
    for c in doc["cells"]:
        rs = c["seeds"]
        ratio = [r["hedged_s"] / r["bare_s"] for r in rs]
        loaded = statistics.mean(r["hedge_loaded"] for r in rs)
        hedge = statistics.mean(r["hedge"] for r in rs)
        lines.append(
            f"| {c['link']:g} | {c['slow']:g} | "
            f"{statistics.median(r['hedged_s'] for r in rs):.3f} | "
            f"{statistics.median(r['bare_s'] for r in rs):.3f} | "
            f"{statistics.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}] | "
            f"{loaded:.0f} of {hedge:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="context tokens (default 2048)")
    ap.add_argument("--rate-mbps", type=float, default=100.0, help="the link (default 100)")
    ap.add_argument("--seeds", default="1-4", help="e.g. 1-4 or 1,3")
    ap.add_argument("--compute-speed", default="65,2.9", metavar="CALL_MS,TOKEN_MS",
                    help="what the receiver believes (default 65,2.9: this host idle)")  # fmt: skip
    ap.add_argument("--slow", default="0.8,1,1.1,1.25,1.5",
                    help="the receiver's real compute time over what it believes")  # fmt: skip
    ap.add_argument("--link", default="1,0.9", help="the link's real times over the planned")
    ap.add_argument("--out", default="results/eval_hedge")
    args = ap.parse_args(argv)
    try:
        a, _, b = args.seeds.partition("-")
        seeds = list(range(int(a), int(b) + 1)) if b else [int(x) for x in args.seeds.split(",")]
        slows, links = _floats(args.slow), _floats(args.link)
        call_ms, token_ms = _floats(args.compute_speed)
    except ValueError:
        ap.error("--seeds, --slow, --link and --compute-speed take numbers (see --help)")
    if not (slows and links and all(x > 0 for x in [*slows, *links, token_ms]) and call_ms >= 0):
        ap.error("--slow, --link and the compute speed must be positive")
    if not 64 <= args.tokens <= 8192:
        ap.error(f"--tokens must be in 64..8192, not {args.tokens}")
    from kvtransport.model.loader import load_model

    loaded = load_model(threads=1)
    speed = ComputeSpeed(call_ms / 1e3, token_ms / 1e3)
    preps = []
    for seed in seeds:
        print(f"seed {seed}: card and plans ...", file=sys.stderr, flush=True)
        preps.append(prepare(loaded, args.tokens, seed, args.rate_mbps, speed))
    doc = run(preps, slows, links)
    doc["params"] = {"tokens": args.tokens, "rate_mbps": args.rate_mbps, "seeds": seeds,
                     "per_call_ms": call_ms, "per_token_ms": token_ms}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hedge.json").write_text(json.dumps(doc, indent=1))
    (out / "hedge.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
