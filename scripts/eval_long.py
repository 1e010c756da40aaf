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
compares it with the plan on the measured speed, in the same process, rounds interleaved;
``--python`` runs it with another checkout's interpreter (a baseline).

    .venv/bin/python scripts/eval_long.py --tokens 4096,8000 --seeds 1-4 --out results/long
    .venv/bin/python scripts/eval_long.py --tokens 2048 --mis-speed 10 --seeds 1,2
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


def loadavg() -> str:
    """The first three fields of /proc/loadavg."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _row(report: Any, label: str = "adaptive") -> dict[str, Any]:
    row = next(r for r in report.schemes if r.label == label)
    return {"ttft_s": row.ttft_s, "speedup": row.speedup, "matches": row.matches,
            "questions": len(report.questions) or None, "computed": row.computed_tokens,
            "loaded": row.loaded_tokens, "error": row.error, "note": row.note}  # fmt: skip


def one(tokens: int, seed: int, rate: float, card_dir: str, mis: float | None) -> dict:
    """One demo run (this process); with ``mis``: the plan on a mismeasured speed too."""
    from kvtransport.demo.demo_report import DemoConfig
    from kvtransport.demo.run import run_demo
    from kvtransport.model.cache_builder import ComputeSpeed
    from kvtransport.model.loader import load_model

    loaded = load_model(threads=1)
    cfg = DemoConfig(tokens=tokens, seed=seed, rate_mbps=rate, schemes=("adaptive",),
                     link="emulated", progress=False, repeats=1,
                     card_dir=Path(card_dir))  # fmt: skip
    out: dict[str, Any] = {"tokens": tokens, "seed": seed, "load_before": loadavg()}
    report = run_demo(cfg, loaded)
    out.update(_row(report), context_tokens=report.cache["context_tokens"],
               reprefill_s=report.reprefill.get("ttft_s"), plan_s=report.timings.get("plan"),
               card_bytes=report.cache["bytes"],
               cache=report.cache, plan=report.plan)  # fmt: skip
    try:
        from kvtransport.model.model_cache import receiver_bytes

        out["receiver_bytes"] = receiver_bytes(loaded.model, report.cache["context_tokens"])
    except ImportError:  # a baseline without it
        out["receiver_bytes"] = None
    if mis is not None:
        s = ComputeSpeed.measure(loaded.model, list(range(100, 100 + min(tokens, 1024))))
        wrong = (s.per_call_s * mis, s.per_token_s * mis, 79e-6)
        for name, speed in (("measured", (s.per_call_s, s.per_token_s, s.per_pair_s)),
                            ("mismeasured", wrong)):  # fmt: skip
            r = run_demo(replace(cfg, compute_speed=speed), loaded)
            out[name] = {**_row(r), "plan": r.plan, "load": loadavg()}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["load_after"] = loadavg()
    return out


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
    ap.add_argument("--python", default=sys.executable, help="interpreter of each run")
    ap.add_argument("--card-dir", default="/tmp/kvt_eval_long_cards")
    ap.add_argument("--out", type=Path, default=None, help="write long.json here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        tokens, seed = (int(x) for x in args.one.split(":"))
        print(json.dumps(one(tokens, seed, args.rate_mbps, args.card_dir, args.mis_speed)))
        return
    results = []
    for seed in _ints(args.seeds):
        for tokens in _ints(args.tokens):
            cmd = [args.python, __file__, "--one", f"{tokens}:{seed}", "--rate-mbps",
                   str(args.rate_mbps), "--card-dir", args.card_dir]  # fmt: skip
            if args.mis_speed is not None:
                cmd += ["--mis-speed", str(args.mis_speed)]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                print(f"{tokens}:{seed} failed: {p.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            line = {k: r.get(k) for k in ("tokens", "seed", "context_tokens", "speedup",
                                            "matches", "questions", "ttft_s", "reprefill_s",
                                            "plan_s", "peak_rss_mib", "receiver_bytes",
                                            "card_bytes", "load_before", "load_after")}  # fmt: skip
            for k in ("measured", "mismeasured"):
                if k in r:
                    line[k] = {x: r[k][x] for x in ("ttft_s", "speedup", "matches", "load")}
            print(json.dumps(line), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "long.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
