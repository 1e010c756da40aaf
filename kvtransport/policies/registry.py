"""Policy names: what ``--policy NAME`` builds (the shells' one registry).

Deployable policies only: the clairvoyant oracle reads the channel's future and lives with
the simulators (kvtransport.sim.oracle, whose ``make_sim_policy`` also knows its name).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvtransport.core.policy_base import Policy
from kvtransport.errors import UserError
from kvtransport.policies.heuristics import (
    ARQ,
    Adaptive,
    BlockRS,
    ConstantAction,
    FixedRLC,
    NoFEC,
)

_RATE = re.compile(r"^(fixed|block-rs):(\d+)/(\d+)$")


def _ddqn() -> Policy:
    """The shipped DDQN runtime (numpy/numba only; imported on first use)."""
    from kvtransport.policies.ddqn import DDQNPolicy

    return DDQNPolicy()


_FACTORIES: dict[str, Callable[[], Policy]] = {
    "none": NoFEC,
    "arq": ARQ,
    "adaptive": Adaptive,
    "tail-rule": ConstantAction,
    "ddqn": _ddqn,
}
POLICY_HELP = "none, fixed:R/N, block-rs:R/N, arq, adaptive, tail-rule, ddqn (the shipped DDQN)"


def default_policy() -> str:
    """The policy a shell uses when told none: ``ddqn`` when the package ships trained
    weights (kvtransport.policies.ddqn), else ``adaptive``."""
    try:
        from kvtransport.policies.ddqn import shipped_policy_available
    except ImportError:
        return "adaptive"
    return "ddqn" if shipped_policy_available() else "adaptive"


def register_policy(name: str, factory: Callable[[], Policy]) -> None:
    """Make ``make_policy(name)`` build ``factory()``."""
    _FACTORIES[name] = factory


def make_policy(spec: str) -> Policy:
    """Build a policy from its command-line name (see ``POLICY_HELP``)."""
    spec = spec.strip()
    m = _RATE.match(spec)
    if m:
        kind, r, n = m.group(1), int(m.group(2)), int(m.group(3))
        return FixedRLC(r, n) if kind == "fixed" else BlockRS(r, n)
    if spec not in _FACTORIES:
        raise UserError(f"unknown policy {spec!r}; choose from {POLICY_HELP}")
    return _FACTORIES[spec]()
