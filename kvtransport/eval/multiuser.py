"""Link-sharing scenarios: handovers arriving together or staggered over one link, every
allocator on the same scenario, the clairvoyant bound and the full-cache ceiling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtransport.eval.registries import ALLOCATORS, make_allocator

BYTES_PER_TOKEN = 23_040  # SmolLM2-135M: 30 layers x 3 kv heads x 64 x (K, V) x fp16


def parse_arrivals(spec: str) -> tuple[str, float]:
    """'together' -> ('together', 0); 'staggered:0.3' -> ('staggered', 0.3)."""
    if spec == "together":
        return spec, 0.0
    kind, _, spread = spec.partition(":")
    if kind != "staggered":
        raise SystemExit(f"--arrivals: {spec!r} is neither 'together' nor 'staggered:SECONDS'")
    try:
        s = float(spread or "0.3")
    except ValueError:
        raise SystemExit(f"--arrivals: {spec!r}: the spread must be a number of seconds") from None
    if not s > 0:
        raise SystemExit(f"--arrivals: {spec!r}: the spread must be positive")
    return "staggered", s


def scenario(
    users: int,
    arrivals: str,
    seed: int,
    curves: list[Any],
    *,
    window_s: float,
    bytes_per_token: int,
) -> list[Any]:
    """The handovers of one scenario (deterministic in its arguments)."""
    from kvtransport.sim.multisim import Handover

    kind, spread = parse_arrivals(arrivals)
    rng = np.random.default_rng([seed, users, int(spread * 1e6)])
    starts = np.zeros(users) if kind == "together" else np.sort(rng.uniform(0.0, spread, users))
    out = []
    for i, a in enumerate(starts):
        cv = curves[int(rng.integers(len(curves)))]
        out.append(
            Handover(
                id=i,
                arrival=float(a),
                deadline=float(a) + window_s,
                size=int(cv.context_tokens * bytes_per_token),
                utility=cv.utility,
                context_tokens=cv.context_tokens,
            )
        )
    return out


def run_scenario(
    handovers: list[Any],
    rate_mbps: float,
    *,
    channel: str,
    fluid: bool,
    seed: int,
    policies: tuple[str, ...] = ALLOCATORS,
    max_nodes: int = 100,
    factory: Callable[[str, float], Any] | None = None,
) -> dict[str, Any]:
    """Every policy on one scenario, the clairvoyant bound, the full-cache ceiling.

    factory(name, one_way_s) builds each policy (default ``make_allocator``; another
    script passes its own to run variants of a policy under names of its own)."""
    factory = factory or make_allocator
    from kvtransport.netem import load_profile
    from kvtransport.scheduling import allocation_bound as bound
    from kvtransport.scheduling import allocator as al
    from kvtransport.sim.multisim import payload_efficiency, simulate_handovers

    delay_s = 0.0 if fluid else load_profile(channel).delay_ms * 1e-3
    n = len(handovers)
    res: dict[str, Any] = {}
    efficiency = payload_efficiency()
    if fluid:
        cap = rate_mbps * 1e6 / 8.0 * efficiency
        for name in policies:
            t0 = time.process_time()
            ts = [
                al.ScheduledTransfer(h.id, h.size, h.deadline, h.utility, h.weight, h.arrival)
                for h in handovers
            ]
            fluid_out = bound.simulate_fluid(ts, cap, factory(name, 0.0))
            res[name] = {
                "accuracy": fluid_out.weighted_utility / n,
                "fractions": [fluid_out.fractions[h.id] for h in handovers],
                "cpu_s": time.process_time() - t0,
            }
    else:
        best = 0.0
        for name in policies:
            out = simulate_handovers(
                handovers,
                factory(name, delay_s),
                channel=channel,
                rate_mbps=rate_mbps,
                seed=seed,
            )
            best = max(best, out.efficiency)
            res[name] = {
                "accuracy": out.mean_accuracy,
                "fractions": [o.fraction for o in out.outcomes],
                "efficiency": out.efficiency,
                "packets_lost": out.packets_lost + out.packets_dropped,
                "cpu_s": out.cpu_s,
            }
        efficiency = best
        cap = rate_mbps * 1e6 / 8.0 * efficiency
    ts = [
        al.ScheduledTransfer(
            h.id, h.size, max(h.deadline - delay_s, h.arrival), h.utility, h.weight, h.arrival
        )
        for h in handovers
    ]
    t0 = time.process_time()
    cb = bound.clairvoyant_bound(ts, cap, rel_tol=1e-3, max_nodes=max_nodes)
    bound_cpu = time.process_time() - t0
    for r in res.values():
        r["ratio"] = r["accuracy"] * n / cb.upper if cb.upper > 0 else 1.0
        r["ratio_found"] = r["accuracy"] * n / cb.achievable if cb.achievable > 0 else 1.0
    return {
        "ceiling": float(np.mean([float(h.utility(1.0)) for h in handovers])),
        "clairvoyant": cb.upper / n,
        "clairvoyant_found": cb.achievable / n,
        "clairvoyant_nodes": cb.nodes,
        "clairvoyant_cpu_s": bound_cpu,
        "efficiency": efficiency,
        "capacity_Bps": cap,
        "contexts": [h.context_tokens for h in handovers],
        "arrival_times": [h.arrival for h in handovers],
        "policies": res,
    }
