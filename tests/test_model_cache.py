"""The model cache whose layers grow in place (kvtransport.model.model_cache), on the real model.

A cache built range by range must hold what transformers' concatenating cache holds, write
each range where it goes (no copy of the cache per range), and answer as it does; answering
from a cache built in place must leave it as it was.
"""

import numpy as np
import pytest
import torch

from kvtransport.model import hf, tasks
from kvtransport.model.cache_builder import CacheBuilder
from kvtransport.model.model_cache import GrowingLayer, new_model_cache

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def sample(smollm):
    s = tasks.generate("facts_qa", smollm.tokenizer, target_tokens=160, seed=5)
    ctx, question = s.prompt(smollm.tokenizer)
    kv = hf.prefill(smollm.model, smollm.tokenizer, ctx, attention=False)
    return ctx, question, kv


def test_a_growing_layer_writes_in_place_and_doubles_when_full():
    layer = GrowingLayer(capacity=8)
    k = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 3, 5, 4)
    layer.update(k, -k)
    buffer = layer.keys.data_ptr()
    keys, values = layer.update(k[:, :, :3], -k[:, :, :3])  # fits: written where it goes
    assert keys.data_ptr() == buffer and layer.get_seq_length() == 8
    assert torch.equal(keys, torch.cat([k, k[:, :, :3]], dim=2))
    assert torch.equal(values, -keys)
    layer.update(k, -k)  # 13 > 8: the buffer doubles (to 16), the contents stay
    assert layer._k.shape[2] == 16 and layer.get_seq_length() == 13
    assert torch.equal(layer.keys, torch.cat([k, k[:, :, :3], k], dim=2))
    layer.crop(-5)
    assert layer.get_seq_length() == 8 and torch.equal(layer.keys, keys)
    with pytest.raises(ValueError):
        layer.crop(2)


def test_loading_range_by_range_never_moves_the_buffers(smollm, sample):
    """Every 16-token range is written into the same preallocated buffers: the cost of a
    range is the range, not the cache (a concatenating cache reallocates per update)."""
    ctx, _, kv = sample
    b = CacheBuilder(smollm.model, ctx)
    b.load(kv.keys[:, :, :16], kv.values[:, :, :16])
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in b.model_cache.layers]
    for a in range(16, kv.num_tokens, 16):
        b.load(kv.keys[:, :, a : a + 16], kv.values[:, :, a : a + 16])
    layers = b.model_cache.layers
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers] == ptrs
    got = b.kv()
    assert np.array_equal(got.keys, kv.keys) and np.array_equal(got.values, kv.values)


def test_answering_from_a_built_cache_equals_the_injected_one_and_leaves_it(smollm, sample):
    ctx, question, kv = sample
    b = CacheBuilder(smollm.model, ctx)
    b.compute(64)
    b.load(kv.keys[:, :, 64:], kv.values[:, :, 64:])
    before = b.kv()
    cache = b.model_cache
    first = hf.greedy_generate(smollm.model, cache, question, max_new_tokens=12)
    assert cache.get_seq_length() == kv.num_tokens  # cropped back after answering
    again = hf.greedy_generate(smollm.model, cache, question, max_new_tokens=12)
    injected = hf.greedy_generate(smollm.model, before, question, max_new_tokens=12)
    assert first.tokens == again.tokens == injected.tokens
    after = b.kv()
    assert np.array_equal(after.keys, before.keys) and np.array_equal(after.values, before.values)
    logits, _ = hf.cache_forward(smollm.model, cache, question, last=1)
    ref, _ = hf.cache_forward(smollm.model, before, question, last=1)
    assert torch.allclose(logits, ref, atol=1e-5)
    with pytest.raises(ValueError, match="whole"):
        hf.greedy_generate(smollm.model, cache, question, present=np.ones((1, 1), bool))


def test_a_growing_cache_answers_as_transformers_own(smollm, sample):
    """The same K/V in a growing and in a concatenating DynamicCache give the same logits
    for the same question (positions, lengths and masks agree)."""
    from transformers import DynamicCache

    ctx, question, kv = sample
    ours = new_model_cache(smollm.model, 8)  # small: it must grow on the first update
    theirs = DynamicCache(config=smollm.model.config)
    for cache in (ours, theirs):
        for layer in range(kv.num_layers):
            k, v = torch.from_numpy(kv.keys[layer]), torch.from_numpy(kv.values[layer])
            cache.update(k[None], v[None], layer)
    ids = torch.tensor([list(question)])
    pos = torch.arange(kv.num_tokens, kv.num_tokens + len(question))[None]
    with torch.inference_mode():
        a = smollm.model(input_ids=ids, position_ids=pos, cache=ours, use_cache=True).logits
        b = smollm.model(input_ids=ids, position_ids=pos, cache=theirs, use_cache=True).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert ours.get_seq_length() == theirs.get_seq_length() == kv.num_tokens + len(question)


def test_the_receivers_memory_is_stated_and_a_context_it_cannot_hold_refused(smollm, sample):
    """The cache the receiver builds takes exactly cache_bytes (its buffers hold the
    context and ANSWER_ROOM); the stated need grows linearly in the tokens; a context past
    the model's 8,192 positions, or larger than the memory available, is refused in one
    line before anything is allocated."""
    from kvtransport.errors import UserError
    from kvtransport.model.model_cache import (
        ANSWER_ROOM,
        available_bytes,
        cache_bytes,
        check_context,
        receiver_bytes,
    )

    model = smollm.model
    ctx = sample[0]
    b = CacheBuilder(model, ctx)
    b.compute(len(ctx))
    held = sum(t.nbytes for layer in b.model_cache.layers for t in (layer._k, layer._v))
    assert held == cache_bytes(model.config, len(ctx) + ANSWER_ROOM)
    assert receiver_bytes(model, 1000) > cache_bytes(model.config, 1000 + ANSWER_ROOM)
    steps = [receiver_bytes(model, n) for n in (1000, 2000, 3000)]
    assert steps[2] - steps[1] == steps[1] - steps[0] > 0
    with pytest.raises(UserError, match=r"8193 tokens exceed the model's 8192 positions"):
        CacheBuilder(model, [1] * 8193)
    with pytest.raises(UserError, match="8193 tokens exceed"):
        hf.prefill(model, smollm.tokenizer, [1] * 8193)
    check_context(model, 8192)
    have = available_bytes()
    assert have is not None
    with pytest.raises(UserError, match=r"a 100-token cache needs about \d+ MiB"):
        check_context(model, 100, extra_bytes=have)
    with pytest.raises(UserError, match="exceed the model's 8192 positions"):
        b.answer([1] * (8193 - len(ctx)))
