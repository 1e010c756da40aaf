"""The virtual-clock loop (kvtransport.sim.virtual_clock) and the shells built on it.

Every virtual-clock shell is one VirtualClockLoop around its endpoints; the checks here are
that the shells drive their endpoints the same way: the emulated link (two processes, each
a loop around its endpoint, joined by a coordinator) sends exactly the simulator's
datagrams at exactly the simulator's times, and the loop's tie order is the documented one.
"""

import numpy as np
import pytest
from kvtransport.netem import load_profile, make_channel

from kvtransport.core.protocol import STANDARD, ProtocolConfig
from kvtransport.core.transfer import synthetic_transfer
from kvtransport.core.wire import feedback_epoch, parse
from kvtransport.demo.demo_emulated import EmulatedLink, PeerError
from kvtransport.demo.demo_links import INITIAL_RTT_S, PROFILE
from kvtransport.policies.registry import make_policy
from kvtransport.sim.simulator import Simulation, full_send_time
from kvtransport.sim.virtual_clock import VirtualClockLoop

KEY = bytes(range(32))


def _simulated(tr, policy, deadline, seed, trace, config=STANDARD):
    prof = load_profile(PROFILE)
    data_seed, fb_seed = np.random.SeedSequence(seed).spawn(2)  # as the emulated link
    over = config.link_overhead
    sim = Simulation(tr, make_policy(policy), make_channel(prof, data_seed, overhead_bytes=over),
                     make_channel(prof, fb_seed, overhead_bytes=over), rate_bps=prof.rate_bps,
                     deadline=deadline, transfer_id=77, key=KEY, initial_rtt=INITIAL_RTT_S,
                     record=False, trace=trace, config=config)  # fmt: skip
    sim.run()
    return sim


def test_the_emulated_link_sends_the_simulators_datagrams_at_the_simulators_times():
    """Same transfer, seed and channels: the emulated link's sender process sends the same
    datagrams, byte for byte, at the same link times as the simulator's sender, and the
    receiver (the daemon's host there, a bare session here) gets the same blocks."""
    tr = synthetic_transfer(600_000, 50, "zipf", seed=4)
    deadline = 0.8 * full_send_time(tr.nbytes, 100e6, 1280, True)
    link = EmulatedLink()
    link.key = KEY  # the simulator seals with the same key: the same bytes
    try:
        link.load(tr)
        for policy in ("adaptive", "arq"):
            link.trace = []
            got = link.transfer(policy, deadline_s=deadline, transfer_id=77, seed=9)
            emulated = [(t, d) for kind, t, d in link.trace if kind == "data"]
            trace: list[tuple] = []
            sim = _simulated(tr, policy, deadline, 9, trace)
            simulated = [(e[1], e[3]) for e in trace if e[0] == "send" and e[2] == 0]
            assert len(simulated) > 300 and sim.feedback_sent > 10
            assert emulated == simulated, policy
            assert np.array_equal(got.complete, sim.receiver.result.complete), policy
    finally:
        link.close()


def _opened(feedback: list[tuple[float, bytes]]) -> list[tuple]:
    """Sealed feedback as (time, header fields but the epoch, plaintext)."""
    out = []
    for t, data in feedback:
        d = parse(data, KEY)
        out.append((t, d.type, d.flags, d.transfer_id, d.seq, bytes(d.payload)))
    return out


def test_the_emulated_link_runs_the_config_it_is_given():
    """An emulated link built with a protocol config runs both processes' hosts and both
    channels with it: the same datagrams at the same times as the simulator given that
    config (the receiver's feedback interval drives what the sender sends), which differ
    from the standard config's (another symbol size, link overhead and feedback interval
    move every datagram)."""
    tr = synthetic_transfer(400_000, 40, "zipf", seed=4)
    config = ProtocolConfig(symbol_size=1024, link_overhead=60, feedback_interval=0.007)
    deadline = 0.8 * full_send_time(tr.nbytes, 100e6, 1280, True)
    link = EmulatedLink(config=config)
    link.key = KEY
    try:
        link.load(tr)
        link.trace = []
        got = link.transfer("adaptive", deadline_s=deadline, transfer_id=77, seed=9)
        emulated = [(t, d) for kind, t, d in link.trace if kind == "data"]
        # the simulator's receiver knows the exact deadline, the daemon's host counts it
        # from the first datagram: their reports differ only from the deadline on
        feedback = [(t, d) for kind, t, d in link.trace if kind == "feedback" and t < deadline]
    finally:
        link.close()
    trace: list[tuple] = []
    sim = _simulated(tr, "adaptive", deadline, 9, trace, config)
    assert [(e[1], e[3]) for e in trace if e[0] == "send" and e[2] == 0] == emulated
    # feedback is sealed under each receiving session's random epoch (kvtransport.core.wire,
    # "Sealing"): the same reports, opened, at the same times, each host under one epoch
    simulated = [(e[1], e[3]) for e in trace if e[0] == "send" and e[2] == 1 and e[1] < deadline]
    assert _opened(simulated) == _opened(feedback)
    assert len({feedback_epoch(parse(d, KEY)) for _, d in feedback}) == 1
    assert np.array_equal(got.complete, sim.receiver.result.complete)
    standard: list[tuple] = []
    _simulated(tr, "adaptive", deadline, 9, standard)
    assert [(e[1], e[3]) for e in standard if e[0] == "send" and e[2] == 0] != emulated


def test_the_emulated_links_sender_is_the_daemons_host():
    """The sender process admits a transfer as the sender daemon does (its SenderHost): a
    deadline the daemon refuses is refused with the daemon's one-line reason, and the
    process goes on to send the next transfer."""
    tr = synthetic_transfer(200_000, 20, "zipf", seed=4)
    link = EmulatedLink()
    try:
        link.load(tr)
        with pytest.raises(PeerError, match=r"^the deadline must be 0.0001..3600 s \(5e-05\)$"):
            link.transfer("adaptive", deadline_s=5e-5, transfer_id=5, seed=1)
        deadline = 0.8 * full_send_time(tr.nbytes, 100e6, 1280, True)
        got = link.transfer("adaptive", deadline_s=deadline, transfer_id=6, seed=1)
        assert got.counters["source_sent"] > 0 and got.utility > 0
    finally:
        link.close()


class _Clock:
    """An endpoint that records when it is called and sends what it is told to."""

    def __init__(self, name, log, timers=(), replies=None):
        self.name, self.log = name, log
        self.timers = sorted(timers)
        self.replies = replies or {}
        self.out = []

    def get_timer(self):
        return self.timers[0] if self.timers else None

    def handle_timer(self, now):
        self.timers.pop(0)
        self.log.append((now, self.name, "timer"))
        self.out += self.replies.get(("timer", now), [])

    def receive_datagram(self, data, addr, now):
        self.log.append((now, self.name, data))
        self.out += self.replies.get((data, now), [])

    def datagrams_to_send(self, now):
        out, self.out = self.out, []
        return out


class _Delay:
    def __init__(self, delay):
        self.delay = delay

    def transmit(self, t, size):
        return t + self.delay


def test_ties_go_to_deliveries_then_timers_by_rank_then_calls():
    log: list = []
    loop = VirtualClockLoop()
    # at t = 1: a datagram from a (sent at 0.5), the timers of b (rank 2) and a (rank 1)
    a = _Clock("a", log, timers=[0.5, 1.0], replies={("timer", 0.5): [([b"x"], "B")]})
    b = _Clock("b", log, timers=[1.0])
    loop.add(a, "A", rank=1, channel=_Delay(0.5))
    loop.add(b, "B", rank=2, channel=_Delay(0.5))
    loop.call_at(1.0, lambda t: log.append((t, "call", "")))
    assert not loop.run()
    assert log == [
        (0.5, "a", "timer"),
        (1.0, "b", b"x"),  # the delivery first
        (1.0, "a", "timer"),  # then the timers, by rank
        (1.0, "b", "timer"),
        (1.0, "call", ""),  # then the scheduled calls
    ]
    assert loop.events == 5 and loop.in_flight == 0 and loop.sent(0) == (1, 1)


def test_a_timer_in_the_past_fires_now_and_datagrams_to_strangers_go_to_the_outbox():
    log: list = []
    loop = VirtualClockLoop()
    a = _Clock("a", log, replies={(b"in", 2.0): [([b"out"], "elsewhere")]})
    loop.add(a, "A")
    loop.deliver(2.0, b"in", 0, "elsewhere")
    assert not loop.run()
    a.timers = [1.0]  # moved from outside, into the past
    loop.touch(0)
    assert not loop.run() and log[-1] == (2.0, "a", "timer")  # at the loop's now, not 1.0
    assert loop.take_outbox() == [(2.0, b"out", "elsewhere")] and loop.take_outbox() == []
    with pytest.raises(ValueError, match="already in the loop"):
        loop.add(_Clock("c", log), "A")
