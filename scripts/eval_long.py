"""Long contexts and a mismeasured speed: the demo's handoff at 4K-32K tokens, and a plan
made on a wrong compute speed, on this CPU.

Each run is the demo (kvtransport.demo.run: the emulated link, ge-heavy at --rate-mbps,
the adaptive scheme, the fiction_qa task) in a process of its own, so that its peak
memory (ru_maxrss: the model, the card, the receiver's cache and the demo's copies) is its
own. Per run: the TTFT speed-up over re-prefilling, the answers equal to the full cache's,
the peak memory, the receiver's stated need (kvtransport.model.model_cache.receiver_bytes),
the card's size and the plan's time. Runs are interleaved (every size of one seed, then the
next seed) and the load average is printed with each, as the host may be shared.

``--mis-speed FACTOR`` instead plans on a speed FACTOR times slower than measured with a
per-pair cost of 79 us (what two torch threads measured on a loaded 2-core host) and
compares it with the plan on the measured speed, in the same process, ``--rounds`` rounds
interleaved. ``--mis-spread`` gives the wrong speed the spread its measured rounds would
show (a comma list runs one plan per spread): above kvtransport.model.cache_builder's
TRUST_LIMIT the speed is not trusted and the planner prices it conservatively
(kvtransport.model.plan.robust_speed); 0 plans on it as if it were trusted (the plan
before that rule). Each plan's line breaks its TTFT down: the split and its planned
compute time, the planned link time and answer, the bytes and the precision mix, and what
the race did (tokens computed and loaded, race and transfer seconds). ``--python`` runs it
with another checkout's interpreter (a baseline).

    .venv/bin/python scripts/eval_long.py --tokens 4096,8000 --seeds 1-4 --out results/long
    .venv/bin/python scripts/eval_long.py --tokens 2048,8000 --mis-speed 10 --mis-spread 0,1
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np


def loadavg() -> str:
    """The first three fields of /proc/loadavg."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _row(report: Any, label: str = "adaptive") -> dict[str, Any]:
    row = next(r for r in report.schemes if r.label == label)
    return {"ttft_s": row.ttft_s, "speedup": row.speedup, "matches": row.matches,
            "questions": len(report.questions) or None, "computed": row.computed_tokens,
            "loaded": row.loaded_tokens, "recomputed": row.recomputed_tokens,
            "race_s": row.race_s, "transfer_s": row.transfer_s, "error": row.error,
            "note": row.note}  # fmt: skip


BREAKDOWN = ("split_tokens", "planned_compute_s", "planned_link_s", "planned_answer_s",
             "payload_bytes", "blocks")  # fmt: skip
"""The plan's fields each mismeasured-speed line prints (kvtransport.demo.run's plan)."""


def breakdown(run: dict[str, Any]) -> dict[str, Any]:
    """One plan's TTFT broken down: what was planned (split, compute, link, answer, bytes,
    precision mix) next to what the race did (TTFT, tokens computed and loaded, race and
    transfer seconds) and the answers."""
    plan = run["plan"]
    out = {k: plan.get(k) for k in BREAKDOWN}
    out.update({k: run.get(k) for k in ("ttft_s", "computed", "loaded", "recomputed",
                                        "race_s", "transfer_s", "matches", "load")})  # fmt: skip
    return out


def mis_speeds(s: Any, factor: float, spreads: list[float]) -> list[tuple[str, tuple[float, ...]]]:
    """The plans compared: the measured speed ``s``, then per spread the speed ``factor``
    times slower with a 79 us per-pair cost and that spread (``mis0``, ``mis1``, ...)."""
    out: list[tuple[str, tuple[float, ...]]] = [
        ("measured", (s.per_call_s, s.per_token_s, s.per_pair_s))
    ]
    for spread in spreads:
        wrong = (s.per_call_s * factor, s.per_token_s * factor, 79e-6)
        out.append((f"mis{spread:g}", (*wrong, spread) if spread else wrong))
    return out


def one(tokens: int, seed: int, rate: float, card_dir: str, mis: float | None,
        spreads: list[float] | None = None, rounds: int = 1, questions: int | None = None,
        max_new_tokens: int | None = None, loaded: Any = None) -> dict:  # fmt: skip
    """One demo run (this process); with ``mis``: instead the plan on the measured speed
    and on each mismeasured one (:func:`mis_speeds`), ``rounds`` rounds interleaved.
    questions / max_new_tokens: the demo's (None: its defaults); loaded: the model
    (kvtransport.model.loader.load_model's; None: loaded here, one thread)."""
    from kvtransport.demo.demo_report import DemoConfig
    from kvtransport.demo.run import run_demo
    from kvtransport.model.cache_builder import ComputeSpeed
    from kvtransport.model.loader import load_model

    loaded = loaded if loaded is not None else load_model(threads=1)
    small = {k: v for k, v in (("questions", questions), ("max_new_tokens", max_new_tokens))
             if v is not None}  # fmt: skip
    cfg = DemoConfig(tokens=tokens, seed=seed, rate_mbps=rate, schemes=("adaptive",),
                     link="emulated", progress=False, repeats=1,
                     card_dir=Path(card_dir), **small)  # fmt: skip
    out: dict[str, Any] = {"tokens": tokens, "seed": seed, "load_before": loadavg()}
    if mis is None:
        report = run_demo(cfg, loaded)
        out.update(_row(report), context_tokens=report.cache["context_tokens"],
                   reprefill_s=report.reprefill.get("ttft_s"),
                   plan_s=report.timings.get("plan"), card_bytes=report.cache["bytes"],
                   cache=report.cache, plan=report.plan)  # fmt: skip
        try:
            from kvtransport.model.model_cache import receiver_bytes

            out["receiver_bytes"] = receiver_bytes(loaded.model, report.cache["context_tokens"])
        except ImportError:  # a baseline without it
            out["receiver_bytes"] = None
    else:
        from kvtransport.model import tasks

        sample = tasks.generate(cfg.task, loaded.tokenizer, target_tokens=tokens, seed=seed)
        ids = sample.prompt(loaded.tokenizer)[0]
        s = ComputeSpeed.measure(loaded.model, ids)
        out["context_tokens"] = len(ids)
        out["speed"] = {"per_call_s": s.per_call_s, "per_token_s": s.per_token_s,
                        "per_pair_s": s.per_pair_s, "spread": s.spread}  # fmt: skip
        for r in range(rounds):
            for name, speed in mis_speeds(s, mis, spreads or [0.0]):
                rep = run_demo(replace(cfg, compute_speed=speed), loaded)
                run = {**_row(rep), "plan": rep.plan, "load": loadavg(),
                       "reprefill_s": rep.reprefill.get("ttft_s")}  # fmt: skip
                out.setdefault(name, []).append(run)
                print(
                    json.dumps({"round": r, "plan": name, **breakdown(run)}),
                    file=sys.stderr,
                    flush=True,
                )
        out["ratio"] = ttft_ratios(out)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["load_after"] = loadavg()
    return out


def ttft_ratios(out: dict[str, Any]) -> dict[str, float]:
    """Per mismeasured plan, the median over rounds of its TTFT over the measured plan's
    in the same round."""
    base = [r["ttft_s"] for r in out["measured"]]
    return {name: float(np.median([r["ttft_s"] / b for r, b in zip(runs, base, strict=True)]))
            for name, runs in out.items()
            if name.startswith("mis") and isinstance(runs, list)}  # fmt: skip


def _ints(text: str) -> list[int]:
    if "-" in text and "," not in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,8000", help="context sizes (default 4096,8000)")
    ap.add_argument("--seeds", default="1", help="e.g. 1-4 or 1,3 (default 1)")
    ap.add_argument("--rate-mbps", type=float, default=100.0)
    ap.add_argument(
        "--mis-speed",
        type=float,
        default=None,
        help="also plan on a speed this many times slower (79 us per pair)",
    )
    ap.add_argument("--mis-spread", default="1",
                    help="spreads of the mismeasured speed, comma list (default 1: not "
                         "trusted; 0: trusted)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (--mis-speed)")
    ap.add_argument("--questions", type=int, default=None, help="questions per run")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="answer length")
    ap.add_argument("--python", default=sys.executable, help="interpreter of each run")
    ap.add_argument("--card-dir", default="/tmp/kvt_eval_long_cards")
    ap.add_argument("--out", type=Path, default=None, help="write long.json here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        tokens, seed = (int(x) for x in args.one.split(":"))
        spreads = [float(x) for x in args.mis_spread.split(",")]
        print(
            json.dumps(
                one(
                    tokens,
                    seed,
                    args.rate_mbps,
                    args.card_dir,
                    args.mis_speed,
                    spreads,
                    args.rounds,
                    args.questions,
                    args.max_new_tokens,
                )
            )
        )
        return
    results = []
    for seed in _ints(args.seeds):
        for tokens in _ints(args.tokens):
            cmd = [args.python, __file__, "--one", f"{tokens}:{seed}", "--rate-mbps",
                   str(args.rate_mbps), "--card-dir", args.card_dir]  # fmt: skip
            if args.mis_speed is not None:
                cmd += ["--mis-speed", str(args.mis_speed), "--mis-spread", args.mis_spread,
                        "--rounds", str(args.rounds)]  # fmt: skip
            for opt in ("questions", "max_new_tokens"):
                if getattr(args, opt) is not None:
                    cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr: each plan
            if p.returncode:
                print(f"{tokens}:{seed} failed (exit {p.returncode})")
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            line = {k: r.get(k) for k in ("tokens", "seed", "context_tokens", "speedup",
                                            "matches", "questions", "ttft_s", "reprefill_s",
                                            "plan_s", "peak_rss_mib", "receiver_bytes",
                                            "card_bytes", "load_before", "load_after")}  # fmt: skip
            if "ratio" in r:
                line["ttft_over_measured"] = r["ratio"]
            print(json.dumps(line), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "long.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
