"""One cell of the policy evaluation: held-out episodes of one channel and rho (and
one-way delay), every scheme on the same episodes, with the per-episode references."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtransport.eval.registries import AUTO, make_scheme, product_choice

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.netem import Profile

REFERENCES = ("clairvoyant", "genie")
"""Per-episode references: the clairvoyant planner (never below any scheme on the
episode) and the genie bound (no scheme can exceed it)."""


def cell_key(channel: str, rho: float, delay_ms: float | None = None) -> str:
    """``CHANNEL@RHO``, or ``CHANNEL+DELAYms@RHO`` for a high-RTT cell."""
    return f"{channel}{'' if delay_ms is None else f'+{delay_ms:g}ms'}@{rho:g}"


def is_high_rtt(key: str) -> bool:
    """Whether ``key`` (a :func:`cell_key`) names a high-RTT cell (one with a delay)."""
    return "+" in key.rsplit("@", 1)[0]


def run_cell(
    channel: str | Profile,
    rho: float,
    schemes: Any,
    n: int,
    n_rs: int,
    weights: str | None,
    utility: str,
    delay_ms: float | None = None,
    references: bool = True,
    prior: str = "none",
    stream: str = "utility",
    queue_guard: bool = True,
) -> dict[str, list[Any]]:
    """Every scheme's utility per episode on ``channel`` (a profile name, netem loss
    notation or trace path, or a Profile), and (``references``) per episode the genie
    bound and the clairvoyant planner, which searches its plans plus every scheme's own
    result on that episode (kvtransport.sim.repair_planner). Block RS plays the first
    ``n_rs`` episodes only."""
    from functools import partial

    from kvtransport.agents.episodes import build_simulation, eval_spec
    from kvtransport.sim.repair_planner import clairvoyant_plan

    out: dict[str, list[Any]] = {name: [] for name in schemes}
    if references:
        out.update({r: [] for r in REFERENCES}, clairvoyant_best=[])
    build = partial(build_simulation, queue_guard=queue_guard)
    for i in range(n):
        spec = eval_spec(channel, rho, i, utility, delay_ms=delay_ms, prior=prior, stream=stream)
        known = {}
        for name in schemes:
            if name.startswith("block-rs") and i >= n_rs:
                continue
            policy = product_choice(spec) if name == AUTO else name
            sim = build(spec, make_scheme(policy, weights))
            sim.run()
            known[name] = sim.utility_recovered
            out[name].append(known[name])
        if references:
            bound = build(spec, make_scheme("none", None)).meta["utility_bound"]
            out["genie"].append(float(bound))
            plan = clairvoyant_plan(partial(build, spec), known)
            out["clairvoyant"].append(plan.utility)
            out["clairvoyant_best"].append(plan.best)
    return out
