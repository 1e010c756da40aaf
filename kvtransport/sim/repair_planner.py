"""Clairvoyant planner: the best repair placement found for one realized channel.

A reference for evaluation, not a policy a daemon can run. The simulator draws every
random choice from the episode's seed (kvtransport.sim.simulator: the data and feedback
channels' loss and delay draws, the payload, the transfer id), so building the same
episode again replays the same realization of **both** directions, loss for loss. The
planner plays a search set of repair plans on that one realization and keeps the best:

- the **causal** policies (tail rule alone, the adaptive heuristic at margins z = 1, 2, 3,
  ARQ, fixed 4/32 RLC): whatever any of them achieves on this realization is reachable,
  so the planner never loses to them;
- **clairvoyant** plans: the oracle (kvtransport.sim.oracle.Oracle) reads the data channel's
  loss fate of every slot left and of every datagram in flight, and repairs exactly what
  will be lost; its ``margin`` (surviving intervals kept before admission stops: 0, 1, 2,
  4), the session's tail rule on or off, and proactive cover of the exact losses
  throughout (not only in the last RTT) move where admission stops and where the
  repairs go. The feedback direction's losses shape every plan through the replay
  (what the sender hears and when).

``known`` takes utilities the caller already measured on the same realization (the
evaluation's own schemes, the DDQN included): they join the search set without being
played again, so the planner is by construction at least every scheme it is compared
with. It stays below the genie bound (kvtransport.sim.simulator.genie_bound), which every
scheme does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtransport.core.policy_base import Policy
from kvtransport.policies.heuristics import Adaptive
from kvtransport.sim.oracle import Oracle, make_sim_policy
from kvtransport.sim.simulator import Simulation

CAUSAL_SEARCH = ("tail-rule", "adaptive", "adaptive:z=1", "adaptive:z=3", "arq", "fixed:4/32")
"""Causal plans in the search set (names as ``make_policy`` or ``adaptive:z=Z``)."""
CLAIRVOYANT_SEARCH = (
    "oracle", "oracle:m=1", "oracle:m=2", "oracle:m=4",
    "oracle+pro", "oracle+pro:m=1", "oracle+pro:m=2",
)  # fmt: skip
"""Plans that read the realized losses (``oracle[+tail|+pro][:m=MARGIN]``)."""
SEARCH = CAUSAL_SEARCH + CLAIRVOYANT_SEARCH


def candidate(name: str) -> Policy:
    """A fresh policy for one name of the search set (see ``SEARCH``)."""
    head, _, arg = name.partition(":")
    if head == "adaptive" and arg.startswith("z="):
        return Adaptive(z=float(arg[2:]))
    if head in ("oracle", "oracle+tail", "oracle+pro"):
        margin = float(arg[2:]) if arg.startswith("m=") else 0.0
        if arg and not arg.startswith("m="):
            raise ValueError(f"unknown planner candidate {name!r}")
        return Oracle(margin, tail_rule=head == "oracle+tail", proactive=head == "oracle+pro")
    return make_sim_policy(name)


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one realization: the best utility, which plan reached it
    (first of equals in search order, known results first) and every plan's score."""

    utility: float
    best: str
    scores: dict[str, float]


def play(build: Callable[[Policy], Simulation], policy: Policy) -> float:
    """Utility recovered before the deadline by ``policy`` on ``build``'s realization."""
    sim = build(policy)
    sim.run()
    return sim.utility_recovered


def clairvoyant_plan(
    build: Callable[[Policy], Simulation],
    known: Mapping[str, float] | None = None,
    search: tuple[str, ...] = SEARCH,
) -> Plan:
    """Search ``search`` (plus ``known``) on the realization ``build(policy)`` replays.

    ``build`` must set up the same episode (same seed, channels, transfer) for every
    policy; ``known``: utilities already measured on it, by name (not played again)."""
    scores = dict(known or {})
    for name in search:
        if name not in scores:
            scores[name] = play(build, candidate(name))
    if not scores:
        raise ValueError("the planner needs at least one plan to search")
    best = max(scores, key=lambda k: scores[k])
    return Plan(scores[best], best, scores)
