"""The shared link's allocator-to-rates step on a virtual clock, with real sender sessions
(kvtransport.hosts.link_share: the code the sender daemon and the multi-user simulator share)."""

import pytest

from kvtransport.core.observation import Obs
from kvtransport.core.sender import SenderSession
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.hosts.link_share import LinkShare, Member
from kvtransport.policies.registry import make_policy
from kvtransport.scheduling.allocator import EqualShare, UtilityWaterFilling, repair_guard_s
from kvtransport.scheduling.utility_model import SigmoidUtility

U = SigmoidUtility(0.85, 10.0, 0.2)
SYMBOL = 1200
SLOT = 0.01


def _member(tid: int, size: int, deadline: float, weight: float = 1.0, rate=100e6) -> Member:
    tr = synthetic_transfer(size, max(1, size // 12_288), seed=tid)
    s = SenderSession(
        tr, make_policy("adaptive"), rate_bps=rate, deadline=deadline, now=0.0,
        transfer_id=tid, symbol_size=SYMBOL,
    )  # fmt: skip
    return Member(tid, s, size, deadline, U, weight, 0.0, rate_bps=rate)


def _link(rate: float, policy=None) -> LinkShare:
    return LinkShare(rate, policy, slot_s=SLOT, symbol_size=SYMBOL, tagged=True)


def test_weights_decide_who_gets_the_overloaded_link():
    link = _link(100e6)
    light, heavy = _member(1, 2_000_000, 0.1), _member(2, 2_000_000, 0.1, weight=2.0)
    link.join(light)
    link.join(heavy)
    until = link.step(0.0)
    assert until == pytest.approx(SLOT)
    # 4 MB wanted, ~1.2 MB fits: the weight-2 transfer is served first
    assert heavy.share > light.share
    assert heavy.session.rate_bps == pytest.approx(heavy.share * 100e6)
    assert light.share + heavy.share <= 1.0 + 1e-9


def test_a_share_below_a_datagram_per_slot_pauses_and_a_lone_transfer_gets_the_link():
    rate = 3e6  # one datagram per 10 ms slot is ~1.1 Mbit/s: a third of this link is less
    link = _link(rate, EqualShare())
    a, b, c = (_member(i, 200_000, 2.0, rate=rate) for i in (1, 2, 3))
    for m in (a, b, c):
        link.join(m)
    link.step(0.0)
    assert a.share == pytest.approx(1 / 3) and b.share == pytest.approx(1 / 3)
    # every share too small to send: one member (the first of the largest) takes the link
    assert not a.paused and a.rate_bps == rate
    assert b.paused and c.paused
    assert b.rate_bps == 0.0 and b.session.next_timer() == pytest.approx(2.0)  # the deadline
    link.leave(3)
    link.step(0.01)
    assert a.share == pytest.approx(0.5) and a.rate_bps == pytest.approx(0.5 * rate)
    assert not b.paused and b.session.next_timer() == pytest.approx(0.01)  # resumes now
    link.leave(2)
    assert link.step(0.05) is None  # alone: nothing to re-plan until someone joins
    assert not a.paused and a.share == 1.0 and a.rate_bps == rate


def test_a_link_slower_than_a_datagram_per_slot_still_carries_a_lone_transfer():
    """Below about 1.1 Mbit/s even the whole link is less than a datagram per slot: the
    lone transfer is paced at the link's rate, not paused until its deadline."""
    rate = 0.8e6
    link = _link(rate)
    a = _member(1, 100_000, 3.0, rate=rate)
    link.join(a)
    assert rate < link.min_rate_bps
    assert link.step(0.0) is None
    assert not a.paused and a.rate_bps == rate and a.session.rate_bps == rate
    assert a.session.next_timer() == pytest.approx(0.0)


def test_the_allocator_plans_to_the_deadline_less_the_one_way_delay():
    link = LinkShare(100e6, UtilityWaterFilling(), slot_s=SLOT, symbol_size=SYMBOL,
                     tagged=False, one_way_s=0.02)  # fmt: skip
    m = _member(1, 500_000, 0.1)
    link.join(m)
    assert link.scheduler.transfers[1].deadline == pytest.approx(0.08)


def test_the_default_allocator_keeps_a_repair_guard_derived_from_the_link():
    """The link's own policy has a transfer's forced bytes through a guard before its
    deadline (repair_guard_s of the one-way delay), re-derived when the delay changes;
    a policy passed in is used as given. A poor transfer due soon and a valuable one due
    late: served by value, the valuable one goes first and the poor one still fits later
    (up to its deadline); a guard of 42 ms (5 ms one way) forces the poor one now."""
    poor, good = SigmoidUtility(0.5, 10.0, 0.3), SigmoidUtility(0.95, 10.0, 0.1)

    def shares(policy, one_way_s: float, then: float | None = None) -> tuple[float, float]:
        link = LinkShare(100e6, policy, slot_s=SLOT, symbol_size=SYMBOL, tagged=False,
                         one_way_s=one_way_s)  # fmt: skip
        a, b = _member(1, 1_000_000, 0.12), _member(2, 1_000_000, 0.5)
        a.utility, b.utility = poor, good
        link.join(a)
        link.join(b)
        if then is not None:
            link.set_one_way(then)
        link.step(0.0)
        return a.share, b.share

    assert shares(None, 0.005) == (1.0, 0.0)  # guard 42 ms: 1 MB due by 73 ms, forced now
    assert shares(UtilityWaterFilling(), 0.005) == (0.0, 1.0)  # no guard: value first
    assert shares(None, 0.005, then=0.0) == (0.0, 1.0)  # guard 12 ms: fits after "b"
    assert shares(None, 0.0, then=0.005) == (1.0, 0.0)
    link = _link(100e6)
    link.set_one_way(0.02)
    assert link.scheduler.policy.guard_s == repair_guard_s(0.02) == pytest.approx(0.132)
    with pytest.raises(ValueError, match="one-way"):
        link.set_one_way(-1.0)


def test_the_sender_engine_shares_its_link_by_weight_over_real_udp():
    """The daemon's engine passes each submit's weight and deadline to its LinkShare: two
    identical transfers on an overloaded link, the weight-2 one gets the larger share."""
    from kvtransport.daemons.daemon_sender import SenderEngine
    from kvtransport.daemons.udp import DatagramSocket, clock
    from kvtransport.hosts.sender_host import SenderHost

    sock = DatagramSocket(("127.0.0.1", 0))
    try:
        engine = SenderEngine(sock, SenderHost(rate_bps=100e6, symbol_size=SYMBOL))
        now = clock()
        dest = ("127.0.0.1", 9)  # discard: nothing answers, nothing is needed
        outs = [
            engine.submit(
                synthetic_transfer(2_000_000, 162, seed=int(w)),
                dest,
                now=now,
                deadline_s=0.1,
                weight=w,
            )  # fmt: skip
            for w in (1.0, 2.0)
        ]
        light, heavy = (o.status(now) for o in outs)
        assert heavy["weight"] == 2.0 and heavy["share"] > light["share"]
        assert light["share"] + heavy["share"] <= 1.0 + 1e-9
        engine.close(clock())
    finally:
        sock.close()


def test_a_members_own_prior_wins_over_the_link_and_the_blind_default():
    link = _link(100e6)
    blind, known = _member(1, 500_000, 0.5), _member(2, 500_000, 0.5)
    known.prior_loss = 0.07
    link.join(blind)
    link.join(known)
    link.step(0.0)
    assert known.session.policy.prior_loss == pytest.approx(0.07)
    assert blind.session.policy.prior_loss == pytest.approx(0.1)  # nothing known: default
    # the session carries it too: its loss estimate before feedback and the policy's
    # observation (what the DDQN sees); the blind member's session has none
    assert known.session.prior_loss == pytest.approx(0.07)
    assert known.session.loss_estimate() == pytest.approx(0.07)
    obs = known.session.observe(0.0)
    assert obs[Obs.PRIOR_KNOWN] == 1.0 and obs[Obs.PRIOR_LOSS] == pytest.approx(0.07)
    assert blind.session.prior_loss is None
    assert blind.session.observe(0.0)[Obs.PRIOR_KNOWN] == 0.0
