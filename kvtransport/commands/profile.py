"""`kvtransport profile`: measure a model's per-layer KV-cache sensitivity profile."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from kvtransport.bounds import float_arg, int_arg
from kvtransport.commands import _common

NAME = "profile"
HELP = "measure a model's per-layer sensitivity to KV-cache damage (layer weights)"
DESCRIPTION = """\
Measure how much each layer's KV cache matters, the RippleKV way: on a small calibration
set of generated task samples (needle-in-a-haystack and country facts), add norm-adaptive
Gaussian noise to one layer's value cache at a time and measure the KL divergence of the
model's next-token distribution from the clean cache's. The per-layer means form the
sensitivity profile, saved as JSON; `kvtransport prefill --layer-weights FILE` and the
utility ordering turn it into layer weights (normalize, then map exponentially with a
ratio: the most sensitive layer weighs RATIO times the least sensitive one).

Cost: samples x layers forward passes (one to two minutes for SmolLM2 with the defaults).

example:
  kvtransport profile
  kvtransport profile --model smollm2 --samples 16 --out smollm2-sensitivity.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common.add_model(parser)
    parser.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="where to write the profile JSON (default: MODEL_ID-sensitivity.json here)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=8,
        metavar="N",
        help="calibration samples (default 8)",
    )
    parser.add_argument(
        "--target-tokens",
        type=int_arg(120, 1 << 20),
        default=400,
        metavar="N",
        help="context length of each calibration sample in tokens (default 400)",
    )
    parser.add_argument(
        "--noise",
        type=float_arg(0, 1e3),
        default=None,
        metavar="SIGMA",
        help="relative noise scale: noise norm ~ SIGMA x value norm (default 1.0)",
    )
    parser.add_argument(
        "--draws",
        type=int_arg(1, 1_000_000),
        default=1,
        metavar="N",
        help="noise draws per sample and layer",
    )
    parser.add_argument(
        "--continuation",
        type=int_arg(1, 1 << 16),
        default=8,
        metavar="N",
        help="answer tokens over which the KL is averaged (default 8)",
    )
    parser.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=1000, help="calibration seed (default 1000)"
    )
    parser.add_argument(
        "--ratio",
        type=float_arg(1, 1e6),
        default=None,
        metavar="R",
        help="ratio of the layer weights stored in the profile: the most sensitive "
        "layer weighs R times the least sensitive one (default 4)",
    )
    parser.add_argument("--threads", type=int_arg(1, 1024), default=None, help="torch threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _validate(args: argparse.Namespace) -> None:
    from kvtransport.errors import UserError

    for name in ("samples", "target_tokens", "draws", "continuation"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.target_tokens < 120:
        raise UserError("--target-tokens must be at least 120 (the prompt's own overhead)")
    if args.noise is not None and not args.noise >= 0:
        raise UserError(f"--noise must be >= 0, not {args.noise}")
    if args.ratio is not None and not args.ratio >= 1:
        raise UserError(f"--ratio must be >= 1, not {args.ratio}")
    if args.out is not None and not Path(args.out).expanduser().parent.is_dir():
        raise UserError(f"cannot write {args.out}: its directory does not exist")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    from kvtransport.model.loader import load_model
    from kvtransport.model.sensitivity import (
        DEFAULT_NOISE_SCALE,
        DEFAULT_RATIO,
        packaged_profile_name,
        profile_model,
    )

    loaded = load_model(args.model, threads=args.threads)
    command = "kvtransport profile " + _argv_of(args)
    prof = profile_model(
        loaded.model,
        loaded.tokenizer,
        samples=args.samples,
        target_tokens=args.target_tokens,
        noise_scale=DEFAULT_NOISE_SCALE if args.noise is None else args.noise,
        draws=args.draws,
        continuation=args.continuation,
        seed=args.seed,
        progress=not args.quiet,
        command=command,
        ratio=DEFAULT_RATIO if args.ratio is None else args.ratio,
    )
    out = Path(args.out).expanduser() if args.out else Path(packaged_profile_name(prof.model_id))
    prof.save(out)
    weights = prof.layer_weights
    order = sorted(range(prof.num_layers), key=lambda i: -prof.kl[i])
    print(f"wrote {out}: {prof.num_layers} layers of {prof.model_id} in {prof.seconds:.0f} s")
    print("most sensitive layers: " + ", ".join(f"{i} (KL {prof.kl[i]:.3g})" for i in order[:5]))
    print("least sensitive layers: " + ", ".join(f"{i} (KL {prof.kl[i]:.3g})" for i in order[-3:]))
    print(f"layer weights (ratio {prof.weight_ratio:g}): " + " ".join(f"{w:.3f}" for w in weights))
    return 0


def _argv_of(args: argparse.Namespace) -> str:
    """The options that determine the profile, spelled out for its provenance record."""
    parts = []
    names = ("model", "out", "samples", "target_tokens", "noise", "draws", "continuation", "ratio")
    for name in names:
        value = getattr(args, name)
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", shlex.quote(str(value))]
    parts += ["--seed", str(args.seed)]
    return " ".join(parts)
