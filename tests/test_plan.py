"""The handoff planner: byte budget, utility-ordered upgrades, split against link speed."""

from dataclasses import replace

import numpy as np
import pytest

from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import utility
from kvtransport.model.cache_builder import ComputeSpeed
from kvtransport.model.plan import (
    ALL_LEVELS,
    DEFAULT_MIN_FIDELITY,
    LinkEstimate,
    _Task,
    menu,
    plan_handoff,
    robust_speed,
)

GEOM = blocks.Geometry(num_layers=30, num_kv_heads=3, num_tokens=504, head_dim=64)
SPEED = ComputeSpeed(per_call_s=0.01, per_token_s=0.004)  # ~2 s for 504 tokens
LINK = LinkEstimate(rate_bps=100e6, loss=0.12, one_way_s=0.005, symbol_size=1280)
FP16, INT8, INT4 = (blocks.PRECISIONS.index(p) for p in ("fp16", "int8", "int4"))
NO_INT4 = ("fp16", "int8")
NO_K8V4 = ("fp16", "int8", "int4")  # the menu before k8v4
BARE = {"hedge_share": 0.0}  # the planned part alone: the tests of its levels


def _utilities(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = rng.gamma(0.5, size=(GEOM.num_layers, GEOM.token_blocks))
    return u / u.sum()


def _bytes(plan) -> int:
    cost = GEOM.cost_table(blocks.PRECISIONS).reshape(GEOM.num_layers, GEOM.token_blocks, -1)
    sent = plan.precision >= 0
    return int(np.take_along_axis(cost, np.maximum(plan.precision, 0)[..., None], 2)[sent].sum())


def _random_cache():
    """A 4-layer, 100-token geometry, a random cache of it and random block utilities."""
    rng = np.random.default_rng(0)
    g = blocks.Geometry(num_layers=4, num_kv_heads=2, num_tokens=100, head_dim=32)
    shape = (g.num_layers, g.num_kv_heads, g.num_tokens, g.head_dim)
    kv = KVCache(rng.normal(size=shape).astype(np.float32),
                 rng.normal(size=shape).astype(np.float32), np.arange(100), "m")  # fmt: skip
    return g, kv, rng.random((g.num_layers, g.token_blocks))


@pytest.mark.parametrize("budget", [0.6, 0.8, 1.2])
def test_plan_fits_its_budget(budget):
    plan = plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=budget)
    assert plan.fits
    assert plan.payload_bytes + plan.hedge_bytes == _bytes(plan)
    assert LINK.seconds(plan.payload_bytes) <= budget
    assert SPEED.seconds(plan.split) <= budget
    # the receiver's first call is not sent; everything after it is (the hedge included)
    assert np.all(plan.precision[:, : plan.first_call // GEOM.block_tokens] == -1)
    assert np.all(plan.precision[:, plan.first_call // GEOM.block_tokens :] >= 0)


def test_more_budget_never_lowers_fidelity_and_upgrades_by_utility():
    u = _utilities(1)
    plans = [plan_handoff(GEOM, u, link=LINK, speed=SPEED, budget_s=b, **BARE)
             for b in (0.6, 0.8, 1.5)]  # fmt: skip
    fid = [p.fidelity for p in plans]
    assert fid == sorted(fid) and fid[0] < fid[-1]
    for p in plans:
        sent = p.precision >= 0
        whole, level = u[:, :-1], p.precision[:, :-1]  # (the last range is short)
        hi, lo = whole[level == FP16], whole[level == INT8]
        if hi.size and lo.size:
            assert hi.min() >= lo.max()  # fp16 went to the most useful blocks
        assert sent.any()


def test_a_slower_link_moves_work_to_the_receiver():
    u = _utilities(2)
    fast = plan_handoff(GEOM, u, link=LINK, speed=SPEED, budget_s=0.6)
    slow_link = LinkEstimate(rate_bps=30e6, loss=0.12, one_way_s=0.005, symbol_size=1280)
    slow = plan_handoff(GEOM, u, link=slow_link, speed=SPEED, budget_s=0.6)
    assert slow.split > fast.split


def test_an_impossible_budget_gives_the_fastest_plan():
    plan = plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=0.05)
    assert not plan.fits
    for k in range(GEOM.token_blocks + 1):
        split = min(k * GEOM.block_tokens, GEOM.num_tokens)
        rest = GEOM.cost_table(("int8",)).reshape(GEOM.num_layers, -1)[:, k:].sum()
        assert plan.finish_s <= max(SPEED.seconds(split), LINK.seconds(rest)) + 1e-12


def test_expected_arrivals_follow_the_prefix_order():
    plan = plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=0.7, **BARE)
    k = plan.split // GEOM.block_tokens
    assert np.all(np.isinf(plan.expect_at[:k]))
    assert np.all(np.diff(plan.expect_at[k:]) > 0)
    assert plan.expect_at[-1] == pytest.approx(plan.link_s)


def test_the_planned_stream_carries_exactly_the_planned_bytes():
    g, kv, u = _random_cache()
    link = LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    plan = plan_handoff(g, u, link=link, speed=SPEED, budget_s=0.08)
    order = utility.stream_order(u, g.block_tokens, "position")
    s = blocks.encode_stream(kv, u, order, plan.precision)
    assert s.payload.size == plan.payload_bytes
    tb = s.manifest.token_block.astype(int)
    assert np.all(np.diff(tb) >= 0) and tb.min() == plan.split // g.block_tokens


def _floor_finish(link: LinkEstimate, k: int) -> float:
    split = min(k * GEOM.block_tokens, GEOM.num_tokens)
    rest = GEOM.cost_table(("int8",)).reshape(GEOM.num_layers, -1)[:, k:].sum()
    return max(SPEED.seconds(split), link.seconds(rest) if rest else 0.0)


@pytest.mark.parametrize("rate", [30e6, 100e6, 1e9])
def test_the_ttft_objective_finishes_first_and_never_later_than_the_fidelity_one(rate):
    link = LinkEstimate(rate_bps=rate, loss=0.12, one_way_s=0.005, symbol_size=1280)
    u = _utilities(3)
    quick = plan_handoff(GEOM, u, link=link, speed=SPEED, budget_s=1.5, objective="ttft",
                         levels=NO_INT4)  # fmt: skip
    full = plan_handoff(GEOM, u, link=link, speed=SPEED, budget_s=1.5, levels=NO_INT4)
    soonest = min(_floor_finish(link, k) for k in range(GEOM.token_blocks + 1))
    assert quick.fits and quick.finish_s == pytest.approx(soonest)
    assert quick.finish_s < full.finish_s  # the fidelity plan spends the budget
    assert quick.fidelity <= full.fidelity
    assert quick.payload_bytes + quick.hedge_bytes == _bytes(quick)


def test_the_ttft_objective_upgrades_only_with_the_link_time_compute_leaves_idle():
    u = _utilities(4)
    extra = (GEOM.cost_table(("fp16",)) - GEOM.cost_table(("int8",))).reshape(GEOM.num_layers, -1)
    upgraded = 0
    for rate in np.linspace(50e6, 1e9, 60):
        link = LinkEstimate(rate_bps=rate, loss=0.12, one_way_s=0.005, symbol_size=1280)
        plan = plan_handoff(GEOM, u, link=link, speed=SPEED, budget_s=1.5, objective="ttft",
                            levels=NO_INT4, **BARE)  # fmt: skip
        soonest = min(_floor_finish(link, k) for k in range(GEOM.token_blocks + 1))
        assert plan.finish_s == pytest.approx(soonest)  # upgrades never delay the answer
        per_byte = u / extra  # utility per extra byte (the last range's blocks are short)
        hi, lo = per_byte[plan.precision == FP16], per_byte[plan.precision == INT8]
        if hi.size:
            upgraded += 1
            assert lo.size == 0 or hi.min() >= lo.max()  # the most useful per byte first
        if lo.size:  # the next upgrade in that order would not cross while it computes
            nxt = extra[plan.precision == INT8][np.argmax(lo)]
            assert link.seconds(plan.payload_bytes + nxt) > max(plan.compute_s, plan.link_s)
    assert upgraded >= 1  # some rates leave the link idle while the receiver computes


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=1.0, objective="x")


def _fidelity(plan, u) -> float:
    fid = np.array([blocks.DEFAULT_FIDELITY[p] for p in blocks.PRECISIONS])
    return float(u[plan.precision < 0].sum() + (u * fid[plan.precision])[plan.precision >= 0].sum())


@pytest.mark.parametrize("objective", ["ttft", "fidelity"])
# floors well above int4's calibrated fidelity (0.988), where they bind: below, a plan may
# send everything at int4, its computed prefix making up the rest
@pytest.mark.parametrize("floor", [0.995, 0.997, 0.999])
def test_int4_goes_to_the_least_useful_blocks_only_as_far_as_the_fidelity_floor(objective, floor):
    u = _utilities(5)
    with_int4 = tight = 0
    for rate in (50e6, 100e6, 1e9):
        link = LinkEstimate(rate_bps=rate, loss=0.12, one_way_s=0.005, symbol_size=1280)
        plan = plan_handoff(GEOM, u, link=link, speed=SPEED, budget_s=0.5, levels=NO_K8V4,
                            objective=objective, min_fidelity=floor, **BARE)  # fmt: skip
        assert plan.fidelity == pytest.approx(_fidelity(plan, u))
        assert plan.fidelity >= floor - 1e-12
        whole, level = u[:, :-1], plan.precision[:, :-1]  # (the last range is short)
        lo, hi = whole[level == INT4], whole[(level >= 0) & (level < INT4)]
        assert hi.size
        with_int4 += bool(lo.size)
        assert not lo.size or lo.max() <= hi.min()  # int4 only below every better-kept block
        if objective == "ttft" and plan.link_s >= plan.compute_s:
            # no idle link time bought upgrades, so the floor alone set the levels, and
            # tightly: the int8 block least useful per byte back at int4 would break it
            tight += 1
            low8 = np.argwhere(plan.precision == INT8)
            step = (GEOM.cost_table(("int8",)) - GEOM.cost_table(("int4",))).reshape(u.shape)
            i, j = low8[np.argmin((u / step)[plan.precision == INT8])]
            back = plan.precision.copy()
            back[i, j] = INT4
            fid = np.array([blocks.DEFAULT_FIDELITY[p] for p in blocks.PRECISIONS])
            below = float(u[back < 0].sum() + (u * fid[back])[back >= 0].sum())
            assert below < floor
    assert with_int4  # the slow links leave the floor's int4 in place
    assert tight or objective == "fidelity"


def test_a_higher_floor_sends_more_bytes_and_never_answers_sooner():
    u = _utilities(6)
    plans = [plan_handoff(GEOM, u, link=LINK, speed=SPEED, budget_s=1.0, objective="ttft",
                          min_fidelity=f, **BARE) for f in (0.0, 0.99, 0.997, 0.999)]  # fmt: skip
    assert not (plans[0].precision == INT8).any() or plans[0].finish_s < plans[-1].finish_s
    finish = [p.finish_s for p in plans]
    assert finish == sorted(finish) and finish[0] < finish[-1]
    int4 = [int((p.precision == INT4).sum()) for p in plans]
    assert int4 == sorted(int4, reverse=True) and int4[-1] < int4[0]


def test_an_unreachable_floor_keeps_every_sent_block_at_the_best_level():
    plan = plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=1.0,
                        objective="ttft", levels=("int8", "int4"), min_fidelity=1.0)  # fmt: skip
    assert set(np.unique(plan.precision).tolist()) <= {-1, INT8}


def test_a_floor_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="min_fidelity"):
        plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=1.0, min_fidelity=1.5)


def test_the_back_order_is_what_the_sender_sends_and_what_the_plan_expects():
    """order="back": the planned stream holds the token ranges after the split, the last
    range first, every layer of a range together; the expected arrivals follow it (the
    last range first, the split's range when the whole payload has crossed)."""
    from kvtransport.model.plan import planned_stream
    from kvtransport.model.race import stream_rank

    g, kv, u = _random_cache()
    card = blocks.encode_stream(kv, u, utility.stream_order(u, g.block_tokens))
    link = LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    front, _ = planned_stream(card, link=link, budget_s=0.08, speed=SPEED)
    plan, s = planned_stream(card, link=link, budget_s=0.08, speed=SPEED, order="back")
    assert plan.order == "back" and s.payload.size == plan.payload_bytes
    k = plan.split // g.block_tokens
    assert 0 < k < g.token_blocks - 1
    tb = s.manifest.token_block.astype(int)
    # whole ranges, last first, each range's layers back to back, the prefix not sent
    assert tb.tolist() == [r for r in range(g.token_blocks - 1, k - 1, -1)
                           for _ in range(g.num_layers)]  # fmt: skip
    rank = stream_rank(s.manifest)
    assert np.all(np.diff(rank[k:]) < 0) and np.all(rank[:k] == -1)
    assert np.all(np.isinf(plan.expect_at[:k]))
    assert np.all(np.diff(plan.expect_at[k:]) < 0)  # the last range is due first
    assert plan.expect_at[k] == pytest.approx(plan.link_s)
    # the order only moves the expected arrivals: split, precision and bytes are the same
    assert front.split == plan.split and np.array_equal(front.precision, plan.precision)
    assert front.expect_at[-1] == pytest.approx(plan.expect_at[k])


def test_the_plan_sends_int8_in_the_products_groups_whatever_the_cards_own():
    """A card whose geometry holds other int8 groups (cards written before the change hold
    32-value ones) is planned and sent with one int8 group per head vector: the same bytes
    as from a new card."""
    from kvtransport.model.plan import planned_stream

    g, kv, u = _random_cache()
    order = utility.stream_order(u, g.block_tokens)
    old = blocks.encode_stream(kv, u, order, int8_group_size=16)
    new = blocks.encode_stream(kv, u, order)
    assert old.manifest.geometry.group_of("int8") == 16
    link = LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    kw = dict(link=link, budget_s=0.08, speed=SPEED, levels=("int8",))
    plan_old, sent_old = planned_stream(old, **kw)
    plan_new, sent_new = planned_stream(new, **kw)
    assert sent_old.manifest.geometry.group_of("int8") == g.head_dim
    assert np.any(sent_old.manifest.precision == blocks.PRECISIONS.index("int8"))
    assert sent_old.manifest_bytes == sent_new.manifest_bytes
    assert np.array_equal(sent_old.payload, sent_new.payload)
    assert sent_old.payload.size == plan_old.payload_bytes


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="order must be one of position, back"):
        plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=1.0, order="middle")


def test_the_hedge_is_the_prefix_tail_sent_last_first_after_the_planned_ranges():
    """The sender also sends the prefix's last ranges (the hedge share of the prefix, at
    most one race chunk), after every planned range and the last first, at the fidelity
    floor's level; the planned part (split, precision, bytes, finish, fidelity) is the
    unhedged plan's, and the plan says when the hedge is in place (send_s). No hedge
    where computing it costs less than two calls."""
    from kvtransport.model.plan import planned_stream
    from kvtransport.model.race import DEFAULT_MAX_CHUNK, stream_rank

    g, kv, u = _random_cache()
    card = blocks.encode_stream(kv, u, utility.stream_order(u, g.block_tokens))
    link = LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    speed = ComputeSpeed(per_call_s=0.001, per_token_s=0.0002)  # a prefix of 5 ranges
    kw = {"link": link, "speed": speed, "budget_s": 0.2, "objective": "ttft"}
    bare, _ = planned_stream(card, **kw, hedge_share=0.0)
    plan, s = planned_stream(card, **kw, hedge_share=0.5)
    bt = g.block_tokens
    k, first = plan.split // bt, plan.first_call // bt
    assert bare.hedge == 0 and plan.split == bare.split and plan.link_s == bare.link_s
    assert plan.fidelity == bare.fidelity and plan.hedge >= 2 * g.block_tokens
    assert plan.hedge <= min(0.5 * plan.split, DEFAULT_MAX_CHUNK)
    assert plan.hedge == (k - first) * bt and plan.payload_bytes == bare.payload_bytes
    assert s.payload.size == plan.payload_bytes + plan.hedge_bytes
    assert np.array_equal(plan.precision[:, k:], bare.precision[:, k:])
    assert np.all(plan.precision[:, first:k] == INT8)  # the 0.999 floor's level
    tb = s.manifest.token_block.astype(int)
    planned = [r for r in range(k, g.token_blocks) for _ in range(g.num_layers)]
    hedge = [r for r in range(k - 1, first - 1, -1) for _ in range(g.num_layers)]
    assert tb.tolist() == planned + hedge
    rank = stream_rank(s.manifest)
    assert np.all(rank[:first] == -1) and np.all(np.diff(rank[first:k]) < 0)
    assert np.all(plan.expect_at[first:k] > plan.expect_at[k:].max())
    assert np.all(np.diff(plan.expect_at[first:k]) < 0)  # the last range is due first
    assert plan.send_s == pytest.approx(plan.expect_at[first]) and plan.send_s > plan.finish_s
    # the hedge comes after the budget as well: the planned part does not depend on it
    tight, _ = planned_stream(card, **{**kw, "budget_s": bare.finish_s}, hedge_share=0.5)
    assert tight.hedge == plan.hedge and tight.split == bare.split
    # where computing the hedge costs less than two calls, none: the call would cost more
    costly = ComputeSpeed(per_call_s=0.005, per_token_s=0.0002)  # 3 ranges: 0.0096 s
    dear, _ = planned_stream(card, **{**kw, "speed": costly}, hedge_share=0.5)
    assert dear.split >= 2 * bt and dear.hedge == 0


def test_a_hedge_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="hedge_share must be in"):
        plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=1.0, hedge_share=2)


def test_the_tail_crosses_layer_by_layer_and_the_plan_answers_sooner():
    """With the question's forward time given, the plan sends the context's last ranges
    (at least two, those that take the link about that long) layer by layer after the
    other planned ranges and before the hedge; the receiver recognises the tail from the
    stream's order alone, and the plan expects each tail range with its last layer. The
    plan then prices a split by when the first token is out: it answers sooner than the
    plan without a tail followed by a whole pass, with a prefix no longer."""
    from kvtransport.model.plan import planned_stream
    from kvtransport.model.race import layered_tail, stream_rank

    g, kv, u = _random_cache()
    card = blocks.encode_stream(kv, u, utility.stream_order(u, g.block_tokens))
    link = LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    speed = ComputeSpeed(per_call_s=0.001, per_token_s=0.0004)
    kw = {"link": link, "speed": speed, "budget_s": 0.2, "objective": "ttft", "hedge_share": 0.5}
    bare, bare_s = planned_stream(card, **kw)
    answer_s = 0.006
    plan, s = planned_stream(card, **kw, answer_s=answer_s)
    bt, nb = g.block_tokens, g.token_blocks
    assert bare.tail == 0 and layered_tail(bare_s.manifest) is None
    t = nb - -(-plan.tail // bt)
    assert plan.tail == g.num_tokens - t * bt and nb - t >= 2
    m = s.manifest
    assert layered_tail(m) == t
    per_range = np.bincount(m.token_block.astype(int), weights=m.length, minlength=nb)
    tail_s = link.seconds(per_range[t:].sum()) - link.one_way_s
    assert tail_s >= answer_s > link.seconds(per_range[t + 1 :].sum()) - link.one_way_s
    k, first = plan.split // bt, plan.first_call // bt
    tb, layer = m.token_block.astype(int), m.layer.astype(int)
    body = [(r, i) for r in range(k, t) for i in range(g.num_layers)]
    tail = [(r, i) for i in range(g.num_layers) for r in range(t, nb)]
    hedge = [(r, i) for r in range(k - 1, first - 1, -1) for i in range(g.num_layers)]
    assert list(zip(tb.tolist(), layer.tolist(), strict=True)) == body + tail + hedge
    rank = stream_rank(m)  # a tail range completes with its last layer's block
    assert np.all(rank[t:] == len(body) + (g.num_layers - 1) * (nb - t) + np.arange(nb - t))
    assert np.all(plan.expect_at[t:] > plan.expect_at[k:t].max())
    assert plan.expect_at[-1] == pytest.approx(plan.link_s)
    # when the first token is out: the pass over the link's last layer, or after the prefix
    after = max(plan.compute_s + answer_s, plan.link_s + answer_s / g.num_layers)
    assert plan.answer_at_s == pytest.approx(after)
    assert plan.split <= bare.split and plan.answer_at_s < bare.finish_s + answer_s
    with pytest.raises(ValueError, match="answer_s"):
        plan_handoff(GEOM, _utilities(), link=LINK, speed=SPEED, budget_s=1.0, answer_s=-1.0)
    # the back order has no tail (its last ranges go first)
    back, back_s = planned_stream(card, **kw, answer_s=answer_s, order="back")
    assert back.tail == 0 and layered_tail(back_s.manifest) is None


def test_send_plans_a_tail_when_told_the_racing_receivers_question_length():
    """kvtransport.send / a sender daemon submit plan through handoff_plan and as_transfer:
    with the receiver's speed and its question's length, the stream ends in a layer-major
    tail; with the speed alone it does not; a question length of 0, or one without the
    speed, is refused."""
    from kvtransport.embed.inprocess import as_transfer, handoff_plan
    from kvtransport.errors import UserError
    from kvtransport.model.race import layered_tail

    g, kv, u = _random_cache()
    card = blocks.encode_stream(kv, u, utility.stream_order(u, g.block_tokens))
    speed = ComputeSpeed(per_call_s=0.001, per_token_s=0.0004)
    tails = []
    for question in (None, 20):
        plan = handoff_plan(200.0, "auto", 10.0, loss_estimate=0.0, receiver_speed=speed,
                            question_tokens=question)  # fmt: skip
        t = as_transfer(card, plan)
        tails.append(layered_tail(blocks.Manifest.from_bytes(t.app_metadata)))
    assert tails[0] is None and tails[1] is not None
    with pytest.raises(UserError, match="question_tokens"):
        handoff_plan(200.0, "auto", 10.0, receiver_speed=speed, question_tokens=0)
    with pytest.raises(UserError, match="needs receiver_speed"):
        handoff_plan(200.0, "auto", 10.0, question_tokens=20)


K8V4 = blocks.PRECISIONS.index("k8v4")


def test_the_menu_keeps_the_levels_on_the_hull_of_bytes_and_fidelity():
    from kvtransport.model.plan import DEFAULT_LEVELS, menu

    assert DEFAULT_LEVELS == NO_K8V4  # k8v4 is opt-in
    fid = dict(blocks.DEFAULT_FIDELITY)
    assert menu(GEOM, ALL_LEVELS, fid) == ("fp16", "int8", "k8v4", "int4")
    # below the chord from int4 to int8 (in bytes), mixing those two does better
    c4, c48, c8 = (GEOM.block_nbytes(p) for p in ("int4", "k8v4", "int8"))
    chord = fid["int4"] + (fid["int8"] - fid["int4"]) * (c48 - c4) / (c8 - c4)
    assert menu(GEOM, ALL_LEVELS, dict(fid, k8v4=chord - 1e-4)) == NO_K8V4
    assert menu(GEOM, ALL_LEVELS, dict(fid, k8v4=chord + 1e-4)) == ALL_LEVELS
    # a calibration that does not rate a level plans without it (the DDQN's episodes)
    older = {"fp32": 1.0, "fp16": 1.0, "int8": 0.999, "int4": 0.98}
    assert menu(GEOM, ALL_LEVELS, older) == NO_K8V4
    with pytest.raises(ValueError, match="rates none"):
        menu(GEOM, ("k8v4",), older)


@pytest.mark.parametrize("floor", [0.995, 0.997, 0.999])
def test_k8v4_between_int4_and_int8_costs_no_bytes_at_a_fidelity_floor(floor):
    """Greedy by fidelity per byte is within one raise of the cheapest plan (the last raise
    may overshoot the floor), with or without the level between."""
    u = _utilities(7)
    one_raise = GEOM.block_nbytes("int8") - GEOM.block_nbytes("int4")
    used = 0
    for rate in (50e6, 100e6, 300e6):
        link = LinkEstimate(rate_bps=rate, loss=0.12, one_way_s=0.005, symbol_size=1280)
        kw = dict(link=link, speed=SPEED, budget_s=0.5, objective="ttft", min_fidelity=floor)
        four = plan_handoff(GEOM, u, levels=ALL_LEVELS, **kw, **BARE)
        three = plan_handoff(GEOM, u, levels=NO_K8V4, **kw, **BARE)
        assert four.fidelity >= floor - 1e-12 and four.fidelity == pytest.approx(_fidelity(four, u))
        if four.split == three.split:  # the same prefix: the floor alone set the levels
            assert four.payload_bytes <= three.payload_bytes + one_raise
        assert four.answer_at_s <= three.answer_at_s + 1e-9
        whole, level = u[:, :-1], four.precision[:, :-1]  # (the last range is short)
        i4, k84, i8 = (whole[level == c] for c in (INT4, K8V4, INT8))
        used += bool(k84.size)
        if i4.size and k84.size:  # raised by utility (per byte: whole blocks cost the same)
            assert i4.max() <= k84.min()
        if k84.size and i8.size:
            assert k84.max() <= i8.max()
    assert used


def test_a_k8v4_rated_off_the_hull_is_never_planned():
    u = _utilities(8)
    c4, c48, c8 = (GEOM.block_nbytes(p) for p in ("int4", "k8v4", "int8"))
    fid = dict(blocks.DEFAULT_FIDELITY)
    chord = fid["int4"] + (fid["int8"] - fid["int4"]) * (c48 - c4) / (c8 - c4)
    for rate in (50e6, 100e6):
        link = LinkEstimate(rate_bps=rate, loss=0.12, one_way_s=0.005, symbol_size=1280)
        plan = plan_handoff(GEOM, u, link=link, speed=SPEED, budget_s=0.5, min_fidelity=0.997,
                            levels=ALL_LEVELS, fidelity=dict(fid, k8v4=chord - 1e-3),
                            **BARE)  # fmt: skip
        assert not np.any(plan.precision == K8V4)
        assert np.any(plan.precision == INT4)


def test_an_untrusted_speed_plans_a_shorter_prefix_back_first_at_the_floors_levels():
    """A speed whose measured rounds disagreed prices the prefix at the slowest round
    (robust_speed), sends the last ranges first (the receiver computes on from the front
    to wherever the link meets it: no tail) and sends the floor's levels: no upgrades for
    an idle link that only the untrusted speed predicts."""
    u = _utilities(5)
    slow = SPEED.scaled(10.0)  # measured slow: the link looks idle while it computes
    shaky = replace(SPEED, spread=1.0)  # the same median speed, rounds 100 % apart
    assert not shaky.trusted and SPEED.trusted
    assert robust_speed(shaky).per_token_s == pytest.approx(2 * SPEED.per_token_s)
    assert robust_speed(SPEED) is SPEED
    kw = {"budget_s": 20.0, "objective": "ttft", "answer_s": 3.0, **BARE}
    trusted = plan_handoff(GEOM, u, link=LINK, speed=slow, **kw)
    untrusted = plan_handoff(GEOM, u, link=LINK, speed=replace(slow, spread=1.0), **kw)
    assert untrusted.split <= trusted.split
    assert (trusted.order, untrusted.order) == ("position", "back")
    assert trusted.tail > 0 and untrusted.tail == 0
    assert untrusted.compute_s == pytest.approx(slow.scaled(2.0).seconds(untrusted.split))
    assert untrusted.payload_bytes < trusted.payload_bytes  # the trusted one upgraded
    assert untrusted.fidelity >= DEFAULT_MIN_FIDELITY > trusted.prefix_utility
    # the floor's levels: the same blocks as a plan with no idle link time to spend
    floor = plan_handoff(GEOM, u, link=LINK, speed=replace(slow, spread=1.0),
                         **{**kw, "budget_s": 1e-3})  # fmt: skip
    assert np.array_equal(untrusted.precision, floor.precision)


@pytest.mark.parametrize("levels", [NO_K8V4, ALL_LEVELS, NO_INT4])
def test_the_floor_order_for_any_prefix_is_the_whole_caches_less_the_prefix(levels):
    """_Task.floored takes the raise order once (from every block at the cheapest level)
    and drops the prefix's blocks: the same levels as ranking the blocks after each
    prefix on their own."""
    g, u = GEOM, _utilities(6)
    lv = menu(g, levels)
    fid = np.array([blocks.DEFAULT_FIDELITY[p] for p in lv])
    cost = g.cost_table(lv).reshape(g.num_layers, g.token_blocks, len(lv))
    task = _Task(g, u, cost, fid, LINK, 0.05, 1.0, lv, DEFAULT_MIN_FIDELITY, "position", 0.0)
    for k in range(0, g.token_blocks + 1, 3):
        level = np.full((g.num_layers, g.token_blocks), len(lv) - 1)
        level[:, :k] = -1
        need = DEFAULT_MIN_FIDELITY - float(u[:, :k].sum() + u[:, k:].sum() * fid[-1])
        if need > 0 and k < g.token_blocks:
            i, j, target, gain, _ = task.upgrades(level)
            take = min(int(np.searchsorted(np.cumsum(gain), need)) + 1, len(gain))
            np.minimum.at(level, (i[:take], j[:take]), target[:take])
        assert np.array_equal(task.floored(k), level), k


def test_link_times_of_many_byte_counts_are_each_ones():
    counts = np.array([0, 1, 1279, 1280, 1281, 10**6, 7.5e7, -3])
    each = LINK.seconds_each(counts, 0.1)
    assert each.tolist() == [LINK.seconds(float(c), 0.1) for c in counts]
