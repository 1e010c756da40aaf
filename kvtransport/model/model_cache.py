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

Sliding-window layers (Mistral, windowed Qwen2, Gemma-2's alternate layers) keep every
token too: transformers' ``DynamicSlidingWindowLayer`` drops the keys that fell out of the
window, so a context computed in chunks would lose the keys the next chunk's first tokens
still see (and it cannot be cropped back past its window). With every token kept, the
model's own mask builder applies the window (``create_sliding_window_causal_mask`` reads
``config.sliding_window``, and a full layer reports its whole length and offset 0), so a
chunk attends to exactly the window it would in one pass. :func:`check_model` refuses,
with one line naming the layer, the models whose cache or attention this cannot build
exactly.

Imports torch and transformers (the model's edge): import this module lazily.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvtransport.errors import UserError

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


def cache_bytes(config: Any, tokens: int, itemsize: int = 4) -> int:
    """Bytes of a model cache of ``tokens`` tokens: every layer's keys and values
    (``[kv_heads, tokens, head_dim]`` each, ``itemsize`` bytes an element; sliding-window
    layers keep every token too: module docstring)."""
    layers = int(config.num_hidden_layers)
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 2 * layers * heads * dim * int(tokens) * itemsize


def chunk_bytes(config: Any, tokens: int, itemsize: int = 4) -> int:
    """An upper estimate of the working memory of one forward call of ``tokens`` tokens
    (the hidden states and one layer's MLP activations at a time; attention runs on the
    flash kernel, whose scores never take ``tokens**2`` memory)."""
    hidden = int(config.hidden_size)
    inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    return int(tokens) * itemsize * (6 * hidden + 3 * inner)


def receiver_bytes(model: Any, tokens: int) -> int:
    """The memory a receiver needs beyond the model's weights to build and answer from the
    cache of a ``tokens``-token context: its model cache with :data:`ANSWER_ROOM` (at the
    model's dtype) and one call computing the whole context (the largest the race makes)."""
    item = torch.empty((), dtype=model.dtype).element_size()
    return cache_bytes(model.config, tokens + ANSWER_ROOM, item) + chunk_bytes(
        model.config, tokens, item
    )


def max_positions(model: Any) -> int | None:
    """The longest sequence ``model`` was made to attend over (its config's
    ``max_position_embeddings``), or None when the config does not say."""
    n = getattr(model.config, "max_position_embeddings", None)
    return int(n) if n else None


def available_bytes() -> int | None:
    """The memory the kernel says is available to start new work (``MemAvailable`` of
    /proc/meminfo), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_context(model: Any, tokens: int, *, extra_bytes: int = 0) -> None:
    """Refuse, with a one-line UserError, a context of ``tokens`` tokens (question and
    answer included) longer than the model's positions (:func:`max_positions`: a model
    attends past its trained length with no sane answers), or whose receiver memory
    (:func:`receiver_bytes`, plus ``extra_bytes`` the caller holds besides) exceeds the
    memory available now (:func:`available_bytes`)."""
    limit = max_positions(model)
    if limit is not None and tokens > limit:
        raise UserError(f"{tokens} tokens exceed the model's {limit} positions "
                        "(max_position_embeddings): shorten the context")  # fmt: skip
    need = receiver_bytes(model, tokens) + extra_bytes
    have = available_bytes()
    if have is not None and need > have:
        raise UserError(f"a {tokens}-token cache needs about {need / 2**20:.0f} MiB, "
                        f"{have / 2**20:.0f} MiB are available")  # fmt: skip


def new_model_cache(model: Any, capacity: int) -> Any:
    """An empty ``DynamicCache`` for ``model`` whose layers, sliding-window ones included,
    keep every token and grow in place (:class:`GrowingLayer`), each with room for
    ``capacity`` tokens before it grows (module docstring). The model must pass
    :func:`check_model`."""
    check_model(model)
    room = max(int(capacity), MIN_CAPACITY)
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer(room) for _ in cache.layers]
    return cache


def sliding_windows(config: Any) -> list[int | None]:
    """Per layer, the window of a sliding-window layer (tokens a query sees, itself
    included) or None for full attention, as transformers' own cache for ``config`` has
    them."""
    layers = DynamicCache(config=config).layers
    return [
        int(layer.sliding_window) if isinstance(layer, DynamicSlidingWindowLayer) else None
        for layer in layers
    ]


def check_model(model: Any) -> None:
    """Raise a one-line UserError when ``model``'s cache cannot be built exactly in chunks
    and answered from (the race, partial recompute, the answer step): an encoder-decoder,
    a cache layer other than full or sliding-window attention (chunked attention, linear
    attention, state-space layers), attention logit soft-capping (Gemma-2's), or any model
    whose attention transformers does not run on SDPA (kvtransport's attention is SDPA with
    masks). Checked once per model object."""
    if getattr(model, "_kvt_checked", False):
        return
    cfg = model.config
    name = type(model).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise UserError(f"{name} is an encoder-decoder model: kvtransport carries the "
                        "KV cache of a decoder-only causal LM")  # fmt: skip
    cap = getattr(cfg, "attn_logit_softcapping", None)
    if cap is not None:
        raise UserError(f"{name}: attention logit soft-capping ({cap}) is not supported by "
                        "the race's chunked compute yet (SDPA does not apply it)")  # fmt: skip
    if not getattr(model, "_supports_sdpa", True):
        raise UserError(f"{name}: its attention does not run on PyTorch SDPA, which the "
                        "race's chunked compute uses")  # fmt: skip
    types = list(getattr(cfg, "layer_types", None) or [])
    for i, kind in enumerate(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise UserError(f"{name}: {kind} (layer {i}) is not supported by the race's "
                            "chunked compute yet")  # fmt: skip
    for i, layer in enumerate(DynamicCache(config=cfg).layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise UserError(f"{name}: cache layer {type(layer).__name__} (layer {i}) is not "
                            "supported by the race's chunked compute yet")  # fmt: skip
    model._kvt_checked = True
