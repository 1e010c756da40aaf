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
call (a fixed cost per call plus a cost per token), which the handoff planner
(kvtransport.model.plan) and the race's wait-or-compute rule use.

torch and transformers are imported inside the functions (the model's edge).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransport.model.kvcache import KVCache


@dataclass(frozen=True)
class ComputeSpeed:
    """Seconds to compute ``n`` context tokens in one call: ``per_call_s + n * per_token_s``."""

    per_call_s: float
    per_token_s: float

    def seconds(self, tokens: int | np.ndarray) -> Any:
        """The time to compute ``tokens`` tokens in one call (0 for none)."""
        t = np.asarray(tokens, dtype=np.float64)
        some = t > 0
        out = np.where(some, self.per_call_s + np.where(some, t, 1.0) * self.per_token_s, 0.0)
        return float(out) if out.ndim == 0 else out

    @classmethod
    def measure(
        cls, model: Any, token_ids: Sequence[int], sizes: tuple[int, int] = (16, 512)
    ) -> ComputeSpeed:
        """Fit the two costs from timed chunks of this context on this model.

        The small chunk is computed after a prefix of the context of its length (the
        faster of two runs): the cost of a call. The large one (at most the context) is
        computed from the start, as a planned prefix is: its cost per token includes the
        attention over a long chunk, which short chunks do not show (a line through two
        short chunks underestimated a 600-token prefix by a quarter).
        """
        small, large = sizes
        ids = list(token_ids)
        large = min(large, len(ids))
        if large <= small:
            small = max(1, large // 4)
        best = float("inf")
        for _ in range(2):
            b = CacheBuilder(model, ids[: 2 * small])
            b.compute(small)
            t0 = time.perf_counter()
            b.compute(small)
            best = min(best, time.perf_counter() - t0)
        b = CacheBuilder(model, ids[:large])
        t0 = time.perf_counter()
        b.compute(large)
        long_s = time.perf_counter() - t0
        per_token = max((long_s - best) / (large - small), 1e-6)
        return cls(per_call_s=max(best - small * per_token, 0.0), per_token_s=per_token)


class CacheBuilder:
    """The model cache of ``token_ids``, grown front to back by :meth:`compute` and
    :meth:`load`; :attr:`filled` tokens are in place. :meth:`kv` returns it as numpy."""

    def __init__(self, model: Any, token_ids: Sequence[int]) -> None:
        from kvtransport.model import hf
        from kvtransport.model.model_cache import ANSWER_ROOM, new_model_cache

        hf.install_masked_attention(model)
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
