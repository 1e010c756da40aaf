"""`kvtransport demo`: the README's main command (the logic lives in kvtransport.demo.run)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtransport.bounds import int_arg
from kvtransport.commands import _common

NAME = "demo"
HELP = "hand a real model's KV cache across a burst-loss link: five repair schemes side by side"
DESCRIPTION = """\
One handoff, end to end, against re-prefilling. The real model (SmolLM2-135M-Instruct)
prefills the context of a seeded task once; its KV cache becomes a cache card (kept in
$KVT_CACHE/demo, default ~/.cache/kvtransport/demo, so the next run skips that prefill).

The receiver must answer within a TTFT budget (--budget, a share of its own estimate of
re-prefilling the context; it measures its compute speed first). The plan
(kvtransport.model.plan) splits the work: the receiver computes the first tokens of the context
itself while the rest crosses the link as int8 blocks (fp16 for the most useful ones where
the link would otherwise idle while the receiver computes), token ranges front first; the
split is the one that answers soonest, so the budget is a cap (--objective fidelity
spends it on fp16 instead). The link is ge-heavy (100 Mbit/s or
--rate-mbps, 5 ms, Gilbert-Elliott bursts, about 12% loss, both ways); the stream crosses
once per repair scheme:

  no FEC, block RS 4/32 (Reed-Solomon), RLC 4/32 (fixed-rate sliding-window code),
  adaptive (heuristic on feedback), DDQN (the shipped Double-DQN repair policy)
  and, on --link netns, the same bytes over TCP (cubic and bbr) through the same link

For each, the receiver races (kvtransport.model.race): it loads token ranges as they arrive,
waits for one due any moment, and computes (exactly, at their own positions) what has
not arrived, so it always answers from the whole cache; "link down" is the receiver
alone (nothing arrives): the fallback. It answers --questions questions about the
context; the table shows per scheme the utility in place at the deadline, the blocks
missing, the tokens the receiver computed, the answers against the full cache's, and
the time to first token against re-prefilling measured in the same run. The "no cache"
row is the floor: the question alone (the default task's facts are invented, so the
model cannot know them; with --task facts_qa it knows some capitals anyway).

Links (--link):
  netns     the real sender-daemon and receiver-daemon in two network namespaces of the
            netem testbed, at real-time priority (needs root). Real time: the table
            differs a little from run to run.
  emulated  the daemons' sender and receiver hosts in two processes joined by the userspace
            channel of the same profile, on the link's own clock: the same --seed gives
            the same table run after run (apart from measured compute times), as any
            user.
  auto      netns when run as root, else emulated (with a note). Default.

--quick uses a 128-token context, shorter answers and a budget of 0.6 (at 128 tokens the
question's own forward pass is a large share of re-prefilling). Progress bars
go to stderr when it is a terminal; --json prints one JSON object instead of the table.

A shared host: every TTFT is measured in --rounds interleaved rounds (default 3:
re-prefill, then each row, then again), and the table shows medians, each speed-up the
median of the rounds' ratios. The "host" line gives the 1-minute load average and warns
when other work wanted more cores than the demo leaves free (the cores less its
--threads), as timings then stretch unevenly. A host too slow for the plan does not stop
the demo: the netns link measures its round trip with warm daemons and plans with it, and
a transfer whose deadline still leaves no time to send crosses nothing (the receiver
computes every token; a note under the table says so).

examples:
  kvtransport demo
  kvtransport demo --quick --link emulated --seed 7
  kvtransport demo --task niah_single --tokens 1024 --json > demo.json
  kvtransport demo --quick --model ~/models/Qwen2.5-0.5B-Instruct   # your own model
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller context, shorter answers")
    _common.add_model(parser)
    parser.add_argument(
        "--link",
        choices=("auto", "netns", "emulated"),
        default="auto",
        help="where the cache crosses (default auto: netns as root, else emulated)",
    )
    parser.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=1, help="task and link seed (default 1)"
    )
    from kvtransport.model.tasks import TASK_NAMES

    parser.add_argument(
        "--task",
        default="fiction_qa",
        choices=TASK_NAMES,
        help="the context and question (default fiction_qa: facts about an invented world)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="N",
        help="context size in tokens, up to the model's positions (8192 for SmolLM2) "
        "and the memory available (default 512; 128 with --quick)",
    )
    parser.add_argument(
        "--budget", type=float, default=None, metavar="SHARE",
        help="TTFT budget as a share of the receiver's re-prefill estimate (default 0.3)",
    )  # fmt: skip
    parser.add_argument(
        "--rate-mbps", type=float, default=None, metavar="R",
        help="link rate in Mbit/s (default: the ge-heavy profile's 100)",
    )  # fmt: skip
    parser.add_argument(
        "--compute-speed", default=None, metavar="CALL_MS,TOKEN_MS[,PAIR_US]",
        help="the receiver's compute cost for the plan instead of measuring it: per call, "
        "per token, and per question token and context token (the question's attention; "
        "default 0). A fixed plan makes --link emulated repeat exactly",
    )  # fmt: skip
    parser.add_argument(
        "--precision", default=None, metavar="LIST",
        help="precisions the plan may send, best first (default fp16,int8,int4: int4 only "
        "for the least useful blocks, as far as an expected fidelity of 0.999 allows; e.g. "
        "fp32, fp16,int8 or, with keys int8 and values int4 between int8 and int4, "
        "fp16,int8,k8v4,int4; int8r is int8 entropy-coded, the same values in fewer bytes)",
    )  # fmt: skip
    parser.add_argument(
        "--objective", choices=("ttft", "fidelity"), default=None,
        help="ttft (default): the plan answers as soon as it can, the budget is a cap; "
        "fidelity: the plan spends the budget on precision (more fp16)",
    )  # fmt: skip
    parser.add_argument(
        "--order", choices=("position", "back"), default=None,
        help="the stream's token ranges front first (position, the default) or the last "
        "first (back: the link fills the cache from the end while the receiver computes "
        "from the front)",
    )  # fmt: skip
    parser.add_argument(
        "--hedge", type=float, default=None, metavar="SHARE",
        help="the share of the receiver's planned prefix the sender also sends, last first, "
        "in case the receiver computes slower than it measured (default 0.25; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--no-tail", action="store_true",
        help="send every token range whole (no layer-by-layer tail): the receiver answers "
        "once the whole cache is in place instead of while the context's last ranges arrive",
    )  # fmt: skip
    parser.add_argument(
        "--link-rate-mbps", type=float, default=None, metavar="MBPS",
        help="the rate the link really carries when the plan assumes another (--rate-mbps): "
        "a link worse than planned",
    )  # fmt: skip
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for prefill and decoding (1)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int_arg(1, 1 << 16), default=None, metavar="N",
        help="answer length cap (default 24; 12 with --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--questions", type=int, default=None, metavar="K",
        help="questions asked of each received cache (default 5; fewer if the context "
        "states fewer facts)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", "--repeats", dest="repeats", type=int, default=None, metavar="N",
        help="measure every TTFT in N interleaved rounds (re-prefill, then each row, per "
        "round) and report medians (default 3; answers are computed once)",
    )  # fmt: skip
    parser.add_argument(
        "--no-card-cache",
        action="store_true",
        help="always prefill; do not read or write cards in the cache directory",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtransport.demo.run import (
        DemoConfig,
        default_card_dir,
        render_table,
        report_json,
        run_demo,
    )

    base = DemoConfig.quick() if args.quick else DemoConfig()
    overrides = {
        "task": args.task,
        "seed": args.seed,
        "link": args.link,
        "threads": args.threads,
        "card_dir": None if args.no_card_cache else Path(default_card_dir()),
        "progress": True,
    }
    if args.tokens is not None:
        overrides["tokens"] = args.tokens
    if args.max_new_tokens is not None:
        overrides["max_new_tokens"] = args.max_new_tokens
    if args.questions is not None:
        overrides["questions"] = args.questions
    if args.repeats is not None:
        overrides["repeats"] = args.repeats
    if args.budget is not None:
        overrides["budget"] = args.budget
    if args.rate_mbps is not None:
        overrides["rate_mbps"] = args.rate_mbps
    if args.compute_speed is not None:
        overrides["compute_speed"] = _speed(args.compute_speed)
    if args.objective is not None:
        overrides["objective"] = args.objective
    if args.order is not None:
        overrides["order"] = args.order
    if args.hedge is not None:
        overrides["hedge"] = args.hedge
    if args.no_tail:
        overrides["tail"] = False
    if args.link_rate_mbps is not None:
        overrides["link_rate_mbps"] = args.link_rate_mbps
    if args.precision is not None:
        overrides["precision"] = tuple(p.strip() for p in args.precision.split(",") if p.strip())
    cfg = DemoConfig(**{**base.__dict__, **overrides})
    report = run_demo(cfg, _model(args))
    print(report_json(report) if args.json else render_table(report))
    return 0


def _model(args: argparse.Namespace) -> Any:
    """The model ``--model`` names, loaded (a one-line error for a path that is not one);
    None for the default, which the demo loads after opening its link."""
    if args.model is None:
        return None
    from kvtransport.model.loader import load_model

    return load_model(args.model, threads=args.threads)


def _speed(text: str) -> tuple[float, ...]:
    from kvtransport.errors import UserError

    try:
        parts = [float(x) for x in text.split(",")]
        if len(parts) not in (2, 3):
            raise ValueError
    except ValueError:
        raise UserError(
            f"--compute-speed must be CALL_MS,TOKEN_MS[,PAIR_US], not {text!r}"
        ) from None
    return tuple(
        x * scale for x, scale in zip(parts, (1e-3, 1e-3, 1e-6)[: len(parts)], strict=True)
    )
