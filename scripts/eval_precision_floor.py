"""What the plan's fidelity floor (kvtransport.model.plan.DEFAULT_MIN_FIDELITY) trades: link time
against answers equal to the full cache's.

For each context size and seed of the demo's task, the handoff is planned (objective
``ttft``, the demo's link profile, a fixed receiver compute speed so that every plan is
the same on every host) with fp16/int8 only and with int4 allowed down to each floor. The
planned stream is decoded, the receiver's prefix filled in exactly (as its own compute
gives it), and the demo's questions answered; an answer counts when it equals the full
cache's. Only the answers depend on the model; no timing is measured (the planned finish
is the plan's own estimate), so the host's load does not matter.

Writes floor.json and floor.md into --out (default results/eval_precision_floor).

    .venv/bin/python scripts/eval_precision_floor.py
    .venv/bin/python scripts/eval_precision_floor.py --tokens 512 --seeds 1-2 --floors 0.999
    # int4 as it was before 2026-12-06 (keys per token, planned at fidelity 0.98)
    .venv/bin/python scripts/eval_precision_floor.py --int4-keys token --int4-fidelity 0.98
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from kvtransport.eval.args import parse_seeds

SPEED = (0.07, 0.0031)  # seconds per call, per token: the demo host's measured speed


def evaluate(
    loaded,
    tokens: int,
    seeds: list[int],
    floors: list[float],
    int8_group: int | None = None,
    int4_keys: str = "channel",
    int4_fidelity: float | None = None,
) -> dict:
    """Per seed and setting: int4 share of the sent blocks, planned finish, answers equal.
    int8_group / int4_keys: the int8 quantization group and int4's key layout the plan
    sends (None / channel: the product's; kvtransport.kvformat.blocks.Geometry.of);
    int4_fidelity: int4's fidelity the plan assumes (None: DEFAULT_FIDELITY's)."""
    from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE
    from kvtransport.demo.demo_model import answer, link_profile, prepare_card
    from kvtransport.demo.demo_report import (
        DEFAULT_BUDGET,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_QUESTIONS,
    )
    from kvtransport.kvformat import blocks
    from kvtransport.model import tasks
    from kvtransport.model.cache_builder import ComputeSpeed
    from kvtransport.model.plan import LinkEstimate, planned_stream

    prof = link_profile(None)
    link = LinkEstimate(prof.rate_bps, float(prof.stationary_loss()), prof.delay_ms / 1e3,
                        DEFAULT_SYMBOL_SIZE)  # fmt: skip
    speed = ComputeSpeed(*SPEED)
    fidelity = dict(blocks.DEFAULT_FIDELITY)
    if int4_fidelity is not None:
        fidelity["int4"] = int4_fidelity
    settings = [("fp16,int8", ("fp16", "int8"), 0.0)]
    settings += [(f"int4 to {f:g}", ("fp16", "int8", "int4"), f) for f in floors]
    tok = loaded.tokenizer
    runs = []
    for seed in seeds:
        sample = tasks.generate("fiction_qa", tok, target_tokens=tokens, seed=seed)
        ctx, q = sample.prompt(tok)
        qs = [q] + [p.prompt(tok)[1] for p in tasks.question_set(sample, DEFAULT_QUESTIONS)[1:]]
        stream, _, _ = prepare_card(loaded, sample, ctx, None)
        ids = np.asarray(ctx)
        full = blocks.decode_stream(stream.manifest, stream.payload, token_ids=ids).cache
        ref = [answer(loaded, full, None, x, DEFAULT_MAX_NEW_TOKENS)[0] for x in qs]
        budget = DEFAULT_BUDGET * speed.seconds(len(ctx))
        row = {"seed": seed, "tokens": len(ctx), "settings": {}}
        for name, levels, floor in settings:
            plan, planned = planned_stream(stream, link=link, budget_s=budget, speed=speed,
                                           levels=levels, token_ids=ids, objective="ttft",
                                           min_fidelity=floor, fidelity=fidelity,
                                           int8_group_size=int8_group,
                                           int4_keys=int4_keys)  # fmt: skip
            kv = blocks.decode_stream(planned.manifest, planned.payload, token_ids=ids).cache
            kv.keys[:, :, : plan.split] = full.keys[:, :, : plan.split]
            kv.values[:, :, : plan.split] = full.values[:, :, : plan.split]
            got = [answer(loaded, kv, None, x, DEFAULT_MAX_NEW_TOKENS)[0] for x in qs]
            sent = plan.precision >= 0
            row["settings"][name] = {
                "equal": sum(a == b for a, b in zip(got, ref, strict=True)),
                "questions": len(qs),
                "int4_share": float((plan.precision == 3)[sent].mean()),
                "finish_s": plan.finish_s,
                "split": plan.split,
            }
        runs.append(row)
        print(f"{tokens} tok seed {seed}: " + ", ".join(
            f"{k} {v['equal']}/{v['questions']} ({v['finish_s'] * 1e3:.0f} ms)"
            for k, v in row["settings"].items()), file=sys.stderr, flush=True)  # fmt: skip
    return {"tokens": tokens, "seeds": seeds, "runs": runs, "int8_group": int8_group,
            "int4_keys": int4_keys, "int4_fidelity": fidelity["int4"]}  # fmt: skip


def render(docs: list[dict]) -> str:
    head = docs[0] if docs else {}
    group = head.get("int8_group")
    lines = [
        "Plan objective ttft, demo link (ge-heavy, 100 Mbit/s), receiver compute fixed at "
        f"{SPEED[0] * 1e3:g} ms + {SPEED[1] * 1e3:g} ms/token; int8 quantized in groups of "
        f"{'one head vector' if group is None else f'{group} values'}; int4 keys per "
        f"{head.get('int4_keys', 'token')}, planned at fidelity {head.get('int4_fidelity', 0.98)}"
        "; answers = equal to the full cache's, summed over seeds",
        "",
        "| context | blocks sent as | int4 share of sent blocks | planned in place (mean) "
        "| answers = full cache: sum, worst seed |",
        "|---|---|---|---|---|",
    ]
    for d in docs:
        names = list(d["runs"][0]["settings"])
        for name in names:
            rs = [r["settings"][name] for r in d["runs"]]
            tok = statistics.mean(r["tokens"] for r in d["runs"])
            lines.append(
                f"| {tok:.0f} tok | {name} | {statistics.mean(r['int4_share'] for r in rs):.0%} "
                f"| {statistics.mean(r['finish_s'] for r in rs) * 1e3:.0f} ms "
                f"| {sum(r['equal'] for r in rs)}/{sum(r['questions'] for r in rs)}, "
                f"{min(r['equal'] for r in rs)}/{rs[0]['questions']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="512,2048", help="context sizes (default 512,2048)")
    p.add_argument("--seeds", default="1-8", help="e.g. 1-8 or 1,3 (2048 uses the first 4)")
    p.add_argument("--floors", default="0.999,0.998,0.997", help="fidelity floors to compare")
    p.add_argument("--int8-group", type=int, default=None, metavar="N",
                   help="int8 quantization group in values (default: one per head vector, "
                   "as the product sends; 32: the group before)")  # fmt: skip
    p.add_argument("--int4-keys", choices=("channel", "token"), default="channel",
                   help="int4's key layout (default: per channel, as the product sends; "
                   "token: the layout before)")  # fmt: skip
    p.add_argument("--int4-fidelity", type=float, default=None, metavar="F",
                   help="int4's fidelity the plan assumes (default: the product's "
                   "calibration; 0.98: the one before)")  # fmt: skip
    p.add_argument("--out", default="results/eval_precision_floor")
    args = p.parse_args(argv)
    try:
        sizes = [int(t) for t in args.tokens.split(",")]
        floors = [float(f) for f in args.floors.split(",")]
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        p.error(f"cannot read the lists: {exc}")
    if args.int8_group is not None and (args.int8_group < 2 or args.int8_group % 2):
        p.error(f"--int8-group must be an even divisor of head_dim, not {args.int8_group}")
    if args.int4_fidelity is not None and not 0.0 < args.int4_fidelity <= 1.0:
        p.error(f"--int4-fidelity must be in (0, 1], not {args.int4_fidelity}")
    import torch

    from kvtransport.model.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model(threads=1)
    docs = [evaluate(loaded, n, seeds if n <= 1024 else seeds[:4], floors, args.int8_group,
                     args.int4_keys, args.int4_fidelity) for n in sizes]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps(docs, indent=1))
    (out / "floor.md").write_text(render(docs))
    print(render(docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
