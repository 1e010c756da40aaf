"""The model's side of the demo: the context's cache card (one prefill, then kept between
runs), the receiver's partial cache rebuilt from what arrived, and the answer from it.

torch and transformers are imported inside the functions (kvtransport.model.hf), as everywhere
outside the model code.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.demo.demo_links import LinkOutcome
from kvtransport.errors import UserError

BLOCK_TOKENS = 16


def default_card_dir() -> Path:
    """``$KVT_CACHE/demo`` (default ``~/.cache/kvtransport/demo``)."""
    from kvtransport.model.loader import cache_root

    return cache_root().parent / "demo"


def _card_key(model_id: str, context_ids: list[int], weights: np.ndarray | None) -> str:
    from kvtransport import __version__
    from kvtransport.model import utility

    h = hashlib.sha256()
    h.update(f"{__version__}|{model_id}|{BLOCK_TOKENS}|{utility.OBSERVATION_WINDOW}|".encode())
    h.update(np.asarray(context_ids, dtype="<i8").tobytes())
    if weights is not None:
        h.update(np.asarray(weights, dtype="<f8").tobytes())
    return h.hexdigest()[:16]


def prepare_card(
    loaded: Any, task: Any, context_ids: list[int], card_dir: Path | None
) -> tuple[Any, bool, float]:
    """The context's block stream (kvtransport.kvformat.blocks.EncodedStream), from the card cache
    or from one prefill; returns (stream, cached, prefill seconds).

    The manifest's creation info holds no time stamp, so the same context always gives
    the same bytes (the emulated link's repeatability starts here).
    """
    from kvtransport import __version__
    from kvtransport.kvformat import blocks, card
    from kvtransport.model import encoding, hf, utility

    weights = utility.default_layer_weights(loaded.model_id, loaded.num_layers)
    path = None
    if card_dir is not None:
        key = _card_key(loaded.model_id, context_ids, weights)
        path = Path(card_dir) / f"{task.task}-seed{task.seed}-{len(context_ids)}tok-{key}.card"
        if path.is_file():
            try:
                stored = card.read_card(path)
            except card.CardError:
                stored = None  # damaged: rebuilt below
            if stored is not None and stored.manifest.model_id == loaded.model_id:
                ids = stored.manifest.token_ids
                if ids is not None and ids.tolist() == list(context_ids):
                    m = stored.manifest
                    return blocks.EncodedStream(m, m.to_bytes(), stored.payload), True, 0.0
    t0 = time.perf_counter()
    kv = hf.prefill(loaded.model, loaded.tokenizer, context_ids, window=utility.OBSERVATION_WINDOW)
    prefill_s = time.perf_counter() - t0
    stream = encoding.encode_cache(
        kv,
        layer_weights=weights,
        block_tokens=BLOCK_TOKENS,
        window=utility.OBSERVATION_WINDOW,
        created={"tool": f"kvtransport {__version__}", "by": "kvtransport demo",
                 "task": task.task, "seed": task.seed},
    )  # fmt: skip
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            card.write_card(path, stream)
        except (OSError, UserError):
            pass  # a read-only cache directory only costs the next run a prefill
    return stream, False, prefill_s


def answer(loaded: Any, kv: Any, present: np.ndarray | None, question_ids: list[int],
           max_new_tokens: int) -> tuple[str, float]:  # fmt: skip
    """(answer text, seconds from injection start to the first token)."""
    from kvtransport.model import hf

    if present is not None and present.all():
        present = None
    gen = hf.greedy_generate(
        loaded.model, kv, question_ids, present=present, max_new_tokens=max_new_tokens
    )
    text = loaded.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
    return text, gen.first_token_seconds


def rebuild(stream: Any, outcome: LinkOutcome, context_ids: list[int]) -> tuple[Any, np.ndarray]:
    """The receiver's cache and presence mask from what arrived (all masked if the
    manifest never came: the receiver then knows nothing of the context)."""
    from kvtransport.embed.partial import partial_cache

    got = partial_cache(outcome, token_ids=context_ids, expected=stream.manifest)
    return got.cache, got.present


def link_profile(rate_mbps: float | None) -> Any:
    """The demo's link profile (kvtransport.demo.demo_links.PROFILE), at another rate if given."""
    from kvtransport.demo.demo_links import PROFILE
    from kvtransport.netem import load_profile

    return load_profile(PROFILE).with_overrides(rate_mbps, None)


REBUILD_BYTES_PER_S = 200e6
"""The receiver's rebuild speed assumed by the plan (dequantizing and placing blocks:
kvtransport.kvformat.blocks.decode_stream ran at 240-360 MB/s on int8/fp16 blocks on a loaded
2-core machine). A constant, not a measurement per run, so that a fixed compute speed
gives a fixed plan and deadline."""


def plan_stream(
    stream: Any,
    context_ids: list[int],
    profile: Any,
    speed: Any,
    budget_s: float,
    question_tokens: int,
    levels: tuple[str, ...],
    objective: str = "fidelity",
    order: str = "position",
    *,
    hedge: float,
    answer_s: float = 0.0,
    one_way_s: float | None = None,
) -> tuple[Any, Any, float]:
    """Plan the handoff (kvtransport.model.plan) for a TTFT budget and encode what it sends.

    The link's part of the budget is what is left after the receiver's own work once the
    cache is in place: rebuilding the received blocks (every block at the cheapest level,
    at REBUILD_BYTES_PER_S) and the question's forward pass. Returns (plan, the planned
    stream, the link's budget in seconds). order: the stream order
    (kvtransport.model.plan.ORDERS); hedge: the plan's hedge share (0: none); answer_s:
    the question's forward time on the receiver, for the plan's tail (0: none);
    one_way_s: the link's one-way delay (None: the profile's; a link that measured its
    round trip gives half of it).
    """
    from kvtransport.core.protocol import DEFAULT_SYMBOL_SIZE
    from kvtransport.model.plan import LinkEstimate, planned_stream

    link = LinkEstimate(
        rate_bps=profile.rate_bps,
        loss=float(profile.stationary_loss()),
        one_way_s=profile.delay_ms / 1e3 if one_way_s is None else one_way_s,
        symbol_size=DEFAULT_SYMBOL_SIZE,
    )
    g = stream.manifest.geometry
    rebuild_s = float(g.cost_table(levels[-1:]).sum()) / REBUILD_BYTES_PER_S
    link_budget = max(budget_s - float(speed.seconds(question_tokens)) - rebuild_s, 1e-3)
    plan, planned = planned_stream(stream, link=link, budget_s=link_budget, speed=speed,
                                   levels=levels, token_ids=np.asarray(context_ids),
                                   objective=objective, order=order,
                                   hedge_share=hedge, answer_s=answer_s)  # fmt: skip
    return plan, planned, link_budget
