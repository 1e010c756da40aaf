"""Reproduce the PriorityFEC paper's results on this implementation, with one command.

Each figure is a PNG (--out, default docs/figures) plus a Markdown table and a JSON file of
every measurement (--data, default results/evaluate); each states the command, the seeds
and the machine (CPU model, cores, load average). Intervals are 95 % t-intervals over the
samples named in each table (episodes, prompts x channel seeds, or repeated runs).

  1  utility recovered before the deadline vs rho in {0.6, 0.8, 1.0, 1.2} on the 100 Mbit/s
     Gilbert-Elliott burst-loss link (ge-heavy), every scheme (the paper's Fig. 5): none,
     fixed-rate RLC 4/32, block Reed-Solomon 4/32, ARQ, the adaptive heuristic, the shipped
     DDQN, the clairvoyant oracle, and the session's tail rule alone with reactive repair
     (action 0 throughout: what the DDQN reduces to where it always picks action 0).
     Held-out episodes of scripts/eval_policy.py (kvtransport.agents.episodes.eval_spec:
     block utilities measured from the real model on held-out contexts), same episodes
     for every scheme.
  2  end-to-end token F1 against the gold answer vs rho, on facts QA and on the RULER-style
     needle tasks, every scheme, with the clean full-cache reference line (Fig. 6). Real
     model: each prompt is prefilled once; its fp16 block stream crosses the simulator
     (the real sessions over ge-heavy) per scheme, rho and channel seed, is rebuilt
     (decode_stream), injected with missing blocks masked per layer, and answered.
  3  ablation on ge-heavy (Fig. 7): utility order vs position order, each without FEC and
     with the shipped DDQN's adaptive streaming RLC; teacher-forced top-1 agreement with
     the full cache's answer, and F1 against the gold answer. Same prompts and channel
     seeds as figure 2.
  4  online overhead per 1000 packets (Table II): state/feedback handling, policy,
     encoding, decoding (scripts/bench_transport.py's per-packet split, scripts/
     bench_policy.py's in-situ DDQN decisions; several runs of each), and the control
     latency's mean and p99.
  5  TTFT: handoff (link time until the deadline or completion + rebuild + injection +
     first token) at rho 1.0 and 0.8, fp16 and int8 blocks, vs re-prefill (prefill +
     first token), for 512 to 4K context tokens, on ge-heavy with the shipped DDQN.
  6  multi-user: scripts/eval_multiuser.py's result, when that script exists ("pending"
     until then).

--small runs a fast version of everything (the test suite's); --only picks figures.

    .venv/bin/python scripts/evaluate.py                 # everything, ~30 min on 2 cores
    .venv/bin/python scripts/evaluate.py --only 1,4      # a subset
    .venv/bin/python scripts/evaluate.py --small --out /tmp/ev --data /tmp/ev
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _eval_common as ec  # noqa: E402
import _eval_model  # noqa: E402
import _eval_transport  # noqa: E402

RUNNERS = {
    1: _eval_transport.figure1,
    2: _eval_model.figure2,
    3: _eval_model.figure3,
    4: _eval_transport.figure4,
    5: _eval_model.figure5,
    6: _eval_transport.figure6,
}


def parse_only(text: str | None) -> list[int]:
    """'1,3' -> [1, 3]; None -> every figure. A bad list exits with one line."""
    if not text:
        return sorted(RUNNERS)
    try:
        picked = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--only takes figure numbers like 1,3 (1..6), not {text!r}") from None
    if not picked or any(n not in RUNNERS for n in picked):
        raise SystemExit(f"--only: the figures are 1..6, not {text!r}")
    return picked


def headline(records: dict[int, dict[str, Any]]) -> list[str]:
    """One or two lines per figure for the terminal."""
    out = []
    if r := records.get(1):
        rho = "0.8" if "0.8" in r["summary"] else next(iter(r["summary"]))
        cells = ", ".join(f"{ec.LABELS[n]} {v['mean']:.3f}" for n, v in r["summary"][rho].items())
        out.append(f"fig 1, utility at rho {rho}: {cells}")
    if r := records.get(2):
        for fam, fs in r["summary"].items():
            ddqn = ", ".join(
                f"rho {k[5:]}: {v['f1']['mean']:.3f}"
                for k, v in fs.items()
                if k.startswith("ddqn@")
            )
            out.append(
                f"fig 2, {fam} F1: full cache {fs['full_cache']['f1']['mean']:.3f}; DDQN {ddqn}"
            )
    if r := records.get(3):
        out.append(
            "fig 3, top-1 utility minus position order: "
            + ", ".join(f"{k} {v['top1']['mean']:+.3f}" for k, v in r["paired"].items())
        )
    if (r := records.get(4)) and r["stages_ms_per_1000_packets"]:
        t = r["stages_ms_per_1000_packets"]["total"]["mean"]
        lat = r["control_latency_us"]
        out.append(
            f"fig 4: {t:.2f} ms per 1000 packets (published ~30); DDQN decision "
            f"{lat['decision_cpu.mean_us']['mean']:.1f} us mean, "
            f"{lat['decision_cpu.p99_us']['mean']:.1f} us p99 CPU (published 76 / 94)"
        )
    if r := records.get(5):
        for row in r["rows"]:
            out.append(
                f"fig 5, {row['context_tokens']} tokens: re-prefill "
                f"{1e3 * row['reprefill']['mean']:.0f} ms; handoff "
                + ", ".join(
                    f"{k} {1e3 * h['ttft']['mean']:.0f} ms" for k, h in row["handoff"].items()
                )
            )
    if r := records.get(6):
        out.append(f"fig 6: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--small", action="store_true", help="a fast version (the test suite's)")
    p.add_argument("--only", metavar="N[,M]", help="figures to run (default: all, 1..6)")
    p.add_argument("--out", default="docs/figures", help="PNG directory (default docs/figures)")
    p.add_argument(
        "--data",
        default="results/evaluate",
        help="JSON and Markdown directory (default results/evaluate)",
    )
    p.add_argument("--seed", type=int, default=1, help="base channel seed (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    figures = parse_only(args.only)
    if args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    run = ec.Run(
        settings=ec.Settings.small() if args.small else ec.Settings.full(),
        out=Path(args.out),
        data=Path(args.data),
        command=shlex.join([".venv/bin/python", "scripts/evaluate.py", *argv]),
        seed=args.seed,
        threads=args.threads,
        progress=not args.quiet,
    )
    t0 = time.perf_counter()
    records = {}
    for n in run.bar(figures, desc="figures", unit="figure"):
        records[n] = RUNNERS[n](run)
    index = {
        "command": run.command,
        "figures": figures,
        "wall_s": time.perf_counter() - t0,
        "figure_wall_s": {n: r["wall_s"] for n, r in records.items()},
        "machine": ec.machine(),
    }
    run.data.mkdir(parents=True, exist_ok=True)
    (run.data / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    for line in headline(records):
        print(line)
    print(
        f"wrote figures {','.join(map(str, figures))}: PNGs in {run.out}, tables and JSON in "
        f"{run.data} ({index['wall_s']:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
