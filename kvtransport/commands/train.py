"""`kvtransport train`: train the Double-DQN repair scheduler offline."""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable
from pathlib import Path

from kvtransport.bounds import float_arg, int_arg
from kvtransport.errors import UserError

NAME = "train"
HELP = "train the DDQN repair scheduler in the simulator (offline, CPU)"
DESCRIPTION = """\
Train the Double-DQN policy that schedules repair symbols, in the Gymnasium environment
kvtransport/RepairScheduling-v0 (the real sender and receiver in the simulator, episodes
drawn from a wide seeded distribution of links, deadlines, cache sizes and block-utility
profiles; see kvtransport.agents.episodes). The replay buffer starts with demonstration
episodes of the heuristics; the network is validated every --eval-every steps on held-out
episodes against the adaptive heuristic, and the best one is kept.

Writes into --out: best_model.zip (SB3 checkpoint of the best validation), last_model.zip,
ddqn.npz (the best network exported for the numpy runtime; scripts/eval_policy.py
--weights evaluates it), checkpoints/step_N.npz (every validated network), ddqn.json (the
command with every option spelled out, and the effective configuration: every training
and episode-distribution setting, defaults included), progress.csv (one row per
validation), sb3/progress.csv (SB3's training log), learning_curve.png, summary.json.

To ship a policy, copy ddqn.npz and ddqn.json into the package's kvtransport/policies/data/.
The shipped policy's recorded command trains on the distribution it was trained on
(tests/test_train_config.py holds the two equal).
torch runs on one thread. On a 2-core machine expect about 150-400 steps per second.

examples:
  kvtransport train --steps 300000 --out runs/ddqn
  kvtransport train --steps 20000 --out /tmp/quick --eval-every 5000 --trace office.csv.gz
  kvtransport train --steps 150000 --handoff-share 0.3 --out runs/ddqn-handoff
  kvtransport train --steps 150000 --rate-range 20,400 --prior none --out runs/ddqn-v2
  kvtransport train --steps 60000 --init-from kvtransport/policies/data/ddqn.npz --out runs/warm
"""

MAX_RATE_MBPS = 100_000.0
"""The fastest link --rate-range may draw (100 Gbit/s)."""
MAX_RHO = 100.0
"""The loosest deadline --rho-range may draw (in loss-free send times)."""
MAX_DEADLINE_RTTS = 100.0
"""The most round trips --long-link-min-rtts and --long-link-deadline-rtts may name."""
DISTRIBUTION_OPTIONS = {
    "rate_range": "rate_range_mbps",
    "rho_range": "rho_range",
    "long_link_min_rtts": "high_rtt_min_rtts",
    "long_link_deadline_rtts": "long_link_deadline_rtts",
}
"""Options (argparse dests) that set an EpisodeDistribution field of the same meaning
when given (None: the distribution's default); a recorded command spells each out."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # The defaults are TrainConfig's (kvtransport.agents.training; not imported here: it
    # needs gymnasium). tests/test_packaging.py holds them equal.
    p.add_argument(
        "--steps",
        type=int_arg(1, 10**10),
        default=300_000,
        metavar="N",
        help="environment steps of training (default 300000)",
    )
    p.add_argument(
        "--out", default="runs/ddqn", metavar="DIR", help="output directory (default runs/ddqn)"
    )
    p.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=0, metavar="S", help="random seed (default 0)"
    )
    p.add_argument(
        "--hidden", default="64,64", metavar="H1,H2", help="hidden layer sizes (default 64,64)"
    )
    p.add_argument(
        "--demo-steps",
        type=int_arg(0, 10**10),
        default=40_000,
        metavar="N",
        help="demonstration steps put in the replay buffer first (default 40000)",
    )
    p.add_argument(
        "--eval-every",
        type=int_arg(1, 10**10),
        default=25_000,
        metavar="N",
        help="validate every N steps (default 25000)",
    )
    p.add_argument(
        "--eval-episodes",
        type=int_arg(1, 1_000_000),
        default=40,
        metavar="N",
        help="held-out validation episodes (default 40)",
    )
    p.add_argument(
        "--eval-hard",
        type=int_arg(0, 1_000_000),
        default=0,
        metavar="N",
        help="validation episodes added on long links at the upper half of the trained "
        "rates with deadlines of 1-2 round trips, where networks most often lose to the "
        "adaptive heuristic (default 0: none)",
    )
    p.add_argument(
        "--expert-realizations",
        type=int_arg(1, 64),
        default=1,
        metavar="K",
        help="choose each demonstration episode's expert (the best of the tail rule, the "
        "adaptive heuristic's margins and the clairvoyant oracle) on average over K draws "
        "of its channels rather than on the episode's own draw alone (default 1)",
    )
    p.add_argument(
        "--shortfall-weight",
        type=float_arg(0, 1000),
        default=0.0,
        metavar="W",
        help="keep the checkpoint with the best mean validation utility minus W times the "
        "mean shortfall below the better of the adaptive heuristic and the tail rule on "
        "each episode (default 0: the mean utility alone)",
    )
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="loss/delay trace (CSV seq,lost,owd_us; repeatable): random windows "
        "of it become part of the training episodes",
    )
    p.add_argument(
        "--handoff-share",
        type=float_arg(0, 1),
        default=0.0,
        metavar="F",
        help="share (0..1) of the training and validation episodes that are TTFT handoff "
        "streams (the planned cache of kvtransport.model.plan: prefix order, mixed "
        "precisions, so utility does not fall along the stream) instead of equal blocks "
        "in utility order; the rest keep the default distribution (default 0: none)",
    )
    p.add_argument(
        "--rate-range",
        type=_rate_range,
        default=None,
        metavar="LO,HI",
        help="link rates of the training and validation episodes, in Mbit/s: drawn "
        "log-uniform in LO..HI (0 < LO <= HI; default: the episode distribution's, "
        "50,1000)",
    )
    p.add_argument(
        "--rho-range",
        type=_rho_range,
        default=None,
        metavar="LO,HI",
        help="deadlines of the training and validation episodes (handoff streams keep "
        "their own), in loss-free send times of the stream (rho): drawn uniform in LO..HI "
        "(0 < LO <= HI; default: the episode distribution's, 0.6,1.2)",
    )
    p.add_argument(
        "--long-link-min-rtts",
        type=float_arg(0, MAX_DEADLINE_RTTS),
        default=None,
        metavar="R",
        help="the shortest deadline a long-link episode (one way beyond the short links' "
        "20 ms) may draw, in round trips of its link; shorter draws are redrawn (default: "
        "the episode distribution's, 2)",
    )
    p.add_argument(
        "--long-link-deadline-rtts",
        type=_rtts_range,
        default=None,
        metavar="LO,HI",
        help="size the long-link episodes (synthetic utilities) so that each one's deadline "
        "is LO..HI round trips of its link (uniform): fast long links then get one- and "
        "two-round-trip deadlines as often as slow ones (default: off, blocks drawn as on "
        "short links)",
    )
    p.add_argument(
        "--prior",
        type=_prior_weights,
        default=None,
        metavar="KIND[=W],...",
        help="the sender's loss prior before the first feedback in the training and "
        "validation episodes: one kind (none: no prior, a first transfer; previous: the "
        "loss an earlier transfer over the link ended with; profile: the link profile's "
        "stationary loss), or a weighted mix like none=0.3,previous=0.5,profile=0.2 "
        "(default: that mix)",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="WEIGHTS",
        help="start the Q-network from this weights file (a ddqn.npz; the shipped one is "
        "kvtransport/policies/data/ddqn.npz in the source tree) instead of random weights; "
        "its hidden sizes must be --hidden's (default: random initial weights)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _range(what: str, most: float, unit: str, example: str) -> Callable[[str], tuple[float, float]]:
    """An argparse ``type``: ``LO,HI`` with 0 < LO <= HI <= ``most`` (``what``: the
    values' name in errors, ``unit`` their unit, ``example`` a valid text)."""

    def parse(text: str) -> tuple[float, float]:
        parts = text.split(",")
        try:
            if len(parts) != 2:
                raise ValueError
            lo, hi = (float(x) for x in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be two {what}{unit} like {example}, not {text!r}"
            ) from None
        for x in (lo, hi):
            if not 0.0 < x <= most:  # also NaN
                raise argparse.ArgumentTypeError(
                    f"{what} must be in (0, {most:g}]{unit}, not {x:g} in {text!r}"
                )
        if lo > hi:
            raise argparse.ArgumentTypeError(f"LO must not exceed HI (inverted range {text!r})")
        return lo, hi

    return parse


_rate_range = _range("rates", MAX_RATE_MBPS, " Mbit/s", "20,400")
_rho_range = _range("rhos", MAX_RHO, "", "0.6,2")
_rtts_range = _range("round trips", MAX_DEADLINE_RTTS, "", "1,4")


def _prior_weights(text: str) -> dict[str, float]:
    """An argparse ``type``: ``KIND`` (weight 1) or ``KIND=W,...`` (weights >= 0, finite,
    not all 0; each kind once). Which kinds exist is checked in ``_config``."""
    weights: dict[str, float] = {}
    for item in text.split(","):
        kind, eq, w = item.partition("=")
        kind = kind.strip()
        try:
            weight = float(w) if eq else 1.0
        except ValueError:
            weight = math.nan
        if not kind or not math.isfinite(weight) or weight < 0:
            raise argparse.ArgumentTypeError(
                f"must be KIND or KIND=WEIGHT,... with weights >= 0, not {text!r}"
            )
        if kind in weights:
            raise argparse.ArgumentTypeError(f"{kind!r} is given twice in {text!r}")
        weights[kind] = weight
    if not any(weights.values()):
        raise argparse.ArgumentTypeError(f"at least one weight must be positive in {text!r}")
    return weights


def _config(args: argparse.Namespace):  # noqa: ANN202 - TrainConfig is imported lazily
    from kvtransport.agents.training import TrainConfig

    if args.steps < 1:
        raise UserError("--steps must be at least 1")
    if args.demo_steps < 0 or args.eval_episodes < 1 or args.eval_every < 1:
        raise UserError("--demo-steps must be >= 0, --eval-every and --eval-episodes >= 1")
    try:
        hidden = tuple(int(h) for h in args.hidden.split(","))
    except ValueError:
        raise UserError(f"--hidden must be sizes like 64,64, not {args.hidden!r}") from None
    if not hidden or any(not 1 <= h <= 4096 for h in hidden):
        raise UserError("--hidden sizes must be between 1 and 4096")
    for t in args.trace:
        if not Path(t).is_file():
            raise UserError(f"--trace {t}: no such file")
    distribution: dict = {}
    if args.handoff_share:
        distribution["handoff_share"] = args.handoff_share
    for option, field in DISTRIBUTION_OPTIONS.items():
        if getattr(args, option) is not None:
            distribution[field] = getattr(args, option)
    if args.prior is not None:
        from kvtransport.agents.episodes import PRIOR_KINDS

        unknown = [k for k in args.prior if k not in PRIOR_KINDS]
        if unknown:
            raise UserError(
                f"--prior: unknown kind {unknown[0]!r}; choose from {', '.join(PRIOR_KINDS)}"
            )
        distribution["prior_weights"] = args.prior
    if args.init_from is not None:
        from kvtransport.policies.ddqn import load_weights

        trained = [int(d) for d in load_weights(args.init_from).dims[1:-1]]
        if trained != list(hidden):
            raise UserError(
                f"--init-from {args.init_from}: its hidden layers are "
                f"{','.join(map(str, trained))}, not --hidden {args.hidden}"
            )
    return TrainConfig(
        steps=args.steps,
        seed=args.seed,
        hidden=hidden,
        demo_steps=args.demo_steps,
        eval_every=args.eval_every,
        eval_episodes=args.eval_episodes,
        eval_hard_episodes=args.eval_hard,
        shortfall_weight=args.shortfall_weight,
        expert_realizations=args.expert_realizations,
        trace_files=tuple(args.trace),
        distribution=distribution,
        init_from=args.init_from,
    )


def _number(x: float) -> str:
    """``x`` as the shortest text that parses back to the same float (20, 0.35, 1e-07)."""
    s = repr(float(x))
    return s[:-2] if s.endswith(".0") else s


def _command_line(args: argparse.Namespace, config: dict) -> str:
    """The full command with every setting spelled out (recorded next to the weights):
    the options as given, and the episode-distribution options at their effective values
    (``config``: kvtransport.agents.training.effective_config), so that the command asks
    for the same distribution when a default has moved since."""
    dist = config["distribution"]
    prior = dist["prior_weights"]
    if len(prior) == 1 and next(iter(prior.values())) == 1.0:
        prior_text = next(iter(prior))
    else:
        prior_text = ",".join(f"{k}={_number(w)}" for k, w in prior.items())
    parts = [
        "kvtransport",
        "train",
        "--steps",
        str(args.steps),
        "--out",
        args.out,
        "--seed",
        str(args.seed),
        "--hidden",
        args.hidden,
        "--demo-steps",
        str(args.demo_steps),
        "--eval-every",
        str(args.eval_every),
        "--eval-episodes",
        str(args.eval_episodes),
        "--eval-hard",
        str(args.eval_hard),
        "--shortfall-weight",
        _number(args.shortfall_weight),
        "--prior",
        prior_text,
        "--handoff-share",
        _number(dist["handoff_share"]),
    ]
    for option, field in DISTRIBUTION_OPTIONS.items():
        value = dist.get(field)
        if value is None:  # off (long_link_deadline_rtts): no value to spell
            continue
        text = ",".join(map(_number, value)) if isinstance(value, list | tuple) else _number(value)
        parts += ["--" + option.replace("_", "-"), text]
    for t in args.trace:
        parts += ["--trace", t]
    if args.init_from is not None:
        parts += ["--init-from", args.init_from]
    if "expert_realizations" in config:  # recorded only when set (effective_config)
        parts += ["--expert-realizations", str(config["expert_realizations"])]
    return " ".join(shlex.quote(p) for p in parts)


def run(args: argparse.Namespace) -> int:
    from kvtransport.agents.training import effective_config, train
    from kvtransport.netem import TraceError

    cfg = _config(args)
    try:
        command = _command_line(args, effective_config(cfg))
        res = train(cfg, args.out, command=command, quiet=args.quiet)
    except TraceError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{args.out}: {exc.strerror or exc}") from None
    print(
        f"best validation utility {res.best_utility:.4f} at step {res.best_step} "
        f"(adaptive heuristic {res.adaptive_utility:.4f}); {res.steps} steps in "
        f"{res.wall_s / 60:.1f} min; weights in {Path(args.out) / 'ddqn.npz'}"
    )
    return 0
