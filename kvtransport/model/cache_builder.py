"""Build a context's exact KV cache front to back, each token range computed or loaded.

The receiver of a handoff knows the shared context's token ids. It can *compute* a range
of them itself (a forward pass at their own positions over the cache built so far: the
same arithmetic as a prefill, split in chunks) or *load* the range's K/V that crossed the
link. :class:`CacheBuilder` holds the model cache (a transformers ``DynamicCache`` whose
layers grow in place: kvtransport.model.model_cache) and appends ranges strictly in
position order, so every computed range attends to exactly the tokens before it, as in
one full prefill: computing every range reproduces the prefill
(within float rounding), and a mix of loaded and computed ranges is exact wherever the
loaded K/V are (up to their quantization). Recomputing what never arrived is the same
operation as computing the prefix, so there is one mechanism for compute-while-loading,
completion at the deadline and the dead-link fallback (see kvtransport.model.race).

:class:`ComputeSpeed` is the receiver's measured cost of computing ``n`` tokens in one
call (a fixed cost per call plus a cost per token, plus what a short call such as a
question pays per context token before it), which the handoff planner
(kvtransport.model.plan) and the race's wait-or-compute rule use.

torch and transformers are imported inside the functions (the model's edge).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtransport.errors import UserError
from kvtransport.kvformat.kvcache import KVCache

PAIR_CHUNK = 64
"""Tokens of the chunk that measures :attr:`ComputeSpeed.per_pair_s` (the demo's
questions are 20-40 tokens): long enough that what it pays per context token stands out
of the timing noise after a 512-token prefix."""


@dataclass(frozen=True)
class ComputeSpeed:
    """Seconds to compute ``n`` context tokens in one call: ``per_call_s + n * per_token_s``;
    ``per_pair_s``: what each token of a short call adds per context token before it (the
    attention over a long cache, which a question's forward pass pays: :meth:`answer_seconds`;
    0 when not measured); ``spread``: how far the measured rounds of a long prefix
    disagreed ((max - min) / median; 0 when given, not measured: :meth:`measure`)."""

    per_call_s: float
    per_token_s: float
    per_pair_s: float = 0.0
    spread: float = 0.0

    @property
    def trusted(self) -> bool:
        """The measured rounds agreed (:attr:`spread` within :data:`TRUST_LIMIT`); a speed
        that was given, not measured, is trusted. The planner prices one that is not
        trusted conservatively (kvtransport.model.plan.robust_speed)."""
        return self.spread <= TRUST_LIMIT

    def scaled(self, factor: float) -> ComputeSpeed:
        """Every cost times ``factor`` (> 0): the same receiver running that much slower."""
        if not factor > 0:
            raise ValueError(f"a speed's scale must be positive, not {factor}")
        return replace(self, per_call_s=self.per_call_s * factor,
                       per_token_s=self.per_token_s * factor,
                       per_pair_s=self.per_pair_s * factor)  # fmt: skip

    def learned(self, tokens: int, seconds: float) -> ComputeSpeed:
        """This speed corrected by one real call: ``tokens`` context tokens computed in
        ``seconds``. Outside :data:`LEARN_TOLERANCE` of the time it predicts, every cost is
        scaled so that it predicts the call's time (one timing says how much faster or
        slower the host is, not which of the costs changed); within it, unchanged (the
        timing noise of one call)."""
        predicted = float(self.seconds(tokens))
        if tokens <= 0 or not seconds > 0 or not predicted > 0:
            return self
        ratio = seconds / predicted
        if 1 / LEARN_TOLERANCE <= ratio <= LEARN_TOLERANCE:
            return self
        return self.scaled(ratio)

    def answer_seconds(self, question_tokens: int, context_tokens: int) -> float:
        """The time of a question's forward pass after a cache of ``context_tokens``."""
        return float(self.seconds(question_tokens)) + (
            question_tokens * context_tokens * self.per_pair_s
        )

    def seconds(self, tokens: int | np.ndarray) -> Any:
        """The time to compute ``tokens`` tokens in one call (0 for none)."""
        t = np.asarray(tokens, dtype=np.float64)
        some = t > 0
        out = np.where(some, self.per_call_s + np.where(some, t, 1.0) * self.per_token_s, 0.0)
        return float(out) if out.ndim == 0 else out

    @classmethod
    def measure(
        cls,
        model: Any,
        token_ids: Sequence[int],
        sizes: tuple[int, int] = (16, 512),
        pair_chunk: int = PAIR_CHUNK,
        repeats: int = 3,
        max_repeats: int = 7,
    ) -> ComputeSpeed:
        """Fit the three costs from timed chunks of this context on this model, in
        ``repeats`` rounds, more (up to ``max_repeats``) while the rounds disagree.

        Each round computes the small chunk after a prefix of the context of its length
        (a call's cost), then the large one (at most the context) from the start, as a
        planned prefix is (its cost per token includes the attention over a long chunk,
        which short chunks do not show; a line through two short chunks underestimated a
        600-token prefix by a quarter), and a ``pair_chunk``-token chunk after each: what
        a call pays per context token before it (``per_pair_s``: the chunk after the
        large prefix less the same chunk after twice the small one; a 16-token chunk's
        difference was within the timing noise). A context too short to tell the two
        apart (the large prefix less than ``pair_chunk`` beyond twice the small one) gets
        ``per_pair_s`` 0, not measured.

        Outliers: a shared host (or more torch threads than free cores) makes some calls
        several times slower, at random. The short calls take their fastest round each
        (an interrupted call is only ever slower), so ``per_pair_s``, a difference of two
        short calls, is the difference of their fastest rounds, never of one slow and one
        fast call; the large prefix takes the median of the rounds (the speed the host
        holds over a prefix's time). While the large prefix's rounds spread by more than
        :data:`SPREAD_LIMIT` of their median, another round is run (up to
        ``max_repeats``); :attr:`spread` is the spread left. Rounds still spread beyond
        :data:`TRUST_LIMIT` (not :attr:`trusted`, for the caller to warn on) give the
        fastest large prefix instead of the median (the host's uninterrupted speed); the
        planner then prices the receiver's prefix :attr:`spread` slower than that, about
        the slowest round (kvtransport.model.plan.robust_speed), and the race corrects it
        from its first real chunk (kvtransport.model.race). ``per_pair_s`` is capped
        by what the large prefix paid per causal pair (:func:`_pair_cost`).

        Cost: each round computes the large prefix once and three short calls (about three
        times one call of the large prefix alone); the live race measures once per model
        and keeps it (kvtransport.embed.live_race). Fewer than 2 context tokens raise
        ValueError.
        """
        small, large = sizes
        ids = list(token_ids)
        if len(ids) < 2:
            raise ValueError(f"measuring needs at least 2 context tokens, not {len(ids)}")
        large = min(large, len(ids))
        if large <= small:
            small = max(1, large // 4)
        q = max(1, min(pair_chunk, large))
        small_s: list[float] = []
        long_s: list[float] = []
        short_q: list[float] = []
        long_q: list[float] = []

        def timed(builder: CacheBuilder, n: int) -> float:
            t0 = time.perf_counter()
            builder.compute(n)
            return time.perf_counter() - t0

        while len(long_s) < max(1, repeats) or (
            _spread(long_s) > SPREAD_LIMIT and len(long_s) < max(repeats, max_repeats)
        ):
            b = CacheBuilder(model, ids[:small] + ids[:small] + ids[:q])
            b.compute(small)
            small_s.append(timed(b, small))
            short_q.append(timed(b, q))
            b = CacheBuilder(model, ids[:large] + ids[:q])
            long_s.append(timed(b, large))
            long_q.append(timed(b, q))
        spread = _spread(long_s)
        # rounds that still disagree: the fastest (an interrupted call is only slower);
        # the race corrects the plan from its first real chunk if the host stays slower
        prefix_s = float(np.median(long_s)) if spread <= TRUST_LIMIT else min(long_s)
        best = min(small_s)
        per_token = max((prefix_s - best) / (large - small), 1e-6)
        return cls(per_call_s=max(best - small * per_token, 0.0), per_token_s=per_token,
                   per_pair_s=_pair_cost(min(long_q) - min(short_q), q, large - 2 * small,
                                         large, prefix_s),
                   spread=spread)  # fmt: skip


SPREAD_LIMIT = 0.25
"""The spread of the large prefix's timed rounds (max less min, over the median) beyond
which :meth:`ComputeSpeed.measure` runs another round."""

TRUST_LIMIT = 0.5
"""The spread beyond which a measured speed is not trusted (:attr:`ComputeSpeed.trusted`):
the rounds still disagree that much after ``max_repeats`` rounds, so
:meth:`ComputeSpeed.measure` takes the fastest large prefix instead of their median."""

LEARN_TOLERANCE = 1.25
"""How far (as a ratio either way) one real call's time may be from a speed's prediction
before :meth:`ComputeSpeed.learned` rescales the speed."""


def _pair_cost(extra_s: float, q: int, apart: int, large: int, prefix_s: float) -> float:
    """Seconds per (question token, context token) pair: ``extra_s`` that a ``q``-token
    chunk paid for ``apart`` more context tokens before it (0: not measurable, ``apart``
    < ``q``), never more than the large prefix's whole time over its ``large**2 / 2``
    causal pairs (the prefix pays every pair, and more besides): a difference of two
    short calls one of which a busy host slowed cannot pass for attention cost."""
    if apart < q:
        return 0.0
    return min(max(extra_s, 0.0) / (q * apart), prefix_s / (large * large / 2))


def _spread(times: Sequence[float]) -> float:
    """(max - min) / median of ``times``; inf for fewer than two."""
    if len(times) < 2:
        return float("inf")
    return float((max(times) - min(times)) / max(float(np.median(times)), 1e-12))


class CacheBuilder:
    """The model cache of ``token_ids``, grown front to back by :meth:`compute` and
    :meth:`load`; :attr:`filled` tokens are in place. :meth:`kv` returns it as numpy.

    A context longer than the model's positions, or whose cache and largest call do not
    fit the memory available (kvtransport.model.model_cache.receiver_bytes: linear in the
    tokens), is refused with a one-line UserError before anything is allocated."""

    def __init__(self, model: Any, token_ids: Sequence[int]) -> None:
        from kvtransport.model import hf
        from kvtransport.model.model_cache import ANSWER_ROOM, check_context, new_model_cache

        hf.install_masked_attention(model)
        check_context(model, len(token_ids))  # positions and memory, before allocating
        self.model = model
        self.token_ids = [int(t) for t in token_ids]
        self.filled = 0
        # layers that grow in place: a range appended copies that range, not the cache
        self._cache = new_model_cache(model, len(self.token_ids) + ANSWER_ROOM)

    @property
    def model_cache(self) -> Any:
        """The model cache built so far (a transformers ``DynamicCache`` of ``filled``
        tokens), to answer from without a copy (kvtransport.model.hf.greedy_generate)."""
        return self._cache

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self._cache.layers)

    def compute(self, n: int) -> None:
        """Run the next ``n`` context tokens through the model at their own positions."""
        import torch

        from kvtransport.model import hf

        n = self._check(n)
        start = self.filled
        with torch.inference_mode(), hf.causal_chunks(self.model):
            hf.forward_at(self.model, self.token_ids[start : start + n], start, self._cache, 1)
        self.filled += n

    def load(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Append K/V ``[layers, kv_heads, n, head_dim]`` of the next ``n`` tokens."""
        import torch

        if keys.shape != values.shape or keys.ndim != 4:
            raise ValueError(f"keys {keys.shape} and values {values.shape} must match, 4-D")
        n = self._check(int(keys.shape[2]))
        dtype = self.model.dtype
        for layer in range(keys.shape[0]):
            k = torch.from_numpy(np.ascontiguousarray(keys[layer])).to(dtype)[None]
            v = torch.from_numpy(np.ascontiguousarray(values[layer])).to(dtype)[None]
            self._cache.update(k, v, layer)
        self.filled += n

    def answer(
        self,
        question_ids: Sequence[int],
        tail_layer: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> int:
        """The question's first answer token (greedy) after the whole context; the cache is
        left holding the context only.

        tail_layer: the context's tokens from :attr:`filled` to the end are loaded layer by
        layer while the question runs through the model: ``tail_layer(l)`` returns layer
        ``l``'s K/V ``[kv_heads, tokens, head_dim]`` of those tokens and is called just
        before layer ``l`` runs (layer 0 before the pass starts), so it may wait for them
        to arrive. If it raises, the exception propagates and the builder is as it was
        (``filled`` tokens in every layer). None: the context must be complete.
        """
        import torch

        from kvtransport.model import hf
        from kvtransport.model.model_cache import max_positions

        if len(question_ids) == 0:
            raise ValueError("the question has no tokens")
        limit = max_positions(self.model)
        if limit is not None and self.num_tokens + len(question_ids) > limit:
            raise UserError(f"{self.num_tokens} context and {len(question_ids)} question "
                            f"tokens exceed the model's {limit} positions")  # fmt: skip
        if tail_layer is None and self.filled < self.num_tokens:
            raise ValueError(f"{self.filled} of {self.num_tokens} context tokens in place")
        layers = self._cache.layers
        dtype = self.model.dtype
        hooks = []

        def load(layer: int) -> None:
            assert tail_layer is not None
            keys, values = tail_layer(layer)
            if keys.shape[1] != self.num_tokens - self.filled:
                raise ValueError(f"tail of layer {layer} has {keys.shape[1]} tokens, "
                                 f"{self.num_tokens - self.filled} are missing")  # fmt: skip
            k = torch.from_numpy(np.ascontiguousarray(keys)).to(dtype)[None]
            v = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)[None]
            layers[layer].update(k, v)

        try:
            with torch.inference_mode():
                if tail_layer is not None:
                    load(0)  # the pass's positions and mask read layer 0's length
                    for i, mod in enumerate(hf.decoder_layers(self.model)[1:], start=1):
                        hooks.append(mod.register_forward_pre_hook(
                            lambda *_, i=i: load(i)))  # fmt: skip
                out = hf.forward_at(self.model, question_ids, self.num_tokens, self._cache, 1)
                token = int(out.logits[0, -1].argmax())
        except BaseException:
            for layer in layers:
                layer.crop(self.filled - layer.get_seq_length())
            raise
        finally:
            for h in hooks:
                h.remove()
        for layer in layers:
            layer.crop(self.num_tokens - layer.get_seq_length())
        self.filled = self.num_tokens
        return token

    def kv(self) -> KVCache:
        """The cache built so far as numpy (``filled`` tokens; a copy)."""
        import torch

        from kvtransport.model.loader import model_id_of

        layers = self._cache.layers
        if self.filled == 0:
            raise ValueError("nothing built yet")
        keys = torch.stack([layer.keys[0] for layer in layers]).float().numpy()
        values = torch.stack([layer.values[0] for layer in layers]).float().numpy()
        return KVCache(
            keys=keys,
            values=values,
            token_ids=np.asarray(self.token_ids[: self.filled], dtype=np.int64),
            model_id=model_id_of(self.model),
        )

    def _check(self, n: int) -> int:
        if not 0 < n <= self.num_tokens - self.filled:
            raise ValueError(f"cannot add {n} tokens at {self.filled} of {self.num_tokens}")
        return n
