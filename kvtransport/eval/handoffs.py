"""Real-model handoffs (the figures on F1, the ablation and TTFT).

A :class:`Case` is one task prompt that the real model (kvtransport.model.loader)
prefilled once: its KV cache, block utilities (kvtransport.model.utility with the packaged
layer weights, as the demo and the cards use) and the full cache's greedy answer, which is
both the clean reference answer and the teacher-forcing reference for top-1 agreement
(:func:`reference_answer`). :meth:`Case.stream` serializes the cache as a block stream
(kvtransport.model.encoding.encode_cache, fp16 blocks of 16 tokens by default: 12 KiB
blocks, the unit the policy evaluation uses) in utility or position order. :func:`deliver`
sends it through the simulator (kvtransport.sim.simulator: the real sender and receiver
sessions over the channel model, the run ``kvtransport simulate`` and the demo's emulated
link make for the same seed) and rebuilds what arrived (kvtransport.demo.demo_model.rebuild:
kvtransport.kvformat.blocks.decode_stream, all masked if the manifest never came).
:meth:`Case.answer` injects the partial cache with the missing blocks masked per layer and
decodes greedily (kvtransport.demo.demo_model.answer); answers and agreements are memoized
per presence mask, because two deliveries that hold the same blocks hold the same cache
and get the same greedy answer (at rho >= 1 most schemes deliver everything).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransport.eval.registries import FAMILIES

BLOCK_TOKENS = 16
CASE_SEED = 50_000
"""Prompt seeds of the real-model figures start here: disjoint from the sensitivity
calibration's (small), the utility development's (20000+), eval_retention's (10000+) and
eval_quant's (30000+)."""


def layer_weights_for(
    model_id: str, num_layers: int, profile: str | None = None
) -> np.ndarray | None:
    """Layer weights from a sensitivity profile file, else the packaged one, else None."""
    from kvtransport.model import sensitivity, utility

    if profile is None:
        return utility.default_layer_weights(model_id, num_layers)
    if profile == "uniform":
        return None
    prof = sensitivity.load_profile(profile)
    if prof.num_layers != num_layers:
        raise SystemExit(f"{profile}: {prof.num_layers} layers, the model has {num_layers}")
    return prof.weights(ratio=utility.LAYER_RATIO)


def weights_label(profile: str | None, weights: np.ndarray | None) -> str:
    """How the layer weights were chosen, for a report's meta block."""
    return (profile or "packaged profile") if weights is not None else "uniform"


def reference_answer(
    model: Any, tokenizer: Any, kv: Any, question: Any, max_tokens: int = 32
) -> list[int]:
    """The full cache's greedy answer, ending with the stop token when it stopped."""
    from kvtransport.model import hf

    gen = hf.greedy_generate(model, kv, question, max_new_tokens=max_tokens)
    stops = hf.stop_ids_of(model)  # the ids greedy_generate stops on
    return gen.tokens + ([stops[0]] if gen.stopped and len(stops) == 1 else [])


def ttft_prefill(model: Any, ids: list[int]) -> tuple[float, int]:
    """Seconds to prefill ``ids`` in one call and the first token it predicts."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.arange(len(ids))[None],
            use_cache=True,
            logits_to_keep=1,
        )
        tok = int(out.logits[0, -1].argmax())
    return time.perf_counter() - t0, tok


def layer_weights(lm: Any) -> np.ndarray | None:
    from kvtransport.model import utility

    return utility.default_layer_weights(lm.model_id, lm.num_layers)


@dataclass(eq=False)
class Case:
    """One prompt prefilled once by the real model (see the module docstring)."""

    family: str
    sample: Any
    context_ids: list[int]
    question_ids: list[int]
    kv: Any  # kvtransport.kvformat.kvcache.KVCache (fp32, as prefilled)
    utilities: np.ndarray  # [layers, token_blocks]
    reference: list[int]  # the full cache's greedy answer (+ its stop token)
    full_answer: str
    precision: str = "fp16"
    prefill_s: float = 0.0
    _streams: dict[str, tuple[Any, Any]] = field(default_factory=dict, repr=False)
    _answers: dict[bytes, str] = field(default_factory=dict, repr=False)
    _top1: dict[bytes, float] = field(default_factory=dict, repr=False)

    @property
    def golds(self) -> tuple[str, ...]:
        return tuple(self.sample.answers)

    def stream(self, order: str = "utility") -> tuple[Any, Any]:
        """(kvtransport.kvformat.blocks.EncodedStream, kvtransport.core.transfer.Transfer) in
        ``order`` (utility or position; the block utilities are the same either way)."""
        if order not in self._streams:
            from kvtransport.model import encoding

            st = encoding.encode_cache(
                self.kv,
                utilities=self.utilities,
                block_tokens=BLOCK_TOKENS,
                precision=self.precision,
                order=order,
                created={
                    "by": "scripts/evaluate.py",
                    "task": self.sample.task,
                    "seed": self.sample.seed,
                },
            )
            self._streams[order] = (st, st.to_transfer())
        return self._streams[order]

    def answer(self, lm: Any, kv: Any, present: np.ndarray, max_new_tokens: int) -> str:
        """The greedy answer from a (partial) cache, memoized per presence mask."""
        from kvtransport.demo.demo_model import answer

        key = mask_key(present)
        if key not in self._answers:
            self._answers[key] = answer(lm, kv, present, self.question_ids, max_new_tokens)[0]
        return self._answers[key]

    def top1(self, lm: Any, kv: Any, present: np.ndarray) -> float:
        """Teacher-forced top-1 agreement with the full cache's answer, memoized."""
        from kvtransport.model import hf

        key = mask_key(present)
        if key not in self._top1:
            p = None if present.all() else present
            self._top1[key] = hf.top1_agreement(
                lm.model, kv, self.question_ids, self.reference, present=p
            )
        return self._top1[key]


def mask_key(present: np.ndarray) -> bytes:
    """A short key for a presence mask (all present: b"all")."""
    if present.all():
        return b"all"
    return hashlib.blake2b(np.packbits(present).tobytes(), digest_size=16).digest()


def samples(lm: Any, family: str, n: int, tokens: int, seed: int = CASE_SEED) -> list[Any]:
    """``n`` task samples of a family (cycling through its tasks), seeds from ``seed``."""
    from kvtransport.model import tasks

    names = FAMILIES[family]
    return [
        tasks.generate(names[i % len(names)], lm.tokenizer, target_tokens=tokens, seed=seed + i)
        for i in range(n)
    ]


def prepare_case(
    lm: Any, sample: Any, family: str, *, precision: str = "fp16", max_new_tokens: int = 24
) -> Case:
    """Prefill one prompt (with the SnapKV attention probe), score its blocks and take the
    full cache's greedy answer."""
    from kvtransport.model import hf, utility

    ctx, question = sample.prompt(lm.tokenizer)
    t0 = time.perf_counter()
    kv = hf.prefill(lm.model, lm.tokenizer, ctx, window=utility.OBSERVATION_WINDOW)
    prefill_s = time.perf_counter() - t0
    u = utility.cache_utility(kv, BLOCK_TOKENS, layer_weights(lm))
    ref = reference_answer(lm.model, lm.tokenizer, kv, question, max_new_tokens)
    text = lm.tokenizer.decode(ref, skip_special_tokens=True).strip()
    return Case(family, sample, ctx, question, kv, u, ref, text, precision, prefill_s)


@dataclass
class Delivery:
    """What one transfer of a case's stream delivered, rebuilt for injection."""

    utility: float  # utility recovered before the deadline (0..1)
    blocks_missing: int
    blocks_total: int
    reason: str  # the receiver's: "complete" or "deadline" (or "idle", ...)
    transfer_s: float  # link time until the receiver's result
    rebuild_s: float  # decode_stream: verify and place every complete block
    kv: Any
    present: np.ndarray  # [layers, tokens] per-layer presence mask


def deliver(
    case: Case, order: str, policy: Any, *, channel: str, rho: float, seed: int
) -> Delivery:
    """Send the case's stream through the simulator once and rebuild what arrived."""
    from kvtransport.demo.demo_links import LinkOutcome
    from kvtransport.demo.demo_model import rebuild
    from kvtransport.sim.simulator import make_simulation

    stream, transfer = case.stream(order)
    sim = make_simulation(
        transfer, channel=channel, rho=rho, policy=policy, seed=seed, record=False
    )
    sim.run()
    res = sim.receiver.result
    assert res is not None  # run() goes on until the receiver's result
    end = res.timings.get("complete") if res.reason == "complete" else None
    transfer_s = float(end if end is not None else res.timings.get("finished", sim.deadline))
    outcome = LinkOutcome(
        utility=float(res.utility_recovered),
        reason=res.reason,
        complete=res.complete,
        payload=res.payload,
        app_metadata=res.app_metadata,
        transfer_s=transfer_s,
    )
    t0 = time.perf_counter()
    kv, present = rebuild(stream, outcome, case.context_ids)
    rebuild_s = time.perf_counter() - t0
    n = stream.manifest.num_blocks
    missing = int((~res.complete).sum()) if res.app_metadata is not None else n
    return Delivery(outcome.utility, missing, n, res.reason, transfer_s, rebuild_s, kv, present)
