"""`kvtransport demo`: the README's main command (the logic lives in kvtransport.demo)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtransport.bounds import int_arg

NAME = "demo"
HELP = "hand a real model's KV cache across a burst-loss link: five repair schemes side by side"
DESCRIPTION = """\
One handoff, end to end. The real model (SmolLM2-135M-Instruct) prefills the context of a
seeded task once and its KV cache becomes a cache card (blocks in utility order; kept in
$KVT_CACHE/demo, default ~/.cache/kvtransport/demo, so the next run skips that prefill).
A sender and a receiver start once in processes of their own, and the card crosses the
ge-heavy link (100 Mbit/s, 5 ms, Gilbert-Elliott bursts, about 12% loss, both ways) once
per scheme, under a deadline of rho x the loss-free send time:

  no FEC, block RS 4/32 (Reed-Solomon), RLC 4/32 (fixed-rate sliding-window code),
  adaptive (heuristic on feedback), DDQN (the shipped Double-DQN repair policy)

The receiver injects whatever arrived (missing blocks masked per layer) and answers
--questions questions about the context on it: the task's own, then other facts the same
context states (drawn by the seed). One answer is a knife edge (a 135M model's answer can
flip on a small difference in the cache); several show how much of the context survived.
The table shows, per scheme: the utility recovered before the deadline, the blocks
missing, the answer to the first question, the mean token F1 of the answers against the
full cache's answers, how many answers equal the full cache's, and the time to first
token (transfer + rebuild + injection + first token) against re-prefilling the context.
The "no cache" row is the floor: every block masked, the question alone (a 135M model
knows some capitals without the context; a badly damaged cache can do worse than that).

Links (--link):
  netns     the real sender-daemon and receiver-daemon in two network namespaces of the
            netem testbed, at real-time priority (needs root). Real time: the table
            differs a little from run to run.
  emulated  the sender and receiver sessions in two processes joined by the userspace
            channel of the same profile, on the link's own clock: the same --seed gives
            the same table run after run (apart from measured compute times), as any
            user.
  auto      netns when run as root, else emulated (with a note). Default.

--quick uses a 128-token context and shorter answers. Progress bars
go to stderr when it is a terminal; --json prints one JSON object instead of the table.

examples:
  kvtransport demo
  kvtransport demo --quick --link emulated --seed 7
  kvtransport demo --task niah_single --tokens 1024 --json > demo.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller context, shorter answers")
    parser.add_argument(
        "--link",
        choices=("auto", "netns", "emulated"),
        default="auto",
        help="where the cache crosses (default auto: netns as root, else emulated)",
    )
    parser.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=1, help="task and link seed (default 1)"
    )
    from kvtransport.tasks import TASK_NAMES

    parser.add_argument(
        "--task",
        default="facts_qa",
        choices=TASK_NAMES,
        help="the context and question (default facts_qa)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="N",
        help="context size in tokens (default 512; 128 with --quick)",
    )
    parser.add_argument(
        "--rho",
        type=float,
        default=0.8,
        help="deadline / loss-free send time (default 0.8)",
    )
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
        "--no-card-cache",
        action="store_true",
        help="always prefill; do not read or write cards in the cache directory",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtransport.demo import (
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
        "rho": args.rho,
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
    cfg = DemoConfig(**{**base.__dict__, **overrides})
    report = run_demo(cfg)
    print(report_json(report) if args.json else render_table(report))
    return 0
