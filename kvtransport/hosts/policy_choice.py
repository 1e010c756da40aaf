"""Which policy a transfer gets when its shell is told none: a deployment choice.

The host layer decides it from what the sender knows before its first feedback (the
link's one-way delay and rate, the deadline, whether it starts from a loss prior, and the
kind of stream its producer declared), reading the shipped DDQN's training distribution
from its sidecar (kvtransport.policies.ddqn). The protocol core never chooses.
"""

from __future__ import annotations

from kvtransport.policies.registry import default_policy

LONG_LINK_ONE_WAY_S = 0.02
"""From this one-way delay on (a 40 ms round trip), a whole-range stream gets
``LONG_LINK_HANDOFF_POLICY`` (:func:`default_policy_for`)."""
LONG_LINK_HANDOFF_POLICY = "adaptive"
"""The policy of a whole-range stream over a long link when the shell is told none."""
FAST_LINK_POLICY = "adaptive"
"""The policy in place of the shipped DDQN on a link whose bandwidth-delay product is
beyond any it was trained on (:func:`default_policy_for`)."""
PRIOR_MAX_BDP_BITS = 24e6
"""With a loss prior (the sender knows the path's loss before its first feedback), the
largest bandwidth-delay product (bits: rate x round trip) on which a shipped DDQN trained
without priors keeps the transfer; beyond it the transfer gets ``FAST_LINK_POLICY``
(:func:`default_policy_for`)."""
SHORT_DEADLINE_RTTS = 2.0
"""A transfer over a long link whose deadline is under this many round trips gets
``SHORT_DEADLINE_POLICY`` in place of the shipped DDQN (:func:`default_policy_for`)."""
SHORT_DEADLINE_POLICY = "adaptive"
"""The policy in place of the shipped DDQN on a long link with a deadline under
``SHORT_DEADLINE_RTTS`` round trips (:func:`default_policy_for`)."""


def default_policy_for(
    one_way_s: float,
    whole_ranges: bool,
    rate_bps: float | None = None,
    deadline_s: float | None = None,
    prior_known: bool = False,
) -> str:
    """The policy a shell uses for one transfer when told none.

    ``whole_ranges``: the stream sends each token range's blocks one after another (the
    handoff plan's and the vLLM connector's prefix order), so the racing receiver loads a
    range only once every block of it arrived and a partial range is worth nothing.
    ``one_way_s``: the link's one-way delay as the sender knows it before feedback (half
    the RTT it assumes). Such a stream over a link of at least ``LONG_LINK_ONE_WAY_S``
    gets ``LONG_LINK_HANDOFF_POLICY``: there the shipped DDQN, trained mostly on
    utility-ordered streams, recovers less than the heuristic under bursty loss (up to
    0.11 of utility per episode) and about as much under light loss (docs/results.md,
    issue 16). ``rate_bps``: the link's rate (None: not known). Where
    :func:`default_policy` is the shipped DDQN and the link's bandwidth-delay product
    (``rate_bps`` x twice ``one_way_s``) exceeds the largest one it was trained on
    (kvtransport.policies.ddqn.shipped_trained_bdp_bits: 180 Mbit, 1 Gbit/s x 180 ms),
    the transfer gets ``FAST_LINK_POLICY``: beyond its training the network meets spans
    in flight it never saw; the shipped one mostly ties the heuristic there but fell
    0.013 below it at 2 Gbit/s, 80 ms one way, with a deadline of half a round trip, and
    its predecessor, trained to 400 Mbit/s, fell below it in 9 of 16 cells at 1 Gbit/s
    (docs/results.md, issue 16). ``deadline_s``: the transfer's deadline from its first
    datagram (None: not known). Where the shipped DDQN would run over a link of at least
    ``LONG_LINK_ONE_WAY_S`` with a deadline under ``SHORT_DEADLINE_RTTS`` round trips,
    the transfer gets ``SHORT_DEADLINE_POLICY``: at 1-1.5 round trips the DDQN fell 0.025
    below the heuristic on average (1.5-2: 0.012), and tied it from 2 on
    (scripts/eval_short_deadlines.py; docs/results.md, issue 16). ``prior_known``: the
    sender starts from a loss prior (a daemon's later transfers to a receiver, or a link
    whose other transfers report loss). Where the shipped DDQN trained without priors
    (its sidecar says so), the bandwidth-delay product it keeps is then at most
    ``PRIOR_MAX_BDP_BITS``: the heuristic starts from the prior, while such a network
    reads it only as a loss estimate in states where it never saw one (its prior inputs
    are zeroed: kvtransport.policies.ddqn); with a previous transfer's prior the shipped
    one fell below the heuristic in 12 of 32 cells beyond 24 Mbit (400 Mbit/s and 1 Gbit/s,
    40 and 80 ms one way; up to 0.015) and in none of the 48 at 24 Mbit or less (50-150
    Mbit/s; scripts/eval_fast_links.py --prior previous; docs/results.md, issue 16).
    Every other transfer gets :func:`default_policy`."""
    long_link = one_way_s >= LONG_LINK_ONE_WAY_S
    if whole_ranges and long_link:
        return LONG_LINK_HANDOFF_POLICY
    policy = default_policy()
    if policy != "ddqn":
        return policy
    if rate_bps is not None:
        from kvtransport.policies.ddqn import shipped_trained_bdp_bits, shipped_trained_priors

        limit = shipped_trained_bdp_bits()
        if prior_known and not shipped_trained_priors():
            limit = min(limit, PRIOR_MAX_BDP_BITS)
        if rate_bps * 2.0 * one_way_s > limit:
            return FAST_LINK_POLICY
    if long_link and deadline_s is not None and deadline_s < SHORT_DEADLINE_RTTS * 2 * one_way_s:
        return SHORT_DEADLINE_POLICY
    return policy
