"""The policy a shell picks for a transfer when told none (kvtransport.hosts.policy_choice.
default_policy_for): the shipped DDQN, except for a stream of whole token ranges over a
long link, where it repairs too late, on a link whose bandwidth-delay product is beyond
its training, and on a long link with a deadline under two round trips, where the
heuristic recovers more (docs/results.md, issue 16)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransport.core.transfer import Transfer, synthetic_transfer
from kvtransport.daemons.daemon_sender import transfer_policy
from kvtransport.hosts.policy_choice import (
    FAST_LINK_POLICY,
    LONG_LINK_HANDOFF_POLICY,
    LONG_LINK_ONE_WAY_S,
    SHORT_DEADLINE_POLICY,
    SHORT_DEADLINE_RTTS,
    default_policy_for,
)
from kvtransport.kvformat import blocks
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import utility
from kvtransport.model.cache_builder import ComputeSpeed
from kvtransport.model.plan import LinkEstimate, planned_stream
from kvtransport.policies.ddqn import shipped_trained_bdp_bits
from kvtransport.policies.registry import default_policy
from kvtransport.sim.simulator import simulate

BT = 16


def _stream(order: str, tokens: int = 200) -> blocks.EncodedStream:
    rng = np.random.default_rng(3)
    k = rng.standard_normal((4, 2, tokens, 32)).astype(np.float16)
    v = rng.standard_normal((4, 2, tokens, 32)).astype(np.float16)
    att = rng.random((4, tokens)).astype(np.float32)
    cache = KVCache(k, v, rng.integers(0, 1000, tokens), "toy", att)
    u = utility.cache_utility(cache, BT)
    return blocks.encode_stream(cache, u, utility.stream_order(u, BT, order), block_tokens=BT)


def test_only_whole_ranges_over_a_long_link_leave_the_default():
    assert LONG_LINK_HANDOFF_POLICY != default_policy()  # the shipped weights are present
    long, short = LONG_LINK_ONE_WAY_S, LONG_LINK_ONE_WAY_S * 0.99
    assert default_policy_for(long, whole_ranges=True) == LONG_LINK_HANDOFF_POLICY
    assert default_policy_for(4 * long, whole_ranges=True) == LONG_LINK_HANDOFF_POLICY
    assert default_policy_for(short, whole_ranges=True) == default_policy()
    assert default_policy_for(4 * long, whole_ranges=False) == default_policy()
    assert default_policy_for(0.0, whole_ranges=False) == default_policy()


def test_a_manifest_says_whether_its_stream_sends_whole_ranges():
    for order in ("position", "back"):
        assert _stream(order).manifest.whole_ranges, order
    # utility order interleaves the ranges' layers (the sinks' range first, then by utility)
    assert not _stream("utility").manifest.whole_ranges
    assert not _stream("random").manifest.whole_ranges
    # the handoff plan, with the hedge's ranges sent last (last first) and int4/int8 blocks
    link = LinkEstimate(rate_bps=10e6, loss=0.0, one_way_s=0.001, symbol_size=1280)
    plan, planned = planned_stream(
        _stream("utility"), link=link, budget_s=0.2, speed=ComputeSpeed(0.001, 2e-4),
        objective="ttft", hedge_share=0.5,
    )  # fmt: skip
    assert plan.first_call < plan.split  # a hedge is sent
    assert planned.manifest.whole_ranges


def test_the_transfer_policy_reads_the_stream_and_the_assumed_rtt():
    long_rtt = 2 * LONG_LINK_ONE_WAY_S
    prefix = _stream("position").to_transfer()
    card = _stream("utility").to_transfer()
    assert transfer_policy(prefix, long_rtt, 100e6) == LONG_LINK_HANDOFF_POLICY
    assert transfer_policy(prefix, 0.99 * long_rtt, 100e6) == default_policy()
    assert transfer_policy(card, long_rtt, 100e6) == default_policy()
    assert transfer_policy(card, 0.16, 3e9) == FAST_LINK_POLICY  # and the link's rate
    assert transfer_policy(card, 0.16, 100e6, 0.3) == SHORT_DEADLINE_POLICY  # and the deadline
    assert transfer_policy(card, 0.16, 100e6, 0.33) == default_policy()
    # opaque bytes (no manifest, or something else as app metadata) are not a block stream
    assert transfer_policy(synthetic_transfer(10_000, 4), long_rtt, None) == default_policy()
    other = Transfer(prefix.payload, prefix.blocks, b"not a manifest")
    assert transfer_policy(other, long_rtt, None) == default_policy()


def test_a_link_beyond_the_ddqns_training_gets_the_heuristic():
    """The shipped weights' training drew links up to 1 Gbit/s and 90 ms one way (their
    sidecar says so): a link whose rate x round trip exceeds that product gets the
    heuristic, any other (or one whose rate the shell does not know) the DDQN."""
    assert FAST_LINK_POLICY != default_policy() == "ddqn"
    assert shipped_trained_bdp_bits() == pytest.approx(1e9 * 2 * 0.090)
    assert default_policy_for(0.080, False, 2e9) == FAST_LINK_POLICY  # 320 Mbit
    assert default_policy_for(0.040, False, 1e9) == default_policy()  # 80 Mbit
    assert default_policy_for(0.090, False, 1e9) == default_policy()  # the corner
    assert default_policy_for(0.005, False, 20e9) == FAST_LINK_POLICY  # 200 Mbit
    assert default_policy_for(0.080, False, None) == default_policy()


def test_on_a_fast_long_link_the_pick_recovers_more_than_the_ddqn():
    """The case the rate rule exists for (2 % loss, 2 Gbit/s, 80 ms one way, 20 MB at
    rho 1; the DDQN trained up to 1 Gbit/s): the policy it picks recovers more than the
    shipped DDQN it replaces there, on both seeds. (Beyond its training the shipped DDQN
    mostly ties the heuristic; this cell, a deadline of half a round trip, is where it
    was measured below it: docs/results.md, "The shipped network is now N" and "... now
    O".)"""
    pick = default_policy_for(0.080, False, 2e9)
    link = dict(channel="loss 2%", rate_mbps=2000, delay_ms=80, rho=1.0, size_bytes=20_000_000)
    got = {
        p: [simulate(policy=p, seed=s, record=False, **link).utility_recovered for s in (1, 2)]
        for p in {pick, "ddqn"}
    }
    assert all(a > d + 0.01 for a, d in zip(got[pick], got["ddqn"], strict=True)), got


def test_with_a_loss_prior_a_link_beyond_24_mbit_gets_the_heuristic():
    """The shipped weights trained without priors (their sidecar says so): a sender that
    knows the path's loss before feedback keeps the DDQN only up to PRIOR_MAX_BDP_BITS of
    rate x round trip; without a prior the trained product still applies."""
    from kvtransport.hosts.policy_choice import PRIOR_MAX_BDP_BITS
    from kvtransport.policies.ddqn import shipped_trained_priors

    assert not shipped_trained_priors() and PRIOR_MAX_BDP_BITS == 24e6
    assert default_policy_for(0.080, False, 200e6, prior_known=True) == FAST_LINK_POLICY
    assert default_policy_for(0.040, False, 400e6, prior_known=True) == FAST_LINK_POLICY
    assert default_policy_for(0.040, False, 300e6, prior_known=True) == default_policy()
    assert default_policy_for(0.080, False, 200e6) == default_policy()  # no prior
    card = _stream("utility").to_transfer()
    assert transfer_policy(card, 0.16, 200e6, None, True) == FAST_LINK_POLICY
    assert transfer_policy(card, 0.16, 200e6, None, False) == default_policy()


def test_with_a_prior_on_a_fast_long_link_the_pick_recovers_more_than_the_ddqn():
    """The case the prior rule exists for (ge-light, 400 Mbit/s, 80 ms one way: 64 Mbit;
    20 MB at rho 1, two round trips and more, the loss an earlier transfer ended with as
    the prior): the policy it picks recovers more than the shipped DDQN on both seeds, by
    0.0057-0.0061 on four (docs/results.md, "A network trained without priors ignores
    them"). The DDQN never learned to use a prior; the heuristic starts from it."""
    from kvtransport.agents.episodes import episode_prior
    from kvtransport.netem.profiles import load_profile

    pick = default_policy_for(0.080, False, 400e6, 0.4, prior_known=True)
    assert pick != "ddqn"
    link = dict(channel="ge-light", rate_mbps=400, delay_ms=80, rho=1.0,
                size_bytes=20_000_000)  # fmt: skip
    got: dict[str, list[float]] = {pick: [], "ddqn": []}
    for s in (1, 2):
        prior = episode_prior("previous", load_profile("ge-light"), s)
        for p in got:
            sim = simulate(policy=p, seed=s, record=False, prior_loss=prior, **link)
            got[p].append(sim.utility_recovered)
    assert all(a > d + 0.004 for a, d in zip(got[pick], got["ddqn"], strict=True)), got


@pytest.mark.parametrize(("name", "delay_ms"), [("ge-heavy", 120.0), ("4state-bursty", 60.0)])
def test_on_long_link_handoffs_the_pick_recovers_more_than_the_ddqn(name, delay_ms):
    """The case the rule exists for, on held-out episodes (the evaluation's first 12 at
    rho 1): over a long link the policy it picks recovers more whole ranges in total than
    the shipped DDQN it replaces there, in two of the cells where the gap is widest
    (ge-heavy at 120 ms one way, 4state-bursty at 60 ms). (Over 40 cells of 20-120 ms the
    heuristic is ahead by 0.002 per episode and the DDQN wins cells at 20-60 ms on bursty
    loss: docs/results.md, "The shipped network is now O".)"""
    import kvtransport.agents  # noqa: F401  (registers ddqn)
    from kvtransport.agents.episodes import build_simulation, eval_spec, round_trip

    from kvtransport.policies.registry import make_policy

    got = {"pick": 0.0, "ddqn": 0.0}
    for i in range(12):
        spec = eval_spec(name, 1.0, i, delay_ms=delay_ms, stream="handoff")
        pick = default_policy_for(round_trip(spec) / 2, whole_ranges=True)
        assert pick == LONG_LINK_HANDOFF_POLICY
        for who, policy in (("pick", pick), ("ddqn", "ddqn")):
            sim = build_simulation(spec, make_policy(policy))
            sim.run()
            got[who] += sim.utility_recovered
    assert got["pick"] > got["ddqn"] + 0.2, got


def test_the_sender_daemon_picks_per_transfer_unless_told(tmp_path):
    """A sender daemon started without ``--policy`` gives each request that names none
    its transfer's default (daemon_sender.transfer_policy, from the request's initial
    RTT and deadline); a request's own policy, or the daemon's, wins."""
    from kvtransport.daemons.api import transfer_frames
    from kvtransport.daemons.daemon_sender import SenderDaemon

    prefix = _stream("position").to_transfer()
    card = _stream("utility").to_transfer()
    long_ms = 2e3 * LONG_LINK_ONE_WAY_S
    picks = {}
    for default in (None, "fixed:4/32"):
        tx = SenderDaemon(bind=("127.0.0.1", 0), control=f"ipc://{tmp_path}/s.ipc",
                          rate_bps=50e6, key=None, policy=default)  # fmt: skip
        try:
            for label, transfer, head in (
                ("long", prefix, {"initial_rtt_ms": long_ms, "rho": 1.0}),
                ("short", prefix, {"initial_rtt_ms": 20.0, "rho": 1.0}),
                ("named", prefix, {"initial_rtt_ms": long_ms, "policy": "arq", "rho": 1.0}),
                ("card, 1.9 RTTs", card, {"initial_rtt_ms": 160.0, "deadline_ms": 304.0}),
                ("card, 2.1 RTTs", card, {"initial_rtt_ms": 160.0, "deadline_ms": 336.0}),
            ):
                got = tx._submit({"to": "127.0.0.1:9", **head},
                                 transfer_frames(transfer))  # fmt: skip
                out = tx.engine.host.get(int(got["transfer_id"], 16))
                assert out is not None
                picks[default, label] = out.policy
        finally:
            tx.close()
    assert picks[None, "long"] == LONG_LINK_HANDOFF_POLICY
    assert picks[None, "short"] == default_policy()
    assert picks[None, "card, 1.9 RTTs"] == SHORT_DEADLINE_POLICY
    assert picks[None, "card, 2.1 RTTs"] == default_policy()
    assert picks[None, "named"] == picks["fixed:4/32", "named"] == "arq"
    assert picks["fixed:4/32", "long"] == picks["fixed:4/32", "short"] == "fixed:4/32"


def test_the_sender_daemon_reads_whether_it_knows_the_receivers_loss(tmp_path):
    """On a 400 Mbit/s link with a 160 ms round trip (64 Mbit), a daemon's first transfer
    to a receiver gets the DDQN; once the host remembers the loss that receiver's last
    transfer ended with (SenderHost.receiver_loss, as a finished transfer leaves it), the
    next one gets the heuristic; another receiver still gets the DDQN."""
    from kvtransport.daemons.api import transfer_frames
    from kvtransport.daemons.daemon_sender import SenderDaemon

    card = _stream("utility").to_transfer()
    tx = SenderDaemon(bind=("127.0.0.1", 0), control=f"ipc://{tmp_path}/s.ipc",
                      rate_bps=400e6, key=None, policy=None)  # fmt: skip
    try:

        def pick(to: str) -> str:
            got = tx._submit({"to": to, "initial_rtt_ms": 160.0, "deadline_ms": 600.0},
                             transfer_frames(card))  # fmt: skip
            out = tx.engine.host.get(int(got["transfer_id"], 16))
            assert out is not None
            return out.policy

        assert pick("127.0.0.1:9") == default_policy()
        tx.engine.host.receiver_loss[("127.0.0.1", 9)] = 0.03
        assert pick("127.0.0.1:9") == FAST_LINK_POLICY
        assert pick("127.0.0.1:10") == default_policy()
    finally:
        tx.close()


def test_a_long_link_deadline_under_two_round_trips_gets_the_heuristic():
    """Below ``SHORT_DEADLINE_RTTS`` round trips of a long link the DDQN gives way; at or
    above it, on a short link, or with no deadline known, it stays."""
    assert SHORT_DEADLINE_POLICY != default_policy() == "ddqn"
    rtt = 0.160
    assert default_policy_for(rtt / 2, False, 100e6, 0.99 * SHORT_DEADLINE_RTTS * rtt) == (
        SHORT_DEADLINE_POLICY
    )
    assert default_policy_for(rtt / 2, False, 100e6, SHORT_DEADLINE_RTTS * rtt) == "ddqn"
    assert default_policy_for(rtt / 2, False, None, 0.2) == SHORT_DEADLINE_POLICY
    assert default_policy_for(rtt / 2, False, 100e6, None) == "ddqn"
    short = 0.99 * LONG_LINK_ONE_WAY_S
    assert default_policy_for(short, False, 100e6, 0.5 * short) == "ddqn"


@pytest.mark.parametrize("channel", ["bernoulli-5", "ge-heavy"])
def test_on_a_one_round_trip_deadline_the_pick_recovers_more_than_the_ddqn(channel):
    """The case the deadline rule exists for, inside the DDQN's trained links: 150 Mbit/s,
    60 ms one way, 2.5 MB at rho 1 (a deadline of about 1.2 round trips). The policy it
    picks recovers clearly more than the shipped DDQN it replaces there."""
    link = dict(channel=channel, rate_mbps=150, delay_ms=60, rho=1.0, size_bytes=2_500_000)
    deadline = simulate(policy="ddqn", seed=1, record=False, **link).deadline_s
    assert deadline < 1.5 * 0.120
    pick = default_policy_for(0.060, False, 150e6, deadline)
    assert pick == SHORT_DEADLINE_POLICY
    got = {
        p: sum(simulate(policy=p, seed=s, record=False, **link).utility_recovered for s in (1, 2))
        for p in (pick, "ddqn")
    }
    assert got[pick] > got["ddqn"] + 0.2, got
