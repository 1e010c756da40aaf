"""Any causal LM, the same answers: tiny random-weight models of five architectures
(full attention, GQA, a sliding window shorter than the context, alternating sliding and
global layers, Phi-3's fused projections), fp32 on one thread, checked against one plain
transformers forward pass of the whole context. The product's paths: the race computing
the context in chunks (dead link), the race completing a partial cache (missing ranges
recomputed), and the answer step (the question's first token, with and without a
layer-major tail). A model the race cannot serve exactly is refused up front with one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from kvtransport.errors import UserError
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import hf
from kvtransport.model.cache_builder import CacheBuilder, ComputeSpeed
from kvtransport.model.race import LinkView, complete_missing, run_race

TOL = 1e-4
WINDOW = 32
BT = 16  # tokens per range
SHAPE = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256)  # fmt: skip

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**SHAPE),
    "qwen2-windowed": lambda: tf.Qwen2Config(**SHAPE, use_sliding_window=True,
                                             sliding_window=WINDOW, max_window_layers=2),
    "mistral-window": lambda: tf.MistralConfig(**SHAPE, sliding_window=WINDOW),
    "gemma3-alternating": lambda: tf.Gemma3TextConfig(**SHAPE, head_dim=16,
                                                      sliding_window=WINDOW,
                                                      sliding_window_pattern=2),
    "phi3-window": lambda: tf.Phi3Config(**SHAPE, pad_token_id=0, sliding_window=48),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


CTX, QUESTION = _ids(100, 0), _ids(7, 1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request):
    """(model, reference K/V of the context, reference logits of the question's last token),
    the references from one plain forward pass with the model's own attention."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    with torch.inference_mode():
        whole = model(input_ids=torch.tensor([CTX + QUESTION])).logits[0, -1].float()
        cache = DynamicCache()  # every token of every layer, windowed or not
        model(input_ids=torch.tensor([CTX]), cache=cache)
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).float().numpy()
    values = torch.stack([layer.values[0] for layer in cache.layers]).float().numpy()
    kv = KVCache(keys=keys, values=values, token_ids=np.asarray(CTX, dtype=np.int64),
                 model_id=request.param)  # fmt: skip
    return model, kv, whole


def _kv_err(a: KVCache, b: KVCache) -> float:
    return float(max(np.abs(a.keys - b.keys).max(), np.abs(a.values - b.values).max()))


def _question_err(model, model_cache, whole: torch.Tensor) -> float:
    logits, _ = hf.cache_forward(model, model_cache, QUESTION, last=1)
    return float((logits[-1] - whole).abs().max())


def test_sliding_windows_are_shorter_than_the_context():
    """The matrix exercises what it claims: windowed layers, the window inside the context."""
    from kvtransport.model.model_cache import sliding_windows

    windows = {name: sliding_windows(make()) for name, make in CONFIGS.items()}
    assert windows["llama"] == [None] * 4
    assert windows["mistral-window"] == [WINDOW] * 4
    assert None in windows["gemma3-alternating"] and WINDOW in windows["gemma3-alternating"]
    assert None in windows["qwen2-windowed"] and WINDOW in windows["qwen2-windowed"]
    assert windows["phi3-window"] == [48] * 4


def test_context_computed_in_chunks_exactly(case):
    """Chunks shorter and longer than the window, boundaries inside it."""
    model, kv, whole = case
    b = CacheBuilder(model, CTX)
    for n in (5, 27, 40, 28):
        b.compute(n)
    assert _kv_err(b.kv(), kv) <= TOL
    assert _question_err(model, b.model_cache, whole) <= TOL


def test_race_computes_around_what_arrived_exactly(case):
    """The race: a planned prefix computed, two ranges loaded, the rest computed after the
    sender's deadline, then the question's first token."""
    model, kv, whole = case
    ranges = -(-len(CTX) // BT)
    ready = np.full(ranges, np.inf)
    ready[3:5] = 0.0
    res = run_race(model, CTX, split=3 * BT, received=kv, ready_at=ready,
                   link=LinkView(ready, np.zeros(ranges), -1.0), speed=ComputeSpeed(0.0, 1e-3),
                   block_tokens=BT, question_ids=QUESTION)  # fmt: skip
    assert [s.action for s in res.steps][:3] == ["compute", "load", "compute"]
    assert res.loaded == 2 * BT and res.computed == len(CTX) - 2 * BT
    assert _kv_err(res.kv, kv) <= TOL
    assert _question_err(model, res.model_cache, whole) <= TOL
    assert res.first_token == int(whole.argmax())


def test_partial_cache_completed_by_recompute_exactly(case):
    model, kv, whole = case
    present = np.ones((kv.num_layers, kv.num_tokens), dtype=bool)
    present[1, 20:40] = False  # a hole across a window boundary, one layer
    present[:, 70:90] = False  # a hole in every layer
    received = KVCache(keys=np.where(present[:, None, :, None], kv.keys, 9.0),
                       values=np.where(present[:, None, :, None], kv.values, 9.0),
                       token_ids=kv.token_ids, model_id=kv.model_id)  # fmt: skip
    res = complete_missing(model, CTX, received, present, BT)
    assert res.loaded > 0 and res.computed >= 40
    assert _kv_err(res.kv, kv) <= TOL
    assert _question_err(model, res.model_cache, whole) <= TOL


def test_answer_step_with_a_layer_major_tail(case):
    model, kv, whole = case
    b = CacheBuilder(model, CTX)
    b.compute(40)
    b.load(kv.keys[:, :, 40:60], kv.values[:, :, 40:60])
    b.compute(20)
    token = b.answer(QUESTION, lambda layer: (kv.keys[layer, :, 80:], kv.values[layer, :, 80:]))
    assert token == int(whole.argmax())
    assert _kv_err(b.kv(), kv) <= TOL  # the cache holds the context only, whole
    assert _question_err(model, b.model_cache, whole) <= TOL
    assert b.answer(QUESTION) == token  # asked again: the same answer


def test_prefill_keeps_every_token_of_windowed_layers(case):
    model, kv, _ = case
    got = hf.prefill(model, None, CTX, attention=True)
    assert got.keys.shape == kv.keys.shape
    assert _kv_err(got, kv) <= TOL


@pytest.mark.parametrize(
    ("config", "names"),
    [
        (lambda: tf.Gemma2Config(**SHAPE, head_dim=16, sliding_window=WINDOW), "soft-capping"),
        (
            lambda: tf.Gemma2Config(
                **SHAPE, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=None
            ),
            "SDPA",
        ),  # fmt: skip
    ],
)
def test_a_model_the_race_cannot_serve_exactly_is_refused_in_one_line(config, names):
    model = tf.AutoModelForCausalLM.from_config(config()).eval()
    for enter in (hf.install_masked_attention, lambda m: CacheBuilder(m, CTX),
                  lambda m: hf.prefill(m, None, CTX)):  # fmt: skip
        with pytest.raises(UserError, match=names) as err:
            enter(model)
        assert "\n" not in str(err.value) and "Gemma2ForCausalLM" in str(err.value)
