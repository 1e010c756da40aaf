"""`kvtransport answer`: answer a question from a cache card (or by re-prefilling)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvtransport.bounds import float_arg, int_arg

DEFAULT_WAIT_S = 10.0
"""answer --race-dir's default --wait-s: how long, from the command's start, it waits for
a transfer of its context to appear."""

NAME = "answer"
HELP = "answer a question from a cache card (injected, optionally degraded) or a context"
DESCRIPTION = """\
The downstream agent's side of a handoff. With --card, read the cache card, optionally
degrade it the way a lossy transfer would (--drop the last FRACTION of the block stream
sent in --order; --precision re-quantizes the blocks), inject it into the model with
missing blocks masked per layer (or, with --complete, the token ranges with a missing
block recomputed exactly from the card's token ids: kvtransport.model.race), append the
question and answer greedily. With
--context, re-prefill the context instead (the baseline a handoff avoids). With a
complete card both print the same answer. With --context and --race-dir DIR, race the
transfer of that context's cache that a receiver daemon on this host (run with
--race-dir DIR) is receiving: compute the context's front, load each token range as it
arrives, recompute exactly what does not (kvtransport.embed.live_race.race_daemon). The
transfer may start before or after the command, or have ended already: the command claims
it (the daemon keeps its mirror until the answer is done), measures the model's speed,
and waits up to --wait-s seconds from its start for the transfer to appear; then it races.
A line on stderr says what the race did: tokens loaded from the transfer, computed and
waited for, or that no transfer of this context came (answered by re-prefilling).

--json prints one object with the answer, timings in seconds (load_model, read_card or
prefill, injection, first_token, total) and the blocks used.

examples:
  kvtransport answer --card notes.card --question "Who wrote the report?"
  kvtransport answer --card notes.card --question "..." --drop 0.5 --order random --json
  kvtransport answer --context notes.txt --question "Who wrote the report?"
  kvtransport answer --context notes.txt --question "..." --race-dir /dev/shm/kvt --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--card", metavar="CARD", help="cache card from `kvtransport prefill`")
    src.add_argument("--context", metavar="FILE", help="re-prefill this context instead")
    parser.add_argument("--question", required=True, metavar="Q", help="the question")
    parser.add_argument(
        "--model",
        metavar="M",
        default=None,
        help="model (default: SmolLM2-135M-Instruct); must match the card's model",
    )
    parser.add_argument(
        "--drop",
        type=float_arg(0, 1),
        default=0.0,
        metavar="FRACTION",
        help="lose the last FRACTION (0..1) of the block stream (default 0)",
    )
    parser.add_argument(
        "--order",
        choices=("utility", "random", "position"),
        default="utility",
        help="stream order the drop applies to (default utility)",
    )
    parser.add_argument(
        "--precision",
        default=None,
        metavar="P",
        help="fp32|fp16|int8|int4|mixed:BYTES: re-quantize the blocks (default: as stored)",
    )
    parser.add_argument(
        "--seed", type=int_arg(0, 2**32 - 1), default=0, help="seed of the random order"
    )
    parser.add_argument(
        "--complete",
        action="store_true",
        help="recompute the token ranges with a missing block instead of masking them",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int_arg(1, 1 << 16),
        default=64,
        metavar="N",
        help="answer length cap",
    )
    parser.add_argument(
        "--race-dir",
        metavar="DIR",
        help="with --context: race the transfer of its cache that a local receiver daemon "
        "mirrors into DIR (its --race-dir) instead of re-prefilling all of it",
    )
    parser.add_argument(
        "--wait-s",
        type=float_arg(0, 3600),
        default=None,
        metavar="S",
        help="with --race-dir: wait up to S seconds from the start for the transfer to "
        f"appear in DIR (default {DEFAULT_WAIT_S:g})",
    )
    parser.add_argument("--threads", type=int_arg(1, 1024), default=None, help="torch threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _validate(args: argparse.Namespace) -> None:
    from kvtransport.commands.prefill import check_precision
    from kvtransport.errors import UserError

    if not 0.0 <= args.drop <= 1.0:
        raise UserError(f"--drop must be a fraction in [0, 1], not {args.drop}")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if not args.question.strip():
        raise UserError("--question is empty")
    check_precision(args.precision)
    if args.race_dir is not None and (
        args.context is None or args.drop > 0 or args.precision is not None or args.complete
    ):
        raise UserError("--race-dir goes with --context, without --drop, --precision, --complete")
    if args.wait_s is not None and args.race_dir is None:
        raise UserError("--wait-s goes with --race-dir")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from kvtransport.commands.prefill import read_text
    from kvtransport.embed.partial import partial_cache
    from kvtransport.errors import UserError
    from kvtransport.kvformat import card
    from kvtransport.model import encoding, hf, utility
    from kvtransport.model.loader import chat_prompt, load_model

    _validate(args)
    degrading = args.drop > 0 or args.precision is not None
    context = read_text(args.context, "context") if args.context else None
    t_all = time.perf_counter()
    # Read the card first: a bad card fails before the slow model load. Its read time is
    # part of the time to first token (a real receiver has its model loaded already).
    stored = card.read_card(args.card) if args.card else None
    t_read = time.perf_counter() - t_all
    loaded = load_model(args.model, threads=args.threads)
    timings: dict[str, float] = {"load_model": loaded.load_seconds}
    tok = loaded.tokenizer
    context_ids, question_ids = chat_prompt(tok, context or "", args.question)
    if args.race_dir is not None:
        return _race(args, loaded, context_ids, question_ids, t_all)

    # The TTFT clock: model loaded, question known, context not yet processed.
    t_start = time.perf_counter() - t_read
    if stored is not None:
        if stored.manifest.model_id != loaded.model_id:
            raise UserError(
                f"card {args.card} holds a cache of {stored.manifest.model_id}, "
                f"not of {loaded.model_id}"
            )
        geo = stored.manifest.geometry
        want = (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim)
        if (geo.num_layers, geo.num_kv_heads, geo.head_dim) != want:
            raise UserError(
                f"card {args.card} has {geo.num_layers} layers x {geo.num_kv_heads} kv heads x "
                f"{geo.head_dim} head_dim; {loaded.model_id} has {want[0]} x {want[1]} x {want[2]}"
            )
        got = partial_cache(stored)
        timings["read_card"] = t_read
        timings["reassemble"] = time.perf_counter() - t_start - t_read
        block_tokens = stored.manifest.geometry.block_tokens
        utilities = stored.utility_grid()
    else:
        got = None
        assert context is not None  # --card or --context, exactly one (argparse)
        # attention statistics only when a degraded cache needs utilities
        kv = hf.prefill(
            loaded.model, tok, context, window=utility.OBSERVATION_WINDOW, attention=degrading
        )
        timings["prefill"] = time.perf_counter() - t_start
        block_tokens = 16
        if degrading:
            weights = utility.default_layer_weights(loaded.model_id, kv.num_layers)
            utilities = utility.cache_utility(kv, block_tokens, weights)
    if degrading:
        t = time.perf_counter()
        got = encoding.degrade(
            got.cache if got is not None else kv,
            utilities,
            drop=args.drop,
            order=args.order,
            precision=args.precision,
            block_tokens=block_tokens,
            seed=args.seed,
        )
        timings["degrade"] = time.perf_counter() - t
    if got is not None:
        kv, present = got.cache, got.present
        blocks_info = {
            "total": got.manifest.geometry.num_blocks,
            "sent": got.manifest.num_blocks,
            "used": got.manifest.num_blocks - int(got.missing.size),
            "missing": int(got.missing.size),
            "utility_used": round(got.utility_recovered, 6),
            "precisions": _precision_counts(got.manifest, got.missing),
        }
    else:
        present = np.ones((kv.num_layers, kv.num_tokens), dtype=bool)
        n_blocks = -(-kv.num_tokens // block_tokens) * kv.num_layers
        blocks_info = {
            "total": n_blocks,
            "sent": n_blocks,
            "used": n_blocks,
            "missing": 0,
            "utility_used": 1.0,
            "precisions": {np.dtype(kv.keys.dtype).name: n_blocks},
        }
    blocks_info["order"] = args.order
    if args.complete and got is not None and not present.all():
        from kvtransport.model.race import complete_missing

        ids = got.cache.token_ids
        if ids is None or np.any(ids < 0):
            raise UserError("--complete needs the context's token ids; this card has none")
        t = time.perf_counter()
        done = complete_missing(loaded.model, ids.tolist(), kv, present, block_tokens)
        kv, present = done.kv, np.ones_like(present)
        timings["complete"] = time.perf_counter() - t
        blocks_info["recomputed_tokens"] = done.computed
    t_gen = time.perf_counter()
    gen = hf.greedy_generate(
        loaded.model,
        kv,
        question_ids,
        present=None if present.all() else present,
        max_new_tokens=args.max_new_tokens,
    )
    answer = tok.decode(gen.tokens, skip_special_tokens=True).strip()
    timings["injection"] = gen.inject_seconds
    timings["first_token"] = (t_gen - t_start) + gen.first_token_seconds
    timings["generate"] = gen.seconds
    timings["total"] = time.perf_counter() - t_all
    if args.json:
        out = {
            "answer": answer,
            "source": "card" if args.card else "prefill",
            "tokens": gen.tokens,
            "stopped": gen.stopped,
            "context_tokens": kv.num_tokens,
            "question_tokens": len(question_ids),
            "timings": {k: round(v, 4) for k, v in timings.items()},
            "blocks": blocks_info,
        }
        print(json.dumps(out))
    else:
        print(answer)
    return 0


def _race(
    args: argparse.Namespace, loaded: Any, context_ids: list[int], question_ids: list[int],
    t_all: float,
) -> int:  # fmt: skip
    """--race-dir: the context's cache raced from a local receiver daemon's mirror (the
    wait for it counted from the command's start, the model's load and speed measure
    within it)."""
    import sys

    from kvtransport.embed.live_race import race_daemon
    from kvtransport.model import hf

    wait_s = DEFAULT_WAIT_S if args.wait_s is None else args.wait_s
    left = max(0.0, wait_s - (time.perf_counter() - t_all))

    def note(line: str) -> None:
        print(f"kvtransport answer: {line}", file=sys.stderr, flush=True)

    # the race ends with the question's first token (while the stream's tail arrives)
    res = race_daemon(loaded.model, context_ids, race_dir=args.race_dir, wait_s=left,
                      question_ids=question_ids, note=note)  # fmt: skip
    assert res.answer_s is not None
    gen = hf.greedy_generate(loaded.model, res.model_cache, question_ids,
                             max_new_tokens=args.max_new_tokens)  # fmt: skip
    answer = loaded.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
    if not args.json:
        print(answer)
        print(f"kvtransport answer: {_race_summary(res, args.race_dir, wait_s)}",
              file=sys.stderr)  # fmt: skip
        return 0
    timings = {
        "load_model": loaded.load_seconds,
        "race": res.seconds,
        "first_token": res.answer_s,
        "generate": gen.seconds,
        "total": time.perf_counter() - t_all,
    }
    print(json.dumps({
        "answer": answer,
        "source": "race",
        "tokens": gen.tokens,
        "stopped": gen.stopped,
        "context_tokens": len(context_ids),
        "question_tokens": len(question_ids),
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "race": {"computed_tokens": res.computed, "loaded_tokens": res.loaded,
                 "waited_s": round(res.waited_s, 4), "transfer": res.transfer,
                 "refused": res.refused, "summary": _race_summary(res, args.race_dir, wait_s)},
    }))  # fmt: skip
    return 0


def _race_summary(res: Any, race_dir: str, wait_s: float) -> str:
    """One line: whether the answer raced a transfer, and what the race did."""
    n = res.computed + res.loaded
    if res.transfer is None:
        return (f"no transfer for this context in {race_dir} within {wait_s:g} s: answered "
                f"by re-prefilling ({n} tokens computed)")  # fmt: skip
    if res.refused:
        return (f"transfer {res.transfer} in {race_dir} not loaded ({res.refused}): answered "
                f"by re-prefilling ({n} tokens computed)")  # fmt: skip
    return (f"raced transfer {res.transfer}: {res.loaded} of {n} context tokens loaded, "
            f"{res.computed} computed, {res.waited_s:.2f} s waited for arrivals")  # fmt: skip


def _precision_counts(manifest: Any, missing: Any) -> dict[str, int]:
    import numpy as np

    from kvtransport.kvformat.blocks import PRECISIONS

    ok = np.ones(manifest.num_blocks, dtype=bool)
    ok[missing] = False
    names, counts = np.unique(manifest.precision[ok], return_counts=True)
    return {PRECISIONS[int(p)]: int(c) for p, c in zip(names, counts, strict=True)}
