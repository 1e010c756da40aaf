"""KV caches in and out of a HuggingFace causal LM, including partial caches.

Out: ``prefill`` runs the context once and returns a numpy ``KVCache`` (keys, values,
token ids) with SnapKV-style attention statistics: per layer, the attention mass each
context token receives from an observation window of the last ``window`` queries,
averaged over the window and the heads (each layer's row sums to 1).

In: a receiver holds a ``KVCache`` plus ``present: bool[layers, tokens]`` saying which
(layer, token) slots arrived. ``mode="mask"`` (the default) keeps every slot in the model
cache (missing ones zero-filled, never NaN) and hides a missing slot from *its own layer
only*, through transformers' attention-function interface: a token whose layer-7 block was
lost is still seen by layer 8. ``mode="zero"`` zero-fills missing slots without masking, the
naive baseline. Positions never shift: every slot keeps its place and new tokens are fed
with explicit ``position_ids`` (``generate()`` would derive positions from the attention
mask's cumulative sum, which is wrong once slots are masked), hence the small greedy loop.

How the hook works (checked on transformers 5.24; docs/results.md, "Facts the design rests on"):
an attention function and a mask builder are registered under one name and the model is
switched to it. The function delegates to stock SDPA with the causal mask AND-ed with the
layer's visibility, which rides on the attention module itself (``_kvt_visible``) only for
the duration of a ``layer_visibility`` block. With no visibility set it *is* stock SDPA.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtransport.kvformat.kvcache import KVCache

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: Name under which the masking attention is registered with transformers.
ATTN_IMPLEMENTATION = "kvtransport_masked_sdpa"
MODES = ("mask", "zero")
_registered = False


# ----------------------------------------------------------------------------- attention hook


def _causal_mask(q_len: int, kv_len: int, device: Any) -> torch.Tensor:
    """Bottom-right aligned causal mask (B=1, 1, q, kv): query i sits at slot kv-q+i."""
    import torch

    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]


class _AttentionProbe:
    """Collects attention mass per layer from the last ``window`` queries (None: all).

    Computes softmax(q k^T) only for those queries, so a long prefill never materializes
    its full tokens x tokens attention matrix.
    """

    def __init__(self, num_layers: int, window: int | None) -> None:
        self.window = window
        self.mass: list[np.ndarray | None] = [None] * num_layers

    def stacked(self) -> np.ndarray:
        """float32 ``[layers, tokens]``: every layer's mass (each layer must have run)."""
        if any(m is None for m in self.mass):
            raise RuntimeError("the attention probe missed a layer")
        return np.stack([m for m in self.mass if m is not None]).astype(np.float32)

    def record(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None
    ) -> None:
        import torch
        from transformers.integrations.sdpa_attention import repeat_kv

        q_len, kv_len = query.shape[2], key.shape[2]
        w = q_len if self.window is None else min(self.window, q_len)
        q = query[:, :, q_len - w :, :]
        k = repeat_kv(key, query.shape[1] // key.shape[1])
        scores = torch.matmul(q, k.transpose(-1, -2)) * float(module.scaling)
        if mask is None:  # causal: only the window's rows, never the full q x kv mask
            m = _causal_mask(w, kv_len, query.device)
        else:
            m = mask[..., q_len - w :, :]
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m
        probs = torch.softmax(scores.float(), dim=-1)  # [1, heads, w, kv]
        self.mass[module.layer_idx] = probs.mean(dim=(0, 1, 2)).cpu().numpy()


def _causal_chunk_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Any
) -> torch.Tensor | None:
    """Attention of ``q`` new tokens that follow ``p = kv - q`` cached ones, causal, as two
    flash-kernel calls merged by their log-sum-exp: the new tokens over the cached keys
    (all visible, dense) and over themselves (square, causal). That is exactly the work of
    a one-shot causal prefill's rows; one SDPA call with the bottom-right causal mask
    computes all q x kv scores (q^2 / 2 of them masked out) on a slower masked kernel.
    Returns [batch, q, heads, dim] as transformers' SDPA does; None where the flash CPU
    kernel is not available (the caller uses SDPA with a mask then)."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or query.device.type != "cpu":
        return None
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    p = kv_len - q_len
    scale = None if scale is None else float(scale)
    own, own_lse = op(query, key[:, :, p:], value[:, :, p:], 0.0, True, scale=scale)
    if p:
        past, past_lse = op(query, key[:, :, :p], value[:, :, :p], 0.0, False, scale=scale)
        lse = torch.logaddexp(past_lse, own_lse)
        own = past * torch.exp(past_lse - lse)[..., None].to(past.dtype) + own * torch.exp(
            own_lse - lse
        )[..., None].to(own.dtype)
    return own.transpose(1, 2).contiguous()


@contextmanager
def causal_chunks(model: Any) -> Iterator[None]:
    """While active, the model's forward calls are plain causal continuations (batch 1,
    no padding, the new tokens right after the cached ones): the full-attention layers'
    attention may ignore the mask transformers passes and use
    :func:`_causal_chunk_attention`; sliding-window layers keep the mask (their window)."""
    from kvtransport.model.model_cache import sliding_windows

    windows = sliding_windows(model.config)
    mods = [m for m in _attention_modules(model) if windows[m.layer_idx] is None]
    for mod in mods:
        mod._kvt_causal_chunks = True
    try:
        yield
    finally:
        for mod in mods:
            mod.__dict__.pop("_kvt_causal_chunks", None)


def _masked_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Stock SDPA with this layer's cached-slot visibility AND-ed into the causal mask."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    visible = getattr(module, "_kvt_visible", None)
    probe = getattr(module, "_kvt_probe", None)
    if (
        visible is None
        and probe is None
        and 1 < q_len < kv_len
        and getattr(module, "_kvt_causal_chunks", False)
    ):
        out = _causal_chunk_attention(module, query, key, value, kwargs.get("scaling"))
        if out is not None:
            return out, None
    if visible is not None:
        if attention_mask is None:
            attention_mask = _causal_mask(q_len, kv_len, query.device)
        keep = torch.ones(kv_len, dtype=torch.bool, device=query.device)
        keep[: visible.shape[0]] = visible
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & keep
        else:  # an additive float mask
            attention_mask = attention_mask.masked_fill(~keep, torch.finfo(query.dtype).min)
    elif attention_mask is None and 1 < q_len != kv_len:
        # Guard: stock SDPA's is_causal path would crop the keys to q_len here.
        attention_mask = _causal_mask(q_len, kv_len, query.device)
    if probe is not None:
        probe.record(module, query, key, attention_mask)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def install_masked_attention(model: Any) -> None:
    """Register the masking attention (once per process) and switch ``model`` to it;
    a model kvtransport cannot serve exactly is refused first (one-line UserError:
    kvtransport.model.model_cache.check_model)."""
    global _registered
    from kvtransport.model.model_cache import check_model

    check_model(model)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, _masked_sdpa)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers, first to last (the modules a forward pass runs in
    order, each over its own layer of the cache)."""
    mods = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
    if len(mods) != model.config.num_hidden_layers:
        raise ValueError(f"found {len(mods)} decoder layers, the config says "
                         f"{model.config.num_hidden_layers}")  # fmt: skip
    return mods


def _attention_modules(model: Any) -> list[Any]:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    mods.sort(key=lambda m: m.layer_idx)
    if len(mods) != model.config.num_hidden_layers:
        raise RuntimeError(
            f"found {len(mods)} attention modules for {model.config.num_hidden_layers} layers"
        )
    return mods


@contextmanager
def layer_visibility(model: Any, present: np.ndarray | None) -> Iterator[None]:
    """While active, layer l attends only to cached slots t with ``present[l, t]``.

    Slots beyond ``present.shape[1]`` (tokens fed after the cache) are always visible,
    subject to causality. ``None`` means no masking (stock SDPA).
    """
    import torch

    install_masked_attention(model)
    mods = _attention_modules(model)
    saved = [mod.__dict__.pop("_kvt_visible", None) for mod in mods]
    if present is not None:
        present = np.asarray(present, dtype=bool)
        if present.ndim != 2 or present.shape[0] != len(mods):
            raise ValueError(f"present {present.shape} must be [{len(mods)} layers, tokens]")
        for mod, row in zip(mods, present, strict=True):
            mod._kvt_visible = torch.from_numpy(row.copy())
    try:
        yield
    finally:
        for mod, old in zip(mods, saved, strict=True):
            mod.__dict__.pop("_kvt_visible", None)
            if old is not None:
                mod._kvt_visible = old


@contextmanager
def _probing(model: Any, window: int | None) -> Iterator[_AttentionProbe]:
    mods = _attention_modules(model)
    probe = _AttentionProbe(len(mods), window)
    for mod in mods:
        mod._kvt_probe = probe
    try:
        yield probe
    finally:
        for mod in mods:
            mod.__dict__.pop("_kvt_probe", None)


# ----------------------------------------------------------------------------- prefill


def model_id_of(model: Any) -> str:
    """The model_id kvtransport.model.loader.load_model attached (``kvt_model_id``), else the
    config's name_or_path."""
    return str(getattr(model, "kvt_model_id", None) or model.config.name_or_path)


def _as_ids(tokenizer: Any, text_or_ids: str | Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(text_or_ids, str):
        from kvtransport.model.prompt import chat_prompt

        return chat_prompt(tokenizer, text_or_ids)[0]
    ids = [int(t) for t in np.asarray(text_or_ids).reshape(-1)]
    if not ids:
        raise ValueError("nothing to prefill: empty token list")
    return ids


def prefill(
    model: Any,
    tokenizer: Any,
    text_or_ids: str | Sequence[int] | np.ndarray,
    *,
    window: int = 32,
    attention: bool = True,
) -> KVCache:
    """Run the context through the model once and return its KV cache as numpy.

    text_or_ids: a context string (wrapped as the user turn's context by
        ``kvtransport.model.prompt.chat_prompt``, the same split a question is later appended to)
        or token ids used as they are.
    window: size of the SnapKV observation window (the context's last queries).
    attention: collect the attention statistics (``KVCache.attention``); a little slower.
    A context longer than the model's positions or too large for the memory available is
    refused (kvtransport.model.model_cache.check_context).
    """
    import torch

    from kvtransport.model.model_cache import check_context, new_model_cache

    ids = _as_ids(tokenizer, text_or_ids)
    install_masked_attention(model)
    check_context(model, len(ids))  # positions and memory: one-line UserError
    cache = new_model_cache(model, len(ids))  # sliding-window layers keep every token too
    with torch.inference_mode():
        if attention:
            with _probing(model, window) as probe:
                forward_at(model, ids, 0, cache, 1)
        else:
            forward_at(model, ids, 0, cache, 1)
    keys = np.stack([layer.keys[0].float().numpy() for layer in cache.layers])
    values = np.stack([layer.values[0].float().numpy() for layer in cache.layers])
    att = probe.stacked() if attention else None
    return KVCache(
        keys=keys,
        values=values,
        token_ids=np.asarray(ids, dtype=np.int64),
        model_id=model_id_of(model),
        attention=att,
    )


# ----------------------------------------------------------------------------- injection


def full_presence(kv: KVCache) -> np.ndarray:
    """A presence mask with every (layer, token) slot present."""
    return np.ones((kv.num_layers, kv.num_tokens), dtype=bool)


def _check_present(kv: KVCache, present: np.ndarray | None) -> np.ndarray | None:
    if present is None:
        return None
    present = np.asarray(present, dtype=bool)
    if present.shape != (kv.num_layers, kv.num_tokens):
        raise ValueError(f"present {present.shape} != ({kv.num_layers}, {kv.num_tokens})")
    return present


def to_model_cache(model: Any, kv: KVCache, present: np.ndarray | None = None) -> Any:
    """A transformers ``DynamicCache`` holding ``kv``; slots not ``present`` are zeros.

    Zero (never NaN: one NaN poisons every logit even when masked) is only the filler;
    whether the model may attend to those slots is decided by ``layer_visibility``.
    """
    import torch

    from kvtransport.model.model_cache import ANSWER_ROOM, new_model_cache

    present = _check_present(kv, present)
    cfg = model.config
    geometry = (cfg.num_hidden_layers, cfg.num_key_value_heads)
    if (kv.num_layers, kv.num_kv_heads) != geometry:
        raise ValueError(
            f"cache of {kv.model_id} ({kv.num_layers} layers, {kv.num_kv_heads} kv heads) "
            f"does not fit model {model_id_of(model)} {geometry}"
        )
    dtype = model.dtype
    cache = new_model_cache(model, kv.num_tokens + ANSWER_ROOM)
    for layer in range(kv.num_layers):
        k = torch.from_numpy(np.ascontiguousarray(kv.keys[layer])).to(dtype)[None]
        v = torch.from_numpy(np.ascontiguousarray(kv.values[layer])).to(dtype)[None]
        if present is not None and not present[layer].all():
            gone = torch.from_numpy(~present[layer])
            k = k.clone()
            v = v.clone()
            k[:, :, gone] = 0
            v[:, :, gone] = 0
        cache.update(k, v, layer)
    return cache


def forward_at(model: Any, ids: Sequence[int], start: int, cache: Any, keep: int) -> Any:
    """One forward pass of ``ids`` at positions ``start...`` (explicit, never derived
    from a mask) over the model ``cache``, which it appends to; logits for the last
    ``keep`` tokens (0: all). Call it inside ``torch.inference_mode()``."""
    import torch

    n = len(ids)
    return model(
        input_ids=torch.tensor([list(ids)], dtype=torch.long),
        position_ids=torch.arange(start, start + n, dtype=torch.long)[None],
        cache=cache,
        use_cache=True,
        logits_to_keep=keep,
    )


@contextmanager
def _opened(
    model: Any, kv: KVCache | Any, present: np.ndarray | None, mode: str
) -> Iterator[tuple[Any, int]]:
    """(model cache, its length) for ``kv`` with the layer visibility ``present`` gives,
    for the duration of the block.

    kv: a numpy :class:`KVCache` (injected into a new model cache) or a model cache built
    in place (kvtransport.model.cache_builder.CacheBuilder.model_cache: whole, so
    ``present`` must be None), used as is and cropped back to its length afterwards, so
    the caller can ask it another question.
    """
    if isinstance(kv, KVCache):
        present = _check_present(kv, present)
        with layer_visibility(model, _visibility(kv, present, mode)):
            yield to_model_cache(model, kv, present), kv.num_tokens
        return
    if present is not None:
        raise ValueError("a built model cache is whole: present must be None")
    length = int(kv.get_seq_length())
    try:
        yield kv, length
    finally:
        kv.crop(length - int(kv.get_seq_length()))


def _visibility(kv: KVCache, present: np.ndarray | None, mode: str) -> np.ndarray | None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "zero" or present is None:
        return None
    return present


def cache_forward(
    model: Any,
    kv: KVCache | Any,
    ids: Sequence[int],
    *,
    present: np.ndarray | None = None,
    mode: str = "mask",
    observe: bool = False,
    last: int = 0,
) -> tuple[torch.Tensor, np.ndarray | None]:
    """Logits for ``ids`` fed after the (partial) cache, at positions ``num_tokens...``.

    kv: a numpy cache, or a model cache built in place (left as it was; see :func:`_opened`).
    last: compute logits for the last ``last`` fed tokens only (0: all of them); the
    vocabulary projection is a large share of a short forward pass.
    Returns ``(logits [len(ids) or last, vocab] float32, attention)``; with ``observe`` the
    attention is ``[layers, num_tokens + len(ids)]``: the mass each slot gets from the fed
    queries, averaged over queries and heads (None otherwise).
    """
    import torch

    if len(ids) == 0:
        raise ValueError("cache_forward needs at least one token to feed")
    with torch.inference_mode(), _opened(model, kv, present, mode) as (cache, p):
        if observe:
            with _probing(model, None) as probe:
                out = forward_at(model, ids, p, cache, last)
            mass = probe.stacked()
        else:
            out = forward_at(model, ids, p, cache, last)
            mass = None
    return out.logits[0].float(), mass


@dataclass
class Generation:
    """Greedy continuation of a cache.

    tokens: generated ids, without the stop token. stopped: a stop token ended it.
    inject_seconds: building the model cache from numpy (about 0 for a model cache built
    in place); first_token_seconds: from the start of injection to the first generated
    token (the receiver's TTFT after the cache is in hand); seconds: the whole call.
    """

    tokens: list[int]
    stopped: bool
    inject_seconds: float
    first_token_seconds: float
    seconds: float


def stop_ids_of(model: Any, tokenizer: Any | None = None) -> tuple[int, ...]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def greedy_generate(
    model: Any,
    kv: KVCache | Any,
    question_ids: Sequence[int],
    *,
    present: np.ndarray | None = None,
    mode: str = "mask",
    max_new_tokens: int = 32,
    stop_ids: Sequence[int] | None = None,
) -> Generation:
    """Greedy decoding after the (partial) cache and ``question_ids``, explicit positions.

    kv: a numpy cache, or a model cache built in place (left as it was; see :func:`_opened`).
    stop_ids: ids that end the answer (default: the model's end-of-turn ids); pass ``()``
        to always produce exactly ``max_new_tokens`` tokens.
    """
    import torch

    t0 = time.perf_counter()
    if len(question_ids) == 0:
        raise ValueError("greedy_generate needs at least one question token")
    stops = set(stop_ids_of(model) if stop_ids is None else stop_ids)
    feed = list(question_ids)
    tokens: list[int] = []
    stopped = False
    t_first = 0.0
    with torch.inference_mode(), _opened(model, kv, present, mode) as (cache, pos):
        t_inject = time.perf_counter() - t0
        while len(tokens) < max_new_tokens:
            out = forward_at(model, feed, pos, cache, 1)
            nxt = int(out.logits[0, -1].argmax())
            if not tokens and not t_first:
                t_first = time.perf_counter() - t0
            pos += len(feed)
            if nxt in stops:
                stopped = True
                break
            tokens.append(nxt)
            feed = [nxt]
    return Generation(
        tokens=tokens,
        stopped=stopped,
        inject_seconds=t_inject,
        first_token_seconds=t_first,
        seconds=time.perf_counter() - t0,
    )


def teacher_forced_top1(
    model: Any,
    kv: KVCache,
    question_ids: Sequence[int],
    reference: Sequence[int],
    *,
    present: np.ndarray | None = None,
    mode: str = "mask",
) -> np.ndarray:
    """Per reference token: does the (partial) cache's top-1 prediction match it?

    The reference continuation (usually the full cache's greedy answer) is fed after the
    question in one pass; prediction i is the argmax after question + reference[:i].
    """
    if len(reference) == 0:
        raise ValueError("empty reference continuation")
    feed = list(question_ids) + list(reference[:-1])
    logits, _ = cache_forward(model, kv, feed, present=present, mode=mode, last=len(reference))
    pred = logits.argmax(dim=-1).numpy()
    return pred == np.asarray(reference)


def top1_agreement(
    model: Any,
    kv: KVCache,
    question_ids: Sequence[int],
    reference: Sequence[int],
    *,
    present: np.ndarray | None = None,
    mode: str = "mask",
) -> float:
    """Teacher-forced top-1 agreement in [0, 1] with ``reference`` (see teacher_forced_top1)."""
    return float(
        teacher_forced_top1(model, kv, question_ids, reference, present=present, mode=mode).mean()
    )
