"""The multi-user allocator: exact water-filling, admission, scheduling, the offline bound."""

import itertools
import math

import numpy as np
import pytest
from scipy.optimize import linprog, minimize, minimize_scalar

from kvtransport.scheduling import allocator as al
from kvtransport.scheduling.allocation_bound import clairvoyant_bound, simulate_fluid
from kvtransport.scheduling.allocator import (
    EarliestDeadlineFirst,
    EqualShare,
    OnlineScheduler,
    ProportionalToSize,
    ScheduledTransfer,
    UtilityWaterFilling,
    allocate_slot,
    min_useful_bytes,
    plan_horizon,
    water_fill,
)
from kvtransport.scheduling.utility_model import SigmoidUtility

POLICIES = [EqualShare, ProportionalToSize, EarliestDeadlineFirst, UtilityWaterFilling]


def _users(rng, n, delivered=True):
    utils = [
        SigmoidUtility(
            rng.uniform(0.5, 1.0), rng.uniform(5, 30), rng.uniform(0.05, 0.6), rng.uniform(0, 0.1)
        )
        for _ in range(n)
    ]
    sizes = rng.uniform(1e5, 1e6, n)
    weights = rng.uniform(0.5, 2.0, n)
    dl = sizes * rng.uniform(0, 0.5, n) * (rng.random(n) < 0.5) if delivered else np.zeros(n)
    return utils, sizes, weights, dl


def _objective(utils, sizes, weights, dl, b):
    return sum(
        w * u((d + x) / s) for u, s, w, d, x in zip(utils, sizes, weights, dl, b, strict=True)
    )


def _scipy_optimum(utils, sizes, weights, dl, cum_cap):
    """SLSQP on fractions (well scaled, analytic gradients) under deadline prefixes.

    Users must already be sorted by cum_cap; every user kept in its concave region.
    """
    n = len(utils)
    x0 = dl / sizes
    xl = np.maximum(x0, [u.concave_start for u in utils])
    scale = sizes.sum()

    def f(x):
        return -sum(w * u(xi) for u, w, xi in zip(utils, weights, x, strict=True))

    def g(x):
        return -np.array(
            [w * float(u.derivative(xi)) for u, w, xi in zip(utils, weights, x, strict=True)]
        )

    cons = [
        {
            "type": "ineq",
            "fun": lambda x, k=k: (
                (cum_cap[k] - ((x[: k + 1] - x0[: k + 1]) * sizes[: k + 1]).sum()) / scale
            ),
            "jac": lambda x, k=k: -np.concatenate([sizes[: k + 1], np.zeros(n - k - 1)]) / scale,
        }
        for k in range(n)
    ]
    best = None
    for start in (0.0, 0.01, 0.5):
        r = minimize(
            f,
            xl + (1 - xl) * start,
            jac=g,
            method="SLSQP",
            bounds=list(zip(xl, np.ones(n), strict=True)),
            constraints=cons,
            options={"ftol": 1e-15, "maxiter": 2000},
        )
        used = np.cumsum((r.x - x0) * sizes)
        if np.all(used <= cum_cap * (1 + 1e-9)) and (best is None or r.fun < best.fun):
            best = r
    return -best.fun


def _feasible_instance(rng, n, nested):
    while True:
        utils, sizes, weights, dl = _users(rng, n)
        lo = min_useful_bytes(sizes, utils, dl)
        hi = sizes - dl
        if nested:
            T = np.sort(rng.uniform(0.1, 1.0, n))
            cap = rng.uniform(0.3, 1.5) * hi.sum() / T[-1] * T
        else:
            cap = np.full(n, lo.sum() + rng.uniform(0, 1) * (hi - lo).sum())
        if np.all(np.cumsum(lo) <= cap):
            return utils, sizes, weights, dl, cap


def test_water_fill_matches_the_scipy_optimum():
    rng = np.random.default_rng(1)
    for _ in range(40):
        n = int(rng.integers(2, 7))
        utils, sizes, weights, dl, cap = _feasible_instance(rng, n, nested=False)
        a = water_fill(cap[0], sizes, utils, weights, dl)
        ours = _objective(utils, sizes, weights, dl, a.bytes)
        ref = _scipy_optimum(utils, sizes, weights, dl, cap)
        assert abs(ours - ref) <= 1e-6 * abs(ref)
        assert a.value == pytest.approx(ours, rel=1e-12)
        assert a.bytes.sum() <= cap[0] * (1 + 1e-12)


def test_nested_water_fill_matches_the_scipy_optimum_under_deadlines():
    rng = np.random.default_rng(2)
    for _ in range(30):
        n = int(rng.integers(2, 7))
        utils, sizes, weights, dl, cap = _feasible_instance(rng, n, nested=True)
        h = al._Horizon(sizes, weights, utils, dl, cap)  # cap is sorted: order is identity
        out, price, _ = h.plan(np.ones(n, dtype=bool))
        ours = _objective(utils, sizes, weights, dl, out)
        ref = _scipy_optimum(utils, sizes, weights, dl, cap)
        assert abs(ours - ref) <= 1e-6 * abs(ref)
        assert np.all(np.cumsum(out) <= cap * (1 + 1e-12) + 1e-6)


def _marginals(utils, sizes, weights, dl, b):
    x = (dl + b) / sizes
    return np.array(
        [
            w * float(u.derivative(xi)) / s
            for u, w, s, xi in zip(utils, weights, sizes, x, strict=True)
        ]
    )


def test_kkt_conditions_hold():
    rng = np.random.default_rng(3)
    interior_seen = 0
    for _ in range(40):
        n = int(rng.integers(2, 9))
        nested = bool(rng.random() < 0.5)
        utils, sizes, weights, dl, cap = _feasible_instance(rng, n, nested=nested)
        a = plan_horizon(cap, sizes, utils, weights, dl, admitted=np.ones(n, dtype=bool))
        assert a.admitted.all()
        lo = min_useful_bytes(sizes, utils, dl)
        hi = sizes - dl
        m = _marginals(utils, sizes, weights, dl, a.bytes)
        lam = a.price
        tol = 1e-7 * np.maximum(lam, 1e-300)
        at_lo = a.bytes <= lo + 1e-6 * sizes
        at_hi = a.bytes >= hi - 1e-6 * sizes
        inside = ~at_lo & ~at_hi
        interior_seen += inside.sum()
        # Equal weighted marginal utility per byte among users strictly inside their bounds:
        # each sits where the reference curve's inverse derivative puts it at that level
        # (in fractions, the scale of the answer; in the curve's tail a 1e-9 shift of x
        # moves U' by ~b 1e-9 relative).
        for i in np.flatnonzero(inside):
            xi = (dl[i] + a.bytes[i]) / sizes[i]
            want = float(utils[i].inverse_derivative(lam[i] * sizes[i] / weights[i]))
            assert xi == pytest.approx(want, abs=1e-9)
        assert np.allclose(m[inside], lam[inside], rtol=1e-6)
        assert np.all(m[at_lo & ~at_hi] <= lam[at_lo & ~at_hi] + tol[at_lo & ~at_hi])
        assert np.all(m[at_hi & ~at_lo] >= lam[at_hi & ~at_lo] - tol[at_hi & ~at_lo])
        # Prices fall with the deadline, only where a deadline prefix is tight, and
        # a positive last price means the whole capacity is used.
        used = np.cumsum(a.bytes)
        assert np.all(np.diff(lam) <= 1e-12 * lam[:-1])
        drops = np.flatnonzero(np.diff(lam) < -1e-9 * lam[:-1])
        assert np.allclose(used[drops], cap[drops], rtol=1e-9)
        if lam[-1] > 0:
            assert used[-1] == pytest.approx(cap[-1], rel=1e-9)
        assert np.all(at_hi[lam == 0])  # slack capacity: those users get everything
    assert interior_seen > 40  # the equal-marginal condition was really exercised


def test_kernels_agree_with_the_reference_curve():
    rng = np.random.default_rng(4)
    utils, sizes, weights, _ = _users(rng, 12, delivered=False)
    x0 = rng.uniform(0, 0.4, 12)
    P = al._params(sizes, weights, utils, x0 * sizes, envelope=True)
    Pc = al._params(sizes, weights, utils, x0 * sizes, envelope=False)
    for i, u in enumerate(utils):
        xt, slope = u.tangent_from(x0[i])
        if x0[i] < u.concave_start:
            assert P[i, al._XLO] == pytest.approx(xt, abs=1e-9)
            assert P[i, al._LIN] == pytest.approx(weights[i] * slope / sizes[i], rel=1e-9)
        for x in np.linspace(max(u.c, 0) + 1e-3, 1.0, 7):
            lam = weights[i] * float(u.derivative(x)) / sizes[i]
            assert al._xinv(Pc, i, lam) == pytest.approx(
                float(u.inverse_derivative(u.derivative(x)))
            )
            assert al._xinv(Pc, i, lam) == pytest.approx(x, abs=1e-9)


def test_admission_only_admits_users_that_reach_their_concave_region():
    rng = np.random.default_rng(5)
    deferred_seen = 0
    for _ in range(60):
        n = int(rng.integers(2, 10))
        utils, sizes, weights, dl = _users(rng, n)
        lo = min_useful_bytes(sizes, utils, dl)
        budget = rng.uniform(0.05, 0.7) * sizes.sum()
        a = allocate_slot(budget, sizes, utils, weights, dl)
        x = (dl + a.bytes) / sizes
        cs = np.array([u.concave_start for u in utils])
        assert np.all(x[a.admitted] >= cs[a.admitted] - 1e-9)
        assert lo[a.admitted].sum() <= budget * (1 + 1e-9)
        assert not np.any(a.admitted & (lo > budget))
        assert np.all(a.bytes[~a.admitted] == 0)
        assert a.bytes.sum() <= budget * (1 + 1e-12)
        deferred_seen += (~a.admitted).sum()
        # Under deadlines: each admitted user's minimum fits before its own deadline.
        T = rng.uniform(0.05, 1.0, n)
        cap = budget * T
        b = plan_horizon(cap, sizes, utils, weights, dl)
        x = (dl + b.bytes) / sizes
        assert np.all(x[b.admitted] >= cs[b.admitted] - 1e-9)
        order = np.argsort(T)
        assert np.all(np.cumsum(np.where(b.admitted, b.bytes, 0)[order]) <= cap[order] * (1 + 1e-9))
    assert deferred_seen > 30  # admission really had to defer people


def test_admission_finds_the_best_subset_on_small_instances():
    rng = np.random.default_rng(7)
    ratios = []
    for _ in range(40):
        n = int(rng.integers(2, 7))
        utils, sizes, weights, _ = _users(rng, n, delivered=False)
        lo = min_useful_bytes(sizes, utils)
        budget = rng.uniform(0.2, 0.8) * sizes.sum()
        a = allocate_slot(budget, sizes, utils, weights)
        best = -math.inf
        for mask in itertools.product([False, True], repeat=n):
            m = np.array(mask)
            if lo[m].sum() > budget:
                continue
            v = sum(w * u(0.0) for u, w, k in zip(utils, weights, m, strict=True) if not k)
            if m.any():
                sub = [utils[i] for i in np.flatnonzero(m)]
                v += water_fill(budget, sizes[m], sub, weights[m]).value
            best = max(best, v)
        ratios.append(a.value / best)
    ratios = np.array(ratios)
    assert ratios.max() <= 1 + 1e-9  # brute force over subsets is the optimum
    assert ratios.min() >= 0.98
    assert np.mean(ratios >= 1 - 1e-9) >= 0.9


def test_water_fill_refuses_minimums_that_do_not_fit():
    utils = [SigmoidUtility(0.9, 10.0, 0.5)] * 2
    with pytest.raises(ValueError, match="minimum useful bytes"):
        water_fill(0.9e6, [1e6, 1e6], utils)


def _staggered(rng, n, spread=1.0, window=0.5):
    return [
        ScheduledTransfer(
            i,
            rng.uniform(1e6, 5e6),
            a + window,
            SigmoidUtility(rng.uniform(0.8, 0.95), rng.uniform(8, 20), rng.uniform(0.15, 0.4)),
            rng.uniform(0.5, 2.0),
            a,
        )
        for i, a in enumerate(rng.uniform(0, spread, n))
    ]


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_scheduler_conserves_bandwidth_and_respects_deadlines(policy_cls):
    rng = np.random.default_rng(8)
    cap = 12.5e6
    ts = sorted(_staggered(rng, 10), key=lambda t: t.arrival)
    sched = OnlineScheduler(cap, policy_cls(), slot_s=0.02)
    given = {t.id: 0.0 for t in ts}
    now, k, departed = 0.0, 0, {}
    while k < len(ts) or sched.transfers:
        while k < len(ts) and ts[k].arrival <= now:
            sched.add(ts[k])
            k += 1
        dec = sched.step(now)
        departed.update(dict(dec.departed))
        until = min(dec.until, ts[k].arrival) if k < len(ts) else dec.until
        assert now < dec.until <= now + 0.02 + 1e-12
        dt = until - now
        active = [sched.transfers[i] for i in dec.rates]
        assert sum(dec.rates.values()) <= cap * (1 + 1e-9)
        for t in active:
            assert t.arrival <= now < t.deadline and dec.until <= t.deadline
            assert dec.rates[t.id] >= 0 and dec.rates[t.id] * dt <= t.remaining * (1 + 1e-9)
        backlog = sum(t.remaining for t in active)
        if backlog > cap * dt * (1 + 1e-6):
            assert sum(dec.rates.values()) >= cap * (1 - 1e-9)  # work-conserving
        assert set(dec.admitted) | set(dec.deferred) == set(dec.rates)
        for tid, r in dec.rates.items():
            sched.add_delivered(tid, r * dt)
            given[tid] += r * dt
        if not sched.transfers and k < len(ts):
            until = ts[k].arrival
        now = until
    assert set(departed) == {t.id for t in ts}
    assert set(departed.values()) <= {"delivered", "deadline"}
    for t in ts:
        assert given[t.id] <= t.size * (1 + 1e-9)
        assert given[t.id] <= cap * (t.deadline - t.arrival) * (1 + 1e-9)


def test_baselines_split_as_their_names_say():
    u = SigmoidUtility(0.9, 10, 0.3)
    ts = [
        ScheduledTransfer(i, s, d, u)
        for i, (s, d) in enumerate([(4e6, 0.3), (2e6, 0.2), (1e6, 0.5)])
    ]
    eq = EqualShare().allocate(0.0, 0.1, 1e7, ts)
    assert np.allclose(eq, 1e6 / 3)
    pr = ProportionalToSize().allocate(0.0, 0.1, 1e7, ts)
    assert np.allclose(pr, np.array([4, 2, 1]) / 7 * 1e6)
    edf = EarliestDeadlineFirst().allocate(0.0, 0.1, 1e7, ts)
    assert np.allclose(edf, [0, 1e6, 0])
    # Caps redistribute: the small transfer is nearly done, the others share the rest.
    ts[2].delivered = 0.9e6
    eq = EqualShare().allocate(0.0, 0.1, 1e7, ts)
    assert np.allclose(eq, [0.45e6, 0.45e6, 0.1e6])


def test_clairvoyant_bound_is_above_every_policy_and_tight():
    rng = np.random.default_rng(9)
    for n, spread, cap in ((6, 0.0, 8e6), (8, 0.3, 12.5e6), (10, 1.0, 12.5e6)):
        ts = _staggered(rng, n, spread)
        cb = clairvoyant_bound(ts, cap)
        assert cb.achievable <= cb.upper + 1e-12
        assert cb.gap <= 1e-4 * cb.upper
        for cls in POLICIES:
            out = simulate_fluid(ts, cap, cls(), 0.02)
            assert out.weighted_utility <= cb.upper * (1 + 1e-9)
            assert out.bytes_sent <= out.busy_capacity * (1 + 1e-9)


def test_clairvoyant_schedule_fits_the_link():
    """Hall feasibility of the returned totals, checked as a transportation LP."""
    rng = np.random.default_rng(10)
    ts = _staggered(rng, 7, spread=0.6)
    cap = 10e6
    cb = clairvoyant_bound(ts, cap)
    times = np.unique([t.arrival for t in ts] + [t.deadline for t in ts])
    seg_cap = cap * np.diff(times)
    pairs = [
        (i, s)
        for i, t in enumerate(ts)
        for s in range(len(seg_cap))
        if times[s] >= t.arrival and times[s + 1] <= t.deadline
    ]
    a_eq = np.zeros((len(ts), len(pairs)))
    a_ub = np.zeros((len(seg_cap), len(pairs)))
    for k, (i, s) in enumerate(pairs):
        a_eq[i, k] = 1
        a_ub[s, k] = 1
    b_eq = np.array([cb.bytes[t.id] for t in ts])
    res = linprog(np.zeros(len(pairs)), A_ub=a_ub, b_ub=seg_cap * (1 + 1e-9), A_eq=a_eq, b_eq=b_eq)
    assert res.status == 0
    assert sum(t.weight * t.utility(cb.fractions[t.id]) for t in ts) == pytest.approx(
        cb.achievable, rel=1e-12
    )


def test_clairvoyant_matches_brute_force_for_two_transfers():
    u1 = SigmoidUtility(0.9, 18.0, 0.45)
    u2 = SigmoidUtility(0.8, 12.0, 0.3)
    ts = [
        ScheduledTransfer("a", 3e6, 0.5, u1, 1.0, 0.0),
        ScheduledTransfer("b", 2e6, 0.7, u2, 1.5, 0.2),
    ]
    cap = 6e6  # a alone: 3 MB, b alone: 3 MB, both windows together: 4.2 MB
    cb = clairvoyant_bound(ts, cap)

    def best_for(b1):
        b2 = min(2e6, cap * 0.5, cap * 0.7 - b1)
        return u1(b1 / 3e6) + 1.5 * u2(b2 / 2e6)

    grid = np.linspace(0, 3e6, 3001)
    k = int(np.argmax([best_for(b) for b in grid]))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, grid.size - 1)]
    r = minimize_scalar(lambda b: -best_for(b), bounds=(lo, hi), method="bounded")
    brute = max(-r.fun, best_for(grid[k]))
    assert cb.achievable - 1e-9 <= brute <= cb.upper + 1e-9
    assert brute == pytest.approx(cb.achievable, rel=1e-4)


def test_water_filling_reaches_the_clairvoyant_bound_on_concurrent_handovers():
    """All users hand over at once on an overloaded link: the setting of the issue."""
    ratios = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(4, 13))
        ts = [
            ScheduledTransfer(
                i,
                rng.uniform(1e6, 4e6),
                0.5,
                SigmoidUtility(rng.uniform(0.8, 0.95), rng.uniform(8, 25), rng.uniform(0.15, 0.45)),
                rng.uniform(0.5, 2),
            )
            for i in range(n)
        ]
        cap = sum(t.size for t in ts) / 0.5 * rng.uniform(0.2, 0.8)
        cb = clairvoyant_bound(ts, cap)
        ours = simulate_fluid(ts, cap, UtilityWaterFilling(), 0.05).weighted_utility
        for cls in (EqualShare, ProportionalToSize, EarliestDeadlineFirst):
            assert ours >= simulate_fluid(ts, cap, cls(), 0.05).weighted_utility - 1e-9
        ratios.append(ours / cb.upper)
    assert min(ratios) >= 0.99


def test_online_admission_drops_a_poor_early_transfer_for_better_later_ones():
    """Re-deciding admission beats keeping it when a bad transfer arrives first."""
    poor = SigmoidUtility(0.6, 15.0, 0.6)
    good = SigmoidUtility(0.95, 15.0, 0.2)
    ts = [ScheduledTransfer("poor", 6e6, 0.55, poor, 1.0, 0.0)]
    ts += [ScheduledTransfer(f"g{i}", 2e6, 0.6, good, 1.0, 0.1) for i in range(3)]
    cap = 8e6
    redecide = simulate_fluid(ts, cap, UtilityWaterFilling(), 0.01)
    sticky = simulate_fluid(ts, cap, UtilityWaterFilling(sticky=True), 0.01)
    assert redecide.weighted_utility > sticky.weighted_utility
    assert all(redecide.fractions[f"g{i}"] >= good.concave_start for i in range(3))


def test_value_first_serving_keeps_every_deadline_and_serves_value_first():
    """A slot of the plan: what the deadlines force, then by utility per byte."""
    rng = np.random.default_rng(12)
    cap, until = 10e6, 0.01
    for _ in range(200):
        n = int(rng.integers(2, 9))
        deadlines = np.sort(rng.uniform(until, 0.5, n))
        room = cap * (deadlines - 0.0)
        wants = rng.uniform(0, 1, n) * np.diff(np.concatenate([[0.0], room]))
        sigma = rng.uniform(1e-8, 1e-6, n)
        budget = cap * until
        out = al._value_first_fill(budget, cap, until, deadlines, wants, sigma)
        assert np.all(out >= -1e-9) and np.all(out <= wants + 1e-6)
        assert out.sum() <= budget * (1 + 1e-12)
        # What is left of the plan still fits the capacity after this slot.
        left = np.cumsum(wants - out)
        assert np.all(left <= cap * (deadlines - until) * (1 + 1e-9) + 1e-6)
        assert out.sum() >= min(budget, wants.sum()) * (1 - 1e-9)  # work-conserving
    # Two users, no deadline pressure: the valuable one first even with a later deadline.
    out = al._value_first_fill(1e5, 1e7, 0.01, np.array([0.3, 0.5]), np.array([5e5, 5e5]),
                               np.array([1e-7, 5e-7]))  # fmt: skip
    assert out.tolist() == [0.0, 1e5]
    # ... unless its deadline forces the other: 5e5 bytes due in 50 ms at 10 MB/s.
    out = al._value_first_fill(1e5, 1e7, 0.01, np.array([0.05, 0.5]), np.array([4.5e5, 5e5]),
                               np.array([1e-7, 5e-7]))  # fmt: skip
    assert out[0] == pytest.approx(5e4) and out[1] == pytest.approx(5e4)


def test_clairvoyant_bound_holds_with_many_identical_transfers():
    """Identical transfers in staggered windows (ties everywhere): a valid, feasible bound."""
    u_small = SigmoidUtility(0.9, 7.0, 0.25)
    u_big = SigmoidUtility(0.7, 10.0, 0.14)
    cap = 12e6
    for seed in range(3):
        rng = np.random.default_rng(seed)
        kinds = [(5.9e6, u_small), (11.8e6, u_big)]
        ts = []
        for i, a in enumerate(np.sort(rng.uniform(0, 0.3, 8))):
            size, u = kinds[int(rng.integers(2))]
            ts.append(ScheduledTransfer(i, size, a + 0.5, u, 1.0, a))
        cb = clairvoyant_bound(ts, cap, rel_tol=1e-3, max_nodes=60)
        assert cb.achievable <= cb.upper + 1e-12
        for cls in POLICIES:
            assert simulate_fluid(ts, cap, cls(), 0.01).weighted_utility <= cb.upper * (1 + 1e-6)
        # Hall's condition on every interval between an arrival and a deadline.
        for a in {t.arrival for t in ts}:
            for d in {t.deadline for t in ts}:
                if d > a:
                    inside = sum(cb.bytes[t.id] for t in ts if t.arrival >= a and t.deadline <= d)
                    assert inside <= cap * (d - a) * (1 + 1e-9)


def test_repairs_owed_are_served_before_anything_else():
    """A hole blocks the rest of the stream: pending bytes go first, admitted or not."""
    u = SigmoidUtility(0.9, 10.0, 0.2)
    sched = OnlineScheduler(1e7, UtilityWaterFilling(), slot_s=0.01)
    for i in range(3):
        sched.add(ScheduledTransfer(i, 4e6, 0.5, u))
    sched.set_delivered(0, 3.9e6, pending_bytes=2e4)  # nearly done, 20 kB of repairs owed
    sched.set_delivered(1, 0.0)
    sched.set_delivered(2, 0.0)
    dec = sched.step(0.0)
    assert dec.rates[0] * 0.01 >= 2e4 * (1 - 1e-9)
    assert sum(dec.rates.values()) == pytest.approx(1e7)
    assert sched.transfers[0].pending == 2e4
    sched.set_delivered(0, 3.99e6, pending_bytes=5e4)  # capped at what remains
    assert sched.transfers[0].pending == pytest.approx(1e4)


def test_the_guard_serves_forced_bytes_before_the_last_repair_round():
    poor, good = SigmoidUtility(0.5, 10.0, 0.3), SigmoidUtility(0.95, 10.0, 0.1)
    ts = [ScheduledTransfer("a", 1e6, 0.12, poor), ScheduledTransfer("b", 1e6, 0.5, good)]
    late = UtilityWaterFilling().allocate(0.0, 0.01, 1e7, ts)
    assert late.tolist() == [0.0, 1e5]  # "a" fits later: the valuable one goes first
    guarded = UtilityWaterFilling(guard_s=0.03).allocate(0.0, 0.01, 1e7, ts)
    # "a" must be through 30 ms early: 1 MB in the 80 ms left -> 0.2 MB due now (capped
    # by this slot's 0.1 MB).
    assert guarded.tolist() == [1e5, 0.0]
    with pytest.raises(ValueError, match="guard_s"):
        UtilityWaterFilling(guard_s=-1.0)


def test_the_guard_window_is_spread_not_one_transfers_burst():
    # Six transfers due together (the lossy 12-users-at-1-Gbit/s cell in small): value-first
    # serving hands them the link in turns, and the plan fills the link to the deadline, so
    # some of it must go inside the guard. That spill went to the last transfer in value
    # order, the whole guard at the full link rate, where its first loss too late to
    # repair cuts everything after it. Every plan now keeps its tail for the guard (where
    # receivers report loss: without, the spill costs nothing and stays in value order).
    curves = [SigmoidUtility(0.9, 7.1, 0.25), SigmoidUtility(0.68, 9.75, 0.14)]
    cap, end, guard = 1e8, 0.5, 0.04
    sched = OnlineScheduler(cap, UtilityWaterFilling(guard_s=guard), 0.01)
    for i in range(6):
        sched.add(ScheduledTransfer(i, 6e6 * (1 + i % 2), end, curves[i % 2], loss=0.05))
    now, inside, senders = 0.0, np.zeros(6), []
    while now < end - 1e-9:
        dec = sched.step(now)
        assert sum(dec.rates.values()) == pytest.approx(cap)  # work-conserving throughout
        for k, r in dec.rates.items():
            sched.add_delivered(k, r * (dec.until - now))
            if now >= end - guard - 1e-9:
                inside[k] += r * (dec.until - now)
        if now >= end - guard - 1e-9:
            senders.append({k for k, r in dec.rates.items() if r > 1e-6 * cap})
        now = dec.until
    assert inside.sum() == pytest.approx(cap * guard)
    assert inside.max() <= 0.5 * inside.sum()  # before: one transfer got all of it
    assert np.count_nonzero(inside > 0.1 * inside.sum()) >= 3
    assert all(s == senders[0] for s in senders)  # the tails end together


def test_inside_the_guard_tails_share_the_link_by_what_each_plan_still_wants():
    """Transfers due together, some behind (loss and owed repairs move each sender's
    progress apart): inside the guard each gets the share of the link that its remaining
    plan is of all the remaining plans, so the rate it is given, held to the deadline,
    carries exactly its plan and stays steady slot after slot. A sender extrapolates its
    rate to its deadline (its stop and tail rules); when the shares were proportional to
    the planned totals, a transfer with little left finished it early, the one behind
    then got the link in a burst, and each had stopped admitting sources at the wrong
    time (equal share was ahead by 0.002 in the lossy 1 Gbit/s 12-users cell)."""
    u = SigmoidUtility(0.9, 10.0, 0.1)
    cap, end, guard = 1e8, 0.5, 0.04
    sched = OnlineScheduler(cap, UtilityWaterFilling(guard_s=guard), 0.005)
    for i, done in enumerate((1.0e6, 1.5e6, 2.0e6)):
        sched.add(ScheduledTransfer(i, 6e6, end, u, loss=0.05))
        sched.set_delivered(i, done)
    now, rates = 0.47, []
    while now < end - 1e-9:
        dec = sched.step(now)
        rates.append([dec.rates[i] for i in range(3)])
        if now == 0.47:
            # identical curves: the plan ends everyone at (4.5 MB + 3 MB) / 3 = 2.5 MB
            left = (end - now) * np.array(rates[0])
            assert left == pytest.approx([1.5e6, 1.0e6, 0.5e6], rel=1e-6)
        for k, r in dec.rates.items():
            sched.add_delivered(k, r * (dec.until - now))
        now = dec.until
    assert len(rates) == 6
    assert np.allclose(rates, rates[0], rtol=1e-6)  # steady to the deadline
    assert [sched.transfers[i].delivered for i in range(3)] == pytest.approx([2.5e6] * 3)


def test_a_transfer_alone_in_its_guard_gets_its_plan_as_soon_as_it_can():
    # Its tail is not paced out to the deadline: the guard is there so that what is sent
    # last can still be repaired (pacing it evenly left the last block of three 1 Gbit/s
    # transfers unsent).
    u = SigmoidUtility(0.9, 10.0, 0.1)
    a = ScheduledTransfer("a", 6e6, 0.5, u, delivered=5e6, loss=0.05)
    b = ScheduledTransfer("b", 6e6, 1.0, u, loss=0.05)
    out = UtilityWaterFilling(guard_s=0.04).allocate(0.47, 0.475, 1e8, [a, b])
    assert out.tolist() == pytest.approx([5e5, 0.0])  # the whole slot, not 1e6 / 30 ms
