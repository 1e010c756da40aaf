"""Token importance, block utility and stream order."""

import numpy as np
import pytest

from kvtransport.model import utility


def test_position_prior_favours_sinks_then_recent_tokens():
    p = utility.position_prior(500, sink_tokens=4, recent_tokens=32)
    assert p.sum() == pytest.approx(1.0)
    assert p[:4].min() > p[4:].max()  # sinks lead
    assert p[-1] > p[-40] > p[250]  # then the most recent tokens
    assert np.all(np.diff(p[4:]) >= 0)  # never decreasing towards the end
    assert p[:4].sum() == pytest.approx(0.3 + 0.4 * 4 / 500 + 0.3 * 0, abs=1e-3)
    assert utility.position_prior(3).sum() == pytest.approx(1.0)


def test_token_importance_follows_attention_with_a_small_prior():
    rng = np.random.default_rng(0)
    att = rng.random((3, 100))
    att[1] = 0  # a layer without statistics falls back to the prior
    imp = utility.token_importance(3, 100, att, window=20, prior_weight=0.05)
    assert np.allclose(imp.sum(axis=1), 1.0)
    prior = utility.position_prior(100)
    assert np.allclose(imp[1], prior)
    # tokens inside the 20-query window are seen by fewer queries: 20 / (100 - t)
    corrected = att[0] * np.r_[np.ones(80), 20 / (20 - np.arange(20))]
    assert np.allclose(imp[0], 0.95 * corrected / corrected.sum() + 0.05 * prior)
    # the whole context as the window: token t is seen by 100 - t queries
    full = utility.token_importance(3, 100, att, window=None, prior_weight=0.05)
    corrected = att[0] * 100 / (100 - np.arange(100))
    assert np.allclose(full[0], 0.95 * corrected / corrected.sum() + 0.05 * prior)
    no_att = utility.token_importance(3, 100, None)
    assert np.allclose(no_att, prior[None])
    with pytest.raises(ValueError):
        utility.token_importance(3, 100, att[:, :-1])
    with pytest.raises(ValueError):
        utility.token_importance(3, 100, -att)


def test_block_utility_sums_to_one_and_layer_weights_set_layer_shares():
    imp = utility.token_importance(4, 70, np.random.default_rng(1).random((4, 70)))
    w = np.array([1.0, 3.0, 0.5, 0.5])
    u = utility.block_utility(imp, 16, w)
    assert u.shape == (4, 5)
    assert u.sum() == pytest.approx(1.0)
    assert np.allclose(u.sum(axis=1), w / w.sum())
    # within a layer, block utility is the token importance summed over the block
    assert u[1, 2] / u[1].sum() == pytest.approx(imp[1, 32:48].sum())
    with pytest.raises(ValueError):
        utility.block_utility(imp, 16, np.array([1.0, -1, 1, 1]))


def test_utility_order_puts_first_tokens_first_even_against_attention():
    rng = np.random.default_rng(2)
    att = rng.random((6, 200))
    att[:, :16] = 0  # attention says the first block is worthless in every layer
    att[2, 100:116] = 50  # and one block elsewhere is precious
    u = utility.block_utility(utility.token_importance(6, 200, att, window=1), 16)
    order = utility.stream_order(u, 16, "utility", sink_tokens=4)
    layer, tb = np.divmod(order, u.shape[1])
    assert (tb[:6] == 0).all() and sorted(layer[:6]) == list(range(6))
    assert (layer[6], tb[6]) == (2, 100 // 16)  # then the most useful block
    rest = u.reshape(-1)[order[6:]]
    assert np.all(np.diff(rest) <= 0)  # then strictly by utility
    # sinks wider than one block: every block holding one of them leads
    order = utility.stream_order(u, 16, "utility", sink_tokens=20)
    assert set(np.divmod(order[:12], u.shape[1])[1]) == {0, 1}


def test_position_and_random_orders():
    u = utility.block_utility(utility.token_importance(3, 64, None), 16)
    pos = utility.stream_order(u, 16, "position")
    assert np.divmod(pos, 4)[1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    r1 = utility.stream_order(u, 16, "random", seed=3)
    r2 = utility.stream_order(u, 16, "random", seed=3)
    assert np.array_equal(r1, r2) and sorted(r1.tolist()) == list(range(12))
    assert not np.array_equal(r1, utility.stream_order(u, 16, "random", seed=4))
    with pytest.raises(ValueError):
        utility.stream_order(u, 16, "alphabetical")


def test_kept_mask_takes_the_head_of_the_order():
    u = utility.block_utility(utility.token_importance(2, 64, None), 16)
    order = utility.stream_order(u, 16)
    keep = utility.kept_mask(order, u.shape, 0.5)
    assert keep.sum() == 4
    assert keep.reshape(-1)[order[:4]].all()
    with pytest.raises(ValueError):
        utility.kept_mask(order, u.shape, 1.5)
