"""The queue guard: a sender host paces below the link rate while the path's queue builds.

Unit cases feed a :class:`QueueGuard` the feedback a path would give (round-trip samples
and received counts every 4 ms); the end-to-end cases run the real sessions and hosts in
the simulator over the held-out rate-dip channel and over channels whose capacity never
dips."""

from dataclasses import replace

import numpy as np
import pytest
from kvtransport.netem import load_profile

from kvtransport.core.transfer import synthetic_transfer
from kvtransport.hosts.queue_guard import DRAIN, MAX_BASE_RTT_S, PROBE, QueueGuard
from kvtransport.sim.simulator import make_simulation

WIRE_BITS = 1370 * 8
RATE = 100e6
BASE = 0.010
STEP = 0.004  # a feedback every 4 ms


def _guard():
    return QueueGuard(RATE, WIRE_BITS, min_bps=1e6)


def _feed(guard, t0, n, rtt, delivered_bps, received=0, jitter=0.0, seed=0):
    """``n`` reports from ``t0`` on: RTT samples ``rtt(t)`` (plus uniform jitter; None:
    the report echoes nothing new), the receiver's count growing at ``delivered_bps``;
    returns the time and count after them and the pacing rate after each report."""
    rng = np.random.default_rng(seed)
    t, paced = t0, []
    for _ in range(n):
        t += STEP
        received += int(round(delivered_bps(t) * STEP / WIRE_BITS))
        sample = rtt(t)
        if sample is not None:
            sample += jitter * rng.random()
        guard.on_feedback(t, sample, received)
        paced.append(guard.pacing_bps())
    return t, received, paced


def test_jitter_without_a_shortfall_never_cuts():
    g = _guard()
    # round trips from 10 to 60 ms at random: far above the threshold, but all delivered
    _, _, paced = _feed(g, 0.0, 500, lambda t: BASE, lambda t: RATE, jitter=0.05)
    assert set(paced) == {RATE} and g.cuts == 0


def test_random_loss_without_queueing_never_cuts():
    g = _guard()
    _, _, paced = _feed(g, 0.0, 500, lambda t: BASE, lambda t: 0.5 * RATE)  # half lost
    assert set(paced) == {RATE} and g.cuts == 0


def test_a_stall_in_a_loss_burst_is_not_a_queue():
    """Half the datagrams lost for 100 ms and, within it, two reports 40 ms late (the
    host stalled): a shortfall and two delayed samples, but no queue."""
    g = _guard()
    t, got, _ = _feed(g, 0.0, 25, lambda t: BASE, lambda t: RATE)
    start = t
    late = {start + 12 * STEP, start + 13 * STEP}

    def rtt(s):
        return BASE + 0.040 if any(abs(s - x) < 1e-9 for x in late) else BASE

    _, _, paced = _feed(g, t, 25, rtt, lambda s: 0.5 * RATE, received=got)
    assert set(paced) == {RATE} and g.cuts == 0


def test_reports_that_stall_are_not_a_rate():
    """A full queue drains at the full rate (its round trips 100 ms long), and the host
    stalls: no report for 20 ms, and the one after it counts 9 datagrams for that time
    (seen on the netns testbed as a rate step took effect). Two reports in a window say
    nothing of the link's rate: no cut (before: a cut to 7 Mbit/s, and a transfer 0.08
    of utility down)."""
    g = _guard()
    t, got, _ = _feed(g, 0.0, 25, lambda t: BASE, lambda t: RATE)
    t, got, paced = _feed(g, t, 10, lambda s: BASE + 0.1, lambda s: RATE, received=got)
    t, got = t + 5 * STEP, got + 9  # the stall: no report, 9 datagrams counted
    g.on_feedback(t, BASE + 0.1, got)
    paced.append(g.pacing_bps())
    _, _, after = _feed(g, t, 10, lambda s: BASE + 0.1, lambda s: RATE, received=got)
    assert set(paced + after) == {RATE} and g.cuts == 0


def test_a_dip_is_cut_when_the_reports_come_in_batches():
    """A busy daemon hands the guard the feedbacks of one socket read at one time: three
    reports every 12 ms. That is no stall: the dip is cut (to within the windowed count's
    bias when whole batches fall in or out of a window: 28 Mbit/s here, not below 25)."""
    g = _guard()
    t, got, _ = _feed(g, 0.0, 25, lambda t: BASE, lambda t: RATE)
    start = t
    for _ in range(14):
        t += 3 * STEP
        for k in range(3):  # counted 4 ms apart, handed over together
            got += int(round(0.25 * RATE * STEP / WIRE_BITS))
            g.on_feedback(t, BASE + 0.75 * (t - (2 - k) * STEP - start), got)
    assert g.cuts >= 1 and g.pacing_bps() < 0.3 * RATE


def test_an_outage_is_not_a_rate():
    g = _guard()
    t, got, _ = _feed(g, 0.0, 20, lambda t: BASE, lambda t: RATE)
    # nothing arrives for 100 ms (the reports echo nothing new); then what queued meanwhile
    # drains at the full rate, its round trips 100 ms long at first: a delay, and the
    # outage's silence must not count as a shortfall
    t, got, paced = _feed(g, t, 25, lambda s: None, lambda s: 0.0, received=got)
    end = t
    _, _, after = _feed(
        g, t, 40, lambda s: BASE + max(0.0, 0.1 - (s - end)), lambda s: RATE, received=got
    )
    assert set(paced + after) == {RATE} and g.cuts == 0


def test_a_dip_is_paced_below_what_the_link_delivers_then_probed_back_up():
    g = _guard()
    t, got, _ = _feed(g, 0.0, 25, lambda t: BASE, lambda t: RATE)
    # the capacity falls to a quarter: the queue grows at 3/4 of the pacing rate
    start = t
    t, got, paced = _feed(
        g, t, 40, lambda s: BASE + 0.75 * (s - start), lambda s: 0.25 * RATE, received=got
    )
    assert g.cuts >= 1
    # below what the link delivers (the first window still held some of the full rate)
    assert DRAIN * 0.25 * RATE * 0.99 <= paced[-1] < 0.25 * RATE
    # the queue drains, the round trips come back: the cap grows by PROBE a round trip
    low = paced[-1]
    t, got, paced = _feed(g, t, 60, lambda s: BASE, lambda s: g.pacing_bps(), received=got)
    rises = sorted(set(paced))
    assert rises[0] == pytest.approx(low * PROBE) and rises[1] == pytest.approx(low * PROBE**2)
    assert paced[-1] == RATE and g.cap_bps is None


def test_a_long_path_never_cuts_and_a_reset_takes_the_cap_along():
    long_rtt = 0.080  # 40 ms one way
    assert long_rtt > MAX_BASE_RTT_S
    g = _guard()
    t, got, _ = _feed(g, 0.0, 60, lambda t: long_rtt, lambda t: RATE)
    start = t
    _, _, paced = _feed(
        g, t, 80, lambda s: long_rtt + 0.75 * (s - start), lambda s: 0.25 * RATE, received=got
    )
    assert set(paced) == {RATE} and g.cuts == 0
    g = _guard()  # a short path's dip
    t, got, _ = _feed(g, 0.0, 25, lambda t: BASE, lambda t: RATE)
    start = t
    _feed(g, t, 40, lambda s: BASE + 0.75 * (s - start), lambda s: 0.25 * RATE, received=got)
    assert g.cap_bps is not None
    assert g.reset() and g.pacing_bps() == RATE


def test_a_restarted_receiver_counts_from_zero_again():
    """The receiver restarted (its count starts over): what it receives afterwards is
    delivery all the same, so a dip then is measured at its rate."""
    g = _guard()
    t, got, _ = _feed(g, 0.0, 25, lambda t: BASE, lambda t: RATE)
    t, got, _ = _feed(g, t, 10, lambda t: BASE, lambda t: RATE, received=0)  # restarted
    start = t
    _, _, paced = _feed(
        g, t, 40, lambda s: BASE + 0.75 * (s - start), lambda s: 0.25 * RATE, received=got
    )
    assert g.cuts >= 1 and DRAIN * 0.25 * RATE * 0.99 <= paced[-1] < 0.25 * RATE


def _sim(channel, profiles, guard, rho=1.0, seed=1, policy="tail-rule", **kw):
    prof = load_profile(channel, profiles)
    return make_simulation(
        channel=prof, rho=rho, policy=policy, seed=seed, size_bytes=5_000_000, record=False,
        queue_guard=guard, **kw,
    )  # fmt: skip


def _run(channel, profiles, guard, **kw):
    sim = _sim(channel, profiles, guard, **kw)
    sim.run()
    return sim, sim.result(0.0)


def test_a_capacity_dip_costs_no_queue_loss_with_the_guard():
    """rate-dip: 100 Mbit/s falling to 25 from 0.1 to 0.3 s. Paced at 100 throughout, a
    third of the datagrams die in the full queue; with the guard almost none do, more of
    the stream's utility arrives, the link is paced below 25 Mbit/s in the dip and at its
    full rate again before the deadline."""
    _, off = _run("rate-dip", "netem/data/held-out.toml", guard=False)
    sim = _sim("rate-dip", "netem/data/held-out.toml", guard=True)
    paced = []  # (time, pacing rate) while the transfer is in flight
    for t in np.arange(0.0, sim.deadline, 0.005):
        sim.run_until_decision(until=float(t))
        if sim.sender_host.active and t < sim.sender.stop_time:
            paced.append((float(t), sim.sender_host.link.rate_bps))
    sim.run()
    on = sim.result(0.0)
    assert off.packets_lost > 0.2 * off.packets_sent
    assert on.packets_lost < 0.1 * off.packets_lost
    assert on.utility_recovered > off.utility_recovered + 0.01
    assert sim.sender_host.stats()["queue_cuts"] >= 1
    assert min(rate for t, rate in paced if 0.1 < t < 0.3) < 0.25 * RATE
    assert paced[-1][0] > 0.4 and paced[-1][1] == RATE  # probed back up before the end


def test_the_guard_starts_over_when_a_second_transfer_joins():
    sim = _sim("rate-dip", "netem/data/held-out.toml", guard=True)
    sim.run_until_decision(until=0.25)
    host = sim.sender_host
    assert host.link.rate_bps < 0.25 * RATE  # capped in the dip
    host.max_transfers = 2  # (the simulator's host takes one)
    host.submit(synthetic_transfer(200_000, 16, seed=2), "elsewhere", now=sim.now,
                deadline_s=0.5, policy="tail-rule", initial_rtt=0.011)  # fmt: skip
    assert host.link.rate_bps == RATE and host.guard.cap_bps is None
    # with a second transfer on the link from before the dip, the guard does nothing
    sim = _sim("rate-dip", "netem/data/held-out.toml", guard=True)
    sim.run_until_decision(until=0.05)
    host = sim.sender_host
    host.max_transfers = 2
    host.submit(synthetic_transfer(2_000_000, 64, seed=2), "elsewhere", now=sim.now,
                deadline_s=0.5, policy="tail-rule", initial_rtt=0.011)  # fmt: skip
    sim.run_until_decision(until=0.3)
    assert host.guard.cuts == 0 and len(host.active) == 2


@pytest.mark.parametrize(
    ("channel", "profiles", "delay_ms"),
    [
        ("ge-heavy", None, None),
        # loss bursts and round trips jittering by up to 16 ms: a shortfall and a delay,
        # but no queue
        (replace(load_profile("ge-heavy"), jitter_ms=8.0), None, None),
        ("4state-bursty", None, 80.0),
        ("rate-dip", "netem/data/held-out.toml", 40.0),  # it dips, but the path is long
        ("bernoulli-5-jitter", "netem/data/held-out.toml", None),
        ("gilbert-long", "netem/data/held-out.toml", 40.0),
    ],
)
def test_a_path_whose_capacity_never_dips_or_that_is_long_is_paced_as_without_the_guard(
    channel, profiles, delay_ms
):
    runs = [
        _run(channel, profiles, guard=g, policy="adaptive", delay_ms=delay_ms)
        for g in (False, True)
    ]
    (_, off), (sim, on) = runs
    assert sim.sender_host.stats()["queue_cuts"] == 0
    assert on.to_dict() | {"cpu_s": 0} == off.to_dict() | {"cpu_s": 0}
