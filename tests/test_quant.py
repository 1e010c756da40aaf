"""Quantization: exact round-trip bounds, int4 packing, serialization, mixed precision."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvtransport.codecs import quant


def _bound_holds(x, q):
    """|x - deq| <= scale/2 + spacing(|deq|)/2 element-wise (the documented exact bound)."""
    deq = quant.dequantize(q).astype(np.float64)
    if q.per_channel:
        scale = np.broadcast_to(q.scales.astype(np.float64), x.shape)
    else:
        scale = np.repeat(q.scales.astype(np.float64), q.group_size, axis=-1).reshape(x.shape)
    err = np.abs(x.astype(np.float64) - deq)
    slack = np.spacing(np.abs(deq).astype(np.float32)).astype(np.float64) / 2
    return err <= scale / 2 + slack, err, scale


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("offset,spread", [(0.0, 1.0), (37.0, 0.01), (-5.0, 300.0), (0, 1e-3)])
def test_round_trip_error_bound_and_tightness(bits, offset, spread):
    rng = np.random.default_rng(bits)
    x = (offset + spread * rng.standard_normal((5, 3, 16, 64))).astype(np.float32)
    q = quant.quantize(x, bits, 32)
    ok, err, scale = _bound_holds(x, q)
    assert ok.all(), f"worst excess {(err - scale / 2).max()}"
    # The scale is the smallest that covers each group (within one float16 rounding step),
    # so the bound above is not met by a lazy, over-wide scale.
    g = x.astype(np.float64).reshape(5, 3, 16, 2, 32)
    ideal = (g.max(-1) - g.min(-1)) / (2**bits - 1)
    s = q.scales.astype(np.float64)
    assert np.all(s >= ideal)
    assert np.all(s <= ideal * (1 + 2**-9) + 2 * 2**-24 + np.abs(g.min(-1)) * 2**-9 / 2**bits)
    # the error really uses the quantization step: a random group reaches near scale/2
    assert (err / scale).max() > 0.45


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        (4, 64),
        elements=st.floats(-6e4, 6e4, allow_nan=False, width=32),
    ),
    st.sampled_from([8, 4]),
    st.sampled_from([8, 16, 32, 64]),
)
def test_bound_holds_for_arbitrary_values(x, bits, group):
    q = quant.quantize(x, bits, group)
    ok, err, scale = _bound_holds(x, q)
    assert ok.all()


def test_constant_and_float16_groups_are_exact():
    x = np.full((2, 64), 3.25, np.float32)
    for bits in (8, 4):
        assert np.array_equal(quant.dequantize(quant.quantize(x, bits)), x)
    h = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float16)
    q = quant.quantize(h, 8)
    ok, _, _ = _bound_holds(h.astype(np.float32), q)
    assert ok.all()


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    codes = np.array(list(itertools.product(range(16), repeat=2)), dtype=np.uint8)  # [256, 2]
    packed = quant.pack_int4(codes)
    assert packed.shape == (256, 1)
    assert np.array_equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert np.array_equal(quant.unpack_int4(packed), codes)
    x = np.random.default_rng(1).standard_normal((7, 64)).astype(np.float32)
    q = quant.quantize(x, 4, 32)
    assert q.codes.shape == (7, 32) and q.codes.dtype == np.uint8


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("offset,spread", [(0.0, 1.0), (37.0, 0.01), (-5.0, 300.0)])
def test_per_channel_round_trip_bound_and_tightness(bits, offset, spread):
    rng = np.random.default_rng(bits)
    x = (offset + spread * rng.standard_normal((5, 3, 16, 64))).astype(np.float32)
    q = quant.quantize_channels(x, bits)
    assert q.scales.shape == (5, 3, 1, 64) and q.codes.shape == (5, 3, 16, 64 * bits // 8)
    ok, err, scale = _bound_holds(x, q)
    assert ok.all(), f"worst excess {(err - scale / 2).max()}"
    # each scale is the smallest covering its channel's 16 tokens, not its token's 64 values
    ideal = (x.max(-2, keepdims=True) - x.min(-2, keepdims=True)).astype(np.float64)
    ideal /= 2**bits - 1
    assert np.all(q.scales >= ideal)
    assert np.all(q.scales <= ideal * (1 + 2**-9) + 2 * 2**-24 + abs(offset) * 2**-9)
    assert (err / scale).max() > 0.45


def test_keys_with_outlier_channels_lose_less_per_channel():
    """A key cache's outliers sit in a few fixed channels: per-token groups must stretch
    their scale over them, per-channel ones do not (KIVI's observation)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 16, 64)).astype(np.float32)
    x[..., [5, 40]] += 30.0  # two outlier channels, in every token
    per_token = quant.dequantize(quant.quantize(x, 4, 32))
    per_channel = quant.dequantize(quant.quantize_channels(x, 4))
    normal = np.ones(64, bool)
    normal[[5, 40]] = False
    err_token = np.abs(per_token - x)[..., normal].mean()
    err_channel = np.abs(per_channel - x)[..., normal].mean()
    assert err_channel * 4 < err_token


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("channel_keys", [False, True])
@pytest.mark.parametrize("tokens", [16, 7])
def test_kv_bytes_round_trip_and_size(bits, channel_keys, tokens):
    kv = np.random.default_rng(2).standard_normal((6, 2, 3, tokens, 64)).astype(np.float32)
    rows = quant.quantize_kv(kv, bits, 32, channel_keys)
    assert rows.shape == (6, quant.kv_nbytes(3, tokens, 64, bits, 32, channel_keys))
    k_groups = 3 * 64 if channel_keys else 3 * tokens * 2
    assert rows.shape[1] == 2 * 3 * tokens * 64 * bits // 8 + 4 * (k_groups + 3 * tokens * 2)
    back = quant.dequantize_kv(rows, kv.shape, bits, 32, channel_keys)
    k = kv[:, 0]
    keys = quant.quantize_channels(k, bits) if channel_keys else quant.quantize(k, bits, 32)
    assert np.array_equal(back[:, 0], quant.dequantize(keys))
    assert np.array_equal(back[:, 1], quant.dequantize(quant.quantize(kv[:, 1], bits, 32)))
    with pytest.raises(ValueError):
        quant.dequantize_kv(rows[:, :-1], kv.shape, bits, 32, channel_keys)
    with pytest.raises(ValueError):
        quant.dequantize_kv(rows, kv.shape, bits, 32, not channel_keys)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="non-finite"):
        quant.quantize(np.array([[np.nan] * 32], np.float32), 8)
    with pytest.raises(ValueError, match="float16 range"):
        quant.quantize(np.array([[1e6] * 32], np.float32), 8)
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize(np.zeros((2, 64), np.float32), 8, 24)
    with pytest.raises(ValueError, match="bits"):
        quant.quantize(np.zeros((2, 64), np.float32), 2)
    with pytest.raises(ValueError, match="per-channel"):
        quant.quantize_channels(np.zeros((2, 63), np.float32), 4)
    with pytest.raises(ValueError, match="non-finite"):
        quant.quantize_channels(np.array([[np.inf] * 4] * 2, np.float32), 4)


# ---------------------------------------------------------------------------------------
# Mixed precision

LEVEL_COST = np.array([2.0, 1.125, 0.625]) * 6144  # fp16, int8, int4 bytes per block
FIDELITY = np.array([1.0, 0.99, 0.9])


def _instance(n, seed):
    rng = np.random.default_rng(seed)
    u = rng.pareto(1.2, n) + 1e-3
    u /= u.sum()
    cost = np.tile(LEVEL_COST, (n, 1)).astype(np.int64)
    # a few short tail blocks (the last token range of a layer)
    cost[rng.choice(n, n // 10, replace=False)] //= 4
    return u, cost


def _kept(u, cost, level):
    kept = level >= 0
    return float(np.sum(u[kept] * FIDELITY[level[kept]])), int(np.sum(cost[kept, level[kept]]))


@pytest.mark.parametrize("frac", [0.05, 0.2, 0.35, 0.5, 0.8, 1.0])
def test_mixed_respects_budget_and_beats_utility_blind_choices(frac):
    u, cost = _instance(600, 3)
    budget = int(frac * cost[:, 0].sum())
    alloc = quant.allocate_precision(u, cost, FIDELITY, budget)
    value, nbytes = _kept(u, cost, alloc.level)
    assert nbytes == alloc.nbytes <= budget
    assert value == pytest.approx(alloc.kept_utility)
    # utility-blind 1: the best single uniform precision, blocks kept in index order
    blind = 0.0
    for j in range(3):
        fits = np.cumsum(cost[:, j]) <= budget
        blind = max(blind, float(np.sum(u[fits] * FIDELITY[j])))
    # utility-blind 2: random precisions, random drops until the budget fits
    rng = np.random.default_rng(0)
    lv = rng.integers(0, 3, u.size)
    keep = np.cumsum(cost[np.arange(u.size), lv]) <= budget
    rand = float(np.sum(u[keep] * FIDELITY[lv[keep]]))
    assert value >= blind and value >= rand
    if frac < 1.0:  # everything fits at fp16 only at 1.0
        assert value > blind and value > rand
    if frac <= 0.5:  # blocks must be dropped or squeezed: choosing by utility pays
        assert value > blind + 0.02 and value > rand + 0.02


def test_mixed_is_near_optimal_against_brute_force():
    for seed in range(12):
        u, cost = _instance(7, seed)
        budget = int(cost[:, 1].sum() * 0.7)
        alloc = quant.allocate_precision(u, cost, FIDELITY, budget)
        best = 0.0
        for combo in itertools.product(range(-1, 3), repeat=7):
            lv = np.array(combo)
            v, c = _kept(u, cost, lv)
            if c <= budget:
                best = max(best, v)
        assert alloc.nbytes <= budget
        # greedy on convex hulls loses at most one block's value against the optimum
        assert alloc.kept_utility >= best - u.max() - 1e-12
        assert alloc.kept_utility <= best + 1e-12


def test_mixed_gives_high_utility_blocks_higher_precision():
    u, cost = _instance(400, 5)
    cost[:] = LEVEL_COST.astype(np.int64)
    alloc = quant.allocate_precision(u, cost, FIDELITY, int(0.45 * cost[:, 0].sum()))
    # level index: 0 fp16 > 1 int8 > 2 int4 > dropped (-1 -> rank 3)
    rank = np.where(alloc.level < 0, 3, alloc.level)
    by_u = rank[np.argsort(-u, kind="stable")]
    assert np.all(np.diff(by_u) >= 0), "precision must not rise as utility falls"
    assert len(set(rank.tolist())) >= 2


def test_more_budget_never_keeps_less_utility():
    u, cost = _instance(300, 7)
    values = [
        quant.allocate_precision(u, cost, FIDELITY, b).kept_utility
        for b in np.linspace(0, cost[:, 0].sum(), 25).astype(int)
    ]
    assert np.all(np.diff(values) >= -1e-12)
    assert values[0] == 0.0 and values[-1] == pytest.approx(1.0)


@pytest.mark.parametrize("channel_keys", [False, True])
def test_kv_mixed_bits_round_trip_each_half_at_its_own_precision(channel_keys):
    kv = np.random.default_rng(4).standard_normal((5, 2, 3, 9, 64)).astype(np.float32)
    rows = quant.quantize_kv_mixed(kv, 8, 64, channel_keys, 4, 32)
    size = quant.kv_nbytes_mixed(3, 9, 64, 8, 64, channel_keys, 4, 32)
    k_groups = 3 * 64 if channel_keys else 3 * 9
    assert rows.shape == (5, size) == (5, 3 * 9 * (64 + 32) + 4 * (k_groups + 3 * 9 * 2))
    back = quant.dequantize_kv_mixed(rows, kv.shape, 8, 64, channel_keys, 4, 32)
    k = kv[:, 0]
    keys = quant.quantize_channels(k, 8) if channel_keys else quant.quantize(k, 8, 64)
    assert np.array_equal(back[:, 0], quant.dequantize(keys))
    assert np.array_equal(back[:, 1], quant.dequantize(quant.quantize(kv[:, 1], 4, 32)))
    # the compiled in-place decoder gives the same bits
    keys_out = np.zeros((1, 3, 5 * 9, 64), np.float32)
    values_out = np.zeros_like(keys_out)
    buf = rows.reshape(-1)
    quant.dequantize_mixed_blocks_into(
        buf, np.arange(5) * size, np.zeros(5, np.int64), np.arange(5) * 9, 9,
        8, 64, channel_keys, 4, 32, keys_out, values_out,
    )  # fmt: skip
    for j in range(5):
        assert np.array_equal(keys_out[0, :, 9 * j : 9 * j + 9], back[j, 0])
        assert np.array_equal(values_out[0, :, 9 * j : 9 * j + 9], back[j, 1])
    with pytest.raises(ValueError):
        quant.dequantize_kv_mixed(rows, kv.shape, 4, 64, channel_keys, 4, 32)
