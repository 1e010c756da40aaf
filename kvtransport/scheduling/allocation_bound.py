"""The evaluation's references for link sharing: a fluid link and the clairvoyant bound.

``simulate_fluid`` runs any slot policy (kvtransport.scheduling.allocator) against a fluid link (no
loss, no protocol) to compare policies quickly; ``clairvoyant_bound`` is the offline
optimum over every arrival known in advance, bracketed by branch and bound over an LP
relaxation of the concave envelopes. Neither runs in a daemon: they are what the
multi-user evaluation (scripts/eval_multiuser.py) measures the online allocator against.
They reuse the allocator's own kernels (the per-user parameter matrix and its marginal
utilities), so the bound and the policy price bytes identically.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtransport.scheduling.allocator import (
    _C,
    _LIN,
    _S,
    _X0,
    _XHI,
    _XLB,
    _XLO,
    OnlineScheduler,
    ScheduledTransfer,
    SlotPolicy,
    _check_inputs,
    _marginal,
    _params,
    _set_bounds,
    _value,
)


@dataclass(frozen=True)
class FluidOutcome:
    """Final delivered fraction and utility per transfer id after a fluid run."""

    fractions: dict[Hashable, float]
    utilities: dict[Hashable, float]
    weighted_utility: float
    bytes_sent: float
    busy_capacity: float

    @property
    def mean_utility(self) -> float:
        return float(np.mean(list(self.utilities.values()))) if self.utilities else 0.0


def simulate_fluid(
    transfers: Iterable[ScheduledTransfer],
    capacity_Bps: float,
    policy: SlotPolicy,
    slot_s: float = 0.01,
) -> FluidOutcome:
    """Run a policy over a loss-free fluid link; every byte sent arrives at once.

    The protocol simulator replaces this with real sessions; this is the allocator's own
    yardstick (and the setting in which ``clairvoyant_bound`` is exact). bytes_sent is
    the total carried; busy_capacity the capacity of the time some transfer was active
    (so bytes_sent <= busy_capacity is bandwidth conservation).
    """
    pending = sorted(
        (
            ScheduledTransfer(t.id, t.size, t.deadline, t.utility, t.weight, t.arrival, t.delivered)
            for t in transfers
        ),
        key=lambda t: t.arrival,
    )
    final: dict[Hashable, ScheduledTransfer] = {t.id: t for t in pending}
    sched = OnlineScheduler(capacity_Bps, policy, slot_s)
    now = pending[0].arrival if pending else 0.0
    k = 0
    sent = busy = 0.0
    while k < len(pending) or sched.transfers:
        while k < len(pending) and pending[k].arrival <= now:
            sched.add(pending[k])
            k += 1
        dec = sched.step(now)
        nxt = dec.until
        if k < len(pending):
            nxt = min(nxt, pending[k].arrival)
        if not sched.transfers:
            now = pending[k].arrival if k < len(pending) else now
            continue
        dt = nxt - now
        if dec.rates:
            busy += capacity_Bps * dt
        for tid, r in dec.rates.items():
            sched.add_delivered(tid, r * dt)
            sent += r * dt
        now = nxt
    fr = {tid: t.fraction for tid, t in final.items()}
    ut = {tid: float(t.utility(t.fraction)) for tid, t in final.items()}
    wu = float(sum(t.weight * ut[tid] for tid, t in final.items()))
    return FluidOutcome(fr, ut, wu, sent, busy)


# ------------------------------------------------------------- clairvoyant bound


@dataclass(frozen=True)
class ClairvoyantResult:
    """The offline optimum of a whole scenario (all arrivals known), bracketed.

    upper: a certified upper bound on sum w U(x) over every schedule the link allows.
    achievable: sum w U(x) of a schedule found that the link allows (the best one
    seen), so the clairvoyant optimum lies in [achievable, upper]; the branch and bound
    stops when they are within its tolerance. bytes/fractions: that schedule's totals per
    transfer id. nodes: relaxations solved.
    """

    upper: float
    achievable: float
    bytes: dict[Hashable, float]
    fractions: dict[Hashable, float]
    nodes: int

    @property
    def gap(self) -> float:
        return self.upper - self.achievable


def _envelope_value(P: np.ndarray, b: np.ndarray) -> np.ndarray:
    """w * (concave envelope of U over [XLB, XHI]) at x0 + b / S, per user."""
    x = P[:, _X0] + b / P[:, _S]
    on_line = (P[:, _LIN] >= 0) & (x < P[:, _XLO])
    at_lb = _value(P, (P[:, _XLB] - P[:, _X0]) * P[:, _S])
    line = at_lb + P[:, _LIN] * (b - (P[:, _XLB] - P[:, _X0]) * P[:, _S])
    return np.where(on_line, line, _value(P, b))


class _Relaxation:
    """The concave relaxation over the link's schedules: a small LP with cutting planes.

    Variables: b_i, the bytes user i gets in its window, and t_i, its value. Which
    totals a link of C bytes/s can deliver is Hall's condition on time intervals: for
    every interval I from an arrival to a deadline, the users whose windows lie inside I
    get at most C |I| (then earliest-deadline-first delivers them all). Each user's
    concave envelope F_i over its range [lo_i, hi_i] is bounded from above by supporting
    lines (the envelope's linear piece and tangents of U on its concave part: F_i is
    concave, so each such line lies above it): t_i <= alpha + beta b_i.

    Both families are added lazily (Kelley's cutting planes): solve the LP with the lines
    and Hall intervals known so far, add every violated interval and, where t_i exceeds
    F_i at the solution, the tangent there; repeat until the solution meets every interval
    and the LP's value is within ``tol`` of the relaxation's value at it. With a subset of
    the constraints the LP is a relaxation of the relaxation, so its optimum is an upper
    bound on every schedule at every iteration. Intervals are valid everywhere and kept
    across nodes; lines are kept per user and handed down the tree (a parent's lines lie
    above every child's envelope too).
    """

    def __init__(self, arrival: np.ndarray, deadline: np.ndarray, capacity_Bps: float) -> None:
        self.a = np.asarray(arrival, dtype=np.float64)
        self.d = np.asarray(deadline, dtype=np.float64)
        self.C = float(capacity_Bps)
        n = self.a.size
        # Bytes in units of one typical window's capacity: slopes per byte are
        # ~1e-10..1e-6, which the solver's tolerances cannot tell from 0.
        self.unit = max(self.C * float(np.median(self.d - self.a)), 1.0)
        self.starts = np.unique(self.a)
        self.ends = np.unique(self.d)
        self.inside_a = self.a[:, None] >= self.starts[None, :]  # [user, start]
        self.inside_d = self.d[:, None] <= self.ends[None, :]  # [user, end]
        span = self.ends[None, :] - self.starts[:, None]
        self.cap = np.where(span > 0, self.C * span / self.unit, np.inf)  # [start, end]
        # Start with the whole span and every single window.
        self.rows: list[np.ndarray] = []
        self.rhs: list[float] = []
        self.known: set[tuple[int, int]] = set()
        for j, k in [(0, self.ends.size - 1)] + [
            (
                int(np.searchsorted(self.starts, self.a[i])),
                int(np.searchsorted(self.ends, self.d[i])),
            )
            for i in range(n)
        ]:
            self._add(j, k)

    def _add(self, j: int, k: int) -> None:
        if (j, k) in self.known or not math.isfinite(self.cap[j, k]):
            return
        self.known.add((j, k))
        self.rows.append((self.inside_a[:, j] & self.inside_d[:, k]).astype(np.float64))
        self.rhs.append(float(self.cap[j, k]))

    def _violations(self, b: np.ndarray) -> np.ndarray:
        """Demand minus capacity of every interval [start j, end k] (units)."""
        demand = (self.inside_a * b[:, None]).T @ self.inside_d
        return demand - self.cap

    def solve(
        self, P: np.ndarray, lines: list[list[tuple[float, float]]], tol: float
    ) -> tuple[float, np.ndarray] | None:
        """(LP bound, bytes per user), or None if the node's minimum bytes do not fit."""
        from scipy.optimize import linprog

        n = P.shape[0]
        unit = self.unit
        lo = (P[:, _XLB] - P[:, _X0]) * P[:, _S] / unit
        hi = (P[:, _XHI] - P[:, _X0]) * P[:, _S] / unit
        if np.any(self._violations(lo) > 1e-12 * np.maximum(self.cap, 1.0)):
            return None  # the forced minimum bytes alone break some interval
        c = np.concatenate([np.zeros(n), -np.ones(n)])
        bounds = [(float(lo[i]), float(hi[i])) for i in range(n)] + [(None, None)] * n
        bound, tot = -np.inf, lo * unit
        for _ in range(100):
            line_rows, line_rhs = [], []
            for i in range(n):
                for alpha, beta in lines[i]:
                    r = np.zeros(2 * n)
                    r[i] = -beta * unit
                    r[n + i] = 1.0
                    line_rows.append(r)
                    line_rhs.append(alpha)
            hall = np.concatenate([np.array(self.rows), np.zeros((len(self.rows), n))], axis=1)
            A = np.concatenate([hall, np.array(line_rows)])
            rhs = np.concatenate([np.array(self.rhs), np.array(line_rhs)])
            res = linprog(c, A_ub=A, b_ub=rhs, bounds=bounds, method="highs")
            if res.status != 0:
                return None
            b = np.clip(res.x[:n], lo, hi)
            t = res.x[n:]
            bound = float(t.sum())
            tot = b * unit
            viol = self._violations(b)
            bad = np.argwhere(viol > 1e-10 * np.maximum(self.cap, 1.0))
            for j, k in bad:
                self._add(int(j), int(k))
            gap = t - _envelope_value(P, tot)
            cuts = np.flatnonzero(gap > 0.1 * tol * max(abs(bound), 1e-12) / n)
            for i in cuts.tolist():
                lines[i].append(_tangent(P, i, float(tot[i])))
            if bad.size == 0 and gap.sum() <= tol * max(abs(bound), 1e-12):
                return bound, tot
        # Not converged: the bound is valid; the schedule is made to fit by scaling.
        viol = self._violations(tot / unit)
        scale = 1.0
        if np.any(viol > 0):
            demand = viol + self.cap
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = float(np.nanmin(np.where(demand > 0, self.cap / demand, np.inf)))
        return bound, np.maximum(lo * unit, tot * min(scale, 1.0))


def _tangent(P: np.ndarray, i: int, b: float) -> tuple[float, float]:
    """Supporting line (alpha, beta per byte) of user i's envelope at b extra bytes."""
    x = P[i, _X0] + b / P[i, _S]
    # On the linear piece, and at its end: when the range ends below the tangent point
    # the piece is a chord and U's own tangent there would cut under it.
    if P[i, _LIN] >= 0 and x <= P[i, _XLO]:
        b0 = (P[i, _XLB] - P[i, _X0]) * P[i, _S]
        f0 = float(_value(P[i : i + 1], np.array([b0]))[0])
        return f0 - P[i, _LIN] * b0, float(P[i, _LIN])
    beta = float(_marginal(P, i, x))
    f = float(_value(P[i : i + 1], np.array([b]))[0])
    return f - beta * b, beta


def _initial_lines(P: np.ndarray) -> list[list[tuple[float, float]]]:
    """The linear piece and a few tangents of the concave part, per user."""
    lines = []
    for i in range(P.shape[0]):
        lo = (P[i, _XLB] - P[i, _X0]) * P[i, _S]
        hi = (P[i, _XHI] - P[i, _X0]) * P[i, _S]
        start = max((P[i, _XLO] - P[i, _X0]) * P[i, _S], lo)
        pts = [lo] + list(np.linspace(start, hi, 4))
        lines.append([_tangent(P, i, float(b)) for b in pts])
    return lines


def clairvoyant_bound(
    transfers: Sequence[ScheduledTransfer],
    capacity_Bps: float,
    rel_tol: float = 1e-4,
    max_nodes: int = 500,
) -> ClairvoyantResult:
    """The best weighted utility any scheduler could reach knowing every arrival.

    The offline problem: choose byte totals b_i that a link of C bytes/s can deliver
    within each transfer's window [arrival, deadline] to maximize sum w_i U_i(x_i). A
    schedule is bytes per transfer per segment of time between consecutive arrivals and
    deadlines, each segment carrying at most C times its length (served so, every
    transfer gets its bytes within its window), so the problem is a sum of sigmoids over
    a transportation polytope, non-concave below each c_i.

    Upper bound: replace each U_i on [l_i, u_i] by its concave envelope (the least
    concave majorant, >= U_i) and solve the concave relaxation as a linear program with
    cutting planes (``_Relaxation``; scipy's HiGHS): its value bounds every schedule.
    The relaxation's own schedule is feasible, so its value with the real U_i is
    achievable; so is the schedule re-solved with every transfer the relaxation left on
    its envelope's linear piece (its convex region) given nothing more (a rounding).

    Branch and bound (Udell and Boyd's method for sums of sigmoids): split the range of
    the transfer whose envelope overstates it most at the relaxed solution (at its
    inflection c_i when it sits below it: above c_i the envelope is the curve, so that
    child is exact for it; else at the relaxed point), re-solve both halves; stop when the
    best achievable value is within rel_tol of the largest open bound, or after
    max_nodes relaxations (the bound stays valid either way).
    """
    import heapq

    ts = list(transfers)
    if not ts:
        return ClairvoyantResult(0.0, 0.0, {}, {}, 0)
    if not (capacity_Bps > 0 and math.isfinite(capacity_Bps)):
        raise ValueError("capacity must be a positive number of bytes per second")
    n = len(ts)
    sizes = np.array([t.size for t in ts], dtype=np.float64)
    weights = np.array([t.weight for t in ts], dtype=np.float64)
    dl = np.minimum(np.array([t.delivered for t in ts], dtype=np.float64), sizes)
    _check_inputs(sizes, weights, dl, n)
    base = _params(sizes, weights, [t.utility for t in ts], dl, envelope=True)
    lp = _Relaxation(
        np.array([t.arrival for t in ts]), np.array([t.deadline for t in ts]), capacity_Bps
    )
    cut_tol = min(rel_tol, 1e-4) * 0.1

    def node(
        lower: np.ndarray, upper: np.ndarray, lines: list[list[tuple[float, float]]] | None
    ) -> tuple[float, np.ndarray, np.ndarray, list[list[tuple[float, float]]]]:
        P = base.copy()
        P[:, _XLB] = lower
        P[:, _XHI] = upper
        _set_bounds(P, True)
        own = _initial_lines(P)
        if lines is not None:
            own = [a + b for a, b in zip(own, lines, strict=True)]
        sol = lp.solve(P, own, cut_tol)
        if sol is None:
            return -np.inf, np.zeros(n), P, own
        return sol[0], sol[1], P, own

    best_val, best_out = -np.inf, np.zeros(n)

    def consider(P: np.ndarray, out: np.ndarray) -> None:
        nonlocal best_val, best_out
        val = float(np.sum(_value(P, out)))
        if val > best_val:
            best_val, best_out = val, out

    def rounded(
        lo: np.ndarray, hi: np.ndarray, P: np.ndarray, out: np.ndarray, lines: list
    ) -> None:
        x = P[:, _X0] + out / P[:, _S]
        frac = (P[:, _LIN] >= 0) & (x < P[:, _XLO] - 1e-12) & (x > P[:, _XLB] + 1e-12)
        if frac.any():
            cub, cout, cP, _ = node(lo, np.where(frac, lo, hi), lines)
            if math.isfinite(cub):
                consider(cP, cout)

    root_lo, root_hi = base[:, _X0].copy(), np.ones(n)
    ub, out, P, lines = node(root_lo, root_hi, None)
    if not math.isfinite(ub):  # pragma: no cover - nothing is forced at the root
        raise RuntimeError("the clairvoyant relaxation is infeasible")
    consider(P, out)
    rounded(root_lo, root_hi, P, out, lines)
    heap = [(-ub, 0, root_lo, root_hi, out, P, lines)]
    nodes, counter = 1, 1
    # The optimum is <= max(bounds of open nodes, bounds of nodes closed because their
    # relaxation was already exact); pruned nodes have bounds <= best_val.
    closed = -np.inf
    while heap:
        neg, _, lo, hi, out, P, lines = heapq.heappop(heap)
        if -neg <= best_val + rel_tol * max(abs(best_val), 1e-12) or nodes >= max_nodes:
            heapq.heappush(heap, (neg, -1, lo, hi, out, P, lines))
            break
        over = _envelope_value(P, out) - _value(P, out)
        i = int(np.argmax(over))
        if over[i] <= 1e-9 * max(abs(best_val), 1e-12):
            closed = max(closed, -neg)
            continue
        if nodes > 1 and nodes % 8 == 0:
            rounded(lo, hi, P, out, lines)
        split = P[i, _X0] + out[i] / P[i, _S]
        c = min(max(P[i, _C], 0.0), 1.0)
        if split < c and lo[i] < c < hi[i]:
            split = c  # above the inflection the envelope is the curve: that child is exact
        for clo, chi in ((lo[i], split), (split, hi[i])):
            if chi <= clo:
                continue
            lo2, hi2 = lo.copy(), hi.copy()
            lo2[i], hi2[i] = clo, chi
            cub, cout, cP, clines = node(lo2, hi2, lines)
            nodes += 1
            if not math.isfinite(cub):
                continue
            # A child's optimum is at most its parent's bound.
            cub = min(cub, -neg)
            consider(cP, cout)
            if cub > best_val:
                heapq.heappush(heap, (-cub, counter, lo2, hi2, cout, cP, clines))
                counter += 1
    upper_bound = max(best_val, closed, -heap[0][0] if heap else -np.inf)
    ids = [t.id for t in ts]
    fr = base[:, _X0] + best_out / sizes
    return ClairvoyantResult(
        upper=float(upper_bound),
        achievable=best_val,
        bytes=dict(zip(ids, best_out.tolist(), strict=True)),
        fractions=dict(zip(ids, fr.tolist(), strict=True)),
        nodes=nodes,
    )
