"""A transformers cache whose layers grow in place, for caches built piece by piece.

transformers' ``DynamicLayer`` appends by concatenation: every update copies the whole
layer. A receiver that builds a context's cache range by range (kvtransport.model.cache_builder:
a 16-token range loaded or computed at a time) then copies the cache once per range, a
cost quadratic in the context that lands on its time to first token; so does every
generated token of an answer. :class:`GrowingLayer` keeps each layer in a preallocated
buffer ``[batch, kv_heads, capacity, head_dim]`` and writes new tokens in place (doubling
the buffer when full, so appends stay linear overall); ``keys`` / ``values`` are views of
the filled part, which is all the attention reads.

:func:`new_model_cache` gives a ``DynamicCache`` made of such layers, for a model and a
capacity in tokens. It behaves as transformers' own (same update, length, crop), so the
cache a receiver builds is the one its model answers from, with no copy in between.

Imports torch and transformers (the model's edge): import this module lazily.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64
ANSWER_ROOM = 256
"""Tokens of room to leave past a context in its cache's buffers: a question and the
start of its answer append there without growing them."""


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` over a preallocated buffer (module docstring).

    capacity: tokens the first buffer holds (it doubles when an update needs more). For
    inference only: the buffers are inference tensors (no autograd through the cache).
    Contract: after any update or crop, ``keys`` / ``values`` are ``[b, h, n, d]`` views
    of the first ``n`` buffer slots, ``n`` = :meth:`get_seq_length`.
    """

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        super().__init__()
        self.capacity = max(int(capacity), 1)
        self.filled = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty((b, h, self.capacity, d))
        self._v = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.filled = 0
        self._views()
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():  # the buffers are inference tensors, wherever called
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            assert self._k is not None and self._v is not None
            n = key_states.shape[-2]
            end = self.filled + n
            if end > self._k.shape[-2]:
                self._grow(end)
            self._k[..., self.filled : end, :].copy_(key_states)
            self._v[..., self.filled : end, :].copy_(value_states)
            self.filled = end
            self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a
        negative count; 0 does nothing)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.filled = max(self.filled + tokens_to_remove, 0)
        self._views()

    def reset(self) -> None:
        self._k = self._v = None
        self.filled = 0
        super().reset()

    def _grow(self, need: int) -> None:
        assert self._k is not None and self._v is not None
        cap = max(need, 2 * self._k.shape[-2])
        k = self._k.new_empty((*self._k.shape[:2], cap, self._k.shape[-1]))
        v = self._v.new_empty((*self._v.shape[:2], cap, self._v.shape[-1]))
        k[..., : self.filled, :].copy_(self._k[..., : self.filled, :])
        v[..., : self.filled, :].copy_(self._v[..., : self.filled, :])
        self._k, self._v = k, v

    def _views(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[..., : self.filled, :]
        self.values = self._v[..., : self.filled, :]


def new_model_cache(model: Any, capacity: int) -> Any:
    """An empty ``DynamicCache`` for ``model`` whose full-attention layers grow in place
    (:class:`GrowingLayer`), each with room for ``capacity`` tokens before it grows; other
    layer kinds (sliding windows) stay transformers' own."""
    cache = DynamicCache(config=model.config)
    room = max(int(capacity), MIN_CAPACITY)
    cache.layers = [
        GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
