"""Several real session pairs on one simulated bottleneck, rates set by the allocator."""

import numpy as np
import pytest

from kvtransport.errors import UserError
from kvtransport.scheduling.allocator import (
    EarliestDeadlineFirst,
    EqualShare,
    UtilityWaterFilling,
)
from kvtransport.scheduling.utility_model import SigmoidUtility
from kvtransport.sim.multisim import (
    Handover,
    MultiSimulation,
    payload_efficiency,
    simulate_handovers,
)

U = SigmoidUtility(0.85, 10.0, 0.2)
RATE = 100.0  # Mbit/s
PAYLOAD_BPS = RATE * 1e6 / 8 * payload_efficiency()


def _together(n, size, window, utility=U):
    return [Handover(i, 0.0, window, size, utility) for i in range(n)]


def test_equal_share_splits_the_one_link_evenly_and_never_overfills_its_queue():
    hs = _together(3, 1_000_000, 0.1)  # 3 MB wanted, about 1.2 MB fits
    res = simulate_handovers(hs, EqualShare(), rate_mbps=RATE, seed=3)
    fr = np.array([o.fraction for o in res.outcomes])
    assert fr.max() - fr.min() < 0.03  # within a couple of 12 KiB blocks
    delivered = sum(o.complete_fraction * o.size for o in res.outcomes)
    assert delivered <= PAYLOAD_BPS * 0.1
    assert delivered >= 0.85 * PAYLOAD_BPS * 0.1  # the link was kept busy
    assert res.packets_dropped == 0  # the paced rates never exceed the link
    assert all(o.accuracy == pytest.approx(float(U(o.fraction)), abs=1e-12) for o in res.outcomes)
    assert res.efficiency == pytest.approx(res.decoded_bytes / res.wire_bytes)


def test_edf_serves_the_earliest_deadline_first_with_real_sessions():
    # 1.5 MB wanted, about 1.44 MB of payload fits in 120 ms
    hs = [Handover(0, 0.0, 0.06, 500_000, U), Handover(1, 0.0, 0.12, 1_000_000, U)]
    res = simulate_handovers(hs, EarliestDeadlineFirst(), rate_mbps=RATE, seed=1)
    first, second = res.outcomes
    assert first.fraction == 1.0  # 0.5 MB fits its 60 ms (0.7 MB)
    assert 0.6 < second.fraction < 1.0  # then the rest of the link until 120 ms
    assert first.receiver_finish == "complete"


def test_the_allocator_admits_few_and_beats_equal_share_on_an_overloaded_link():
    hs = _together(8, 1_000_000, 0.1)  # 8 MB wanted, about 1.2 MB fits
    wf = simulate_handovers(hs, UtilityWaterFilling(), rate_mbps=RATE, seed=2)
    eq = simulate_handovers(hs, EqualShare(), rate_mbps=RATE, seed=2)
    assert wf.mean_accuracy > 1.2 * eq.mean_accuracy
    served = [o for o in wf.outcomes if o.fraction > 0.05]
    assert 2 <= len(served) <= 4
    assert all(o.fraction >= U.concave_start for o in served)  # admitted: useful
    assert all(o.admitted_slots > 0 for o in served)


def test_a_late_handover_starts_at_its_arrival_and_runs_are_reproducible():
    hs = [Handover(0, 0.0, 0.1, 600_000, U), Handover(1, 0.04, 0.14, 600_000, U)]
    sim = MultiSimulation(hs, UtilityWaterFilling(), rate_mbps=RATE, seed=5)
    res = sim.run()
    late = sim.users[1].received
    assert late is not None and late.session.timings["first_packet"] >= 0.04
    again = simulate_handovers(hs, UtilityWaterFilling(), rate_mbps=RATE, seed=5)
    assert [o.fraction for o in again.outcomes] == [o.fraction for o in res.outcomes]
    assert again.packets_sent == res.packets_sent


def test_a_lossy_link_is_repaired_and_the_scheduler_is_fed_its_payload_capacity():
    hs = _together(3, 600_000, 0.12)
    sim = MultiSimulation(hs, UtilityWaterFilling(), channel="ge-light", rate_mbps=RATE, seed=4)
    res = sim.run()
    assert res.packets_lost > 0
    assert sum(o.repair_sent for o in res.outcomes) > 0
    for o in res.outcomes:
        assert o.fraction <= o.complete_fraction + 1e-12  # the prefix is part of all blocks
        assert o.accuracy == pytest.approx(float(U(o.fraction)), abs=1e-12)
    # Holes get repaired (owed repairs go first), except what is lost in the last RTT:
    # without that, a paused sender's first hole would cut its prefix far short.
    prefix = sum(o.fraction * o.size for o in res.outcomes)
    assert prefix >= 0.9 * sum(o.complete_fraction * o.size for o in res.outcomes)
    # Capacity in payload bytes: the wire rate less headers and the reported loss.
    assert res.payload_capacity_Bps < PAYLOAD_BPS
    assert res.payload_capacity_Bps > 0.8 * PAYLOAD_BPS


class _SeesLoss(UtilityWaterFilling):
    """The allocator, noting the loss rates the link share hands it."""

    seen: list[float]

    def allocate(self, now, until, capacity_Bps, active):  # type: ignore[no-untyped-def]
        self.seen.extend(t.loss for t in active)
        return super().allocate(now, until, capacity_Bps, active)


def test_the_allocator_is_told_the_loss_each_receiver_reports():
    # The guard spreads what must go out too late to repair only over lossy transfers.
    policy = _SeesLoss(guard_s=0.03)
    policy.seen = []
    lossy = simulate_handovers(_together(3, 600_000, 0.12), policy, channel="bernoulli-5",
                               rate_mbps=RATE, seed=4)  # fmt: skip
    assert lossy.packets_lost > 0 and max(policy.seen) > 0.01
    policy.seen = []
    simulate_handovers(_together(3, 600_000, 0.12), policy, rate_mbps=RATE, seed=4)
    assert max(policy.seen) == 0.0  # a clean link reports none: nothing is spread


def test_bad_scenarios_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        MultiSimulation([], EqualShare())
    with pytest.raises(ValueError, match="unique"):
        MultiSimulation([Handover(1, 0, 1, 10, U), Handover(1, 0, 1, 10, U)], EqualShare())
    with pytest.raises(UserError, match="unknown policy"):
        MultiSimulation(_together(1, 1000, 0.1), EqualShare(), repair_policy="nope")
    with pytest.raises(ValueError, match="arrival < deadline"):
        Handover(0, 0.5, 0.5, 10, U)


def test_a_handover_its_receiver_never_hears_of_gets_nothing_and_the_run_ends():
    """The receiver host opens a session at a transfer's first datagram (as the daemon
    does): on a link that loses everything no session ever opens, and the handover's
    outcome is still reported, with nothing delivered."""
    from kvtransport.netem import Profile
    from kvtransport.netem.loss import Bernoulli

    black_hole = Profile(name="black-hole", loss=Bernoulli(1.0), rate_mbps=RATE)
    res = simulate_handovers(_together(2, 100_000, 0.05), EqualShare(), channel=black_hole)
    assert [o.receiver_finish for o in res.outcomes] == ["nothing arrived"] * 2
    assert all(o.fraction == 0.0 and o.accuracy == U(0.0) for o in res.outcomes)
    assert res.packets_lost == res.packets_sent > 0
