"""The names an evaluation compares and how each is built: repair schemes (the
simulator's policies plus the tail rule and the product's pick) with their labels, the
real-model figures' task families, and the link-sharing allocators."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kvtransport.agents.episodes import EpisodeSpec
    from kvtransport.core.policy_base import Policy

SCHEMES = ("none", "fixed:4/32", "block-rs:4/32", "arq", "adaptive", "ddqn", "oracle")
"""Policy names (kvtransport.sim.oracle.make_sim_policy) of the repair schemes the
figures compare (the demo's and eval_policy's)."""
LABELS = {
    "none": "no FEC",
    "fixed:4/32": "RLC 4/32",
    "block-rs:4/32": "block RS 4/32",
    "arq": "ARQ",
    "adaptive": "adaptive",
    "ddqn": "DDQN",
    "oracle": "oracle",
    "tail-rule": "tail rule (action 0)",
}
"""Scheme name -> its label in a table or legend."""
FAMILIES: dict[str, tuple[str, ...]] = {
    "qa": ("facts_qa",),
    "ruler": ("niah_single", "niah_multikey", "niah_multivalue"),
}
"""Task families of the real-model figures: worlddatax facts QA, and the RULER-style
needle tasks."""
AUTO = "auto"
"""Not a policy of its own: the one a shell picks for the episode's transfer when told
none (:func:`product_choice`), so that a table shows what the product does."""
ALLOCATORS = ("equal-share", "proportional", "edf", "water-filling")
"""Link-sharing slot policies by name (:func:`make_allocator`)."""
ALLOCATOR = "water-filling"
"""The product's allocator among :data:`ALLOCATORS`."""


def product_choice(spec: EpisodeSpec) -> str:
    """The policy a shell picks for ``spec``'s transfer when told none
    (kvtransport.hosts.policy_choice.default_policy_for): the link's one-way delay is half
    the episode's round trip, a handoff stream is whole token ranges, the deadline is the
    episode's, and so is whether the sender has a loss prior."""
    from kvtransport.agents.episodes import round_trip, spec_deadline
    from kvtransport.hosts.policy_choice import default_policy_for

    return default_policy_for(
        round_trip(spec) / 2,
        spec.stream == "handoff",
        spec.channel.rate_mbps * 1e6,
        spec_deadline(spec),
        spec.prior_loss is not None,
    )


def make_scheme(name: str, weights: str | None) -> Policy:
    """A fresh policy for scheme ``name``: ``ddqn`` plays ``weights`` (None: the shipped
    network), ``tail-rule`` is the constant action 0 (reactive repair, the session's tail
    rule alone decides admission), anything else the simulator's policy of that name."""
    from kvtransport.policies.ddqn import DDQNPolicy
    from kvtransport.policies.heuristics import ConstantAction
    from kvtransport.sim.oracle import make_sim_policy

    if name == "ddqn":
        return DDQNPolicy(weights)
    if name == "tail-rule":
        return ConstantAction(0)
    return make_sim_policy(name)


def check_schemes(schemes: list[str], weights: str | None = None) -> None:
    """Raise UserError with its one-line reason for a scheme name no policy has (``AUTO``:
    the policies a shell picks, the DDQN among them), or for ``weights`` (a DDQN weights
    file) that does not load; the scripts' fail-fast check."""
    from kvtransport.policies.ddqn import load_weights
    from kvtransport.sim.oracle import make_sim_policy

    for s in schemes:
        make_sim_policy("ddqn" if s == AUTO else s)
    if weights is not None:
        load_weights(weights)


def add_weights_option(p: argparse.ArgumentParser, also: str = "") -> None:
    """``--weights``: the DDQN weights file the ``ddqn`` scheme plays (:func:`make_scheme`;
    ``also``: what else of the shipped network's the script keeps, said in the help)."""
    p.add_argument("--weights", help="DDQN weights file the ddqn scheme plays (default: the "
                   f"shipped policy; auto's rules{also} stay the shipped network's)")  # fmt: skip


def add_prior_option(p: argparse.ArgumentParser) -> None:
    """``--prior``: the senders' loss prior before feedback
    (kvtransport.agents.episodes.episode_prior's kinds)."""
    p.add_argument("--prior", choices=("none", "previous", "profile"), default="none",
                   help="the senders' loss prior before feedback: none (a first transfer, "
                   "the default), previous (the loss an earlier transfer over the link "
                   "ended with, as a daemon keeps it) or profile (the channel's stationary "
                   "loss)")  # fmt: skip


def make_allocator(name: str, delay_s: float = 0.0) -> Any:
    """A link-sharing slot policy of :data:`ALLOCATORS` by name. The water-filling
    allocator's guard is the one the sender daemon's link derives for this one-way delay
    (kvtransport.scheduling.allocator.repair_guard_s)."""
    from kvtransport.scheduling import allocator as al

    if name == "water-filling":
        return al.UtilityWaterFilling(guard_s=al.repair_guard_s(delay_s))
    return {
        "equal-share": al.EqualShare,
        "proportional": al.ProportionalToSize,
        "edf": al.EarliestDeadlineFirst,
    }[name]()
