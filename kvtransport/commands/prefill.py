"""`kvtransport prefill`: prefill a context once and write its KV cache as a cache card."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtransport.bounds import int_arg
from kvtransport.commands import _common

NAME = "prefill"
HELP = "prefill a context with the model and write its KV cache as a cache card"
DESCRIPTION = """\
Run the model over a context once (the upstream agent's work), score every block of the
KV cache by its utility (SnapKV attention mass from the context's last tokens, weighted by
the layer sensitivity profile when one is given) and write the cache as a cache card: one
safetensors file with the blocks in utility order and a JSON block table.

The context becomes the user turn of the model's chat template; a question is appended
later by `kvtransport answer --card CARD --question Q`.

example:
  kvtransport prefill --context notes.txt --out notes.card
  kvtransport prefill --context notes.txt --precision int8 --out notes-int8.card
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        required=True,
        metavar="FILE",
        help="text file holding the context ('-' reads stdin)",
    )
    parser.add_argument("--out", required=True, metavar="CARD", help="cache card to write")
    _common.add_model(parser)
    parser.add_argument(
        "--precision",
        default=None,
        metavar="P",
        help="fp32|fp16|int8|int4|mixed:BYTES (BYTES may end in K/M/G); "
        "default: the cache's own dtype, lossless",
    )
    parser.add_argument(
        "--block-tokens",
        type=int_arg(1, 1 << 20),
        default=16,
        metavar="N",
        help="tokens per block (default 16)",
    )
    parser.add_argument(
        "--layer-weights",
        metavar="JSON",
        default=None,
        help="'uniform', a layer sensitivity profile (from `kvtransport profile`) or a "
        "JSON list of per-layer weights; default: the model's packaged profile if it "
        "ships one, else uniform",
    )
    parser.add_argument(
        "--window",
        type=int_arg(1, 1 << 20),
        default=512,
        metavar="N",
        help="SnapKV observation window: attention from the last N context tokens scores "
        "the blocks (default 512)",
    )
    parser.add_argument("--threads", type=int_arg(1, 1024), default=None, help="torch threads")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def read_text(path: str, what: str) -> str:
    """Read a UTF-8 text argument file ('-' is stdin) or raise a one-line UserError."""
    from kvtransport.errors import UserError

    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{what} file {path}: no such file") from None
        except IsADirectoryError:
            raise UserError(f"{what} file {path} is a directory") from None
        except UnicodeDecodeError:
            raise UserError(f"{what} file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise UserError(f"cannot read {what} file {path}: {exc.strerror}") from None
    if not text.strip():
        raise UserError(f"{what} file {path} is empty")
    return text


def load_layer_weights(spec: str | None, model_id: str, num_layers: int):  # noqa: ANN201
    """Layer weights (ndarray) or None for uniform.

    spec: None (the model's packaged sensitivity profile if there is one, else uniform),
    "uniform", a sensitivity profile JSON from `kvtransport profile`, or a JSON list.
    """
    import numpy as np

    from kvtransport.errors import UserError
    from kvtransport.model import sensitivity, utility

    if spec is None:
        return utility.default_layer_weights(model_id, num_layers)
    if spec == "uniform":
        return None
    try:
        obj = json.loads(Path(spec).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"layer weights file {spec}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"layer weights file {spec} is not readable JSON: {exc}") from None
    if isinstance(obj, dict) and obj.get("format") == sensitivity.FORMAT:
        prof = sensitivity.load_profile(spec)
        if prof.num_layers != num_layers:
            raise UserError(f"profile {spec} has {prof.num_layers} layers, model {num_layers}")
        return prof.weights(ratio=utility.LAYER_RATIO)
    try:
        w = np.asarray(obj, dtype=np.float64)
    except (TypeError, ValueError):
        w = np.zeros(0)
    if w.shape != (num_layers,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise UserError(
            f"layer weights in {spec} must be a sensitivity profile or {num_layers} "
            "non-negative numbers, not all zero"
        )
    return w


def check_precision(spec: str | None) -> None:
    from kvtransport.errors import UserError
    from kvtransport.kvformat import blocks

    if spec is None:
        return
    try:
        blocks.parse_precision(spec)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from kvtransport.errors import UserError
    from kvtransport.kvformat import card
    from kvtransport.model import encoding

    check_precision(args.precision)
    if args.block_tokens < 1:
        raise UserError("--block-tokens must be at least 1")
    if args.window < 1:
        raise UserError("--window must be at least 1")
    context = read_text(args.context, "context")
    out = Path(args.out)
    if not out.parent.is_dir() and str(out.parent):
        raise UserError(f"cannot write {out}: directory {out.parent} does not exist")
    spec = args.layer_weights
    if spec not in (None, "uniform") and not Path(spec).is_file():  # before the model load
        raise UserError(f"layer weights file {spec}: no such file")

    from kvtransport.model import hf
    from kvtransport.model.loader import load_model

    loaded = load_model(args.model, threads=args.threads)
    weights = load_layer_weights(args.layer_weights, loaded.model_id, loaded.num_layers)
    t0 = time.perf_counter()
    cache = hf.prefill(loaded.model, loaded.tokenizer, context, window=args.window)
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    stream = encoding.encode_cache(
        cache,
        layer_weights=weights,
        window=args.window,
        block_tokens=args.block_tokens,
        precision=args.precision,
        created=card.creation_info(
            context_file=None if args.context == "-" else str(Path(args.context).name),
            prefill_seconds=round(t_prefill, 4),
            layer_weights=args.layer_weights
            or ("packaged sensitivity profile" if weights is not None else "uniform"),
            observation_window=args.window,
        ),
    )
    card.write_card(out, stream)
    t_write = time.perf_counter() - t1
    info: dict[str, Any] = {
        "card": str(out),
        "model_id": cache.model_id,
        "tokens": cache.num_tokens,
        "blocks": stream.manifest.num_blocks,
        "bytes": out.stat().st_size,
        "timings": {
            "load_model": round(loaded.load_seconds, 4),
            "prefill": round(t_prefill, 4),
            "encode_and_write": round(t_write, 4),
        },
    }
    if args.json:
        print(json.dumps(info))
    else:
        print(
            f"wrote {out}: {cache.num_tokens} tokens, {info['blocks']} blocks, "
            f"{info['bytes'] / 2**20:.1f} MiB (prefill {t_prefill:.2f} s)"
        )
    return 0
